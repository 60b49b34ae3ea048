"""Worker processes for tests/test_patches.py: ``python tests/_patches_worker.py <scenario>``.

Patches are process-wide, so every check of "with / without a patch" runs in a fresh
interpreter. Each scenario prints one line, ``RESULT_PREFIX`` + JSON, for the test to read.

* ``single_rank``: one gloo rank; one check per upstream call site, each tagged in CHECK_NEEDS
  with the patches it needs. Honors ``MEGATRON_STREAMING_SKIP_PATCHES``.
* ``selection``: which patches ``apply()`` picks with CUDA faked on (``FAKE_CUDA=1``) and apex
  faked present or blocked (``FAKE_APEX=present|blocked``; TE is always blocked).
* ``two_ranks``: a tiny GPTModel (local spec) trained through megatron's schedules on 2 gloo
  ranks (env RANK, WORLD_SIZE, MASTER_*): TP=2 with sequence parallelism and megatron DDP,
  then PP=2 with shared embeddings, attention dropout and full activation recompute; the
  adapter ``megatron_row_parallel`` against ``RowParallelLinear`` at TP=2; and the adapter
  ``torch_process_group``: a group made on the store, used, dropped.

Models use ``cross_entropy_fusion_impl="native"``: the unfused loss reads parallel_state's global
TP group, the native one the model's own ``pg_collection.tp``. Its jit_fuser is torch.compile
(~30 s of inductor compile on CPU), so the tests run workers with TORCH_COMPILE_DISABLE=1.
"""

import contextlib
import datetime
import glob
import json
import os
import sys
import traceback
from functools import partial
from pathlib import Path

RESULT_PREFIX = "PATCH_TEST_RESULT "
VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 2

# single_rank check -> the patches it needs.
CHECK_NEEDS = {
    "deepspeed_init_no_shm": {"deepspeed_shm"},
    "deepspeed_fp16_engine": {"deepspeed_cpu_fp16"},
    "rng_seed_and_fork": {"megatron_rng"},
    "rng_activation_checkpoint": {"megatron_rng"},
    "norm_sequence_parallel": {"megatron_norm"},
    "norm_zero_centered": {"megatron_norm"},
    "dev_schedule_step": {"megatron_devices", "megatron_rng"},
    "dev_p2p_shapes": {"megatron_devices"},
    "dev_global_memory_buffer": {"megatron_devices"},
    "dev_ddp_buffers": {"megatron_devices"},
    "dev_sp_gather": {"megatron_devices"},
    "dev_gpu_init_layer": {"megatron_devices"},
    "dev_split_1d_chunks": {"megatron_devices"},
    "dev_causal_mask": {"megatron_devices"},
    "embedding_pp_setup": {"megatron_embedding"},
    "dev_dist_checkpoint_save": {"megatron_devices"},
    "dcp_metadata_refuses_code": {"torch_dcp_safe_metadata"},
    "moe_router": {"megatron_moe", "megatron_devices", "megatron_rng"},
}


def shm_files(port: int) -> list:
    """DeepSpeed shm buffers of the job on ``port``.

    Named deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>.
    """
    return glob.glob(f"/dev/shm/deepspeed_*_{port}_*")


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def _emit(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _outcome(check) -> str:
    try:
        check()
    except Exception as exc:  # the outcome is the report
        traceback.print_exc()  # shown by _collect when a test fails
        return f"{type(exc).__name__}: {exc}"[:300]
    return "ok"


def _tiny_config(tp=1, pp=1, sp=False, **overrides):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        # See the module docstring: the unfused loss ignores pg_collection.
        cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native",
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def _groups(tp=1, pp=1, share_embedding=False):
    """ProcessGroupCollection for a world of tp * pp ranks, TP innermost (megatron's order)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    def group_of(enumeration):  # every rank passes the same enumeration, in the same order
        return dist.new_subgroups_by_enumeration(enumeration)[0]

    world = list(range(tp * pp))
    tp_group = group_of([world[i * tp:(i + 1) * tp] for i in range(pp)])
    pp_group = group_of([world[j::tp] for j in range(tp)])
    single = group_of([[r] for r in world])
    everyone = group_of([world])
    # With PP=2 the first and last stage are the whole PP group.
    embd = pp_group if share_embedding else None
    return ProcessGroupCollection(
        tp=tp_group, pp=pp_group, mp=everyone, cp=single, tp_cp=tp_group, dp=single,
        dp_cp=single, ep=single, expt_tp=single, tp_ep=tp_group, expt_dp=single, embd=embd,
        pos_embd=None,
    )


def _tiny_gpt(config, pgs, pre_process=True, post_process=True, share=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=SEQ, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=share, pg_collection=pgs,
    )


def _batches(micro_batch_size=2, seed=7):
    """Deterministic next-token batches of a cyclic sequence, identical on every rank."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, VOCAB, (micro_batch_size, 1), generator=generator)
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).expand(micro_batch_size, -1).contiguous(),
        }


def _forward_step(data_iterator, model):

    batch = next(data_iterator)
    # attention_mask=None: causal attention builds its own mask (transformer.utils call site).
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place

    return out, loss_func


def _ensure_global_memory_buffer():
    # The caller's job without initialize_model_parallel (see patches/__init__.py).
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


# --------------------------------------------------------------------------------------------
# Worker: single_rank
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _shm_build_sentinel(refuse: bool = True):
    """Make any request to build DeepSpeed's shm op fail loudly instead of compiling (with
    ``refuse=False``: find no such op, as on an accelerator without it)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    original = accelerator.create_op_builder

    def create_op_builder(name):
        builder = original(name)
        if name == "ShareMemCommBuilder" and not refuse:
            return None
        if name == "ShareMemCommBuilder" and builder is not None:
            def refuse_build(*args, **kwargs):
                raise RuntimeError("shm op build requested (would JIT-compile with g++)")
            builder.load = refuse_build
        return builder

    accelerator.create_op_builder = create_op_builder
    try:
        yield
    finally:
        accelerator.create_op_builder = original


def _check_deepspeed_init(port):
    import importlib

    import deepspeed

    with _shm_build_sentinel():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=60))
    assert importlib.import_module("deepspeed.comm.comm").cdb.shm_comm_op is None
    assert shm_files(port) == [], shm_files(port)


def _check_deepspeed_fp16_engine():
    """deepspeed.initialize with an fp16 section, on DeepSpeed's CPU accelerator."""
    import deepspeed
    import torch

    model = torch.nn.Linear(4, 4).half()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
                "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True})
    assert engine.fp16_enabled()


def _check_rng_seed_and_fork():
    import torch
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234, tp_rank=1, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(4)
    default_draw = torch.rand(4)
    torch.manual_seed(1234 + 2718 + 1)  # megatron's tensor-parallel seed for tp_rank 1
    assert torch.equal(tp_draw, torch.rand(4)), "forked stream is not the TP seed's stream"
    torch.manual_seed(1234)  # default stream: seeded with the seed, untouched by the fork
    assert torch.equal(default_draw, torch.rand(4)), "fork did not restore the default stream"


def _check_rng_activation_checkpoint():
    import torch
    from megatron.core.tensor_parallel import checkpoint

    x = torch.randn(256, requires_grad=True)
    y = checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5, training=True), False, x)
    y.sum().backward()
    # The recomputation must redraw the forward's dropout mask from the saved RNG state.
    assert torch.equal(x.grad != 0, y != 0), "recompute drew a different dropout mask"


def _check_norm_sequence_parallel():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for normalization in ("LayerNorm", "RMSNorm"):
        config = _tiny_config(tp=2, sp=True, normalization=normalization)
        norm = WrappedTorchNorm(config=config, hidden_size=HIDDEN, eps=1e-5)
        assert config.sequence_parallel, "the caller's config was modified"
        assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())


def _check_norm_zero_centered():
    import torch
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    x = torch.randn(3, HIDDEN)
    for normalization, plain in (("LayerNorm", torch.nn.LayerNorm(HIDDEN, eps=1e-5)),
                                 ("RMSNorm", torch.nn.RMSNorm(HIDDEN, eps=1e-5))):
        config = _tiny_config(normalization=normalization)
        config.layernorm_zero_centered_gamma = True
        norm = WrappedTorchNorm(config=config, hidden_size=HIDDEN, eps=1e-5)
        assert config.layernorm_zero_centered_gamma, "the caller's config was modified"
        assert torch.all(norm.weight == 0), "a zero-centred norm's weight starts at 0"
        with torch.no_grad():  # weight w here acts as w + 1: the plain norm with weight 1 + w
            norm.weight.normal_()
            plain.weight.copy_(norm.weight + 1)
        assert torch.allclose(norm(x), plain(x), atol=1e-6)


def _check_schedule_step(pgs):
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, tp_rank=0, ep_rank=0, etp_rank=0)
    model = _tiny_gpt(_tiny_config(), pgs)
    losses = get_forward_backward_func(pp_size=1, vp_size=None)(
        forward_step_func=_forward_step, data_iterator=_batches(), model=model,
        num_microbatches=2, seq_length=SEQ, micro_batch_size=2, pg_collection=pgs,
    )
    assert all(torch.isfinite(l["lm loss"]) for l in losses)


def _check_p2p_shapes(pgs):
    import torch
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    # One rank has no peer: stub the exchange, so only the allocations and sync run.
    real = torch.distributed.batch_isend_irecv
    torch.distributed.batch_isend_irecv = lambda ops: []
    try:
        P2PCommunicator(pgs.pp, _tiny_config())._communicate_shapes(None, None, True, False)
    finally:
        torch.distributed.batch_isend_irecv = real


def _check_ddp_buffers(pgs):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = _tiny_config()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), _tiny_gpt(config, pgs),
                                  pg_collection=pgs)
    assert all(b.grad_data.device.type == "cpu" for b in ddp.buffers)


class _FakeGroup:
    """A stand-in process group, for reaching code that needs a peer without having one."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _check_sp_gather():
    import torch
    from megatron.core.tensor_parallel import mappings

    def fake_all_gather(output, input_, group):
        output.copy_(torch.cat([input_, input_]))

    real, mappings.dist_all_gather_func = mappings.dist_all_gather_func, fake_all_gather
    try:
        out = mappings._gather_along_first_dim(torch.ones(3, 2), _FakeGroup(size=2, rank=0))
    finally:
        mappings.dist_all_gather_func = real
    assert out.shape == (6, 2) and out.device.type == "cpu"


def _check_gpu_init_layer(pgs):
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    config = _tiny_config(use_cpu_initialization=False, perform_initialization=False)
    layer = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=None, config=config, tp_group=pgs.tp)
    assert layer.weight.device.type == "cpu"


def _check_dist_checkpoint_save():
    # megatron-core's torch_dist writer stages tensors with torch.cuda calls.
    import tempfile

    import torch
    from megatron.core.dist_checkpointing import save
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    with tempfile.TemporaryDirectory() as d:
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3), replica_id=0)}, d,
             sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))


def _check_dcp_metadata_refuses_code():
    # A checkpoint's .metadata replaced by a pickle that runs code when read.
    import pickle
    import tempfile

    from torch.distributed.checkpoint import FileSystemReader

    class RunsCode:
        def __reduce__(self):
            return (exec, ("import os; os.environ['DCP_PICKLE_RAN'] = '1'",))

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, ".metadata"), "wb") as f:
            pickle.dump(RunsCode(), f)
        try:
            FileSystemReader(d).read_metadata()
        except Exception:  # refused (patched), or not metadata after running (upstream)
            pass
    assert os.environ.get("DCP_PICKLE_RAN") != "1", "reading .metadata ran code from the file"


def _single_rank_checks(port):
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel.utils import split_tensor_into_1d_equal_chunks
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer

    checks = {"deepspeed_init_no_shm": _outcome(partial(_check_deepspeed_init, port))}
    if not dist.is_initialized():  # deepspeed init refused: the rest still needs a world
        dist.init_process_group("gloo", rank=0, world_size=1)
    if checks["deepspeed_init_no_shm"] != "ok":  # deepspeed has no backend yet: give it one
        import deepspeed  # without the op, else the next initialize compiles it (minutes)

        with _shm_build_sentinel(refuse=False):
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    _ensure_global_memory_buffer()
    checks["deepspeed_fp16_engine"] = _outcome(_check_deepspeed_fp16_engine)
    pgs = _groups()
    checks["rng_seed_and_fork"] = _outcome(_check_rng_seed_and_fork)
    checks["rng_activation_checkpoint"] = _outcome(_check_rng_activation_checkpoint)
    checks["norm_sequence_parallel"] = _outcome(_check_norm_sequence_parallel)
    checks["norm_zero_centered"] = _outcome(_check_norm_zero_centered)
    checks["dev_schedule_step"] = _outcome(partial(_check_schedule_step, pgs))
    checks["dev_p2p_shapes"] = _outcome(partial(_check_p2p_shapes, pgs))
    checks["dev_global_memory_buffer"] = _outcome(
        lambda: GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe"))
    checks["dev_ddp_buffers"] = _outcome(partial(_check_ddp_buffers, pgs))
    checks["dev_sp_gather"] = _outcome(_check_sp_gather)
    checks["dev_gpu_init_layer"] = _outcome(partial(_check_gpu_init_layer, pgs))
    checks["dev_split_1d_chunks"] = _outcome(
        lambda: split_tensor_into_1d_equal_chunks(torch.ones(4), True, pgs.tp))
    checks["dev_causal_mask"] = _outcome(lambda: get_default_causal_mask(4))
    checks["embedding_pp_setup"] = _outcome(_check_embedding_pp_setup)
    checks["dev_dist_checkpoint_save"] = _outcome(_check_dist_checkpoint_save)
    checks["dcp_metadata_refuses_code"] = _outcome(_check_dcp_metadata_refuses_code)
    checks["moe_router"] = _outcome(partial(_check_moe_router, pgs))
    return checks


def _check_moe_router(pgs):
    """A mixture-of-experts layer (megatron-core's local spec, allgather dispatcher) forward
    and backward: the router's gating GEMM and its weight's device."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    model_parallel_cuda_manual_seed(0, tp_rank=0, ep_rank=0, etp_rank=0)
    config = _tiny_config(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                          moe_token_dispatcher_type="allgather", add_bias_linear=False)
    pgs.tp_dp_cp = pgs.tp  # the router's; one rank
    layer = build_module(get_gpt_layer_local_spec(num_experts=4).submodules.mlp,
                         config=config, pg_collection=pgs)
    out, _ = layer(torch.randn(SEQ, 2, HIDDEN))
    out.sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.device.type == "cpu"


def _check_embedding_pp_setup():
    # The first of two PP stages sharing the embedding with the last one. One rank cannot hold
    # both stages, so the PP group is a stand-in and the embedding group has one member.
    pgs = _groups(share_embedding=True)
    pgs.pp = _FakeGroup(size=2, rank=0)
    model = _tiny_gpt(_tiny_config(pp=2), pgs, pre_process=True, post_process=False, share=True)
    assert model.shared_embedding_or_output_weight().device.type == "cpu"


def _patched_objects() -> dict:
    """Every object a patch replaces, to show a second apply() replaces nothing."""
    import importlib
    import logging

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from patches.megatron_devices import MODULES

    objects = {name: importlib.import_module(name).torch for name in MODULES}
    objects.update(
        rng_get=random._get_cuda_rng_state, rng_set=random._set_cuda_rng_state,
        rng_torch=random.torch, rng_filters=tuple(logging.getLogger(random.__name__).filters),
        embedding=LanguageModule.setup_embeddings_and_output_layer,
        norm=WrappedTorchNorm.__new__,
        shm=importlib.import_module("deepspeed.comm.torch").build_shm_op,
        fp16=importlib.import_module(
            "deepspeed.accelerator.cpu_accelerator").CPU_Accelerator.is_fp16_supported,
        dcp=importlib.import_module("torch.distributed.checkpoint.filesystem").pickle,
    )
    return objects


def _scenario_single_rank():
    # Import megatron with `from x import name` bindings *before* apply(): patches must work
    # where the names are looked up, not where they were bound.
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: F401

    import patches
    import torch

    # A CPU with AVX512-FP16 or AMX-FP16 already answers yes upstream, which would hide
    # whether deepspeed_cpu_fp16 is needed: answer as a CPU without that hardware does.
    torch.ops.mkldnn._is_mkldnn_fp16_supported = lambda: False
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    applied = patches.apply()
    before = _patched_objects()
    second = patches.apply()
    after = _patched_objects()
    unchanged = before == after  # values compare by identity
    port = int(os.environ["MASTER_PORT"])
    checks = _single_rank_checks(port)
    _emit({"applied": applied, "second_apply": second, "patched_objects_unchanged": unchanged,
           "checks": checks, "shm_files": shm_files(port)})


# --------------------------------------------------------------------------------------------
# Worker: selection
# --------------------------------------------------------------------------------------------


def _touched() -> list:
    """Patches whose target objects differ from upstream's."""
    import importlib

    import torch
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from patches.megatron_devices import MODULES

    def wrapped(function):
        return hasattr(function, "__wrapped__")  # set by functools.wraps on patch wrappers

    touched = {
        "megatron_rng": random._get_cuda_rng_state.__module__ != random.__name__
        or random.torch is not torch,
        "megatron_devices": any(importlib.import_module(m).torch is not torch for m in MODULES),
        "megatron_embedding": wrapped(LanguageModule.setup_embeddings_and_output_layer),
        "megatron_norm": wrapped(WrappedTorchNorm.__new__),
        "deepspeed_shm": importlib.import_module("deepspeed.comm.torch").build_shm_op.__module__
        != "deepspeed.comm.torch",
        "deepspeed_cpu_fp16": importlib.import_module("deepspeed.accelerator.cpu_accelerator")
        .CPU_Accelerator.is_fp16_supported.__module__ != "deepspeed.accelerator.cpu_accelerator",
        "torch_dcp_safe_metadata":
            importlib.import_module("torch.distributed.checkpoint.filesystem").pickle
            is not importlib.import_module("pickle"),
        "megatron_moe": hasattr(importlib.import_module("megatron.core.transformer.moe.moe_utils"),
                                "te_general_gemm"),
    }
    return [name for name, changed in touched.items() if changed]


def _scenario_selection():
    import types

    import torch

    if os.environ["FAKE_CUDA"] == "1":
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
    for name in ("apex", "transformer_engine"):
        # A module object makes `import apex` succeed; None makes it raise ImportError.
        present = os.environ["FAKE_APEX"] == "present" and name == "apex"
        sys.modules[name] = types.ModuleType(name) if present else None

    import patches
    from patches import optional

    applied = patches.apply()
    _emit({"applied": applied, "touched": _touched(),
           "have_apex": optional.HAVE_APEX, "have_te": optional.HAVE_TE})


# --------------------------------------------------------------------------------------------
# Worker: two_ranks
# --------------------------------------------------------------------------------------------


def _train(model, pgs, config, steps=2, num_microbatches=2):
    """A few optimizer steps through megatron's schedule; returns the last stage's losses."""
    import torch
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = get_forward_backward_func(pp_size=pgs.pp.size(), vp_size=None)
    p2p = P2PCommunicator(pgs.pp, config) if pgs.pp.size() > 1 else None
    losses, data = [], _batches()
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)
        out = schedule(forward_step_func=_forward_step, data_iterator=data, model=model,
                       num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=2,
                       p2p_communicator=p2p, pg_collection=pgs)
        for param in model.parameters():
            param.grad = param.main_grad
        optimizer.step()
        losses += [float(o["lm loss"]) for o in out]
    return losses


def _ddp(config, module, pgs):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig()
    return DistributedDataParallel(config, ddp_config, module, pg_collection=pgs)


def _run_tp2_sp():
    import math

    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    pgs = _groups(tp=2)
    config = _tiny_config(tp=2, sp=True)
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1, tp_rank=pgs.tp.rank(), ep_rank=0, etp_rank=0)
    model = _ddp(config, _tiny_gpt(config, pgs), pgs)
    losses = _train(model, pgs, config)
    norms = [p for n, p in model.named_parameters() if "layernorm" in n]
    return {
        "losses_finite": all(math.isfinite(l) for l in losses) and len(losses) == 4,
        "norm_params_tagged": bool(norms) and all(p.sequence_parallel for p in norms),
        "norm_checksum": float(sum(p.detach().double().sum() for p in norms)),
    }


def _run_pp2_shared_embedding():
    import math

    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    pgs = _groups(pp=2, share_embedding=True)
    # Attention dropout exercises the tracker fork; recompute exercises the checkpoint RNG.
    config = _tiny_config(pp=2, attention_dropout=0.1, recompute_granularity="full",
                          recompute_method="uniform", recompute_num_layers=1)
    torch.manual_seed(2)
    model_parallel_cuda_manual_seed(2, tp_rank=0, ep_rank=0, etp_rank=0)
    first, last = pgs.pp.rank() == 0, pgs.pp.rank() == 1
    model = _ddp(config, _tiny_gpt(config, pgs, first, last, share=True), pgs)
    losses = _train(model, pgs, config)
    shared = model.module.shared_embedding_or_output_weight().detach()
    high, low = shared.clone(), shared.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=pgs.embd)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=pgs.embd)
    return {
        "losses_finite": all(math.isfinite(l) for l in losses),
        "last_stage_losses": losses,
        "shared_weight_max_diff": float((high - low).abs().max()),
    }


def _row_parallel_partial_sum():
    """The adapter ``megatron_row_parallel`` at TP=2: each rank's partial sum, all-reduced,
    is what ``RowParallelLinear`` returns, and its backward gives the same gradients."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from patches import megatron_row_parallel

    pgs = _groups(tp=2)
    config = _tiny_config(tp=2)
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3, tp_rank=pgs.tp.rank(), ep_rank=0, etp_rank=0)
    linear = RowParallelLinear(2 * HIDDEN, HIDDEN, config=config,
                               init_method=torch.nn.init.normal_, bias=True,
                               input_is_parallel=True, skip_bias_add=True, tp_group=pgs.tp)
    x = torch.randn(SEQ, 2, HIDDEN, generator=torch.Generator().manual_seed(pgs.tp.rank()),
                    requires_grad=True)  # this rank's half of the input features
    grad = torch.randn(SEQ, 2, HIDDEN, generator=torch.Generator().manual_seed(9))

    def backward(output):
        linear.weight.grad, x.grad = None, None
        output.backward(grad)
        return linear.weight.grad.clone(), x.grad.clone()

    full, bias = linear(x)
    expected = backward(full)
    partial = megatron_row_parallel.partial_sum(linear, x)
    got = backward(partial)
    summed = partial.detach().clone()
    dist.all_reduce(summed, group=pgs.tp)
    return {"sum_is_the_output": bool(torch.allclose(summed, full.detach(), atol=1e-6)),
            "bias_returned_apart": bias is linear.bias,
            "gradients_equal": all(torch.equal(a, b) for a, b in zip(got, expected))}


def _standalone_group():
    """The adapter ``torch_process_group`` on 2 ranks, as the cross-worker groups use it: a
    gloo group on a prefix of the world's store, entered in the world's registry (a
    collective on it, its backend and ranks answered) and dropped from it again."""
    import torch
    import torch.distributed as dist

    from patches import torch_process_group as pg

    rank = dist.get_rank()
    store = dist.PrefixStore("standalone/", pg.default_store())
    group = pg.standalone_group("gloo", store, 1 - rank, 2, datetime.timedelta(seconds=60),
                                {rank: 1 - rank}, "standalone")  # group ranks reversed
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=group)
    gathered = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=group)
    answers = {"sum": float(total), "gathered": [float(t) for t in gathered],
               "backend": pg.backend_of(group), "rank_in_group": dist.get_rank(group),
               "registered": dist.get_backend(group) == "gloo"}
    pg.drop(group)
    answers["dropped"] = group not in dist.distributed_c10d._world.pg_map
    return answers


def _scenario_two_ranks():
    # apply() before any megatron import: the other order from single_rank.
    import patches

    applied = patches.apply()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    _ensure_global_memory_buffer()
    result = {"applied": applied, "tp2_sp_ddp": _run_tp2_sp(),
              "pp2_shared_embedding": _run_pp2_shared_embedding(),
              "row_parallel_partial_sum": _row_parallel_partial_sum(),
              "standalone_group": _standalone_group()}
    dist.destroy_process_group()
    _emit(result)


_SCENARIOS = {
    "single_rank": _scenario_single_rank,
    "selection": _scenario_selection,
    "two_ranks": _scenario_two_ranks,
}

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, for `patches`
    _SCENARIOS[sys.argv[1]]()

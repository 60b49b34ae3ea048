"""--bf16 accumulates the micro-batches' gradients in fp32, as Megatron-LM does.

One step of 8 micro-batches on a bf16 GPT; the gradients the inner optimizer steps with are
compared, element by element, with a single-process reference in plain torch that runs the
same micro-batches through a fresh copy of the model (cast to bf16 as DeepSpeed casts it) and
sums each micro-batch's bf16 gradient in fp32, and with the same reference summing them in
bf16 (autograd's own accumulation). The two references differ by about 1e-3 of the largest
gradient: at one rank the run must equal the fp32 one exactly and at two data-parallel ranks
(the reduction's order differs) within 1e-6 of it.

DeepSpeed 0.19.8 builds ``BF16_Optimizer`` for this at ZeRO-1 and its ZeRO optimizer with an
fp32 gradient partition at ZeRO-2 (``config.ds_config.grad_accum_dtype``); at ZeRO-0 it has
no fp32 accumulation for bf16, and with --grad-reduce-in-bf16 Megatron-LM accumulates in bf16
too: those equal the bf16 reference.
"""

import pytest
import torch

from conftest import spawn_gloo

MICRO = 8  # micro-batches of one step (the global batch over micro-batch 2 and DP)
VOCAB, SEQ = 512, 32
MODEL = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--micro-batch-size", "2", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--bf16", "--optimizer", "sgd", "--clip-grad", "0"]
EXACT = 0.0  # one rank: the same additions in the same order
REORDERED = 1e-6  # two ranks: each sums its micro-batches, then the ranks are summed
APART = 1e-4  # the bf16 reference is at least this far from the fp32 one (about 1e-3)


def _cfg(zero_stage: int, *flags):
    from megatron_streaming.cli.arguments import parse_args

    return parse_args([*MODEL, "--global-batch-size", str(2 * MICRO), "--zero-stage",
                       str(zero_stage), *flags])


def _batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(MICRO):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": torch.ones(2, SEQ), "attention_mask": None,
                    "position_ids": torch.arange(SEQ).expand(2, SEQ)})
    return out


def _model(cfg, topology):
    from megatron_streaming.run.build import build_model

    return build_model(cfg, topology, VOCAB, False)


def _references(cfg, topology, batches):
    """Per parameter name: the micro-batches' bf16 gradients summed in fp32, and in bf16."""
    model = _model(cfg, topology)
    for p in model.parameters():  # as DeepSpeed casts the module under --bf16
        p.data = p.data.to(torch.bfloat16)
    in_fp32, in_bf16 = {}, {}
    for batch in batches:
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].view(-1)
        loss = (out.float().view(-1) * mask).sum() / mask.sum() / len(batches)
        loss.backward()
        for name, p in model.named_parameters():
            in_fp32[name] = in_fp32.get(name, 0) + p.grad.float()
            in_bf16[name] = p.grad if name not in in_bf16 else in_bf16[name] + p.grad
            p.grad = None
    return in_fp32, {k: v.float() for k, v in in_bf16.items()}


def _stepped_gradients(engine, model, batches, hooks=()):
    """Per parameter name: (its first element on this rank, the fp32 gradient the inner
    optimizer steps that slice with)."""
    seen = {}

    def capture(optimizer, args, kwargs):
        seen.update({id(t): t.grad.detach().clone() for g in optimizer.param_groups
                     for t in g["params"]})

    handle = engine.inner_optimizer.register_step_pre_hook(capture)
    engine.step_hooks.extend(hooks)
    engine.train_step(iter(batches), 0)
    handle.remove()
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, group in enumerate(engine.master_slices()):
        base = engine.optimizer_state.tensors(i)[0]
        for param, view, first in group:
            grad = seen[id(view)].reshape(-1) if id(view) in seen else seen[id(base)].narrow(
                0, view.storage_offset() - base.storage_offset(), view.numel())
            out[names[id(param)]] = (first, grad)
    return out


def _distances(stepped, reference):
    """Largest element difference between the stepped slices and ``reference``, over the
    largest reference element (one scale for the whole model)."""
    scale = max(r.abs().max().item() for r in reference.values())
    worst = 0.0
    for name, (first, grad) in stepped.items():
        ref = reference[name].reshape(-1)[first:first + grad.numel()]
        worst = max(worst, (grad - ref).abs().max().item())
    return worst / scale


def _engine(cfg, topology):
    from megatron_streaming.worker.engine import WorkerEngine

    model = _model(cfg, topology)
    return WorkerEngine(cfg, topology, model), model


def test_the_generated_deepspeed_config_asks_for_megatrons_accumulation():
    """fp32 under ZeRO (BF16_Optimizer adding each gradient as it is made, at ZeRO-1), bf16 at
    ZeRO-0 (DeepSpeed has no other) and with --grad-reduce-in-bf16, which also reduces in
    bf16; fp16 in fp16, said."""
    from megatron_streaming.config.ds_config import precision_sections

    def sections(stage, *flags):
        return precision_sections(_cfg(stage, *flags).precision, stage)

    fp32, bf16 = {"grad_accum_dtype": "fp32"}, {"grad_accum_dtype": "bf16"}
    assert sections(1) == {"bf16": {"enabled": True, "immediate_grad_update": True},
                           "communication_data_type": "fp32", "data_types": fp32}
    assert sections(2) == {"bf16": {"enabled": True}, "communication_data_type": "fp32",
                           "data_types": fp32}
    assert sections(0)["data_types"] == bf16
    for stage in (1, 2):
        assert sections(stage, "--grad-reduce-in-bf16") == {
            "bf16": {"enabled": True}, "communication_data_type": "bf16", "data_types": bf16}
    fp16 = _cfg(1)
    fp16.precision.bf16, fp16.precision.fp16 = False, True
    assert precision_sections(fp16.precision, 1)["data_types"] == {"grad_accum_dtype": "fp16"}


@pytest.mark.parametrize("value, refused", [("bf16", True), ("float32", False),
                                            ("fp32", False)])
def test_a_deepspeed_json_with_another_accumulation_is_refused_by_name(tmp_path, value, refused):
    import json

    from megatron_streaming.config.ds_config import (DeepSpeedConfigError, merge_user_config,
                                                     precision_sections)

    path = tmp_path / "ds.json"
    user = {"data_types": {"grad_accum_dtype": value}}
    path.write_text(json.dumps(user))
    cfg = _cfg(1, "--deepspeed_config", str(path))
    generated = precision_sections(cfg.precision, 1)
    if not refused:  # another name of fp32: DeepSpeed reads it the same
        assert merge_user_config(generated, user, cfg)["data_types"] == user["data_types"]
        return
    with pytest.raises(DeepSpeedConfigError) as e:
        merge_user_config(generated, user, cfg)
    assert str(e.value) == (
        f'--deepspeed_config {path}: "data_types.grad_accum_dtype": "bf16": generated as '
        '"fp32" (gradients accumulate over micro-batches in fp32 with --bf16 as in '
        "Megatron-LM, in bf16 with --grad-reduce-in-bf16 or at --zero-stage 0, in fp16 with "
        "--fp16); drop the key")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread here, as in the spawned ranks: the reductions inside a kernel (a norm's
    weight gradient over the tokens) then add in the same order in every process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def references(megatron_world):
    in_fp32, in_bf16 = _references(_cfg(1), megatron_world, _batches())
    assert _distances({k: (0, v.reshape(-1)) for k, v in in_bf16.items()}, in_fp32) > APART
    return in_fp32, in_bf16


@pytest.mark.parametrize("zero_stage,flags,optimizer", [
    (1, (), "BF16_Optimizer"), (2, (), "DeepSpeedZeroOptimizer"),
    (2, ("--overlap-grad-reduce",), "DeepSpeedZeroOptimizer")])
def test_bf16_gradients_accumulate_in_fp32_under_zero(megatron_world, references, zero_stage,
                                                      flags, optimizer):
    in_fp32, in_bf16 = references
    engine, model = _engine(_cfg(zero_stage, *flags), megatron_world)
    assert type(engine.optimizer).__name__ == optimizer and engine.zero
    stepped = _stepped_gradients(engine, model, _batches())
    assert len(stepped) == len(in_fp32)
    to_fp32, to_bf16 = _distances(stepped, in_fp32), _distances(stepped, in_bf16)
    assert to_fp32 == EXACT and to_bf16 > APART


@pytest.mark.parametrize("zero_stage,flags", [(0, ()), (1, ("--grad-reduce-in-bf16",))])
def test_bf16_accumulation_at_zero0_and_with_grad_reduce_in_bf16(megatron_world, references,
                                                                  zero_stage, flags):
    in_fp32, in_bf16 = references
    engine, model = _engine(_cfg(zero_stage, *flags), megatron_world)
    stepped = _stepped_gradients(engine, model, _batches())
    to_fp32, to_bf16 = _distances(stepped, in_fp32), _distances(stepped, in_bf16)
    assert to_bf16 == EXACT and to_fp32 > APART


class _Double:
    """A step hook that doubles one parameter's accumulated gradient before the step, as the
    model-parallel fix-ups (``worker.grads``) change it in place."""

    def __init__(self, engine, param):
        self.engine, self.param = engine, param

    def before_step(self, step):
        from patches import deepspeed_zero

        deepspeed_zero.accumulated_grad(self.engine.optimizer, self.param).mul_(2)

    def after_step(self):
        pass


def test_bf16_optimizers_accumulated_gradient_is_what_its_step_reads(megatron_world,
                                                                      references):
    """ZeRO-1 with fp32 accumulation: the sequence-parallel sum over TP and the tied
    embedding's sum over the pipeline stages change the gradient the step reads (the fp32
    buffer's view, not ``param.grad``)."""
    in_fp32, _ = references
    engine, model = _engine(_cfg(1), megatron_world)
    name, param = next((n, p) for n, p in model.named_parameters() if "layernorm" in n)
    stepped = _stepped_gradients(engine, model, _batches(), [_Double(engine, param)])
    first, grad = stepped[name]
    doubled = torch.equal(grad, 2 * in_fp32[name].reshape(-1)[first:first + grad.numel()])
    assert doubled, name
    del stepped[name]
    to_fp32 = _distances(stepped, in_fp32)
    assert to_fp32 == EXACT


def test_zero2s_fp32_partition_is_what_the_sequence_parallel_hook_changes(megatron_world,
                                                                          references):
    """ZeRO-2 with fp32 accumulation: the hook the sequence-parallel sum runs in
    (``deepspeed_zero.after_gradient_partition``) gets views of the fp32 partition the step
    reads, laid out as the parameters are (a layernorm's doubled there is doubled in the
    step); the rest stays the fp32 reference's."""
    from patches import deepspeed_zero

    in_fp32, _ = references
    engine, model = _engine(_cfg(2), megatron_world)
    name, param = next((n, p) for n, p in model.named_parameters() if "layernorm" in n)

    def double(slices):
        for group in slices:
            for p, grad in group:
                if p is param:
                    assert grad.dtype == torch.float32
                    grad.mul_(2)

    deepspeed_zero.after_gradient_partition(engine.optimizer, double)
    stepped = _stepped_gradients(engine, model, _batches())
    first, grad = stepped.pop(name)
    doubled = torch.equal(grad, 2 * in_fp32[name].reshape(-1)[first:first + grad.numel()])
    to_fp32 = _distances(stepped, in_fp32)
    assert doubled and to_fp32 == EXACT


def _topology(rank, layout):
    """This spawned rank's topology, installed into Megatron (``spawn_gloo`` made the world)."""
    import os

    import patches
    from megatron_streaming.parallel import distributed
    from megatron_streaming.parallel.topology import Topology

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed asks for it, as a launcher sets it
    patches.apply()
    distributed.init_distributed("gloo", 5)
    topology = Topology.create(layout, rank)
    topology.install_into_megatron()
    return topology


def _data_parallel(rank, world, group, zero_stages):
    """One rank of DP=2: the gradients each ZeRO stage steps with (half the micro-batches
    here, the other half on the other rank), and rank 0 the references of all of them."""
    from megatron_streaming.parallel.topology import RankLayout

    topology = _topology(rank, RankLayout(world))
    batches = _batches()
    mine = batches[rank * MICRO // world:(rank + 1) * MICRO // world]
    out = {}
    for stage, flags in zero_stages:
        engine, model = _engine(_cfg(stage, *flags), topology)
        out[(stage, flags)] = _stepped_gradients(engine, model, mine)
    if rank == 0:
        out["references"] = _references(_cfg(1), topology, batches)
    return out


@pytest.mark.timeout(300)
def test_two_data_parallel_ranks_reduce_the_fp32_sums(tmp_path):
    """DP=2: BF16_Optimizer all-reduces its fp32 buffers, ZeRO-2 reduces each backward's
    gradients into its fp32 partition (in fp32, --grad-reduce-in-bf16 not given), with
    --overlap-grad-reduce too; each rank's slices equal the fp32 reference over all 8
    micro-batches."""
    cases = ((1, ()), (2, ()), (2, ("--overlap-grad-reduce",)))
    ranks = spawn_gloo(_data_parallel, 2, tmp_path, cases)
    in_fp32, in_bf16 = ranks[0]["references"]
    for stage in cases:
        for rank in ranks:
            to_fp32, to_bf16 = _distances(rank[stage], in_fp32), _distances(rank[stage], in_bf16)
            assert to_fp32 < REORDERED and to_bf16 > APART, stage
        covered = sum(grad.numel() for rank in ranks for _, grad in rank[stage].values())
        expected = sum(v.numel() for v in in_fp32.values())
        # ZeRO partitions the elements over the ranks; BF16_Optimizer steps a partition too
        assert covered == expected, stage


def _pipeline(rank, world, group):
    """One stage of PP=2 at ZeRO-1: the gradients its optimizer steps with, named as in the
    one-stage model (the last stage's layer 0 is layer 1 there, its output layer the tied
    embedding)."""
    from megatron_streaming.parallel.topology import RankLayout

    topology = _topology(rank, RankLayout(world, pp=world))
    engine, model = _engine(_cfg(1, "--pipeline-model-parallel-size", str(world)), topology)
    stepped = _stepped_gradients(engine, model, _batches())
    offset = topology.first_layer(2)
    renamed = {}
    for name, value in stepped.items():
        if name.startswith("decoder.layers."):
            layer, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{int(layer) + offset}.{rest}"
        renamed["embedding.word_embeddings.weight" if name == "output_layer.weight"
                else name] = value
    return renamed


@pytest.mark.timeout(300)
def test_pipeline_stages_sum_the_tied_embeddings_fp32_gradients(tmp_path, references):
    """PP=2, ZeRO-1 (BF16_Optimizer): the word embedding's gradient on the first stage and
    the output layer's on the last are summed over the two stages in the fp32 buffers the
    step reads. Each stage's sum differs from the one-stage model's, whose backward adds the
    two uses in bf16 within each micro-batch; every other parameter equals the reference."""
    in_fp32, _ = references
    first, last = spawn_gloo(_pipeline, 2, tmp_path)
    tied = "embedding.word_embeddings.weight"
    assert torch.equal(first[tied][1], last[tied][1])
    scale = in_fp32[tied].abs().max().item()
    off = (first[tied][1] - in_fp32[tied].reshape(-1)).abs().max().item() / scale
    assert off < 0.02, off  # bf16 rounding of each micro-batch's sum, not a missing half
    rest = {**{k: v for k, v in first.items() if k != tied},
            **{k: v for k, v in last.items() if k != tied}}
    assert sorted(rest) == sorted(k for k in in_fp32 if k != tied)
    to_fp32 = _distances(rest, in_fp32)
    assert to_fp32 == EXACT

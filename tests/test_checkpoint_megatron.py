"""Megatron-LM's own checkpoints, in (``--load`` of one) and out (``export-megatron``).

Megatron-LM's training loop does not run here, so its checkpoints are written the way it writes
them: a megatron-core ``GPTModel`` (its local layer spec, whose sharded keys are Megatron-LM's)
saved with ``dist_checkpointing`` in Megatron-LM's layout (tracker file, ``iter_0000010/``,
``common.pt`` holding ``args`` / ``checkpoint_version`` / ``iteration``, an optimizer tensor and
the RNG object beside the model). A Llama-class model (RMSNorm, SwiGLU, rotary, GQA, untied)
and a GPT one (LayerNorm, GELU, learned positions, biases, tied).

* in: ``pretrain_gpt.py --load`` of it at TP=1, TP=2 and PP=2 has the first loss that the
  megatron-core model itself computes on that batch; with ``--finetune`` the loss of our run
  started from our own checkpoint of the same weights;
* out: ``export-megatron`` of our checkpoint is read back by megatron-core's ``load`` into a
  ``GPTModel`` tensor for tensor, and ``--load`` of it gives the loss of ``--load`` of ours;
* cheap, in-process: detection, the refusals (flag and both values), the safe read of
  ``common.pt``, a vocabulary padded for another TP size, the flags Megatron-LM's loader reads.
"""

import argparse
import os
import pickle

import pytest
import torch
import torch.nn.functional as F

from harness import TINY, read_jsonl, train_losses_together
from megatron_streaming.checkpoint import CheckpointError, megatron_lm, offline
from megatron_streaming.checkpoint.resume import architecture
from megatron_streaming.checkpoint.store import TRACKER
from megatron_streaming.cli.arguments import parse_args

LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2", "--rotary-base", "500000"]
GPT = []  # Megatron's defaults: LayerNorm, GELU, learned absolute positions, biases, tied
VOCAB, ITERATION = 256, 10
# Megatron-LM's unfused attention, as in the megatron-core model the checkpoint came from.
RUN = [*TINY, "--num-layers", "2", "--attention-backend", "unfused", "--eval-iters", "0"]


def _cfg(flags, *more):
    return parse_args([*RUN, *flags, *more])


def megatron_core_model(topology, flags, vocab_rows=VOCAB):
    """A megatron-core GPTModel of ``flags`` built with megatron-core alone (its local spec),
    random weights (norms and biases too)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = _cfg(flags).model
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.query_groups(),
        ffn_hidden_size=m.ffn_size(), gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu, normalization=m.normalization,
        add_bias_linear=not m.disable_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True)
    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_layer_local_spec(
                         normalization=m.normalization),
                     vocab_size=vocab_rows, max_sequence_length=m.seq_length,
                     share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                     position_embedding_type=m.position_embedding_type,
                     rotary_base=m.rotary_base, pg_collection=topology.pg_collection())
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def megatron_lm_args(flags, **more):
    """Megatron-LM's ``args`` of such a run, in its own names."""
    m = _cfg(flags).model
    values = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_size(),
        kv_channels=m.hidden_size // m.num_attention_heads,
        group_query_attention=m.group_query_attention, num_query_groups=m.num_query_groups,
        swiglu=m.swiglu, normalization=m.normalization,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        max_position_embeddings=m.seq_length, seq_length=m.seq_length,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        add_bias_linear=not m.disable_bias_linear, add_qkv_bias=False, qk_layernorm=False,
        rotary_base=m.rotary_base, rotary_percent=1.0, norm_epsilon=1e-5,
        apply_layernorm_1p=False, num_experts=None, make_vocab_size_divisible_by=128,
        padded_vocab_size=VOCAB, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1, params_dtype=torch.float32, bf16=False,
        consumed_train_samples=ITERATION * 4, tokenizer_type="NullTokenizer")
    values.update(more)
    return argparse.Namespace(**values)


def write_megatron_lm(root, model, args, iteration=ITERATION):
    """Megatron-LM's torch_dist save of ``model``, with what else it saves."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    name = "release" if iteration == "release" else f"iter_{iteration:07d}"
    directory = root / name
    directory.mkdir(parents=True)
    embedding = model.embedding.word_embeddings.weight
    state = {
        "model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0,
        "iteration": 0 if iteration == "release" else iteration,
        "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets(
            "optimizer.state.exp_avg.embedding.word_embeddings.weight",
            torch.full_like(embedding, 3.0).detach(), replica_id=0)},
        "rng_state": ShardedObject("rng_state", [{"torch_rng_state": torch.get_rng_state()}],
                                   (1, 1), (0, 0), replica_id=0),
        "opt_param_scheduler": {"num_steps": 40}, "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, str(directory),
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
    (root / TRACKER).write_text(str(iteration))
    return directory


def global_params(model):
    """{name: tensor} of a TP=1 / PP=1 megatron-core model (its names are our global ones)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def first_loss(model, flags, iteration, workers=1):
    """The loss of the first training step after ``iteration`` (2 micro-batches of 2, the
    batches of worker 0's one rank), computed by ``model`` itself."""
    from diloco_reference import worker_iterators
    from megatron_streaming.data.inputs import load_run_tokenizer
    from megatron_streaming.parallel import distributed

    cfg = _cfg(flags)
    distributed.seed_everything(1, 0)  # megatron-core's RNG tracker (dropout is off)
    it = worker_iterators(cfg, load_run_tokenizer(cfg), workers, 1,
                          start_iteration=iteration)[0][0]
    total = 0.0
    for _ in range(2):
        b = next(it)
        losses = model.eval()(b["tokens"], b["position_ids"], b["attention_mask"],
                              labels=b["labels"])
        mask = b["loss_mask"].float()
        total += float((losses.float() * mask).sum() / mask.sum()) / 2
    return total


def export_round_trip(tmp_path, topology, flags, params):
    """Our checkpoint of ``params`` exported to Megatron-LM's format and read back by
    megatron-core's own load into a GPTModel: every tensor exact. Returns the export."""
    from megatron.core import dist_checkpointing

    from megatron_streaming.checkpoint.__main__ import main

    cfg = _cfg(flags)
    offline.write(str(tmp_path / "ours"), cfg.model, params, VOCAB, flags, "test")
    out = tmp_path / "exported"
    assert main(["export-megatron", str(tmp_path / "ours"), str(out)]) == 0
    assert (out / TRACKER).read_text() == "release"  # iteration 0: Megatron-LM's "release"
    back = megatron_core_model(topology, flags)
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    loaded = dist_checkpointing.load(back.sharded_state_dict(), str(out / "release"))
    back.load_state_dict(loaded, strict=False)
    names = dict(back.named_parameters())
    assert set(names) == set(params)
    for name, p in names.items():
        assert torch.equal(p, params[name]), name
    common = megatron_lm.read_common(str(out / "release" / "common.pt"))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    args = common["args"]
    assert architecture(megatron_lm.model_config_of(args)) == architecture(cfg.model)
    # What Megatron-LM's check_checkpoint_args compares (the rest of its flags it takes from
    # the launch, or from here with --use-checkpoint-args).
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.padded_vocab_size,
            args.make_vocab_size_divisible_by, args.max_position_embeddings) == \
        (2, 64, 4, VOCAB, 128, 32)
    assert args.add_position_embedding == (flags == GPT)
    return out


def _log(tmp_path, name):
    return (tmp_path / f"{name}.log").read_text()


# ---- in: --load of a Megatron-LM checkpoint ------------------------------------------------

@pytest.mark.timeout(600)
def test_llama_checkpoint_of_megatron_lm_trains_under_any_layout(tmp_path, megatron_world):
    model = megatron_core_model(megatron_world, LLAMA)
    write_megatron_lm(tmp_path / "mlm", model, megatron_lm_args(LLAMA))
    expected = first_loss(model, LLAMA, ITERATION)
    args = [*RUN, *LLAMA, "--load", str(tmp_path / "mlm"), "--train-iters", str(ITERATION + 2),
            "--no-load-optim", "--no-load-rng"]
    losses = train_losses_together({
        "tp1": (1, args),
        "tp2": (2, [*args, "--tensor-model-parallel-size", "2"]),
        "pp2": (2, [*args, "--pipeline-model-parallel-size", "2"])}, tmp_path)
    for name in ("tp1", "tp2", "pp2"):
        assert len(losses[name]) == 2, (name, losses[name])  # iterations 11 and 12
        assert losses[name][0] == pytest.approx(expected, rel=1e-6, abs=0), name
        assert "started from the weights of the Megatron-LM checkpoint" in _log(tmp_path, name)
        assert f"at iteration {ITERATION}" in _log(tmp_path, name)
    print({name: abs(v[0] - expected) for name, v in losses.items()})


@pytest.mark.timeout(600)
def test_gpt_checkpoint_in_and_out(tmp_path, megatron_world):
    """--load of Megatron-LM's checkpoint (--finetune), of our own checkpoint of the same
    weights and of its export to Megatron-LM's format: one first loss, the megatron-core
    model's; the Megatron-LM checkpoint also starts two workers (ZeRO-1), the sync's global
    copy being its weights."""
    model = megatron_core_model(megatron_world, GPT)
    write_megatron_lm(tmp_path / "mlm", model, megatron_lm_args(GPT))
    params = global_params(model)
    out = export_round_trip(tmp_path, megatron_world, GPT, params)
    expected = first_loss(model, GPT, 0)
    run = [*RUN, *GPT, "--train-iters", "1"]
    streaming = ["--diloco-workers", "2", "--diloco-inner-steps", "4", "--zero-stage", "1",
                 "--save", str(tmp_path / "saved")]
    losses = train_losses_together({
        "megatron_lm": (2, [*run, "--load", str(tmp_path / "mlm"), "--finetune", *streaming]),
        "ours": (1, [*run, "--load", str(tmp_path / "ours")]),
        "exported": (1, [*run, "--load", str(out)])}, tmp_path)
    # Two workers: worker 0's loss, on its own batches.
    worker0 = first_loss(model, GPT, 0, workers=2)
    assert losses["megatron_lm"][0] == pytest.approx(worker0, rel=1e-6, abs=0)
    assert "at iteration 0 (--finetune)" in _log(tmp_path, "megatron_lm")
    for name in ("ours", "exported"):
        assert losses[name][0] == pytest.approx(expected, rel=1e-6, abs=0), name
    assert losses["exported"][0] == losses["ours"][0]
    # The sync's global copy started as the loaded weights (no exchange before step 4), the
    # worker's own trained away from them.
    _, _, theta_g = offline.parameters(str(tmp_path / "saved"), "global")
    _, _, local = offline.parameters(str(tmp_path / "saved"), "local", 0)
    for name, p in params.items():
        assert torch.equal(theta_g[name], p), name
    assert all(not torch.equal(local[n], params[n]) for n in ("embedding.word_embeddings.weight",
                                                              "decoder.final_layernorm.weight"))
    print({"megatron_lm, 2 workers": abs(losses["megatron_lm"][0] - worker0),
           **{n: abs(losses[n][0] - expected) for n in ("ours", "exported")}})


# ---- cheap, in-process -----------------------------------------------------------------------

def _our_model(topology, flags, *more):
    from megatron_streaming.parallel import distributed
    from megatron_streaming.worker.model import build_model

    cfg = _cfg(flags, *more)
    distributed.seed_everything(1, 0)
    return cfg, build_model(cfg.model, cfg.parallel, topology, cfg.data.vocab_size or VOCAB,
                            None, cfg.precision)


@pytest.mark.parametrize("flags", [LLAMA, GPT], ids=["llama", "gpt"])
def test_weights_reach_our_model_exactly_and_the_rest_is_ignored(tmp_path, megatron_world,
                                                                  flags):
    model = megatron_core_model(megatron_world, flags)
    write_megatron_lm(tmp_path, model, megatron_lm_args(flags))
    assert megatron_lm.is_megatron_lm(str(tmp_path))
    source = megatron_lm.open_checkpoint(str(tmp_path))
    assert source.iteration == ITERATION and source.consumed_samples == ITERATION * 4
    cfg, ours = _our_model(megatron_world, flags)
    assert megatron_lm.check_compatible(source, cfg, VOCAB) == []
    assert megatron_lm.load_weights(ours, source) == []
    params = global_params(model)
    for name, p in ours.named_parameters():
        assert torch.equal(p, params[name]), name


@pytest.mark.parametrize("flags", [LLAMA, GPT], ids=["llama", "gpt"])
def test_export_reads_back_in_megatron_core_exactly(tmp_path, megatron_world, flags):
    model = megatron_core_model(megatron_world, flags)
    out = export_round_trip(tmp_path, megatron_world, flags, global_params(model))
    # ... and is a Megatron-LM checkpoint to --load here
    assert megatron_lm.is_megatron_lm(str(out))
    assert not megatron_lm.is_megatron_lm(str(tmp_path / "ours"))


def test_detection_and_the_refusals_name_the_flag_and_both_values(tmp_path, megatron_world):
    model = megatron_core_model(megatron_world, LLAMA)
    root = tmp_path / "mlm"
    write_megatron_lm(root, model, megatron_lm_args(LLAMA))
    assert not megatron_lm.is_megatron_lm(str(tmp_path / "nowhere"))
    assert not megatron_lm.is_megatron_lm(str(tmp_path))
    source = megatron_lm.open_checkpoint(str(root))
    with pytest.raises(CheckpointError, match="a checkpoint written by Megatron-LM"):
        offline.open_checkpoint(str(root))  # the tools read ours: said so

    def refusal(*flags, vocab=VOCAB):
        with pytest.raises(CheckpointError) as e:
            megatron_lm.check_compatible(source, _cfg(LLAMA, *flags), vocab)
        return str(e.value)

    head = f"--load {root}: the Megatron-LM checkpoint's model has "
    assert refusal("--num-layers", "4") == \
        head + "--num-layers 2, this run 4; pass the checkpoint's value"
    assert refusal("--num-query-groups", "4") == \
        head + "--num-query-groups 2, this run 4; pass the checkpoint's value"
    assert refusal("--ffn-hidden-size", "192") == \
        head + "--ffn-hidden-size 128, this run 192; pass the checkpoint's value"
    assert refusal("--normalization", "LayerNorm").startswith(
        head + "--normalization RMSNorm, this run LayerNorm")
    assert _refusal_of(source, LLAMA, ["--untie-embeddings-and-output-weights"]) == \
        head + "--untie-embeddings-and-output-weights True, this run False; pass the " \
        "checkpoint's value"
    assert refusal(vocab=1000) == (
        f"--load {root}: the Megatron-LM checkpoint's vocabulary is padded to 256 rows "
        "(--make-vocab-size-divisible-by 128 x TP 2), which this run's tokenizer of 1000 "
        "tokens does not pad to (--tokenizer-type / --tokenizer-model / --vocab-size)")
    # Only the math, no shape: said, not refused.
    assert megatron_lm.check_compatible(source, _cfg(LLAMA, "--rotary-base", "10000"),
                                        VOCAB) == [
        f"--load {root}: the Megatron-LM checkpoint's model has --rotary-base 500000, this "
        "run 10000"]
    qkv = megatron_lm.MegatronCheckpoint(str(root), source.directory, 10, megatron_lm_args(
        LLAMA, add_qkv_bias=True))
    with pytest.raises(CheckpointError, match="has --add-qkv-bias True, which no model here"):
        megatron_lm.check_compatible(qkv, _cfg(LLAMA), VOCAB)


def _refusal_of(source, flags, dropped):
    with pytest.raises(CheckpointError) as e:
        megatron_lm.check_compatible(source, _cfg([f for f in flags if f not in dropped]),
                                     VOCAB)
    return str(e.value)


def test_other_formats_and_code_in_common_pt_are_refused_unread(tmp_path):
    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    root = tmp_path / "code"
    (root / "iter_0000005").mkdir(parents=True)
    (root / TRACKER).write_text("5")
    (root / "iter_0000005" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"args": Payload(), "iteration": 5}, root / "iter_0000005" / "common.pt")
    assert megatron_lm.is_megatron_lm(str(root))
    with pytest.raises(CheckpointError, match="common.pt holds more than data and was not "
                                              "loaded"):
        megatron_lm.open_checkpoint(str(root))
    assert not (tmp_path / "ran").exists()

    legacy = tmp_path / "legacy"
    (legacy / "release" / "mp_rank_00").mkdir(parents=True)
    (legacy / TRACKER).write_text("release")
    with pytest.raises(CheckpointError, match="legacy per-rank format .*--ckpt-convert-format "
                                              "torch_dist"):
        megatron_lm.open_checkpoint(str(legacy))
    zarr = tmp_path / "zarr"
    (zarr / "iter_0000001").mkdir(parents=True)
    (zarr / TRACKER).write_text("1")
    (zarr / "iter_0000001" / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(CheckpointError, match="of the zarr format .*only torch_dist is read"):
        megatron_lm.open_checkpoint(str(zarr))


def test_a_vocabulary_padded_for_another_tp_size_keeps_the_stored_rows(tmp_path,
                                                                       megatron_world):
    model = megatron_core_model(megatron_world, GPT)
    write_megatron_lm(tmp_path, model, megatron_lm_args(GPT, vocab_size=130))
    source = megatron_lm.open_checkpoint(str(tmp_path))
    more = ["--vocab-size", "130", "--make-vocab-size-divisible-by", "64"]
    cfg, ours = _our_model(megatron_world, GPT, *more)
    assert megatron_lm.check_compatible(source, cfg, 130) == []
    notes = megatron_lm.load_weights(ours, source)
    assert notes[0].startswith("embedding.word_embeddings.weight: 256 rows stored, 192 here")
    stored = model.embedding.word_embeddings.weight
    assert torch.equal(ours.embedding.word_embeddings.weight, stored[:192])


def test_flags_megatron_lm_loads_with(tmp_path, megatron_world):
    """--no-load-optim / --no-load-rng: what --load of a Megatron-LM checkpoint does anyway;
    still refused with one of ours. --finetune with one of ours: refused; --save into the
    Megatron-LM directory: refused."""
    from megatron_streaming.cli.arguments import ConfigError
    from megatron_streaming.parallel.topology import RankLayout
    from megatron_streaming.run.start import resume_source

    write_megatron_lm(tmp_path / "mlm", megatron_core_model(megatron_world, GPT),
                      megatron_lm_args(GPT))
    cfg = _cfg(GPT, "--load", str(tmp_path / "mlm"), "--no-load-optim", "--no-load-rng",
               "--finetune")
    assert any(n.startswith("--no-load-optim: accepted") for n in cfg.notes)
    resume, plan, source = resume_source(cfg, RankLayout(1), VOCAB)
    assert (resume, plan, source.iteration) == (None, None, ITERATION)
    ours = tmp_path / "ours"
    offline.write(str(ours), cfg.model, global_params(megatron_core_model(megatron_world, GPT)),
                  VOCAB, GPT, "test")
    with pytest.raises(ConfigError, match="--no-load-optim: a resume restores"):
        _cfg(GPT, "--load", str(ours), "--no-load-optim")
    with pytest.raises(CheckpointError, match=r"^--finetune: --load .* is a checkpoint of this "
                                              "package, which resumes in full"):
        resume_source(_cfg(GPT, "--load", str(ours), "--finetune"), RankLayout(1), VOCAB)
    # Saving into the Megatron-LM directory would replace its iter_N directories.
    mlm = str(tmp_path / "mlm")
    with pytest.raises(CheckpointError, match=r"^--save .*: the same directory as --load, "
                                              "which holds a Megatron-LM checkpoint"):
        resume_source(_cfg(GPT, "--load", mlm, "--save", mlm, "--finetune"), RankLayout(1),
                      VOCAB)

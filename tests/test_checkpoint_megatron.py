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
  ``common.pt``, a vocabulary padded for another TP size, the flags Megatron-LM's loader reads;
* mixture of experts, both ways, for every ``--moe-layer-freq`` form Megatron-LM accepts (the
  int 1 stacks the layers' keys, any other int or a list keys each layer apart): a Mixtral
  model Megatron-LM builds (``get_gpt_decoder_block_spec``) loads here with the same logits,
  and our export holds exactly the keys Megatron-LM's save of that model holds, loads into
  Megatron-LM's model and has its ``args`` typed as Megatron-LM's parser types them;
* Megatron-LM's loader's rules on our export's ``args`` (``check_checkpoint_args``, the
  optimizer / RNG skip of a weights-only save, ``load_args_from_checkpoint``'s layer specs),
  NullTokenizer's extra end-of-document id, ``--use-checkpoint-args`` and
  ``--exit-on-missing-checkpoint``.
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


def moe_freq_type(x):
    """Megatron-LM's parser of --moe-layer-freq (megatron/training/arguments.py, core_v0.16.1):
    an int, or a list for a list expression; what its ``args`` and TransformerConfig hold."""
    if isinstance(x, int):
        return x
    if "[" in x:
        return eval(x)  # noqa: S307 - the test's own literals, as Megatron-LM's _eval_pattern
    return int(x)


def megatron_core_model(topology, flags, vocab_rows=VOCAB, moe_layer_freq=None):
    """A megatron-core GPTModel of ``flags`` built with megatron-core alone, as Megatron-LM's
    ``gpt_builder`` builds it: its local layer spec, or with --num-experts its decoder block
    spec of ``moe_layer_freq`` (the flag's text, typed by Megatron-LM's parser); random
    weights (norms and biases too)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = _cfg(flags).model
    moe = {}
    if m.moe:
        moe = dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                   moe_layer_freq=moe_freq_type(moe_layer_freq or m.moe_layer_freq),
                   moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_size(),
                   moe_aux_loss_coeff=0.0)
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.query_groups(),
        ffn_hidden_size=m.ffn_size(), gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu, normalization=m.normalization,
        add_bias_linear=not m.disable_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, **moe)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization=m.normalization) if m.moe else \
        get_gpt_layer_local_spec(normalization=m.normalization)
    model = GPTModel(config=config,
                     transformer_layer_spec=spec,
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
        add_position_embedding=True,  # Megatron-LM's default, whatever the position type
        max_position_embeddings=m.seq_length, seq_length=m.seq_length,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        add_bias_linear=not m.disable_bias_linear, add_qkv_bias=False, qk_layernorm=False,
        rotary_base=m.rotary_base, rotary_percent=1.0, norm_epsilon=1e-5,
        apply_layernorm_1p=False, make_vocab_size_divisible_by=128,
        num_experts=m.num_experts if m.moe else None, moe_layer_freq=1,
        moe_ffn_hidden_size=(m.moe_ffn_hidden_size or m.ffn_size()) if m.moe else None,
        moe_router_topk=m.moe_router_topk, moe_router_pre_softmax=False,
        padded_vocab_size=VOCAB, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1, params_dtype=torch.float32, bf16=False,
        consumed_train_samples=ITERATION * 4, tokenizer_type="NullTokenizer",
        vocab_size=VOCAB - 1)  # --vocab-size 255: 255 ids and NullTokenizer's end-of-document
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


def export_round_trip(tmp_path, topology, flags, params, layer_freq=None):
    """Our checkpoint of ``params`` exported to Megatron-LM's format and read back by
    megatron-core's own load into the GPTModel Megatron-LM builds for ``flags`` (with
    ``--moe-layer-freq layer_freq`` as its parser types it): every tensor exact. Returns the
    export."""
    from megatron.core import dist_checkpointing

    from megatron_streaming.checkpoint.__main__ import main

    cfg = _cfg(flags)
    offline.write(str(tmp_path / "ours"), cfg.model, params, VOCAB, flags, "test")
    out = tmp_path / "exported"
    assert main(["export-megatron", str(tmp_path / "ours"), str(out)]) == 0
    assert (out / TRACKER).read_text() == "release"  # iteration 0: Megatron-LM's "release"
    back = megatron_core_model(topology, flags, moe_layer_freq=layer_freq)
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
        (cfg.model.num_layers, 64, 4, VOCAB, 128, 32)
    assert_megatron_lm_loads(args, flags, layer_freq)
    return out


def megatron_lm_run_args(flags, **more):
    """The ``args`` Megatron-LM's parser gives a user launching ``flags`` with its own flag
    spellings (the fields its checkpoint loader reads)."""
    m = _cfg(flags).model
    values = dict(num_layers=m.num_layers, hidden_size=m.hidden_size,
                  num_attention_heads=m.num_attention_heads, add_position_embedding=True,
                  vocab_file=None, max_position_embeddings=m.seq_length,
                  make_vocab_size_divisible_by=128, tokenizer_type="NullTokenizer",
                  padded_vocab_size=VOCAB, use_dist_ckpt=True, data_parallel_random_init=False,
                  phase_transition_iterations=None, finetune=False, no_load_optim=None,
                  no_load_rng=None, tensor_model_parallel_size=1,
                  pipeline_model_parallel_size=1)
    values.update(more)
    return argparse.Namespace(**values)


def check_checkpoint_args(checkpoint_args, args):
    """Megatron-LM's check_checkpoint_args (megatron/training/checkpointing.py, core_v0.16.1)
    for a torch_dist checkpoint of version 3.0: the same comparisons, its message."""
    def compare(name, default=None):
        saved = getattr(checkpoint_args, name, default) if default is not None else \
            getattr(checkpoint_args, name)
        assert saved == getattr(args, name), \
            f"{name} value from checkpoint ({saved}) is not equal to the input argument " \
            f"value ({getattr(args, name)})."

    compare("num_layers")
    compare("hidden_size")
    compare("num_attention_heads")
    compare("add_position_embedding", default=True)
    if args.vocab_file:
        compare("max_position_embeddings")
        compare("make_vocab_size_divisible_by")
        compare("tokenizer_type")
    if args.data_parallel_random_init:
        compare("data_parallel_random_init")


def reads_optimizer_and_rng(checkpoint_args, args, release=False):
    """What Megatron-LM's load_checkpoint asks the checkpoint for besides the model, at the
    same TP / PP: (optimizer and scheduler, RNG state)."""
    optim = not release and not args.finetune and not args.no_load_optim and \
        not getattr(checkpoint_args, "no_save_optim", False)
    rng = not release and not args.finetune and not args.no_load_rng and \
        not getattr(checkpoint_args, "no_save_rng", False)
    return optim, rng


def assert_megatron_lm_loads(args, flags, layer_freq=None):
    """Our export's ``args`` pass Megatron-LM's loader with the user's own flags: its argument
    check (also with --vocab-file, which compares more), no optimizer or RNG state asked for at
    an iteration (a weights-only save), and with --use-checkpoint-args its MoE layer specs take
    them (``load_args_from_checkpoint`` copies ``moe_layer_freq`` into the TransformerConfig
    that ``get_gpt_decoder_layer_specs`` reads)."""
    m = _cfg(flags).model
    check_checkpoint_args(args, megatron_lm_run_args(flags))
    check_checkpoint_args(args, megatron_lm_run_args(flags, vocab_file="vocab.json"))
    assert reads_optimizer_and_rng(args, megatron_lm_run_args(flags)) == (False, False)
    assert args.no_save_optim is True and args.no_save_rng is True
    assert args.add_position_embedding is True and args.use_rotary_position_embeddings is False
    assert args.position_embedding_type == m.position_embedding_type
    # NullTokenizer --vocab-size 255 makes our 256 tokens: the flag's value, and the padding
    assert (args.tokenizer_type, args.vocab_size, args.padded_vocab_size) == \
        ("NullTokenizer", VOCAB - 1, VOCAB)
    expected = moe_freq_type(layer_freq or "1")
    assert type(args.moe_layer_freq) is type(expected) and args.moe_layer_freq == expected
    if m.moe:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, num_moe_experts=args.num_experts,
            moe_layer_freq=args.moe_layer_freq, moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size, use_cpu_initialization=True)
        specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False)
        assert len(specs) == m.num_layers


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
        f"--load {root}: the Megatron-LM checkpoint's tokenizer has 256 tokens "
        "(--tokenizer-type NullTokenizer --vocab-size 255: 255 ids and the end-of-document "
        "one), this run's tokenizer 1000 (--tokenizer-type / --tokenizer-model / --vocab-size)")
    # A tokenizer whose files give its size: only the padded size can be compared.
    hf = megatron_lm.MegatronCheckpoint(str(root), source.directory, ITERATION, megatron_lm_args(
        LLAMA, tokenizer_type="HuggingFaceTokenizer", vocab_size=None))
    with pytest.raises(CheckpointError) as e:
        megatron_lm.check_compatible(hf, _cfg(LLAMA), 1000)
    assert str(e.value) == (
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
    write_megatron_lm(tmp_path, model, megatron_lm_args(GPT, vocab_size=129))  # 130 tokens
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


# ---- mixture of experts, both ways, every --moe-layer-freq form ------------------------------

MIXTRAL = [*LLAMA, "--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2"]
# Megatron-LM's forms of --moe-layer-freq: its default int 1 (the layers' keys stacked), an
# int N, a list, a list expression (each of the last three keys every layer apart).
FREQ_FORMS = ["1", "2", "[1,0,1,0]", "([1]*3+[0]*1)"]
FREQ_IDS = ["int1", "int2", "list", "expression"]


def _logits(model, seed=3):
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(32).expand(2, 32)
    mask = torch.ones(1, 1, 32, 32, dtype=torch.bool).triu(1)
    with torch.no_grad():
        return model.eval()(tokens, positions, mask)


@pytest.mark.parametrize("freq", FREQ_FORMS, ids=FREQ_IDS)
def test_moe_checkpoint_of_megatron_lm_loads_for_every_layer_freq_form(tmp_path, megatron_world,
                                                                       freq):
    """A Mixtral checkpoint Megatron-LM saved with --moe-layer-freq in any of its forms loads
    into our model of the same flags: every tensor, and the logits of Megatron-LM's model."""
    flags = [*MIXTRAL, "--moe-layer-freq", freq]
    model = megatron_core_model(megatron_world, flags, moe_layer_freq=freq)
    directory = write_megatron_lm(tmp_path, model, megatron_lm_args(
        flags, moe_layer_freq=moe_freq_type(freq)))
    # Megatron-LM's own keys: stacked for the int 1 only
    stored = megatron_lm.stored_shapes(str(directory))
    assert ("decoder.layers.self_attention.linear_qkv.weight" in stored) == (freq == "1")
    assert ("decoder.layers.0.self_attention.linear_qkv.weight" in stored) == (freq != "1")
    source = megatron_lm.open_checkpoint(str(tmp_path))
    cfg, ours = _our_model(megatron_world, flags)
    assert megatron_lm.check_compatible(source, cfg, VOCAB) == []
    assert megatron_lm.load_weights(ours, source) == []
    params = global_params(model)
    assert {n for n, _ in ours.named_parameters()} == set(params)
    for name, p in ours.named_parameters():
        assert torch.equal(p, params[name]), name
    assert torch.allclose(_logits(ours), _logits(model), rtol=0, atol=1e-6)


def test_one_moe_model_in_two_layer_freq_forms_loads_and_another_model_is_refused(
        tmp_path, megatron_world):
    """Megatron-LM's int 1 (stacked keys) read by a run that spells the same layers as a list,
    and the other way round; a run whose MoE layers differ is refused naming the flag."""
    stacked = megatron_core_model(megatron_world, MIXTRAL, moe_layer_freq="1")
    write_megatron_lm(tmp_path / "int1", stacked, megatron_lm_args(MIXTRAL))
    apart = megatron_core_model(megatron_world, MIXTRAL, moe_layer_freq="[1,1,1,1]")
    write_megatron_lm(tmp_path / "list", apart, megatron_lm_args(
        MIXTRAL, moe_layer_freq=[1, 1, 1, 1]))
    for name, model, ours in (("int1", stacked, "([1]*4)"), ("list", apart, "1")):
        source = megatron_lm.open_checkpoint(str(tmp_path / name))
        cfg, mine = _our_model(megatron_world, MIXTRAL, "--moe-layer-freq", ours)
        assert megatron_lm.check_compatible(source, cfg, VOCAB) == []
        megatron_lm.load_weights(mine, source)
        params = global_params(model)
        for n, p in mine.named_parameters():
            assert torch.equal(p, params[n]), (name, n)
    source = megatron_lm.open_checkpoint(str(tmp_path / "int1"))
    with pytest.raises(CheckpointError) as e:
        megatron_lm.check_compatible(source, _cfg(MIXTRAL, "--moe-layer-freq", "2"), VOCAB)
    assert str(e.value) == (
        f"--load {tmp_path / 'int1'}: the Megatron-LM checkpoint's model has --moe-layer-freq "
        "[1, 1, 1, 1], this run [1, 0, 1, 0]; pass the checkpoint's value")


@pytest.mark.parametrize("freq", FREQ_FORMS, ids=FREQ_IDS)
def test_moe_export_is_what_megatron_lm_writes(tmp_path, megatron_world, freq):
    """Our export of a Mixtral model holds exactly the tensors (keys and shapes) Megatron-LM's
    own save of that model holds, loads into Megatron-LM's model of the user's flags tensor for
    tensor, and its args pass Megatron-LM's loader (``moe_layer_freq`` typed as its parser
    types the flag: an int or a list)."""
    flags = [*MIXTRAL, "--moe-layer-freq", freq]
    model = megatron_core_model(megatron_world, flags, moe_layer_freq=freq)
    out = export_round_trip(tmp_path, megatron_world, flags, global_params(model),
                            layer_freq=freq)
    mlm = write_megatron_lm(tmp_path / "mlm", model, megatron_lm_args(
        flags, moe_layer_freq=moe_freq_type(freq)))

    def model_tensors(directory):
        return {k: v for k, v in megatron_lm.stored_shapes(str(directory)).items()
                if not k.startswith("optimizer.")}

    assert model_tensors(out / "release") == model_tensors(mlm)


# ---- Megatron-LM's tokenizer sizes and checkpoint flags -----------------------------------

def test_null_tokenizer_checkpoint_of_megatron_lm_is_compared_as_megatron_lm_does(
        tmp_path, megatron_world):
    """Megatron-LM's NullTokenizer --vocab-size 511 is 512 tokens (511 ids and its
    end-of-document one), as ours of the same flags: accepted. Another size is refused."""
    from megatron_streaming.data.inputs import load_run_tokenizer

    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "511"]
    assert load_run_tokenizer(_cfg(GPT, *null)).vocab_size == 512
    root = tmp_path / "mlm"
    write_megatron_lm(root, megatron_core_model(megatron_world, GPT, vocab_rows=512),
                      megatron_lm_args(GPT, vocab_size=511, padded_vocab_size=512))
    source = megatron_lm.open_checkpoint(str(root))
    assert megatron_lm.check_compatible(source, _cfg(GPT, *null), 512) == []
    with pytest.raises(CheckpointError) as e:
        megatron_lm.check_compatible(source, _cfg(GPT, "--tokenizer-type", "NullTokenizer",
                                                  "--vocab-size", "500"), 501)
    assert str(e.value) == (
        f"--load {root}: the Megatron-LM checkpoint's tokenizer has 512 tokens "
        "(--tokenizer-type NullTokenizer --vocab-size 511: 511 ids and the end-of-document "
        "one), this run's tokenizer 501 (--tokenizer-type / --tokenizer-model / --vocab-size)")
    # A tokenizer whose files give its size: the padded size is what is compared.
    hf = megatron_lm.MegatronCheckpoint(str(root), source.directory, ITERATION, megatron_lm_args(
        GPT, tokenizer_type="HuggingFaceTokenizer", vocab_size=None, padded_vocab_size=512))
    assert megatron_lm.check_compatible(hf, _cfg(GPT), 500) == []


def test_use_checkpoint_args_takes_the_model_flags_as_megatron_lm_does(tmp_path,
                                                                      megatron_world):
    """--use-checkpoint-args with a launch that gives no model flag: the Mixtral model (and
    its NullTokenizer) of Megatron-LM's checkpoint; a shape flag the launch gives is kept
    (Megatron-LM: only None ones are set), the others are the checkpoint's."""
    from megatron_streaming.checkpoint import checkpoint_args

    freq = "([1]*3+[0]*1)"
    flags = [*MIXTRAL, "--moe-layer-freq", freq]
    root = tmp_path / "mlm"
    write_megatron_lm(root, megatron_core_model(megatron_world, flags, moe_layer_freq=freq),
                      megatron_lm_args(flags, moe_layer_freq=moe_freq_type(freq)))
    bare = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--load", str(root), "--use-checkpoint-args"]
    cfg = parse_args(bare)
    assert architecture(cfg.model) == architecture(_cfg(flags).model)
    assert (cfg.model.moe_router_topk, cfg.model.rotary_base, cfg.data.tokenizer_type,
            cfg.data.vocab_size) == (2, 500000, "NullTokenizer", VOCAB - 1)
    assert any(n.startswith("--use-checkpoint-args: mapped") for n in cfg.notes)
    assert any("setting num_layers to 4" in a for a in cfg.adjustments)
    # Megatron-LM's rule: a shape flag given wins (and is then refused at load), a forced
    # one is the checkpoint's whatever the launch says.
    cfg = parse_args([*bare, "--num-layers", "6", "--normalization", "LayerNorm"])
    assert (cfg.model.num_layers, cfg.model.normalization) == (6, "RMSNorm")
    # No checkpoint there: the launch's flags, said.
    cfg = parse_args([*bare[:-3], "--load", str(tmp_path / "empty"), "--use-checkpoint-args"])
    assert cfg.model.num_layers == 2 and "no checkpoint under --load" in cfg.adjustments[-1]
    # One of ours: its model flags.
    ours = tmp_path / "ours"
    offline.write(str(ours), _cfg(MIXTRAL).model, {}, VOCAB, MIXTRAL, "test")
    assert checkpoint_args.saved_flags(str(ours))[0]["num_experts"] == 4


def test_exit_on_missing_checkpoint_and_megatron_lm_warning(tmp_path, capsys):
    from megatron_streaming.checkpoint import checkpoint_args

    (tmp_path / "empty").mkdir()
    for load in (tmp_path / "empty", tmp_path / "nowhere"):
        with pytest.raises(SystemExit) as e:
            parse_args([*RUN, "--load", str(load), "--exit-on-missing-checkpoint"])
        assert e.value.code == 0  # Megatron-LM's sys.exit()
        assert capsys.readouterr().out.splitlines() == [
            f"WARNING: could not find the metadata file {load}/{TRACKER}",
            "    will not load any checkpoints and will start from random",
            ">> '--exit-on-missing-checkpoint' set ... exiting. <<"]
    assert checkpoint_args.missing_lines(str(tmp_path)) == [
        f"WARNING: could not find the metadata file {tmp_path}/{TRACKER}",
        "    will not load any checkpoints and will start from random"]
    # A checkpoint there, or no --load: parsed as usual.
    assert parse_args([*RUN, "--exit-on-missing-checkpoint"]).checkpoint.load is None


def test_an_empty_load_of_the_save_directory_starts_fresh_with_megatron_lm_warning(tmp_path):
    from megatron_streaming.parallel.topology import RankLayout
    from megatron_streaming.run.start import resume_source

    root = str(tmp_path / "ckpt")
    cfg = _cfg(GPT, "--load", root, "--save", root)
    assert resume_source(cfg, RankLayout(1), VOCAB) == (None, None, None)
    assert cfg.warnings[-2:] == [
        f"WARNING: could not find the metadata file {root}/{TRACKER}",
        "    will not load any checkpoints and will start from random"]

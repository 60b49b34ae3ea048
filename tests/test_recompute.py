"""Activation recompute through megatron-core: the same losses as without it (dropout on, so
the recomputed forward must redraw the very same masks), and less activation memory."""

import json

import pytest
import torch

from harness import run
from megatron_streaming.cli.arguments import ConfigError, parse_args, validate

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
VOCAB = 200
MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
MODES = {
    "full_uniform": FULL,
    "full_block_2": ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "2"],
    "selective": ["--recompute-granularity", "selective"],
    "selective_core_attn": ["--recompute-granularity", "selective", "--recompute-modules",
                            "core_attn"],
    "legacy_checkpoint_activations": ["--checkpoint-activations"],
}


def _loss_and_grads(topo, flags):
    """Loss and every gradient of one forward/backward of the toy GPT built by ``build_model``
    with ``flags``; dropout 0.1 and the RNG reseeded before the forward, so every mode draws
    the same masks as long as the recomputed forward restores the RNG state."""
    import torch

    from megatron_streaming.parallel import distributed
    from megatron_streaming.worker import weights
    from megatron_streaming.worker.model import build_model

    cfg = parse_args([*MODEL, *DROPOUT, *flags])
    m = cfg.model
    model = build_model(m, cfg.parallel, topo, VOCAB)
    weights.initialize_weights(model, seed=3, std=m.init_method_std, num_layers=m.num_layers,
                               layer_offset=0,
                               tp_rank=topo.tp_rank, tp_size=topo.layout.tp)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, m.seq_length + 1), generator=g)
    mask = torch.triu(torch.ones(m.seq_length, m.seq_length, dtype=torch.bool), 1)
    distributed.seed_everything(11, topo.tp_rank)
    losses = model(tokens[:, :-1], torch.arange(m.seq_length).repeat(2, 1), mask.view(1, 1,
                   m.seq_length, m.seq_length), labels=tokens[:, 1:])
    loss = losses.float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got, want, name):
    assert got[0] == want[0], name
    assert got[1].keys() == want[1].keys(), name
    for key, grad in want[1].items():
        assert torch.equal(got[1][key], grad), (name, key)


@pytest.mark.parametrize("backend", ["flash", "unfused"])
def test_recompute_keeps_loss_and_gradients(megatron_world, backend):
    """Every mode against no recompute, bit for bit, with dropout on, for torch's fused core
    attention and megatron-core's unfused one."""
    attention = ["--attention-backend", backend]
    plain = _loss_and_grads(megatron_world, attention)
    for name, flags in MODES.items():
        _assert_same(_loss_and_grads(megatron_world, [*attention, *flags]), plain, name)


def _tp2_worker(rank, world, group):
    import patches
    from megatron_streaming.parallel.topology import RankLayout, Topology

    patches.apply()
    topo = Topology.create(RankLayout(world_size=world, tp=world), rank)
    topo.install_into_megatron()
    return {"plain": _loss_and_grads(topo, ["--tensor-model-parallel-size", "2"]),
            "full": _loss_and_grads(topo, ["--tensor-model-parallel-size", "2", *FULL])}


@pytest.mark.timeout(300)
def test_recompute_keeps_loss_and_gradients_at_tp2(tmp_path):
    """TP=2: the recomputed forward must restore the tensor-parallel RNG (attention dropout
    differs per TP rank) as well as the default one."""
    from conftest import spawn_gloo

    for res in spawn_gloo(_tp2_worker, 2, tmp_path):
        _assert_same(res["full"], res["plain"], "tp2")


@pytest.mark.timeout(300)
def test_recompute_holds_fewer_activations():
    """Peak bytes autograd keeps for the backward in one step (tests/saved_activations.py):
    full recompute keeps only each layer's input, selective drops the attention's."""
    model = ["--mock-data", "--num-layers", "4", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "2", "--eval-iters", "0"]
    peak = {}
    for name, flags in (("none", []), ("full", FULL),
                        ("selective", ["--recompute-granularity", "selective"])):
        proc = run(1, [*model, *flags], script="tests/saved_activations.py")
        peak[name] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_saved_bytes"]
    assert peak["full"] < peak["selective"] < peak["none"], peak
    assert peak["none"] / peak["full"] > 2.0, peak


@pytest.mark.parametrize("flags, message", [
    (["--recompute-granularity", "full"], "--recompute-granularity full needs "
     "--recompute-method uniform or block"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "--recompute-granularity selective takes no --recompute-method"),
    (["--recompute-method", "block"], "--recompute-method / --recompute-num-layers need "
     "--recompute-granularity"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"],
     "--recompute-modules moe: choose from core_attn, layernorm, mlp"),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"],
     "--recompute-modules mlp: needs a GPU with Transformer Engine here; use core_attn"),
])
def test_recompute_flags_are_checked_like_megatron(flags, message):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--mock-data", *flags]), 1)
    assert message in str(err.value)

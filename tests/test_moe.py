"""Mixture of experts: megatron-core's MoE layers inside a worker.

The flags (Megatron-LM's, Megatron-DeepSpeed's mapped or refused by name), the expert rank
layout against megatron-core's own generator, expert names, and launches: a checkpoint
written at EP=2 resumes at EP=1 and at EP=2 x TP=2 at the uninterrupted loss, with the
experts' load in the logged scalars. The exactness of EP, TP x EP and PP x EP against one
process is in test_parallel_parity.py; of streaming over MoE workers in test_streaming.py.
"""

import pytest

from harness import TINY, read_jsonl, run

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


def _parse(*flags, world=1):
    from megatron_streaming.cli.arguments import parse_args, validate

    cfg = parse_args(["--mock-data", *flags])
    validate(cfg, world)
    return cfg


def _refused(*flags, world=1) -> str:
    from megatron_streaming.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _parse(*flags, world=world)
    return str(e.value)


def test_moe_layer_freq_reads_megatrons_forms():
    from megatron_streaming.config.schema import moe_layer_pattern

    assert moe_layer_pattern("1", 4) == [1, 1, 1, 1]
    assert moe_layer_pattern("2", 4) == [1, 0, 1, 0]
    assert moe_layer_pattern("([0]+[1]*3)*2", 8) == [0, 1, 1, 1, 0, 1, 1, 1]
    assert moe_layer_pattern("[1,0,0,1]", 4) == [1, 0, 0, 1]
    for bad in ("[1,0]", "__import__('os')", "0", "[2,0,1,1]"):
        with pytest.raises(ValueError, match="--moe-layer-freq"):
            moe_layer_pattern(bad, 4)


def test_flags_map_to_megatron_cores_config():
    from megatron_streaming.config import ParallelConfig
    from megatron_streaming.worker.model import transformer_config

    cfg = _parse(*MOE, "--num-layers", "4", "--moe-layer-freq", "[0,1,0,1]",
                 "--moe-ffn-hidden-size", "96", "--moe-shared-expert-intermediate-size", "64",
                 "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff",
                 "0.01", "--moe-z-loss-coeff", "0.001", "--moe-router-dtype", "fp32",
                 "--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity",
                 "--moe-token-drop-policy", "position", "--moe-token-dispatcher-type",
                 "alltoall")
    assert cfg.model.moe_layers() == [False, True, False, True]
    tc = transformer_config(cfg.model, ParallelConfig())
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (4, 2, 96)
    assert tc.moe_layer_freq == [0, 1, 0, 1]
    assert tc.moe_shared_expert_intermediate_size == 64
    assert tc.moe_router_load_balancing_type == "seq_aux_loss"
    assert (tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff) == (0.01, 0.001)
    assert tc.moe_router_dtype == "fp32" and tc.moe_token_dispatcher_type == "alltoall"
    assert (tc.moe_expert_capacity_factor, tc.moe_pad_expert_input_to_capacity,
            tc.moe_token_drop_policy) == (1.25, True, "position")
    # One expert is a dense model, as Megatron-DeepSpeed's scripts pass it.
    assert not _parse("--num-experts", "1").model.moe


def test_megatron_deepspeed_moe_flags_are_mapped_or_refused_by_name():
    cfg = _parse(*MOE, "--topk", "1", "--moe-router-pre-softmax", "--moe-loss-coeff", "0.02",
                 "--moe-train-capacity-factor", "1.5", "--mlp-type", "standard",
                 "--create-moe-param-group", "--moe-expert-parallel-size", "2", world=2)
    m = cfg.model
    assert (m.moe_router_topk, m.moe_aux_loss_coeff, m.moe_expert_capacity_factor) == \
        (1, 0.02, 1.5)
    assert cfg.parallel.expert_model_parallel_size == 2
    no_drop = _parse(*MOE, "--moe-train-capacity-factor", "1.5", "--disable-moe-token-dropping")
    assert no_drop.model.moe_expert_capacity_factor is None
    lines = _refused(*MOE, "--mlp-type", "residual", "--use-tutel")
    assert "--mlp-type residual: Residual-MoE" in lines and "--use-tutel: " in lines
    # DeepSpeed-MoE's top-1 gating where its script does not say --topk.
    ds = _parse("--num-experts", "4", "--disable-bias-linear", "--moe-loss-coeff", "0.01")
    assert (ds.model.moe_router_topk, ds.model.moe_router_pre_softmax) == (1, True)
    # A minimum capacity is the same as none where the capacity is above it already: here
    # 1.0 x (2 x 64 tokens) x top-2 / 4 experts = 64.
    sized = [*MOE, "--micro-batch-size", "2", "--seq-length", "64",
             "--moe-train-capacity-factor", "1.0"]
    assert _parse(*sized, "--moe-min-capacity", "64").model.moe_min_capacity == 64
    assert "--moe-min-capacity 65: megatron-core's capacity has no minimum, and here it is " \
        "64" in _refused(*sized, "--moe-min-capacity", "65")


@pytest.mark.parametrize("flags,world,message", [
    (["--num-experts", "4", "--disable-bias-linear", "--expert-model-parallel-size", "3"], 3,
     "--num-experts (4) is not divisible by --expert-model-parallel-size (3)"),
    (["--expert-model-parallel-size", "2"], 2,
     "--expert-model-parallel-size 2 needs --num-experts above 1"),
    ([*MOE, "--moe-router-topk", "1"], 1, "--moe-router-topk 1 needs --moe-router-pre-softmax"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2,
     "experts take linear biases only at expert tensor-parallel size 1"),
    ([*MOE, "--moe-grouped-gemm"], 1, "--moe-grouped-gemm: the grouped GEMM is a GPU kernel"),
    ([*MOE, "--moe-pad-expert-input-to-capacity"], 1,
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ([*MOE, "--expert-model-parallel-size", "2", "--zero-stage", "0"], 2,
     "--zero-stage 0 with --expert-model-parallel-size 2"),
    ([*MOE, "--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
    ([*MOE, "--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "2"], 2,
     "--expert-tensor-parallel-size 1: only the tensor-parallel size"),
    ([*MOE, "--expert-model-parallel-size", "4"], 2,
     "the 2 ranks of a pipeline stage (tensor x sequence x data parallel) are not divisible"),
    ([*MOE, "--ladder-residual"], 1, "--num-experts does not go with --ladder-residual"),
    ([*MOE, "--num-layers", "4", "--moe-layer-freq", "[1,1,0,0]", "--expert-model-parallel-size",
      "2", "--pipeline-model-parallel-size", "2"], 4,
     "--moe-layer-freq [1,1,0,0] leaves pipeline stage 1 without an MoE layer"),
])
def test_what_cannot_run_is_refused_by_flag(flags, world, message):
    assert message in _refused(*flags, world=world)


@pytest.mark.parametrize("tp,sp,dp,pp,ep", [(1, 1, 4, 1, 2), (2, 1, 4, 1, 2), (2, 1, 2, 2, 2),
                                            (1, 2, 2, 1, 4), (2, 1, 4, 1, 4), (1, 1, 8, 2, 4)])
def test_expert_groups_are_megatron_cores(tp, sp, dp, pp, ep):
    """EP, expert TP and expert DP cut each stage's ranks as megatron-core's expert rank
    generator does (Ulysses' sequence ranks in the place of its context-parallel ones)."""
    from megatron.core.parallel_state import RankGenerator

    from megatron_streaming.parallel.topology import RankLayout

    world = tp * sp * dp * pp
    layout = RankLayout(world, 1, tp, pp, sp, ep=ep, moe=True)
    expert = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1,
                           order="tp-ep-dp-pp")
    groups = layout.all_groups()

    def same(ours, theirs):
        assert sorted(map(sorted, ours)) == sorted(map(sorted, theirs))
    same(groups["ep"], expert.get_ranks("ep"))
    same(groups["expt_tp"], expert.get_ranks("tp"))
    same(groups["expt_dp"], expert.get_ranks("dp"))
    same(groups["tp_ep"], expert.get_ranks("tp-ep"))
    # A dense model makes none of them; Topology.create knows their names.
    from megatron_streaming.parallel.topology import MOE_GROUPS

    assert not set(MOE_GROUPS) & set(RankLayout(world, 1, tp, pp, sp).all_groups())
    assert set(layout._moe_groups()) == set(MOE_GROUPS)


def test_experts_are_named_by_their_global_index():
    from megatron_streaming.streaming.fragments import FragmentPlan
    from megatron_streaming.worker.moe import is_expert
    from megatron_streaming.worker.weights import global_name

    local = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    name = global_name(local, 2, 4)  # stage from layer 2, EP rank 2 of 2 experts each
    assert name == "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    assert is_expert(local) and is_expert(name)
    assert not is_expert("decoder.layers.1.mlp.router.weight")
    assert not is_expert("decoder.layers.1.mlp.shared_experts.linear_fc1.weight")
    # An expert streams with its layer's fragment.
    assert FragmentPlan(4, 2).fragment_of(name) == 1


@pytest.mark.timeout(600)
def test_a_checkpoint_written_at_ep2_resumes_at_ep1_and_at_ep2_tp2(tmp_path):
    """Saved at EP=2 over DP=4 (each expert's ZeRO-2 partition cut over its two
    expert-data-parallel ranks; a SwiGLU MoE with load-balancing and z-losses), loaded at
    EP=1 and at EP=2 x TP=2 with sequence parallelism: the step after loading has the
    uninterrupted run's loss. The logged expert load adds up: every routed token is at an
    expert (no capacity factor: none dropped)."""
    args = [*TINY, *MOE, "--num-layers", "2", "--train-iters", "4", "--eval-iters", "0",
            "--swiglu", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
            "--global-batch-size", "8"]
    ckpt = tmp_path / "ckpt"
    run(4, [*args, "--expert-model-parallel-size", "2", "--zero-stage", "2", "--save",
            str(ckpt), "--save-interval", "3", "--log-jsonl", str(tmp_path / "full.jsonl")])
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3\n")
    full = read_jsonl(tmp_path / "full.jsonl")
    losses = {r["iteration"]: r["train/loss"] for r in full if "train/loss" in r}
    last = full[-1]
    for layer in ("moe/layer00", "moe/layer01"):
        tokens = sum(last[f"{layer}/tokens_per_expert/{e:02d}"] for e in range(4))
        # 8 samples x 32 tokens, top-2, in the logged step
        assert tokens == 8 * 32 * 2 and last[f"{layer}/dropped_tokens"] == 0
        assert 0.5 < last[f"{layer}/load_balancing_loss"] < 2.0
        assert last[f"{layer}/z_loss"] > 0
    for name, (nproc, flags) in {
            "ep1": (2, []),
            "ep2_tp2": (4, ["--expert-model-parallel-size", "2",
                            "--tensor-model-parallel-size", "2", "--sequence-parallel"])}.items():
        log = tmp_path / f"{name}.jsonl"
        run(nproc, [*args, *flags, "--load", str(ckpt), "--log-jsonl", str(log)])
        got = {r["iteration"]: r["train/loss"] for r in read_jsonl(log) if "train/loss" in r}
        assert sorted(got) == [4]
        assert got[4] == pytest.approx(losses[4], rel=1e-6, abs=0), name


@pytest.mark.parametrize("flags", [
    [*MOE, "--num-layers", "3", "--moe-layer-freq", "[1,0,1]", "--swiglu"],
    ["--num-experts", "4", "--moe-router-topk", "2", "--num-layers", "2",
     "--moe-ffn-hidden-size", "96", "--moe-shared-expert-intermediate-size", "64",
     "--disable-bias-linear"],
    ["--num-layers", "2", "--swiglu"],  # dense: the width --swiglu derives
])
def test_the_parameter_count_of_the_flags_is_the_models(megatron_world, flags):
    """``config.shape``'s count (the door, the planner, the checkpoint's JSON) against the
    model megatron-core builds from the same flags."""
    from megatron_streaming.config.shape import parameter_count
    from megatron_streaming.worker.model import build_model

    cfg = _parse("--hidden-size", "64", "--num-attention-heads", "4", *flags)
    model = build_model(cfg.model, cfg.parallel, megatron_world, 100)
    built = sum(p.numel() for n, p in model.named_parameters() if n != "output_layer.weight"
                or cfg.model.untie_embeddings_and_output_weights)
    assert parameter_count(cfg.model, 100) == built


def test_grouped_gemm_on_a_gpu_is_said_once_to_be_untested(monkeypatch):
    """Where it can run, --moe-grouped-gemm is the user's choice, warned at start as a path
    the tests have not run; the validation's other warnings stay (the NCCL one did not)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = _parse(*MOE, "--moe-grouped-gemm", "--diloco-workers", "2", "--diloco-backend",
                 "nccl", "--diloco-timeout", "60", world=2)
    assert any(w.startswith("--moe-grouped-gemm: megatron-core's grouped GEMM experts have "
                            "not run") for w in cfg.warnings), cfg.warnings
    assert any(w.startswith("--diloco-backend nccl: NCCL across workers has not run")
               for w in cfg.warnings), cfg.warnings

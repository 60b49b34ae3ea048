"""benchmarks/torchft_judge.py without torchft or training: the judge's own statements of the
learning rate, the fragments, the merge steps and torchft's fragment order agree with the
library's, and every case is a valid command line of the shape the judge assumes."""

import sys

import pytest

from harness import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import torchft_judge as judge  # noqa: E402


def _cfg(case):
    from megatron_streaming.cli.arguments import parse_args

    return parse_args([*judge.MODEL, *judge.CASES[case][1]])


@pytest.mark.parametrize("case", list(judge.CASES))
def test_case_is_two_one_rank_workers_in_fp32_ending_on_a_merge(case):
    cfg = _cfg(case)
    s, t = cfg.streaming, cfg.training
    assert s.diloco_workers == 2 and s.diloco_quantize == "none"
    assert cfg.precision.dtype_name == "fp32"
    assert t.global_batch_size % t.micro_batch_size == 0  # one rank: gbs / mbs micro-batches
    flags = judge.CASES[case][1]
    if "--diloco-outer-momentum" in flags and "0.9" in flags:  # the papers' Nesterov
        assert s.diloco_nesterov and s.diloco_outer_momentum == 0.9
    if s.diloco_sync:  # both sides' final global parameters hold every outer step
        merges = judge.merge_steps(s.diloco_inner_steps, s.diloco_fragments,
                                   s.diloco_overlap_steps, t.train_iters)
        assert merges and merges[-1] == t.train_iters


@pytest.mark.parametrize("case", ["inner_only", "h1_sgd", "long_p3_h30"])
def test_judges_lr_is_the_schedules_to_the_bit(case):
    from seams import lr_at

    cfg = _cfg(case)
    o, t = cfg.optimizer, cfg.training
    schedule = {"gbs": t.global_batch_size, "warmup": o.lr_warmup_iters, "lr": o.lr,
                "min_lr": o.min_lr, "style": o.lr_decay_style, "train_iters": t.train_iters}
    lrs = [judge.megatron_lr(i, schedule) for i in range(t.train_iters)]
    assert lrs == [lr_at(i, cfg) for i in range(t.train_iters)]
    assert len(set(lrs)) > 2 or o.lr_decay_style == "constant"


@pytest.mark.parametrize("layers,P", [(4, 1), (4, 2), (4, 3), (4, 4), (3, 3)])
def test_judges_fragments_are_the_libraries(layers, P):
    from megatron_streaming.streaming.fragments import FragmentPlan

    plan = FragmentPlan(layers, P, "strided")
    names = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
             "decoder.final_layernorm.weight", "output_layer.weight",
             *[f"decoder.layers.{i}.{part}" for i in range(layers) for part in
               ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight",
                "input_layernorm.weight")]]
    assert [judge.fragment_of(n, layers, P) for n in names] == \
        [plan.fragment_of(n) for n in names]


@pytest.mark.parametrize("H,P,tau", [(8, 1, 0), (8, 2, 1), (8, 4, 1), (30, 3, 1), (1, 1, 0)])
def test_torchft_order_and_merge_steps_follow_our_schedule(H, P, tau):
    from megatron_streaming.streaming.schedule import SyncSchedule

    schedule, iters = SyncSchedule(H, P, tau), 4 * H + tau
    order = judge.torchft_order(P)
    sends = [step for step in range(1, iters + 1) if schedule.sends_after(step)]
    # torchft's k-th sync takes place (k-1) mod P of its list: our fragment of the k-th send.
    assert [schedule.sends_after(step)[0] for step in sends] == \
        [order[(k - 1) % P] for k in range(1, len(sends) + 1)]
    assert judge.merge_steps(H, P, tau, iters) == \
        [step for step in range(1, iters + 1) if schedule.merges_after(step)]

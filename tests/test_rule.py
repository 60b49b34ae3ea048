"""The outer-optimizer rule (streaming/rule.py): its warnings fire where the quality benchmark
found syncing harmful and nowhere else, its advice parses, and a run warns once per job."""

import pytest

from harness import TINY, run
from megatron_streaming.cli.arguments import parse_args, validate
from megatron_streaming.streaming import rule

RUN = ["--mock-data", "--diloco-workers", "2", "--diloco-inner-steps", "30",
       "--diloco-fragments", "3", "--diloco-overlap-steps", "1", "--train-iters", "1200"]
PAPERS = ["--diloco-outer-lr", "0.7", "--diloco-outer-momentum", "0.9"]


def _warnings(*flags):
    cfg = parse_args([*RUN, *flags])
    return rule.warnings(cfg.streaming, cfg.optimizer.lr, cfg.training.train_iters)


def test_the_defaults_draw_no_warning_and_are_plain_averaging():
    s = parse_args(RUN).streaming
    assert (s.diloco_outer_lr, s.diloco_outer_momentum, s.diloco_alpha) == (1.0, 0.0, 0.0)
    assert rule.effective_outer_lr(s.diloco_outer_lr, s.diloco_outer_momentum) == 1.0
    assert _warnings() == []
    # Neither does a smoothed step of the same size, nor the sync switched off.
    assert _warnings("--diloco-outer-lr", "0.5", "--diloco-outer-momentum", "0.5") == []
    assert _warnings(*PAPERS, "--no-diloco-sync") == []


def test_the_papers_momentum_warns_up_to_the_outer_steps_where_harm_was_measured():
    (line,) = _warnings(*PAPERS, "--lr", "2e-3")
    assert line.startswith("--diloco-outer-lr 0.7 with --diloco-outer-momentum 0.9 ")
    assert "7.0x" in line and "as if the inner --lr 0.002 were 0.014" in line
    # Heavy ball builds up the same step; so do more outer steps up to the most measured
    # (H=5 over 1200 steps: 240 per fragment, worse).
    assert len(_warnings(*PAPERS, "--no-diloco-nesterov")) == 1
    assert len(_warnings(*PAPERS, "--train-iters", str(30 * 240))) == 1
    assert rule.outer_steps(30000, 30) == 1000 and rule.outer_steps(None, 30) is None
    # Past them, where the papers find it helps: no warning, a note that says it is untested.
    cfg = parse_args([*RUN, *PAPERS, "--num-layers", "3", "--train-iters", str(30 * 241)])
    validate(cfg, 2)
    assert cfg.warnings == [] and cfg.notes[-1].startswith(
        "--diloco-outer-lr 0.7 with --diloco-outer-momentum 0.9: 241 outer steps per fragment, "
        "past the 240 up to which")
    assert parse_args([*RUN, *PAPERS]).notes == []
    one = parse_args(["--mock-data", "--diloco-workers", "1", *PAPERS, "--diloco-inner-steps",
                      "30", "--diloco-overlap-steps", "1", "--train-iters", str(30 * 241)])
    validate(one, 1)
    assert [w.split(" ")[0] for w in one.warnings] == ["--diloco-overlap-steps"]
    assert "241 outer steps per fragment" in one.notes[-1]


def test_the_sparse_exchange_takes_outer_lr_2_where_none_is_typed_and_is_not_warned():
    sparse = ["--diloco-quantize", "sparse"]
    cfg = parse_args([*RUN, *sparse])
    assert (cfg.streaming.diloco_outer_lr, cfg.streaming.diloco_outer_momentum) == (2.0, 0.0)
    assert cfg.notes[-1].startswith("--diloco-quantize sparse without --diloco-outer-lr: "
                                    "outer lr 2, no momentum")
    assert _warnings(*sparse) == []
    # Typed, the outer step is the user's (and warned above 2, as the dense one above 1.5).
    assert parse_args([*RUN, *sparse, "--diloco-outer-lr", "1"]).streaming.diloco_outer_lr == 1
    typed = parse_args([*RUN, *sparse, "--diloco-outer-momentum", "0.5"]).streaming
    assert (typed.diloco_outer_lr, typed.diloco_outer_momentum) == (1.0, 0.5)
    assert len(_warnings(*sparse, "--diloco-outer-lr", "3")) == 1
    assert len(_warnings("--diloco-outer-lr", "2")) == 1  # the dense exchange's harm
    # One worker: no exchange, the outer lr as without it.
    one = parse_args(["--mock-data", "--diloco-workers", "1", *sparse]).streaming
    assert one.diloco_outer_lr == 1.0


def test_alpha_above_zero_warns():
    (line,) = _warnings("--diloco-alpha", "0.5")
    assert line.startswith("--diloco-alpha 0.5:")


@pytest.mark.parametrize("iters,layers,link_h,expect", [
    (1200, 6, 30, (30, 3, 1)),     # the quality benchmark's streaming setting
    (1200, 6, None, (30, 3, 1)),   # H=100 would leave 12 outer steps: capped at 40 of them
    (100000, 24, 100, (100, 2, 1)),  # H % P == 0
    (40, 2, None, (1, 1, 0)),      # so short that only every-step averaging keeps 40
])
def test_advice_keeps_enough_outer_steps_and_parses(iters, layers, link_h, expect):
    a = rule.advise(iters, layers, link_h)
    assert (a.inner_steps, a.fragments, a.overlap_steps) == expect
    assert (a.outer_lr, a.outer_momentum, a.alpha, a.quantize) == (1.0, 0.0, 0.0, "fp4-e2m1")
    cfg = parse_args(["--mock-data", "--diloco-workers", "2", "--num-layers", str(layers),
                      "--train-iters", str(iters), *a.flags()])
    assert rule.warnings(cfg.streaming, cfg.optimizer.lr) == []
    assert len(a.reasons) == 3


@pytest.mark.timeout(300)
def test_a_run_warns_once_per_job():
    out = run(2, [*TINY, "--train-iters", "2", "--eval-iters", "0", "--diloco-workers", "2",
                  "--diloco-inner-steps", "1", "--diloco-alpha", "0.5", *PAPERS])
    text = out.stdout + out.stderr
    assert text.count("--diloco-outer-lr 0.7 with --diloco-outer-momentum 0.9") == 1, text[-3000:]
    assert text.count("--diloco-alpha 0.5:") == 1


@pytest.mark.parametrize("exchange_steps,expect", [
    (0.4, (1, 1, False)),
    (2.3, (3, 4, False)),   # 10 Mbit/s, 100 ms, 842k parameters: tau 3, lag 4 (measured)
    (9.0, (9, 10, False)),
    (10.0, (0, 10, True)),  # as long as H/P: only a whole round hides it
    (35.0, (0, 10, True)),
])
def test_overlap_covers_the_exchange_and_the_stop_flag_waits_longer(exchange_steps, expect):
    assert rule.overlap_for(exchange_steps, 10) == expect


@pytest.mark.parametrize("exchange_steps", [None, 2.3, 25.0])
def test_advice_for_a_slow_exchange_parses(exchange_steps):
    a = rule.advise(4000, 4, 40, exchange_steps)  # H=40, P=2: a fragment every 20 steps
    s = parse_args(["--mock-data", "--diloco-workers", "2", "--num-layers", "4",
                    "--train-iters", "4000", *a.flags()]).streaming
    expect = (1, 1, False) if exchange_steps is None else rule.overlap_for(exchange_steps, 20)
    assert (s.diloco_overlap_steps, s.diloco_control_lag, s.diloco_eager) == expect
    assert s.diloco_eager == (exchange_steps == 25.0)

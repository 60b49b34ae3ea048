"""Monitoring as a user sees it: TensorBoard's own reader on the event files of a streaming run
and of a data-parallel run, and ``python -m megatron_streaming.cli.plot`` drawn from them; the
per-phase timers (--timing-log-level) in both, printed and in TensorBoard.

One run of each (the expensive part) is shared by the tests of this module.
"""

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from harness import REPO, TINY, env, run
from megatron_streaming.comm.traffic import ring_all_reduce_bytes

ITERS, EVAL_INTERVAL, FRAGMENTS, WORKERS = 11, 4, 2, 2
# H=4, P=2, tau=1: sends after steps 2, 4, ..., 10, merges one step later. 11 iterations end
# on the last merge, so nothing is in flight at the end and the last logged cumulative count
# is the whole run's (the summary's, which is taken after the in-flight ones finish).
# Every Megatron-LM logging flag on (a point every iteration); the data-parallel run keeps
# Megatron-LM's defaults, but a point every 2 iterations.
MEGATRON_LOGGING = ["--log-timers-to-tensorboard", "--log-throughput", "--log-params-norm",
                    "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                    "--log-world-size-to-tensorboard"]
STREAMING = ["--diloco-workers", str(WORKERS), "--diloco-fragments", str(FRAGMENTS),
             "--diloco-inner-steps", "4", "--diloco-overlap-steps", "1",
             "--timing-log-level", "2", *MEGATRON_LOGGING]
TB_INTERVAL = 2
DATA_PARALLEL = ["--diloco-workers", "1", "--timing-log-level", "1",
                 "--timing-log-option", "all", "--tensorboard-log-interval", str(TB_INTERVAL)]
COMMON = [*TINY, "--train-iters", str(ITERS), "--eval-interval", str(EVAL_INTERVAL),
          "--eval-iters", "1"]
EVERY_STEP = list(range(1, ITERS + 1))
DP_POINTS = list(range(TB_INTERVAL, ITERS + 1, TB_INTERVAL))  # 2, 4, ..., 10: not 11

# Megatron-LM's training_log names (core_v0.16.1), each also "<name> vs samples".
MEGATRON_TRAIN_TAGS = ("lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale")
OWN_TRAIN_TAGS = ("train/tokens_per_s", "train/tokens")
# What this project wrote before it took Megatron-LM's names: no longer in TensorBoard (the
# JSON lines keep them for one release).
OLD_TAGS = ("train/loss", "train/lr", "train/grad_norm", "train/step_seconds",
            "train/global_batch_size", "train/loss_scale", "valid/loss", "test/loss")
FRAGMENT_TAGS = ("outer_grad_norm", "bytes_sent", "bytes_received", "skipped", "drift",
                 "send_to_merge_s", "merge_wait_s", "quant_rel_error")
STREAMING_TAGS = ("streaming/drift", "streaming/worker_bytes_sent",
                  "streaming/skipped_fragments", "streaming/cross_worker_bytes",
                  "streaming/worker_control_bytes",
                  *(f"streaming/fragment_{p}/{k}" for p in range(FRAGMENTS) for k in FRAGMENT_TAGS))
EVAL_STEPS = [4, 8, ITERS]  # every --eval-interval, and once more at the end
BATCH = 4  # TINY's --global-batch-size: a worker's samples per step


def f32(x: float) -> float:
    """TensorBoard stores scalars as float32: what an exact value reads back as."""
    return float(np.float32(x))


def launch(run_dir, nproc, args):
    summary = run_dir / "summary.json"
    proc = run(nproc, [*COMMON, *args, "--tensorboard-dir", str(run_dir / "tb"),
                       "--summary-json", str(summary), "--log-jsonl",
                       str(run_dir / "log.jsonl")], timeout=420)
    (run_dir / "output.txt").write_text(proc.stdout + proc.stderr)
    return json.loads(summary.read_text())


def scalars(run_dir) -> dict:
    """tag -> [(step, value)], read by TensorBoard's own event reader, every value kept."""
    from tensorboard.backend.event_processing.event_accumulator import (SCALARS,
                                                                        EventAccumulator)

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()[SCALARS]}


def json_lines(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitoring")
    out = {}
    for name, nproc, args in (("streaming", WORKERS, STREAMING),
                              ("data_parallel", 2, DATA_PARALLEL)):
        out[name] = (root / name, launch(root / name, nproc, args))
    return out


def values(tags, tag, steps=EVERY_STEP):
    """The tag's values, checked to be exactly one per expected step, all finite."""
    assert tag in tags, f"{tag} missing; have {sorted(tags)}"
    got = [step for step, _ in tags[tag]]
    assert got == list(steps), f"{tag}: steps {got}"
    vals = [v for _, v in tags[tag]]
    assert all(math.isfinite(v) for v in vals), f"{tag}: {vals}"
    return vals


def legacy(run_dir, key, steps):
    """The JSON lines' value of an old name at each step (the first line having it)."""
    found = {}
    for line in json_lines(run_dir):
        if key in line:
            found.setdefault(line["iteration"], line[key])
    return [found[s] for s in steps]


def check_training_scalars(run_dir, tags, summary, points):
    """Megatron-LM's training and validation scalars, at every point and only there."""
    per_step_tokens = summary["tokens"] // ITERS
    per_step_samples = summary["samples"] // ITERS  # every worker's
    samples = [p * per_step_samples for p in points]
    for tag in MEGATRON_TRAIN_TAGS:
        vals = values(tags, tag, points)
        # The same values against the consumed samples (Megatron's second axis).
        assert values(tags, f"{tag} vs samples", samples) == vals, tag
    assert all(v > 0 for v in values(tags, "lm loss", points))
    # lm loss is the step's loss: the old name's value in the JSON lines, the summary's last.
    assert values(tags, "lm loss", points) == \
        [f32(v) for v in legacy(run_dir, "train/loss", points)]
    assert values(tags, "learning-rate", points) == \
        [f32(v) for v in legacy(run_dir, "train/lr", points)]
    assert values(tags, "grad-norm", points) == \
        [f32(v) for v in legacy(run_dir, "train/grad_norm", points)]
    assert values(tags, "batch-size", points) == [BATCH] * len(points)
    assert values(tags, "loss-scale", points) == [1.0] * len(points)  # no --fp16
    assert all(v > 0 for v in values(tags, "train/tokens_per_s", points))
    assert values(tags, "train/tokens", points) == [f32(s * per_step_tokens) for s in points]
    if points[-1] == ITERS:
        assert values(tags, "train/tokens", points)[-1] == f32(summary["tokens"])
        assert values(tags, "lm loss", points)[-1] == f32(summary["train_loss"])
    # Evaluations are written when they run, whatever the interval (as Megatron-LM does).
    valid = values(tags, "lm loss validation", EVAL_STEPS)
    assert all(v > 0 for v in valid) and valid[-1] == f32(summary["valid_loss"])
    assert values(tags, "lm loss validation vs samples",
                  [s * per_step_samples for s in EVAL_STEPS]) == valid
    assert values(tags, "lm loss test", [ITERS]) == [f32(summary["test_loss"])]
    assert not set(OLD_TAGS) & set(tags) and not [t for t in tags if t.startswith("timers/")]
    return valid


@pytest.mark.timeout(900)
def test_streaming_run_scalars_as_tensorboard_reads_them(runs):
    run_dir, summary = runs["streaming"]
    tags = scalars(run_dir)
    check_training_scalars(run_dir, tags, summary, EVERY_STEP)
    for tag in STREAMING_TAGS:
        values(tags, tag)
    assert "traffic/data_parallel_bytes" not in tags  # measured traffic only, no estimate

    total = values(tags, "streaming/cross_worker_bytes")
    assert all(a <= b for a, b in zip(total, total[1:])), total  # cumulative
    assert total[0] == 0.0  # the first send is after step 2
    assert total[-1] > 0 and total[-1] == f32(summary["cross_worker_bytes"])
    # Per-interval counts of worker 0's ranks add up to the job's cumulative one (x M).
    per_fragment = [values(tags, f"streaming/fragment_{p}/bytes_sent") for p in range(FRAGMENTS)]
    assert f32(WORKERS * sum(map(sum, per_fragment))) == total[-1]
    assert all(sum(v) > 0 for v in per_fragment)  # every fragment went out at least once
    worker_sent = values(tags, "streaming/worker_bytes_sent")
    assert worker_sent == [f32(sum(v)) for v in zip(*per_fragment)]
    for p in range(FRAGMENTS):
        prefix = f"streaming/fragment_{p}/"
        assert all(v >= 0 for v in values(tags, prefix + "drift"))
        assert all(0 <= v <= 1 for v in values(tags, prefix + "quant_rel_error"))
        assert all(v >= 0 for v in values(tags, prefix + "outer_grad_norm"))
        assert all(v >= 0 for v in values(tags, prefix + "bytes_received"))
        assert all(v >= 0 for v in values(tags, prefix + "send_to_merge_s"))
        assert all(v >= 0 for v in values(tags, prefix + "merge_wait_s"))
        assert values(tags, prefix + "skipped") == [0.0] * ITERS
    # Workers drift apart between merges: after the first inner steps, some drift shows.
    assert all(v >= 0 for v in values(tags, "streaming/drift"))
    assert max(values(tags, "streaming/drift")) > 0


@pytest.mark.timeout(900)
def test_control_bytes_in_tensorboard_and_json_lines_are_the_summarys(runs):
    """One count, one source: the job-wide control bytes (every worker's door, heartbeats,
    stop flags...) are written once, at the end, with the summary's value; each point has
    the reporting worker's own count so far."""
    run_dir, summary = runs["streaming"]
    tags = scalars(run_dir)
    control = summary["cross_worker_control_bytes"]
    assert control > 0
    assert values(tags, "streaming/cross_worker_control_bytes", [ITERS]) == [f32(control)]
    lines = [line for line in json_lines(run_dir)
             if "streaming/cross_worker_control_bytes" in line]
    assert [(line["iteration"], line["streaming/cross_worker_control_bytes"])
            for line in lines] == [(ITERS, control)]  # exact: JSON keeps every digit
    mine = values(tags, "streaming/worker_control_bytes")
    assert all(a <= b for a, b in zip(mine, mine[1:])) and 0 < mine[-1] < control


@pytest.mark.timeout(900)
def test_megatron_logging_flags_write_what_megatron_writes(runs):
    """--log-params-norm, --log-memory-to-tensorboard (a CPU run: resident memory),
    --log-validation-ppl-to-tensorboard, --log-world-size-to-tensorboard,
    --log-timers-to-tensorboard with --log-throughput: their scalars, at each point."""
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.config.shape import padded_vocab_size, parameter_count
    from megatron_streaming.run.flops import floating_point_operations

    run_dir, summary = runs["streaming"]
    tags = scalars(run_dir)
    valid = check_training_scalars(run_dir, tags, summary, EVERY_STEP)
    ppl = values(tags, "lm loss validation ppl", EVAL_STEPS)
    assert ppl == [f32(math.exp(v)) for v in valid]  # exp of the float32 read back
    assert ppl[-1] == f32(math.exp(summary["valid_loss"]))
    assert values(tags, "lm loss test ppl", [ITERS]) == [f32(math.exp(summary["test_loss"]))]
    assert values(tags, "world-size", EVERY_STEP) == [float(WORKERS)] * ITERS
    norms = values(tags, "params-norm", EVERY_STEP)
    assert all(v > 0 for v in norms) and max(norms) - min(norms) < 0.1 * norms[0]
    assert len(set(norms)) > 1  # it follows the training
    assert not [t for t in tags if t.startswith("mem-")]  # CUDA's only
    rss, peak = values(tags, "memory/rss-bytes"), values(tags, "memory/max-rss-bytes")
    assert all(0 < r <= p * (1 + 1e-6) for r, p in zip(rss, peak))
    # iteration-time and throughput at every --log-interval but the first (start-up).
    seconds = values(tags, "iteration-time", EVERY_STEP[1:])
    assert all(v > 0 for v in seconds)
    cfg = parse_args([*COMMON, *STREAMING])
    # The padded vocabulary of the mock data's tokenizer: the one the parameters count.
    padded = next(v for v in range(128, 2**20, 128)
                  if parameter_count(cfg.model, v) == summary["parameters"])
    assert padded == padded_vocab_size(padded, cfg.model.make_vocab_size_divisible_by)
    operations = floating_point_operations(cfg.model, padded, summary["samples"] // ITERS)
    assert values(tags, "throughput", EVERY_STEP[1:]) == pytest.approx(
        [operations / (s * 1e12 * WORKERS) for s in seconds], rel=1e-5)
    # Timers in seconds per iteration (Megatron-LM's), the JSON lines' old ms ones / 1000.
    for name in ("forward-backward", "optimizer", "diloco-sync"):
        got = values(tags, f"{name}-time")
        assert got == pytest.approx(
            [v / 1e3 for v in legacy(run_dir, f"timers/{name}-time", EVERY_STEP)], rel=1e-6)


@pytest.mark.timeout(900)
def test_data_parallel_run_logs_the_all_reduce_traffic_it_stands_for(runs):
    run_dir, summary = runs["data_parallel"]
    tags = scalars(run_dir)
    check_training_scalars(run_dir, tags, summary, DP_POINTS)
    assert not [t for t in tags if t.startswith("streaming/")]
    step_bytes = ring_all_reduce_bytes(summary["parameters"], 2)
    assert step_bytes == 2 * (2 - 1) * 4 * summary["parameters"]
    assert values(tags, "traffic/data_parallel_bytes", DP_POINTS) == \
        [f32(s * step_bytes) for s in DP_POINTS]


@pytest.mark.timeout(900)
def test_megatron_logging_defaults_write_only_what_megatron_writes(runs):
    """Without the flags: no iteration-time, throughput, timers, params-norm, world-size,
    memory or perplexity (Megatron-LM's defaults); --tensorboard-log-interval 2: a point
    every 2 iterations in TensorBoard and the JSON lines alike, and the last iteration (11)
    is none; the progress lines stay every --log-interval."""
    run_dir, _ = runs["data_parallel"]
    tags = scalars(run_dir)
    allowed = {*MEGATRON_TRAIN_TAGS, *OWN_TRAIN_TAGS, "traffic/data_parallel_bytes",
               "lm loss validation", "lm loss test"}
    assert set(tags) == allowed | {f"{t} vs samples" for t in allowed
                                   if t in MEGATRON_TRAIN_TAGS or t == "lm loss validation"}
    points = [line["iteration"] for line in json_lines(run_dir) if "lm loss" in line]
    assert points == DP_POINTS
    text = (run_dir / "output.txt").read_text()
    assert len(re.findall(r"^iteration +\d+/11 \|", text, re.M)) == ITERS


def plot(*args):
    return subprocess.run([sys.executable, "-m", "megatron_streaming.cli.plot", *map(str, args)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=180)


@pytest.mark.timeout(900)
def test_plot_draws_both_runs_and_names_a_directory_without_events(runs, tmp_path):
    out = tmp_path / "figures" / "compare.png"
    # One --tensorboard-dir itself, one directory holding it.
    proc = plot(runs["streaming"][0] / "tb", runs["data_parallel"][0], "-o", out,
                "--labels", "streaming", "data parallel")
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < len(data) < 2_000_000, len(data)

    empty = tmp_path / "no_events_here"
    empty.mkdir()
    proc = plot(runs["streaming"][0], empty, "-o", tmp_path / "never.png")
    assert proc.returncode == 2
    assert str(empty) in proc.stderr and "no TensorBoard event files" in proc.stderr
    assert not (tmp_path / "never.png").exists()


def check_timers(run_dir, phases, block_head, row, points=EVERY_STEP):
    """Megatron's block under every progress line; each phase's worker maximum per step in
    the JSON lines' old ms values (every --log-interval), within the step's wall time (at
    the points)."""
    walls = legacy(run_dir, "train/step_seconds", points)
    got = {name: legacy(run_dir, f"timers/{name}-time", EVERY_STEP) for name in phases}
    for name, ms in got.items():
        assert all(0 < v for v in ms), (name, ms)
    for point, wall in zip(points, walls):
        fb, opt = got["forward-backward"][point - 1], got["optimizer"][point - 1]
        assert fb / 1e3 < 2 * wall and opt / 1e3 < 2 * wall  # another rank's: not above
    text = (run_dir / "output.txt").read_text()
    assert text.count(block_head) == ITERS, text[-3000:]  # --log-interval 1
    for name in phases:
        assert len(re.findall(rf"^ +{name} \.+: {row}$", text, re.M)) == ITERS, name
    return got


@pytest.mark.timeout(900)
def test_timers_report_each_phase_per_step_as_megatron_prints_them(runs):
    run_dir, _ = runs["streaming"]  # --timing-log-level 2, minmax
    got = check_timers(run_dir, ["forward-backward", "optimizer", "diloco-sync"],
                       "(min, max) time across ranks (ms):", r"\([0-9.]+, [0-9.]+\)")
    # The hook runs inside the optimizer step, on every rank: never longer than the step.
    assert all(s <= o for s, o in zip(got["diloco-sync"], got["optimizer"])), got
    tags = scalars(run_dir)  # --log-timers-to-tensorboard: the phases and nothing else
    assert {t for t in tags if t.endswith("-time")} == \
        {"iteration-time", "forward-backward-time", "optimizer-time", "diloco-sync-time"}
    run_dir, _ = runs["data_parallel"]  # level 1, every rank listed; not in TensorBoard
    check_timers(run_dir, ["forward-backward", "optimizer"],
                 "times across ranks (ms):", r"0: [0-9.]+, 1: [0-9.]+", DP_POINTS)


def test_timers_time_nothing_at_level_0_and_format_as_megatron():
    from megatron_streaming.worker import timers

    off = timers.StepTimers(0)
    with off.phase("forward-backward"):
        pass
    off.add("diloco-sync", 1.0)
    off.end_iteration()
    assert off.report(None) == {} and timers.format_report({}, "minmax") == ""
    on = timers.StepTimers(1)
    on.add("optimizer", 0.25)
    on.add("diloco-sync", 9.0)  # a level-2 phase: not timed at level 1
    on.end_iteration()
    on.add("optimizer", 0.75)
    on.end_iteration()
    assert on.report(None) == {"forward-backward": [0.0], "optimizer": [0.5]}
    assert on.report(None) == {"forward-backward": [0.0], "optimizer": [0.0]}  # restarted
    times = {"optimizer": [0.5, 0.25]}
    assert timers.format_report(times, "max").splitlines()[1] == \
        "    optimizer " + "." * 30 + ": 500.00"
    assert timers.format_report(times, "minmax").endswith(": (250.00, 500.00)")
    assert timers.format_report(times, "all").endswith(": 0: 500.00, 1: 250.00")
    assert timers.scalars(times) == {"timers/optimizer-time": 500.0}


# Megatron-LM core_v0.16.1's own num_floating_point_operations(args, 12) on these models
# (its function run with the args these flags give, padded vocabulary 50304).
FLOPS_CASES = {
    "gpt": (["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32"], 7889485824),
    "llama-gqa": (["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8",
                   "--group-query-attention", "--num-query-groups", "2", "--swiglu",
                   "--seq-length", "256", "--ffn-hidden-size", "1376", "--kv-channels", "64"],
                  795441364992),
    "mixtral": (["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
                 "--group-query-attention", "--num-query-groups", "4", "--swiglu",
                 "--seq-length", "128", "--num-experts", "8", "--moe-router-topk", "2",
                 "--moe-ffn-hidden-size", "512", "--moe-layer-freq", "([0]+[1]*1)*2",
                 "--moe-shared-expert-intermediate-size", "256"], 154316832768),
}


@pytest.mark.parametrize("name", sorted(FLOPS_CASES))
def test_throughput_counts_operations_as_megatron_does(name):
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.run.flops import floating_point_operations

    flags, megatron = FLOPS_CASES[name]
    cfg = parse_args(["--mock-data", *flags])
    assert floating_point_operations(cfg.model, 50304, 12) == megatron
    assert floating_point_operations(cfg.model, 50304, 1) == megatron / 12


def test_params_norm_counts_each_parameter_once(megatron_world):
    """--log-params-norm: a tensor-parallel shard counts on its rank, a replicated parameter
    (a norm, a bias) on TP rank 0 only; the norm is over the whole model (the squares summed
    over the model-parallel group, here of one rank)."""
    from types import SimpleNamespace

    import torch

    from megatron_streaming.run.report import RunReport

    model = torch.nn.Module()
    model.shard = torch.nn.Parameter(torch.full((3,), 2.0))
    model.shard.tensor_model_parallel = True
    model.replicated = torch.nn.Parameter(torch.ones(4))
    topo = SimpleNamespace(layout=SimpleNamespace(pp=1, ep=1), tp_rank=0, is_first_stage=True,
                           groups={"mp": megatron_world.groups["mp"]})
    report = RunReport.__new__(RunReport)  # only what params_norm reads
    report.model, report.topology = model, topo
    assert report.params_norm() == 4.0  # sqrt(3 * 2^2 + 4 * 1^2)
    topo.tp_rank = 1  # the replicated one is TP rank 0's to count
    assert report.params_norm() == pytest.approx(12 ** 0.5, rel=1e-12)


def test_tensorboard_log_interval_must_be_positive():
    from megatron_streaming.cli.arguments import ConfigError, parse_args, validate

    cfg = parse_args(["--mock-data", "--tensorboard-log-interval", "3"])
    validate(cfg, 1)
    assert cfg.logging.tensorboard_log_interval == 3
    with pytest.raises(ConfigError, match="--tensorboard-log-interval must be > 0, got 0"):
        validate(parse_args(["--mock-data", "--tensorboard-log-interval", "0"]), 1)

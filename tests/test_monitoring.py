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
STREAMING = ["--diloco-workers", str(WORKERS), "--diloco-fragments", str(FRAGMENTS),
             "--diloco-inner-steps", "4", "--diloco-overlap-steps", "1",
             "--timing-log-level", "2"]
DATA_PARALLEL = ["--diloco-workers", "1", "--timing-log-level", "1",
                 "--timing-log-option", "all"]
COMMON = [*TINY, "--train-iters", str(ITERS), "--eval-interval", str(EVAL_INTERVAL),
          "--eval-iters", "1"]

TRAIN_TAGS = ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
              "train/step_seconds", "train/tokens")
FRAGMENT_TAGS = ("outer_grad_norm", "bytes_sent", "bytes_received", "skipped", "drift",
                 "send_to_merge_s", "merge_wait_s", "quant_rel_error")
STREAMING_TAGS = ("streaming/drift", "streaming/worker_bytes_sent",
                  "streaming/skipped_fragments", "streaming/cross_worker_bytes",
                  "streaming/cross_worker_control_bytes",
                  *(f"streaming/fragment_{p}/{k}" for p in range(FRAGMENTS) for k in FRAGMENT_TAGS))
EVAL_STEPS = [4, 8, ITERS]  # every --eval-interval, and once more at the end


def f32(x: float) -> float:
    """TensorBoard stores scalars as float32: what an exact value reads back as."""
    return float(np.float32(x))


def launch(run_dir, nproc, args):
    summary = run_dir / "summary.json"
    proc = run(nproc, [*COMMON, *args, "--tensorboard-dir", str(run_dir / "tb"),
                       "--summary-json", str(summary)], timeout=420)
    (run_dir / "output.txt").write_text(proc.stdout + proc.stderr)
    return json.loads(summary.read_text())


def scalars(run_dir) -> dict:
    """tag -> [(step, value)], read by TensorBoard's own event reader, every value kept."""
    from tensorboard.backend.event_processing.event_accumulator import (SCALARS,
                                                                        EventAccumulator)

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()[SCALARS]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitoring")
    out = {}
    for name, nproc, args in (("streaming", WORKERS, STREAMING),
                              ("data_parallel", 2, DATA_PARALLEL)):
        out[name] = (root / name, launch(root / name, nproc, args))
    return out


def values(tags, tag, steps=range(1, ITERS + 1)):
    """The tag's values, checked to be exactly one per expected step, all finite."""
    assert tag in tags, f"{tag} missing; have {sorted(tags)}"
    got = [step for step, _ in tags[tag]]
    assert got == list(steps), f"{tag}: steps {got}"
    vals = [v for _, v in tags[tag]]
    assert all(math.isfinite(v) for v in vals), f"{tag}: {vals}"
    return vals


def check_training_scalars(tags, summary):
    per_step_tokens = summary["tokens"] // ITERS
    assert all(v > 0 for v in values(tags, "train/loss"))
    assert all(v > 0 for v in values(tags, "train/lr"))
    assert all(v > 0 for v in values(tags, "train/grad_norm"))
    assert all(v > 0 for v in values(tags, "train/tokens_per_s"))
    assert all(v > 0 for v in values(tags, "train/step_seconds"))
    tokens = values(tags, "train/tokens")
    assert tokens == [f32(s * per_step_tokens) for s in range(1, ITERS + 1)]
    assert tokens[-1] == f32(summary["tokens"])
    assert values(tags, "train/loss")[-1] == f32(summary["train_loss"])
    valid = values(tags, "valid/loss", EVAL_STEPS)
    assert all(v > 0 for v in valid) and valid[-1] == f32(summary["valid_loss"])
    assert values(tags, "test/loss", [ITERS])[0] > 0


@pytest.mark.timeout(900)
def test_streaming_run_scalars_as_tensorboard_reads_them(runs):
    run_dir, summary = runs["streaming"]
    tags = scalars(run_dir)
    check_training_scalars(tags, summary)
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
    # Control bytes (stop flags, ...): cumulative, and within the summary's job-wide total
    # (which also has worker 1's door and heartbeats, through the store on worker 0).
    control = values(tags, "streaming/cross_worker_control_bytes")
    assert all(a <= b for a, b in zip(control, control[1:])) and control[-1] > 0
    assert control[-1] <= summary["cross_worker_control_bytes"]
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
def test_data_parallel_run_logs_the_all_reduce_traffic_it_stands_for(runs):
    run_dir, summary = runs["data_parallel"]
    tags = scalars(run_dir)
    check_training_scalars(tags, summary)
    assert not [t for t in tags if t.startswith("streaming/")]
    step_bytes = ring_all_reduce_bytes(summary["parameters"], 2)
    assert step_bytes == 2 * (2 - 1) * 4 * summary["parameters"]
    assert values(tags, "traffic/data_parallel_bytes") == \
        [f32(s * step_bytes) for s in range(1, ITERS + 1)]


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


def check_timers(run_dir, tags, phases, block_head, row):
    """Each phase's worker maximum per step in TensorBoard (ms), within the step's wall time;
    and Megatron's block under every progress line."""
    steps = values(tags, "train/step_seconds")
    got = {name: values(tags, f"timers/{name}-time") for name in phases}
    for name, ms in got.items():
        assert all(0 < v for v in ms), (name, ms)
    for fb, opt, wall in zip(got["forward-backward"], got["optimizer"], steps):
        assert fb / 1e3 < 2 * wall and opt / 1e3 < 2 * wall  # another rank's: not above
    assert not [t for t in tags if t.startswith("timers/") and t[7:-5] not in phases]
    text = (run_dir / "output.txt").read_text()
    assert text.count(block_head) == ITERS, text[-3000:]  # --log-interval 1
    for name in phases:
        assert len(re.findall(rf"^ +{name} \.+: {row}$", text, re.M)) == ITERS, name
    return got


@pytest.mark.timeout(900)
def test_timers_report_each_phase_per_step_as_megatron_prints_them(runs):
    run_dir, _ = runs["streaming"]  # --timing-log-level 2, minmax
    got = check_timers(run_dir, scalars(run_dir), ["forward-backward", "optimizer",
                                                   "diloco-sync"],
                       "(min, max) time across ranks (ms):", r"\([0-9.]+, [0-9.]+\)")
    # The hook runs inside the optimizer step, on every rank: never longer than the step.
    assert all(s <= o for s, o in zip(got["diloco-sync"], got["optimizer"])), got
    run_dir, _ = runs["data_parallel"]  # level 1, every rank listed
    check_timers(run_dir, scalars(run_dir), ["forward-backward", "optimizer"],
                 "times across ranks (ms):", r"0: [0-9.]+, 1: [0-9.]+")


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

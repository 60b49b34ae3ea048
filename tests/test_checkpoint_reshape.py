"""Checkpoints resume under other flags: another parallel layout, another sync schedule,
another number of workers.

Layouts: the first step after loading has the uninterrupted run's loss (summation order
aside). Schedules and worker counts: the resumed streaming run equals the single-process
DiLoCo reference resumed the same way (``diloco_reference.py``'s REFERENCE_RESUME_*), every
parameter of every worker, local and global.
"""

import json

import pytest

from harness import TINY, read_jsonl, run
from test_streaming import BASE, distributed, dumps, reference_result, relative, start_reference


def _latest(root, iteration):
    """Point the tracker at an earlier checkpoint of the run (it saved more after it)."""
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def _losses(path):
    return {r["iteration"]: r["train/loss"] for r in read_jsonl(path) if "train/loss" in r}


@pytest.mark.timeout(900)
def test_layout_changes_resume_at_the_uninterrupted_loss(tmp_path):
    """Saved at TP2 x PP2 (ZeRO-1), loaded at TP1 (one rank, adding --decoupled-lr: a third
    param group the checkpoint did not have), at PP2 with Ulysses SP2, and at ZeRO-0 with
    DP2; and a 2-worker streaming run with a fragment in flight, saved at TP2 in
    each worker and loaded at TP1 x DP2 under ZeRO-2."""
    args = [*TINY, "--train-iters", "4", "--eval-iters", "0", "--zero-stage", "1"]
    ckpt = tmp_path / "ckpt"
    saved = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    # One launch: the uninterrupted run, which saves after step 3 on its way.
    run(4, [*args, *saved, "--save", str(ckpt), "--save-interval", "3",
            "--log-jsonl", str(tmp_path / "full.jsonl")])
    _latest(ckpt, 3)
    loads = {"tp1": (1, ["--decoupled-lr", "3e-3"]),
             "pp2_sp2": (4, ["--pipeline-model-parallel-size", "2",
                             "--ds-sequence-parallel-size", "2"]),
             "zero0_dp2": (2, ["--zero-stage", "0"])}
    full = _losses(tmp_path / "full.jsonl")
    for name, (nproc, flags) in loads.items():
        log = tmp_path / f"{name}.jsonl"
        out = run(nproc, [*args, *flags, "--load", str(ckpt), "--log-jsonl", str(log)])
        assert "layout changed on resume" in out.stderr
        got = _losses(log)
        assert sorted(got) == [4]
        assert got[4] == pytest.approx(full[4], rel=1e-6, abs=0), name

    stream = [*TINY, "--num-layers", "2", "--train-iters", "9", "--eval-iters", "0",
              "--diloco-workers", "2", "--diloco-inner-steps", "6", "--diloco-fragments", "2",
              "--diloco-overlap-steps", "2", "--diloco-quantize", "int8",
              "--diloco-error-feedback", "--zero-stage", "1"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    sckpt = tmp_path / "stream"
    run(4, [*stream, *tp2, "--save", str(sckpt), "--save-interval", "7",
            "--log-jsonl", str(tmp_path / "sfull.jsonl")])
    _latest(sckpt, 7)
    meta = json.loads((sckpt / "iter_0000007" / "checkpoint.json").read_text())
    assert meta["pending"] == [{"fragment": 0, "step": 6, "all_finite": True}]
    # Same DP size: with several workers, DP decides which samples each worker reads.
    run(4, [*stream, "--pipeline-model-parallel-size", "2", "--zero-stage", "0",
            "--load", str(sckpt), "--log-jsonl", str(tmp_path / "sres.jsonl")])
    full, resumed = _losses(tmp_path / "sfull.jsonl"), _losses(tmp_path / "sres.jsonl")
    assert sorted(resumed) == [8, 9]
    assert resumed[8] == pytest.approx(full[8], rel=1e-6, abs=0)
    # After step 8 the restored exchange merges. int8's blocks run along each rank's flat
    # shard, which the layout decides, so from here on the runs differ by quantization.
    assert resumed[9] == pytest.approx(full[9], rel=1e-4, abs=0)


def _reference(args, out, world, resume_at, resume_args, resume_world):
    """The resumed reference, started in the background (``reference_result`` collects it)."""
    return start_reference(args, out, world, {
        "REFERENCE_RESUME_AT": str(resume_at), "REFERENCE_RESUME_ARGS": json.dumps(resume_args),
        "REFERENCE_RESUME_WORLD_SIZE": str(resume_world)})


def _compare(out, ref, workers):
    for w in range(workers):
        got = dumps(out, w)
        for kind, expected in (("local", ref["local"][w]), ("global", ref["global"])):
            worst, whole = relative(got[kind], expected)
            assert whole <= 1e-6 and worst <= 1e-5, (w, kind, worst, whole)


STREAM = [*BASE, "--num-layers", "4", "--train-iters", "12"]

# Every save is after step 6, with fragment 0's exchange (sent after step 6) in flight.
RESUMES = {
    # P 2 -> 4, strided -> sequential, H 4 -> 8: the exchange in flight merges at load, and the
    # new schedule's merge after step 7 (of a send after step 6 it never made) merges nothing.
    "fragments_2_to_4_sequential": (
        ["--diloco-inner-steps", "4", "--diloco-fragments", "2", "--diloco-overlap-steps", "1"],
        6, ["--diloco-inner-steps", "8", "--diloco-fragments", "4", "--diloco-overlap-steps",
            "1", "--diloco-fragment-pattern", "sequential"], 2, 2),
    # tau 1 -> 0 (merged at load) and M 2 -> 3: the new worker takes the merged theta_g and
    # worker 0's AdamW state; alpha 0.5 tells a merged local copy from theta_g.
    "tau_1_to_0_workers_2_to_3": (
        ["--diloco-inner-steps", "4", "--diloco-fragments", "2", "--diloco-overlap-steps", "1",
         "--diloco-alpha", "0.5"],
        6, ["--diloco-inner-steps", "4", "--diloco-fragments", "2", "--diloco-workers", "3",
            "--diloco-alpha", "0.5"], 2, 3),
    # M 3 -> 2, same schedule: the exchange stays in flight and merges after step 7, under
    # another outer lr and momentum (the momentum buffer carries over).
    "workers_3_to_2_outer_optimizer": (
        ["--diloco-inner-steps", "4", "--diloco-fragments", "2", "--diloco-overlap-steps", "1",
         "--diloco-workers", "3"],
        6, ["--diloco-inner-steps", "4", "--diloco-fragments", "2", "--diloco-overlap-steps",
            "1", "--diloco-outer-lr", "0.5", "--diloco-outer-momentum", "0.8"], 3, 2),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_under_other_sync_flags_matches_the_reference(name, tmp_path):
    first, at, second, n1, n2 = RESUMES[name]
    args1, args2 = [*STREAM, *first], [*STREAM, *second]
    ckpt = tmp_path / "ckpt"
    (tmp_path / "first").mkdir()
    background = _reference(args1, tmp_path, n1, at, args2, n2)
    try:
        distributed(n1, [*args1, "--save", str(ckpt), "--save-interval", str(at),
                         "--exit-interval", str(at)], tmp_path / "first")
        out = distributed(n2, [*args2, "--load", str(ckpt)], tmp_path)
    except BaseException:
        background.kill()
        raise
    if "--diloco-outer-lr" in second:
        assert ("outer optimizer changed on resume (--diloco-outer-lr 0.7 -> 0.5, "
                "--diloco-outer-momentum 0.9 -> 0.8)") in out.stderr
    _compare(tmp_path, reference_result(background, tmp_path), n2)


@pytest.mark.timeout(600)
def test_quantize_change_carries_the_residual(tmp_path):
    """fp4 -> int8 on resume: the error-feedback residual is carried over (not reset), the
    run continues, and its loss stays with the uninterrupted fp4 run's (the wire formats
    differ, so equality is not expected)."""
    args = [*TINY, "--num-layers", "2", "--train-iters", "10",
            "--eval-iters", "0", "--diloco-workers", "2", "--diloco-inner-steps", "4",
            "--diloco-fragments", "2", "--diloco-error-feedback"]
    ckpt = tmp_path / "ckpt"
    run(2, [*args, "--diloco-quantize", "fp4", "--save", str(ckpt), "--save-interval", "5",
            "--log-jsonl", str(tmp_path / "full.jsonl")])
    _latest(ckpt, 5)
    meta = json.loads((ckpt / "iter_0000005" / "checkpoint.json").read_text())
    assert "worker1.outer.residual" in meta["kinds"]["prefixes"]
    out = run(2, [*args, "--diloco-quantize", "int8", "--load", str(ckpt),
                  "--log-jsonl", str(tmp_path / "int8.jsonl")])
    assert "resumed from" in out.stderr
    full, resumed = _losses(tmp_path / "full.jsonl"), _losses(tmp_path / "int8.jsonl")
    assert sorted(resumed) == list(range(6, 11))
    assert resumed[6] == full[6]  # no sync between steps 5 and 6: same weights, same loss
    assert abs(resumed[10] - full[10]) < 0.02 * full[10]

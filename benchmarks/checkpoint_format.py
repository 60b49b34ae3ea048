"""Checkpoint size and save / load time: this version's format against another revision's.

    .venv/bin/python benchmarks/checkpoint_format.py [--baseline 7c2292b] [--out runs/ckpt]
                                                     [--repeats 2] [--models quickstart 100M]
    python3 benchmarks/checkpoint_format.py --device-check cuda --models 1B --out OUT

The second is the device check's (``launch/device_check.sh`` with ``STAGES=checkpoint``, one
GPU): --async-save's blocked time against a synchronous save of a ~1B model (one worker of one
rank), the tensors copied out of the GPU into pinned host memory; ``--device-check cpu
--models quickstart`` rehearses it here.

For two models, the quick-start one (4 layers, hidden 128, 2 workers x TP2, 4 ranks) and one
of about 100M parameters (12 layers, hidden 768, vocabulary 32000, 2 workers of one rank, bf16,
ZeRO-1), each revision trains one step with ``--save``, then resumes it with ``--load``,
``--repeats`` times, the two revisions alternating; the fastest save and the fastest load of
each count (the disk's speed varies from one run to the next; every sample is kept). The
time of ``Checkpointer.save`` and ``Checkpointer.load`` is measured inside each rank (this
script wraps them and re-runs pretrain_gpt.py), the slowest rank counts. Size: the bytes of
the iteration directory. With ``--async-save`` (this revision only): the time the step loop
was blocked by a save (its start, its commit's stages in the loop, and any commit at once,
less any wait for its own files) against the synchronous save's time, for the first save
and a later one, each also less the time a rank waited for the other worker at a commit's
first collective across workers (the two workers' steps drift apart by that much on shared
cores; not the save's own cost: the same schedule's synchronous saves wait as long,
``sync_waits_seconds``; none where the commit went by the stop flag), and against the same
schedule's synchronous saves, the waits in both or in neither. The baseline revision is
checked out as a git worktree under ``--out``. Reported as ratios ours / baseline, measured
in one run.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "quickstart": (4, ["--mock-data", "--vocab-size", "1024", "--diloco-workers", "2",
                       "--tensor-model-parallel-size", "2", "--diloco-inner-steps", "20",
                       "--diloco-fragments", "2", "--diloco-overlap-steps", "1",
                       "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads",
                       "4", "--seq-length", "128", "--micro-batch-size", "4",
                       "--global-batch-size", "8"]),
    # The device check's (``--device-check``, one GPU): one worker of one rank, ~0.94B
    # parameters (16 x 12 x 2048^2 + 2 x 32000 x 2048), about 12 GiB a checkpoint.
    "1B": (1, ["--mock-data", "--vocab-size", "32000", "--num-layers", "16", "--hidden-size",
               "2048", "--num-attention-heads", "16", "--seq-length", "512",
               "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16",
               "--zero-stage", "1"]),
    "100M": (2, ["--mock-data", "--vocab-size", "32000", "--diloco-workers", "2",
                 "--diloco-inner-steps", "20", "--diloco-fragments", "2", "--num-layers", "12",
                 "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "64",
                 "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16",
                 "--zero-stage", "1"]),
}
COMMON = ["--train-iters", "1", "--eval-iters", "0", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--log-interval", "1"]


def timed_main():
    """Runs pretrain_gpt.py from the current directory with Checkpointer.save/load timed;
    appends {"op", "rank", "seconds"} lines to $CKPT_TIMING_OUT."""
    sys.path.insert(0, os.getcwd())
    import megatron_streaming.checkpoint as ckpt

    out = os.environ["CKPT_TIMING_OUT"]

    def wrap(name, details=lambda self, args, result: {}):
        original = getattr(ckpt.Checkpointer, name)

        def timed(self, *args, **kwargs):
            started = time.perf_counter()
            result = original(self, *args, **kwargs)
            with open(out, "a") as f:
                f.write(json.dumps({"op": name, "rank": int(os.environ.get("RANK", 0)),
                                    "seconds": time.perf_counter() - started,
                                    **details(self, args, result)}) + "\n")
            return result

        setattr(ckpt.Checkpointer, name, timed)

    wrap("save")
    wrap("load")
    if hasattr(ckpt.Checkpointer, "start_save"):  # --async-save: the step loop's share
        # Each save's calls by its iteration: its start, its commit's stages in the step loop
        # (``advance``, where this revision has it), and ``finish_save`` where it was
        # committed at once (a synchronous save, or one drained: the next save was due).
        wrap("start_save", lambda self, args, result: {"iteration": args[1], **result.timings})
        wrap("finish_save", lambda self, args, result: {"iteration": args[0].iteration,
                                                        **self.timings})
        if hasattr(ckpt.Checkpointer, "advance"):
            wrap("advance", lambda self, args, result: {
                "iteration": args[0].iteration, "write": args[0].write.seconds["write"]})
    sys.argv = ["pretrain_gpt.py", *sys.argv[2:]]
    import runpy

    runpy.run_path("pretrain_gpt.py", run_name="__main__")


def launch(repo, nproc, args, timing):
    # Every run starts with no earlier run's writes still going to the disk. Run G2, without
    # it, measured our save at 1.71x the old format's (~110M), against 0.88x to 0.90x in G1
    # and G3 with it; the cause was not established (both formats fsync their files).
    os.sync()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.abspath(__file__), "--timed", *args]
    env = dict(os.environ, CKPT_TIMING_OUT=timing, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {repo}:\n{proc.stderr[-4000:]}")


def dir_size(path):
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, files in os.walk(path)
               for n in files)


def paths(repo, name, out):
    ckpt = os.path.join(out, f"{name}_{os.path.basename(repo)}")
    return ckpt, ckpt + ".jsonl"


def measure(repo, name, out, extra=(), load=True):
    """One synchronous save (after one step) and one load of revision ``repo``."""
    nproc, model = MODELS[name]
    ckpt, timing = paths(repo, name, out)
    if os.path.exists(timing):
        os.remove(timing)
    subprocess.run(["rm", "-rf", ckpt])
    launch(repo, nproc, [*model, *COMMON, *extra, "--save", ckpt], timing)
    if load:
        launch(repo, nproc, [*model, *COMMON, *extra, "--train-iters", "2", "--load", ckpt],
               timing)
    records = [json.loads(line) for line in open(timing)]
    # Before start_save / finish_save a save was one call; now the loop makes the two.
    saves = [r["seconds"] for r in records if r["op"] == "save"] or \
        [sum(r["seconds"] for r in records if r["rank"] == rank and
             r["op"] in ("start_save", "finish_save")) for rank in {r["rank"] for r in records}]
    loads = [r["seconds"] for r in records if r["op"] == "load"]
    return {"save_seconds": max(saves), "load_seconds": max(loads, default=None),
            "bytes": dir_size(os.path.join(ckpt, "iter_0000001"))}


def best(samples):
    """The fastest save and the fastest load of several ``measure`` runs (the disk's speed
    varies from one run to the next), with every sample."""
    return {"save_seconds": min(r["save_seconds"] for r in samples),
            "load_seconds": min(r["load_seconds"] for r in samples),
            "bytes": samples[0]["bytes"],
            "save_samples": [r["save_seconds"] for r in samples],
            "load_samples": [r["load_seconds"] for r in samples]}


def measure_async(name, out, extra=(), same_schedule=True):
    """--async-save: 36 steps, a save after every twelfth (the host buffer the tensors are
    copied to is made, and the save planned, beside the second step, as in a run whose first
    save comes later still; twelve steps give a save's commit time to go a stage a step,
    from the flags every rank reads after the same step, as in a run that saves every few
    hundred steps). The first two saves count (the last one's commit waits for its files at
    the end of training). The step loop's share of each save, the slowest rank's: its start
    (collect, copy out, plan), its commit's stages in the loop (``advance``), and a commit
    at once (``finish_save``, if the next save came first), less the time that waited for
    this rank's files; and that less the wait for the other worker at the commit's first
    collective across workers (``waits``; none where the commit went by the flags). The
    same schedule without --async-save, measured the same way, shows those waits at a
    synchronous save: the workers' steps drift apart between synchronisations, with or
    without a save, and a save's first collective across workers is where the worker ahead
    waits for the other. Without ``same_schedule`` (the device check) only the --async-save
    run, keeping its last checkpoint (``--keep-last 1``: the device's disk)."""
    nproc, model = MODELS[name]
    repo = REPO
    ckpt, timing = paths(repo, name, out)

    def saves(async_save):
        if os.path.exists(timing):
            os.remove(timing)
        subprocess.run(["rm", "-rf", ckpt])
        launch(repo, nproc, [*model, *COMMON, *extra, "--train-iters", "36", "--save", ckpt,
                             "--save-interval", "12",
                             *([] if same_schedule else ["--keep-last", "1"]),
                             *(["--async-save"] if async_save else [])], timing)
        by_rank = {}  # rank -> [each save's {"start", "advance", "finish"}, in order]
        for r in (json.loads(line) for line in open(timing)):
            if r["op"] not in ("start_save", "advance", "finish_save"):
                continue
            rank = by_rank.setdefault(r["rank"], {})
            calls = rank.setdefault(r["iteration"], {"advance": 0.0, "finish": None})
            if r["op"] == "start_save":
                calls["start"] = r["seconds"]
            elif r["op"] == "advance":
                calls["advance"] += r["seconds"]
                calls["write"] = r["write"]
            else:
                calls["finish"] = r
                calls["write"] = r["write"]
        return [[calls for _, calls in sorted(rank.items())] for rank in by_rank.values()]

    synchronous = saves(False) if same_schedule else None
    ranks = saves(True)

    def waits(runs, calls, i):
        """How long this rank waited for the other worker in save ``i``'s commit at once:
        at its first collective across workers (the gather of every worker's part), its
        time there less the least any rank spent there (the last to arrive waits for no
        one)."""
        if calls[i]["finish"] is None:
            return 0.0
        return calls[i]["finish"]["gather"] - min(c[i]["finish"]["gather"] for c in runs)

    def blocked(runs, i, less_waits=False):
        """The step loop's share of save ``i``, the slowest rank's."""
        def share(calls):
            finish = calls[i]["finish"]
            at_once = finish["seconds"] - finish["waited"] if finish else 0.0
            return calls[i]["start"] + calls[i]["advance"] + at_once - (
                waits(runs, calls, i) if less_waits else 0.0)

        return max(share(calls) for calls in runs)

    ours = {"async_blocked_seconds": blocked(ranks, 0),
            "async_blocked_later_seconds": blocked(ranks, 1),
            # whether each save was committed by the flags, in the loop's own stride
            "async_committed_in_the_background": [all(c[i]["finish"] is None
                                                      for c in ranks) for i in (0, 1)],
            "async_advance_seconds": [max(c[i]["advance"] for c in ranks) for i in (0, 1)],
            "async_write_seconds": max(c[0]["write"] for c in ranks)}
    if synchronous is None:
        return ours
    return {**ours,
            "async_blocked_less_waits_seconds": blocked(ranks, 0, True),
            "async_blocked_later_less_waits_seconds": blocked(ranks, 1, True),
            "async_waits_seconds": [max(waits(ranks, c, i) for c in ranks) for i in (0, 1)],
            "sync_waits_seconds": [max(waits(synchronous, c, i) for c in synchronous)
                                   for i in (0, 1)],
            # the same schedule's synchronous saves, with and without the waits
            "sync_same_schedule_seconds": [blocked(synchronous, i) for i in (0, 1)],
            "sync_same_schedule_less_waits_seconds": [blocked(synchronous, i, True)
                                                      for i in (0, 1)]}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--timed":
        return timed_main()
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default="7c2292b")
    parser.add_argument("--out", default="runs/ckpt")
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        default=["quickstart", "100M"])
    parser.add_argument("--repeats", type=int, default=2,
                        help="synchronous save and load runs per revision, alternating; the "
                        "fastest of each counts")
    parser.add_argument("--device-check", choices=("cuda", "cpu"),
                        help="the device check (launch/device_check.sh, STAGES=checkpoint; "
                        "cpu to rehearse it): this revision only, on the GPU with cuda: one "
                        "synchronous save after one step, and the --async-save schedule")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    if args.device_check:
        return device_check(args, out)
    base = os.path.join(out, "baseline")
    if not os.path.isdir(base):
        subprocess.run(["git", "worktree", "add", "--detach", base, args.baseline], cwd=REPO,
                       check=True, capture_output=True)
        os.symlink(os.path.join(REPO, ".venv"), os.path.join(base, ".venv"))
    results = {}
    for name in args.models:
        samples = {REPO: [], base: []}
        for _ in range(args.repeats):
            for repo in samples:
                samples[repo].append(measure(repo, name, out))
        ours, theirs = best(samples[REPO]), best(samples[base])
        ratio = {k: ours[k] / theirs[k] for k in ("save_seconds", "load_seconds", "bytes")}
        ours.update(measure_async(name, out))
        for which, i in (("", 0), ("_later", 1)):
            # against our own synchronous save (of one step), and against the same schedule's
            # synchronous saves: the waits for the other worker in both, or in neither
            ratio[f"async_blocked{which}_over_sync_save"] = \
                ours[f"async_blocked{which}_seconds"] / ours["save_seconds"]
            ratio[f"async_blocked{which}_less_waits_over_sync_save"] = \
                ours[f"async_blocked{which}_less_waits_seconds"] / ours["save_seconds"]
            ratio[f"async_blocked{which}_over_same_schedule_sync_save"] = \
                ours[f"async_blocked{which}_seconds"] / ours["sync_same_schedule_seconds"][i]
            ratio[f"async_blocked{which}_less_waits_over_same_schedule_sync_save"] = \
                ours[f"async_blocked{which}_less_waits_seconds"] / \
                ours["sync_same_schedule_less_waits_seconds"][i]
        results[name] = {"ours": ours, "baseline": theirs, "ratio": ratio}
        print(name, json.dumps(results[name]), flush=True)
    with open(os.path.join(out, "checkpoint_format.json"), "w") as f:
        json.dump({"baseline": args.baseline, "repeats": args.repeats, "results": results},
                  f, indent=1)


def device_check(args, out):
    """--async-save's blocked time against a synchronous save, this revision only (with
    ``cuda``: the tensors copied out of the GPU into pinned host memory)."""
    extra = ["--distributed-backend", "nccl", "--diloco-backend", "gloo"] \
        if args.device_check == "cuda" else []
    results = {}
    for name in args.models:
        ours = measure(REPO, name, out, extra, load=False)
        ours.update(measure_async(name, out, extra, same_schedule=False))
        ratio = {f"async_blocked{which}_over_sync_save":
                 ours[f"async_blocked{which}_seconds"] / ours["save_seconds"]
                 for which in ("", "_later")}
        results[name] = {"ours": ours, "ratio": ratio}
        print(name, json.dumps(results[name]), flush=True)
        subprocess.run(["rm", "-rf", paths(REPO, name, out)[0]])  # the device's disk
    with open(os.path.join(out, "checkpoint_device.json"), "w") as f:
        json.dump({"device": args.device_check, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""Where a training step makes the host wait for the GPU: every synchronizing CUDA call of two
one-rank workers (NCCL inside each, gloo across) at ZeRO-2 with ``--overlap-grad-reduce``,
counted by the Python line that made it.

    python3 benchmarks/sync_sites.py run --out OUT              # on a GPU, 30 steps
    python3 benchmarks/sync_sites.py run --out OUT --rehearse   # the plumbing, on the CPU

Each rank runs ``pretrain_gpt.py`` with a step hook (the run's extensions, as
``tests/pretrain_with_faults.py`` injects its faults) that turns on
``torch.cuda.set_sync_debug_mode("warn")`` once set-up is done. torch then warns at every
synchronizing call; the warning is C++'s ``TORCH_WARN``, which torch's ``PyWarningHandler``
(torch/csrc/Exceptions.cpp) turns into a Python ``UserWarning`` when the call returns to
Python (``PyErr_WarnEx``, stack level 1: the calling line; a call from a C++ thread with no
Python above it, the autograd engine's own work, stays in C++ and is not counted). The hook
replaces ``warnings.showwarning`` and lets that warning through every time (``always``: the
default filter shows a line's warning once; ``torch.set_warn_always(True)`` does the same for
C++'s warn-once), and records ``traceback.extract_stack()`` at warn time: the innermost frame
(the site: torch's, DeepSpeed's or ours) and the innermost frame of this repository (the line
of ours that led there).

Steps are windows between the ends of the optimizer steps: step N is everything from the end
of step N-1 to the end of step N (set-up after the hook is made falls in step 1). Written per
rank, ``OUT/sync_sites_rank<R>.json``: ``{window: {"file:line": count}}`` for the warm-up
(steps 1 to ``--warmup``), the steady steps (the rest) and what follows the last step; then
``OUT/sync_sites.json`` with every rank's and a per-step count of the steady window.

``--rehearse`` (no GPU): sync debug mode does nothing on the CPU, so the hook makes a C++
warning of its own at the end of every step (a tensor over a read-only NumPy array, which C++
warns about once per process: ``TORCH_WARN_ONCE``) and counts that as a sync: the counter,
its windows and the JSON are exercised end to end; the steady window must hold one per step,
at one line of this file.
"""

import argparse
import atexit
import json
import os
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SYNC = "called a synchronizing CUDA operation"
REHEARSAL = "The given NumPy array is not writable"  # what a rehearsal counts instead
OUT_ENV, WARMUP_ENV, REHEARSE_ENV = "SYNC_SITES_OUT", "SYNC_SITES_WARMUP", "SYNC_SITES_REHEARSE"

# Two one-rank workers, ZeRO-2 with the gradient reduction overlapped with the backward.
WORKERS = ["--diloco-workers", "2", "--diloco-inner-steps", "10", "--diloco-fragments", "2",
           "--diloco-overlap-steps", "1", "--zero-stage", "2", "--overlap-grad-reduce",
           "--mock-data", "--eval-iters", "0", "--log-interval", "10", "--lr", "1e-3",
           "--lr-warmup-iters", "2", "--clip-grad", "1.0"]
MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size",
         "4", "--global-batch-size", "8", "--bf16", "--distributed-backend", "nccl",
         "--diloco-backend", "gloo"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4"]


def _short(path: str) -> str:
    """A frame's file as a reader finds it: relative to the repository or site-packages."""
    marker = "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    return os.path.relpath(path, REPO) if _in_repository(path) else path


def _in_repository(path: str) -> bool:
    """Whether ``path`` is this repository's own code (not a package installed inside it)."""
    return path.startswith(str(REPO) + os.sep) and "site-packages" + os.sep not in path


class SyncCounter:
    """The step hook: counts the synchronizing calls by site and window (see the module's
    docstring); writes its rank's JSON after every step and at exit."""

    def __init__(self, run, out: Path, warmup: int, rehearse: bool):
        import torch

        self.torch, self.out, self.warmup, self.rehearse = torch, out, warmup, rehearse
        self.rank = run.topology.rank
        self.completed = 0  # optimizer steps ended
        self.windows = {"warmup": {}, "steady": {}, "after": {}}
        self.ours = {"warmup": {}, "steady": {}, "after": {}}
        self.threads, self.functions = {}, {}
        self.lock = threading.Lock()
        self.pattern = REHEARSAL if rehearse else SYNC
        if rehearse:
            import numpy

            self.read_only = numpy.zeros(1)
            self.read_only.flags.writeable = False
        self._show = warnings.showwarning
        warnings.showwarning = self.showwarning
        warnings.filterwarnings("always", message=f".*{self.pattern}")
        torch.set_warn_always(True)
        if not rehearse:
            torch.cuda.set_sync_debug_mode("warn")
        self.last_step = None  # set by the rank's flags (``--train-iters``)
        atexit.register(self.write)

    def window(self) -> str:
        step = self.completed + 1
        if self.last_step is not None and step > self.last_step:
            return "after"
        return "warmup" if step <= self.warmup else "steady"

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if self.pattern not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1]
                 if not f.filename.endswith(os.sep + "warnings.py")]
        if not stack:
            return None
        site = stack[-1]
        key = f"{_short(site.filename)}:{site.lineno}"
        ours = next((f for f in reversed(stack) if _in_repository(f.filename)
                     and f.filename != os.path.abspath(__file__)), None)
        with self.lock:
            w = self.window()
            self.windows[w][key] = self.windows[w].get(key, 0) + 1
            self.functions[key] = site.name
            if ours is not None:
                mine = f"{_short(ours.filename)}:{ours.lineno}"
                self.ours[w][mine] = self.ours[w].get(mine, 0) + 1
                self.functions[mine] = ours.name
            name = threading.current_thread().name
            self.threads[name] = self.threads.get(name, 0) + 1
        return None

    def before_step(self, step: int) -> None:
        pass  # called after the step's backward: the windows end at ``after_step``

    def after_step(self) -> None:
        if self.rehearse:  # a C++ warn-once through torch's handler: one per step
            self.torch.from_numpy(self.read_only)
        self.completed += 1
        self.write()

    def write(self) -> None:
        with self.lock:
            ended = min(self.completed, self.last_step or self.completed)
            record = {"rank": self.rank, "steps": self.completed, "warmup_steps": self.warmup,
                      "steady_steps": max(0, ended - self.warmup),
                      "rehearsal": self.rehearse, "sites": self.windows,
                      "via_this_repository": self.ours, "functions": self.functions,
                      "threads": self.threads}
        path = self.out / f"sync_sites_rank{self.rank}.json"
        path.write_text(json.dumps(record, indent=1))


def rank_main(argv) -> None:
    """One rank: ``pretrain_gpt.py`` with the counter (its settings from the environment)."""
    import pretrain_gpt
    from megatron_streaming.cli.arguments import parse_args

    out, warmup = Path(os.environ[OUT_ENV]), int(os.environ[WARMUP_ENV])
    rehearse = os.environ.get(REHEARSE_ENV) == "1"
    last = parse_args(argv).training.train_iters

    def make(run):
        counter = SyncCounter(run, out, warmup, rehearse)
        counter.last_step = last
        return counter

    sys.argv = [str(REPO / "pretrain_gpt.py"), *argv]
    pretrain_gpt.entry([make])


def summary(out: Path, ranks: int) -> dict:
    """Every rank's counts in one record, with the steady window's syncs per step."""
    records = [json.loads((out / f"sync_sites_rank{r}.json").read_text())
               for r in range(ranks) if (out / f"sync_sites_rank{r}.json").exists()]
    result = {"ranks": records, "per_steady_step": {}}
    for rec in records:
        steps = max(1, rec["steady_steps"])
        result["per_steady_step"][str(rec["rank"])] = {
            key: round(n / steps, 3) for key, n in sorted(
                rec["sites"]["steady"].items(), key=lambda kv: -kv[1])}
    return result


def table(result: dict) -> str:
    lines = []
    for rec in result["ranks"]:
        lines.append(f"rank {rec['rank']}: {rec['steps']} steps; steady steps "
                     f"{rec['steady_steps']}; threads {rec['threads']}")
        for window in ("warmup", "steady", "after"):
            sites = sorted(rec["sites"][window].items(), key=lambda kv: -kv[1])
            total = sum(n for _, n in sites)
            lines.append(f"  {window}: {total} syncs at {len(sites)} sites")
            for key, n in sites[:12]:
                lines.append(f"    {n:5d}  {key} ({rec['functions'].get(key, '?')})")
        mine = sorted(rec["via_this_repository"]["steady"].items(), key=lambda kv: -kv[1])
        lines.append("  steady, by the line of this repository that led there:")
        for key, n in mine[:12]:
            lines.append(f"    {n:5d}  {key} ({rec['functions'].get(key, '?')})")
    return "\n".join(lines)


def run(opts) -> int:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = [*(TINY if opts.rehearse else MODEL), *WORKERS, "--train-iters", str(opts.steps)]
    env = dict(os.environ, **{OUT_ENV: str(out), WARMUP_ENV: str(opts.warmup),
                              REHEARSE_ENV: "1" if opts.rehearse else "0"})
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", __file__, "rank", "--", *flags]
    with open(out / "sync_sites_training.log", "w") as log:
        try:
            code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=opts.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"returncode": code, "flags": flags, **summary(out, 2)}
    (out / "sync_sites.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"training exited with {code}; written: {out / 'sync_sites.json'}")
    if opts.rehearse:  # the counter counts: one deliberate warning per step, at one line
        for rec in result["ranks"]:
            counts = list(rec["sites"]["steady"].values())
            steady = rec["steady_steps"]
            if counts != [steady]:
                print(f"rehearsal: rank {rec['rank']} counted {counts} in the steady window, "
                      f"not [{steady}]")
                return 1
        if len(result["ranks"]) != 2:
            return 1
    return 0 if code == 0 else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["run", "rank"])
    ap.add_argument("--out", default="runs/sync_sites")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=9, help="steps 1 to this: the warm-up")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--rehearse", action="store_true", help="CPU: a deliberate C++ warning "
                    "per step counted instead of the syncs")
    opts = ap.parse_args(argv[:len(argv) - len(rest) - (1 if rest else 0)])
    if opts.mode == "rank":
        rank_main(rest)
        return 0
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())

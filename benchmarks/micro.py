"""Micro-benchmarks: codec throughput against a memory copy, and the sync's cost on quiet steps.

    .venv/bin/python benchmarks/micro.py [--numel 67108864,262144] [--threads 1] [--out runs/micro]
    python3 benchmarks/micro.py --device cuda --codec-only     # the codec on a GPU

Both parts run in one invocation and report ratios measured there (absolute times on a shared
machine drift; ratios of interleaved repetitions do not, much):

* Codec: for fp4 (E3M0), fp4-e2m1, int8 and bf16, ``encode`` (quantize + pack) and ``decode`` (unpack +
  dequantize, into a preallocated buffer as the transport does; fp4 also into a new tensor) of
  one flat fp32 tensor, in GB/s of fp32 (``4 x numel`` bytes per call), against
  ``torch.Tensor.copy_`` of the same tensor into a preallocated one, at two sizes: 64M elements
  and 256k (about one fragment of the slow-link model; small tensors are timed over many calls
  per sample). The operations are interleaved, repetition by repetition; the figure is the
  median of each. ``--threads``
  defaults to 1, as in a training rank (``megatron_streaming.parallel.distributed.cpu_threads``).
* Sync overhead: two workers (torchrun, one rank each, gloo on this host) train the
  benchmarks/slow_link.py model with the Streaming DiLoCo sync built as in a real run (4
  fragments, FP4, tau 1) but H so large that no step sends or merges. In blocks of a few
  steps, the sync's hooks are attached and detached in turn (both workers alike), so "on" and
  "off" steps interleave on the same processes and the same model. Reported: the median step
  time on vs off (ratio), and the time spent inside the hooks per step, measured directly, as
  a fraction of the median step; also the cost of one progress report's sync scalars (drift
  norms over the shard, at every ``--log-interval``), which a real run adds on logged steps.

Writes ``micro.json`` and ``micro.png`` under ``--out``.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CODECS = ("fp4", "fp4-e2m1", "int8", "bf16")
# The slow-link benchmark's model and streaming settings, with H so large nothing is sent.
MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads",
         "4", "--seq-length", "128", "--micro-batch-size", "8", "--eval-iters", "0",
         "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--adam-beta2", "0.95"]
QUIET_SYNC = ["--diloco-workers", "2", "--diloco-inner-steps", "100000", "--diloco-fragments",
              "4", "--diloco-overlap-steps", "1", "--diloco-quantize", "fp4"]


# ---- codec throughput -------------------------------------------------------------------
def codec_throughput(numel: int, reps: int, device: str = "cpu") -> dict:
    import torch

    from megatron_streaming.comm.codec import make_codec, warm_up

    torch.manual_seed(0)
    x = torch.randn(numel) * torch.logspace(-3, 0, numel)  # magnitudes spread like gradients
    x = x.to(device)
    dst = torch.empty_like(x)
    cuda = x.device.type == "cuda"
    for name in CODECS:  # compiled here, on the main thread, as a training rank does
        warm_up(make_codec(name, 128), numel, device)
    ops = {"memory copy": lambda: dst.copy_(x)}
    for name in CODECS:
        codec = make_codec(name, 128)
        encoded = codec.encode(x)
        ops[f"{name} encode"] = (lambda c: lambda: c.encode(x))(codec)
        # Into a preallocated buffer, as the transport decodes into its receive buffers.
        ops[f"{name} decode"] = (lambda c, e: lambda: c.decode(e, out=dst))(codec, encoded)
    # The sparse exchange's codec (64 of every 4,096 at 2 bits): the top-k, packing and the
    # scatter of the decode, on the same tensor (issue 58's device check: its encode and
    # decode against a device copy).
    from megatron_streaming.comm.sparse import SparseCodec

    sparse = SparseCodec()
    ops["sparse encode"] = lambda: sparse.encode(x)
    ops["sparse decode"] = (lambda e: lambda: sparse.decode(e, out=dst))(sparse.encode(x))
    # For reference: into a fresh tensor on every call (for large tensors, the allocator maps
    # new pages each time and faulting them in costs several copies).
    fp4 = make_codec("fp4", 128)
    ops["fp4 decode, new"] = (lambda e: lambda: fp4.decode(e))(fp4.encode(x))
    times = {op: [] for op in ops}
    for op in ops.values():  # warm-up: first-touch page faults, allocator growth, compiling
        op()
    calls = max(1, min(256, (64 << 20) // numel))  # small tensors: many calls per sample
    for _ in range(reps):
        for name, op in ops.items():
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(calls):
                op()
            if cuda:
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - started) / calls)
    copy = statistics.median(times["memory copy"])
    out = {}
    for name, t in times.items():
        median = statistics.median(t)
        out[name] = {"median_s": median, "gb_per_s": 4 * numel / median / 1e9,
                     "time_vs_copy": median / copy, "times_s": [round(v, 5) for v in t]}
    return out


# ---- sync overhead on non-syncing steps (runs inside each of two torchrun ranks) --------
class HookTimer:
    """Wraps the sync's three per-step entry points and adds up the time spent inside."""

    def __init__(self, sync):
        self.seconds = 0.0
        for name in ("_on_inner_step", "before_step", "after_step"):
            setattr(sync, name, self._timed(getattr(sync, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return wrapper


def sync_overhead_rank(blocks: int, block_steps: int, warmup: int, out: Path) -> None:
    import torch.distributed as dist

    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.streaming import report
    from megatron_streaming.run.train import Run

    total = warmup + blocks * block_steps
    cfg = parse_args([*MODEL, *QUIET_SYNC, "--train-iters", str(total), "--log-interval",
                      str(total)])
    run = Run(cfg).setup()
    sync, engine = run.sync, run.engine
    timer = HookTimer(sync)  # before attach, so the optimizer hook is the timed one
    sync.detach()
    sync.attach(engine.inner_optimizer, engine.step_hooks)
    iterator = run.data.train_iterator(0)
    steps = {"on": [], "off": []}
    hook_seconds, report_seconds = [], []
    for step in range(total):
        block = (step - warmup) // block_steps if step >= warmup else -1
        # ABBA order over pairs of blocks, so a slow drift of the machine favours neither.
        on = step < warmup or (block % 4) in (0, 3)
        attached = sync in engine.step_hooks
        if on and not attached:
            sync.attach(engine.inner_optimizer, engine.step_hooks)
        elif not on and attached:
            sync.detach()
        before = timer.seconds
        started = time.perf_counter()
        engine.train_step(iterator, step)
        run.stop.should_stop()  # the loop's per-step stop-flag agreement, as in a real run
        elapsed = time.perf_counter() - started
        if step >= warmup:
            steps["on" if on else "off"].append(elapsed)
            if on:
                hook_seconds.append(timer.seconds - before)
            if (step - warmup) % block_steps == 0:  # one progress report's sync scalars
                started = time.perf_counter()
                report.worker_scalars(sync, run.topology.groups["worker"])
                report_seconds.append(time.perf_counter() - started)
    if sync not in engine.step_hooks:
        engine.step_hooks.append(sync)
    assert not sync.events, f"a quiet step synced: {sync.events[:3]}"
    run.stop.close()
    sync.close()
    result = {"steps_on_s": steps["on"], "steps_off_s": steps["off"],
              "hook_s_per_on_step": hook_seconds, "report_s": report_seconds,
              "parameters": run.report.parameter_count()}
    (out / f"sync_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    run.liveness.close()
    run.topology.cross.job_barrier()


def bootstrap_ratio(on: list, off: list, resamples: int = 2000) -> tuple:
    """95 % interval of median(on) / median(off), resampling each side (the noise floor of
    the A/B comparison on a shared machine)."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(on, k=len(on))) /
                    statistics.median(rng.choices(off, k=len(off))) for _ in range(resamples))
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def sync_overhead(blocks: int, block_steps: int, warmup: int, out: Path) -> dict:
    for f in out.glob("sync_rank*.json"):
        f.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, "--sync-overhead-rank", "--blocks", str(blocks), "--block-steps",
           str(block_steps), "--warmup", str(warmup), "--out", str(out)]
    log = out / "sync_overhead.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"sync-overhead ranks exited with {code}; see {log}")
    ranks = [json.loads((out / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    per_rank = []
    for r in ranks:
        on, off = statistics.median(r["steps_on_s"]), statistics.median(r["steps_off_s"])
        hook = statistics.mean(r["hook_s_per_on_step"])
        low, high = bootstrap_ratio(r["steps_on_s"], r["steps_off_s"])
        per_rank.append({"median_step_on_s": on, "median_step_off_s": off,
                         "on_over_off_95ci": [low, high],
                         "mean_step_on_s": statistics.mean(r["steps_on_s"]),
                         "mean_step_off_s": statistics.mean(r["steps_off_s"]),
                         "on_over_off": on / off, "hook_s_per_step": hook,
                         "hook_fraction_of_step": hook / off,
                         "report_s_median": statistics.median(r["report_s"]),
                         "report_fraction_of_step": statistics.median(r["report_s"]) / off,
                         "steps_each": len(r["steps_on_s"])})
    summary = {k: statistics.mean(p[k] for p in per_rank) for k in per_rank[0]
               if not k.endswith("_95ci")}
    return {"per_rank": per_rank, "mean_over_ranks": summary,
            "parameters": ranks[0]["parameters"], "blocks": blocks,
            "block_steps": block_steps, "warmup_steps": warmup,
            "flags": [*MODEL, *QUIET_SYNC]}


# ---- report ----------------------------------------------------------------------------
def git_state() -> str:
    """The commit measured, and whether the codec differs from it (the library moves)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    dirty = git("status", "--porcelain", "megatron_streaming")
    return git("rev-parse", "--short", "HEAD") + (" + local changes" if dirty else "")


def plot(codec: dict, sync: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2),
                                      gridspec_kw={"width_ratios": [3, 1.3]})
    sizes = list(codec)
    names = list(codec[sizes[0]])
    width = 0.8 / len(sizes)
    for k, size in enumerate(sizes):
        xs = [i + (k - (len(sizes) - 1) / 2) * width for i in range(len(names))]
        bars = [codec[size][n]["gb_per_s"] for n in names]
        left.bar(xs, bars, width, label=f"{int(size):,} elements")
        for x, n, b in zip(xs, names, bars):
            left.annotate(f"{codec[size][n]['time_vs_copy']:.1f}x", (x, b), ha="center",
                          va="bottom", fontsize=6)
    left.set_xticks(range(len(names)), names)
    left.set_yscale("log")
    left.set_ylabel("GB/s of fp32 (log)")
    left.set_title("codec vs memory copy (label: time / copy time)", fontsize=10)
    left.tick_params(axis="x", labelrotation=35, labelsize=8)
    left.legend(fontsize=8)
    m = sync["mean_over_ranks"]
    values = [100 * (m["on_over_off"] - 1), 100 * m["hook_fraction_of_step"],
              100 * m["report_fraction_of_step"]]
    right.bar(["on/off - 1\n(median step)", "inside hooks", "one report"], values,
              color=["C2", "C3", "C4"])
    right.axhline(2, color="grey", linestyle=":", linewidth=0.8)
    right.set_ylabel("% of a non-syncing step")
    right.set_title("sync overhead, non-syncing steps", fontsize=10)
    right.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    # 64M elements (a large shard, beyond every cache) and 256k (about one
    # fragment of the slow-link model; in cache, where a copy is fastest).
    ap.add_argument("--numel", default=f"{64 << 20},{256 << 10}",
                    help="tensor sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the codec runs (cpu, cuda)")
    ap.add_argument("--codec-only", action="store_true", help="skip the sync-overhead part")
    ap.add_argument("--blocks", type=int, default=48, help="sync on/off blocks (ABBA order)")
    ap.add_argument("--block-steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "runs" / "micro"))
    ap.add_argument("--sync-overhead-rank", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.sync_overhead_rank:
        return sync_overhead_rank(opts.blocks, opts.block_steps, opts.warmup, out)
    import torch

    torch.set_num_threads(opts.threads)
    began = time.perf_counter()
    codec = {}
    for numel in (int(n) for n in opts.numel.split(",")):
        codec[str(numel)] = codec_throughput(numel, opts.reps, opts.device)
        print(f"codec on {opts.device}, {numel:,} fp32 elements, {opts.threads} thread(s), "
              f"median of {opts.reps}:")
        for name, r in codec[str(numel)].items():
            print(f"  {name:14} {r['gb_per_s']:7.2f} GB/s  {r['time_vs_copy']:6.2f}x copy time")
    if opts.codec_only:
        record = {"numel": opts.numel, "device": opts.device, "commit": git_state(),
                  "reps": opts.reps, "codec": codec, "wall_s": time.perf_counter() - began}
        (out / "micro_codec.json").write_text(json.dumps(record, indent=1) + "\n")
        return print(f"wrote {out / 'micro_codec.json'}")
    sync = sync_overhead(opts.blocks, opts.block_steps, opts.warmup, out)
    m = sync["mean_over_ranks"]
    cis = [p["on_over_off_95ci"] for p in sync["per_rank"]]
    print(f"sync on non-syncing steps ({m['steps_each']:.0f} steps each, mean of 2 ranks): "
          f"median step on {m['median_step_on_s'] * 1e3:.1f} ms, off "
          f"{m['median_step_off_s'] * 1e3:.1f} ms, ratio {m['on_over_off']:.4f} (95 % interval "
          f"per rank: {', '.join(f'{p[0]:.3f}-{p[1]:.3f}' for p in cis)}); inside hooks "
          f"{m['hook_s_per_step'] * 1e6:.0f} us/step = {100 * m['hook_fraction_of_step']:.3f} %;"
          f" one progress report's sync scalars {m['report_s_median'] * 1e3:.2f} ms = "
          f"{100 * m['report_fraction_of_step']:.2f} %")
    record = {"numel": opts.numel, "threads": opts.threads, "commit": git_state(),
              "reps": opts.reps, "codec": codec,
              "sync_overhead": sync, "wall_s": time.perf_counter() - began}
    (out / "micro.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(codec, sync, out / "micro.png")
    print(f"wrote {out / 'micro.json'} and {out / 'micro.png'}")


if __name__ == "__main__":
    sys.exit(main())

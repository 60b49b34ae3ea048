"""On a machine with one GPU: where the exchange overlaps training, and a quality run at 34M
parameters (data parallel against two Streaming DiLoCo workers at equal tokens).

    python3 benchmarks/gpu.py timeline --out OUT            # two workers, per-step timings
    python3 benchmarks/gpu.py quality --out OUT --deadline-s 300 --step-s 0.08
    python3 benchmarks/gpu.py report --out OUT              # quality.png from quality.json

``launch/device_check.sh`` runs them in order on the device machine; the corpus is the quality
benchmark's ``code`` corpus (benchmarks/quality.py builds it; ``--data`` names its folder).

* ``timeline``: two workers (one rank each on the one GPU, NCCL inside, gloo across) train
  the 34M model; a step hook synchronises the GPU after every step and records its interval,
  and the transport's exchanges are timed on their thread. Reported: the median step on steps
  that send, that merge and that do neither, and how much of the exchanges' time lies inside
  training steps (overlap).
* ``quality``: data parallel (one rank, global batch B) and the 2 workers (B/2 each, H=30, P=3
  fragments of two layers, tau=1, FP4, outer lr 0.6 with Nesterov 0.9: the DiLoCo
  scaling-law paper's best for M=2) train concurrently for the same number of steps, sized
  from ``--step-s`` (a quiet step of the timeline) to end before ``--deadline-s``.
  ``--variants streaming,plain`` adds the same workers under plain averaging (the shipped
  outer default). Held-out loss on the global parameters every sixth of the run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # seams: the transport's collectives, counted

# 6 x 12 x 672^2 + 2048 x 672 + 512 x 672 = 34.2M parameters (the paper's smallest, 35M).
MODEL = ["--num-layers", "6", "--hidden-size", "672", "--num-attention-heads", "12",
         "--seq-length", "512", "--max-position-embeddings", "512", "--bf16",
         "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--adam-beta2", "0.95", "--weight-decay", "0.1", "--lr-decay-style", "cosine",
         "--seed", "1"]
# --tiny: a CPU rehearsal of the same commands (no bf16 there).
TINY = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--clip-grad", "1.0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-decay-style", "cosine"]
GPU = ["--distributed-backend", "nccl", "--diloco-backend", "gloo"]
STREAMING = ["--diloco-workers", "2", "--diloco-inner-steps", "30", "--diloco-fragments", "3",
             "--diloco-overlap-steps", "1", "--diloco-quantize", "fp4"]
# The outer optimizer of each streaming run: the scaling-law paper's best for M=2 at 35M
# ("streaming"), and plain averaging, the shipped default ("plain").
OUTER = {"streaming": ["--diloco-outer-lr", "0.6", "--diloco-outer-momentum", "0.9"],
         "plain": ["--diloco-outer-lr", "1.0", "--diloco-outer-momentum", "0"]}
LABELS = {"dp": "data parallel (1 rank, batch 64)",
          "streaming": "2 workers x 32, outer lr 0.6, Nesterov 0.9",
          "plain": "2 workers x 32, plain averaging"}
B = 64  # sequences of 512 tokens per step, whole job
LR = 1.5e-3
EVAL_SAMPLES = 256


def model(opts) -> list:
    return TINY if opts.tiny else MODEL


def data_flags(data: Path, cache: Path) -> list:
    return ["--train-data-path", str(data / "train_text_document"),
            "--valid-data-path", str(data / "heldout_text_document"),
            "--test-data-path", str(data / "heldout_text_document"),
            "--tokenizer-model", str(data / "train.model"), "--data-cache-path", str(cache)]


def torchrun(nproc: int, script: str, args: list) -> list:
    if nproc == 1:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", script, *args]


# ---- timeline (each of the two ranks) -----------------------------------------------------
class Timeline:
    """Step hook: the GPU is synchronised at each step's end, so a step runs from the previous
    step's end to its own (forward, backward, optimizer, the sync's hooks); the transport's
    exchanges (on their thread) and the merges' waits for them are timed too, and the
    exchanges' collectives counted."""

    def __init__(self, run):
        import torch

        self.torch = torch
        self.steps, self.exchanges, self.waits = [], [], []
        self.step, self.ended = 0, None
        sync = run.sync
        if getattr(sync, "transport", None) is not None:
            from seams import count_collectives

            count_collectives(sync.transport)
            exchange, arrived = sync.transport._exchange, sync._arrived

            def timed_exchange(*args):
                started = time.perf_counter()
                exchange(*args)
                self.exchanges.append((started, time.perf_counter()))

            def timed_arrived(g):
                started = time.perf_counter()
                try:
                    return arrived(g)
                finally:
                    self.waits.append((self.step, time.perf_counter() - started))

            sync.transport._exchange, sync._arrived = timed_exchange, timed_arrived

    def before_step(self, step: int) -> None:
        self.step = step

    def after_step(self) -> None:
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        now = time.perf_counter()
        if self.ended is not None:
            self.steps.append((self.step, self.ended, now))
        self.ended = now


def timeline_rank(out: Path, argv: list) -> None:
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.run.train import Run

    hooks = []
    with Run(parse_args(argv), [lambda run: hooks.append(Timeline(run)) or hooks[-1]]) as run:
        run.sync.events = []
        run.train()
        run.sync.close()
        worker = run.topology.worker
        sent = run.report.cross_worker_bytes()
        record = {"steps": hooks[0].steps, "exchanges": hooks[0].exchanges,
                  "waits": hooks[0].waits, "events": run.sync.events, "cross_worker_bytes": sent,
                  "collectives": run.sync.transport.collectives}
        (out / f"timeline_w{worker}.json").write_text(json.dumps(record))
    run.topology.cross.job_barrier()  # neither rank leaves while the other still talks to it


def overlap_summary(record: dict, skip: int = 10) -> dict:
    """Median step by kind (after ``skip`` warm-up steps), the exchanges' length in steps,
    and how long merges waited for them."""
    kinds = {}
    for step, kind, _, _ in record["events"]:
        kinds.setdefault(step, set()).add(kind)
    groups = {"send": [], "merge": [], "quiet": []}
    for step, start, end in record["steps"]:
        if step <= skip:
            continue
        k = kinds.get(step, set())
        groups["send" if "send" in k else "merge" if "merge" in k else "quiet"].append(end - start)
    ends = [end for _, _, end in record["steps"]]
    # Steps that ended while an exchange was in flight: training went on meanwhile.
    during = [sum(1 for e in ends if a < e < b) for a, b in record["exchanges"]]
    med = {k: statistics.median(v) if v else None for k, v in groups.items()}
    waits = [w for step, w in record["waits"] if step > skip]
    return {"median_step_s": med, "steps": {k: len(v) for k, v in groups.items()},
            "exchanges": len(record["exchanges"]),
            "exchange_s": [round(b - a, 4) for a, b in record["exchanges"]],
            "steps_ended_during_exchange": during,
            "merge_wait_s_max": max(waits) if waits else None,
            "merge_wait_s_median": statistics.median(waits) if waits else None,
            "cross_worker_bytes": record["cross_worker_bytes"],
            "collectives": record["collectives"]}


def timeline(opts) -> None:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    args = [*model(opts), *GPU, *STREAMING, *data_flags(Path(opts.data), out / "cache"),
            "--global-batch-size", str(B // 2), "--micro-batch-size", str(B // 2),
            "--train-iters", str(opts.steps), "--lr", str(LR), "--lr-warmup-iters", "10",
            "--eval-iters", "0", "--log-interval", "10"]
    cmd = torchrun(2, __file__, ["timeline-rank", "--out", str(out), "--", *args])
    with open(out / "timeline.log", "w") as log:
        done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              timeout=opts.timeout)
    if not (out / "timeline_w0.json").exists():
        raise SystemExit(f"timeline failed ({done.returncode}): see {out / 'timeline.log'}")
    summary = overlap_summary(json.loads((out / "timeline_w0.json").read_text()))
    (out / "timeline.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


# ---- quality ------------------------------------------------------------------------------
def quality(opts) -> None:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    # Concurrent on one GPU: the two runs share it, so a step of each costs about two quiet
    # steps of the timeline (same work per step: B sequences either way).
    budget = opts.deadline_s - opts.startup_s
    steps = max(60, int(budget / (opts.slowdown * opts.step_s)) // 30 * 30)
    interval = max(30, steps // 6 // 30 * 30)
    common = [*model(opts), *GPU, *data_flags(Path(opts.data), out / "cache"), "--train-iters",
              str(steps), "--lr", str(LR), "--min-lr", str(LR / 10), "--lr-warmup-iters",
              str(max(30, steps // 20)), "--eval-interval", str(interval),
              "--log-interval", "10"]
    runs = {"dp": (1, [*common, "--diloco-workers", "1", "--global-batch-size", str(B),
                       "--micro-batch-size", str(B), "--eval-iters", str(EVAL_SAMPLES // B)])}
    for name in opts.variants.split(","):
        runs[name] = (2, [*common, *STREAMING, *OUTER[name], "--global-batch-size", str(B // 2),
                          "--micro-batch-size", str(B // 2),
                          "--eval-iters", str(EVAL_SAMPLES // (B // 2))])
    procs = {}
    for name, (nproc, args) in runs.items():
        log = open(out / f"{name}.log", "w")
        outputs = ["--log-jsonl", str(out / f"{name}.jsonl"),
                   "--summary-json", str(out / f"{name}.summary.json")]
        procs[name] = subprocess.Popen(
            torchrun(nproc, "pretrain_gpt.py", [*args, *outputs]),
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="4"))
    print(f"quality: {steps} steps of {B} x 512 tokens each, eval every {interval}", flush=True)
    while any(p.poll() is None for p in procs.values()):
        if time.time() - began > opts.deadline_s:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()  # SIGTERM: the runs stop after their step (curves so far)
            for p in procs.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            break
        time.sleep(2)
    record = {"steps": steps, "eval_interval": interval, "tokens_per_step": B * 512,
              "args": {k: v[1] for k, v in runs.items()},
              "returncodes": {k: p.returncode for k, p in procs.items()},
              "wall_s": time.time() - began}
    for name in runs:
        path = out / f"{name}.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        record[name] = {
            "held_out": [(x["iteration"], x["valid/loss"]) for x in lines if "valid/loss" in x],
            "train": [(x["iteration"], x["train/loss"]) for x in lines if "train/loss" in x]}
        summary = out / f"{name}.summary.json"
        if summary.exists():
            record[name]["summary"] = json.loads(summary.read_text())
    (out / "quality.json").write_text(json.dumps(record, indent=1))
    print(table(record))


def table(record: dict) -> str:
    dp = dict(record["dp"]["held_out"])
    names = [n for n in OUTER if n in record]
    curves = {n: dict(record[n]["held_out"]) for n in names}
    rows = [" | ".join(["step", "tokens", "data parallel",
                        *(f"{LABELS[n]} | gap" for n in names)])]
    for step in sorted(set(dp).intersection(*curves.values())):
        cells = [f"{curves[n][step]:.4f} | {100 * (curves[n][step] / dp[step] - 1):+.2f} %"
                 for n in names]
        rows.append(" | ".join([str(step), f"{step * record['tokens_per_step'] / 1e6:.1f}M",
                                f"{dp[step]:.4f}", *cells]))
    return "\n".join(rows)


def report(opts) -> None:
    """The held-out curves of ``OUT/quality.json`` as ``OUT/quality.png``, and the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(opts.out)
    record = json.loads((out / "quality.json").read_text())
    tokens = record["tokens_per_step"] / 1e6
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for i, name in enumerate(n for n in LABELS if n in record):
        label = LABELS[name]
        for kind, style in (("held_out", "-o"), ("train", ":")):
            points = record[name][kind]
            if kind == "train":
                points = points[::3]
            ax.plot([s * tokens for s, _ in points], [v for _, v in points], style,
                    label=f"{label}, {'held-out' if kind == 'held_out' else 'train'}",
                    markersize=3, color=f"C{i}")
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("loss")
    ax.set_title("34M GPT on one H200: equal tokens", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=120)
    print(table(record))
    print(f"wrote {out / 'quality.png'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["timeline", "timeline-rank", "quality", "report"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=str(REPO / "runs" / "quality" / "data" / "code"))
    ap.add_argument("--steps", type=int, default=70, help="timeline: steps")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--deadline-s", type=float, default=300, help="quality: wall limit")
    ap.add_argument("--startup-s", type=float, default=60,
                    help="quality: start-up and evaluations, within the deadline")
    ap.add_argument("--step-s", type=float, default=0.1,
                    help="quality: a quiet step of the timeline (sizes the run)")
    ap.add_argument("--slowdown", type=float, default=2.3,
                    help="quality: a step of each concurrent run, in quiet timeline steps")
    ap.add_argument("--variants", default="streaming",
                    help="quality: the streaming runs beside data parallel, comma-separated: "
                    + ", ".join(OUTER))
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU rehearsal)")
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []  # a rank's training flags
    opts = ap.parse_args(argv[:len(argv) - len(rest) - (1 if rest else 0)])
    if opts.mode == "timeline-rank":
        return timeline_rank(Path(opts.out), rest)
    {"timeline": timeline, "quality": quality, "report": report}[opts.mode](opts)


if __name__ == "__main__":
    main()

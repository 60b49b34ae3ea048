"""Data parallel vs DiLoCo vs Streaming DiLoCo vs Streaming + overlap + FP4, equal tokens.

    .venv/bin/python benchmarks/streaming_vs_dp.py [--iters 300] [--out runs/bench]

Two workers (one rank each) train a small GPT on ../shared/data/tinyshakespeare.txt; the data
parallel baseline is one worker of two data-parallel ranks with the same global batch, so every
method sees the same samples. Cross-worker bytes: the transport's own count for the DiLoCo
variants; for data parallel, the ring all-reduce volume of its fp32 gradients (2(N-1)/N x 4
bytes x parameters per rank per step, N = 2). Also reports the step time of steps on which no
fragment is sent or merged, with the sync on vs off, as a ratio from one machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "128", "--micro-batch-size", "8", "--lr", "2e-3", "--min-lr", "2e-4",
         "--lr-warmup-iters", "20", "--clip-grad", "1.0", "--eval-iters", "8",
         "--log-interval", "1"]
H = 30
METHODS = {
    "data parallel": ["--diloco-workers", "1", "--global-batch-size", "16"],
    "DiLoCo": ["--diloco-workers", "2", "--diloco-inner-steps", str(H),
               "--diloco-fragments", "1", "--diloco-quantize", "none"],
    "Streaming DiLoCo": ["--diloco-workers", "2", "--diloco-inner-steps", str(H),
                         "--diloco-fragments", "2", "--diloco-quantize", "none"],
    "Streaming + overlap + FP4": ["--diloco-workers", "2", "--diloco-inner-steps", str(H),
                                  "--diloco-fragments", "2", "--diloco-overlap-steps", "1",
                                  "--diloco-quantize", "fp4"],
    "no sync (reference for step time)": ["--diloco-workers", "2", "--no-diloco-sync"],
}


def dataset(out: Path) -> list:
    prefix = out / "tinyshakespeare"
    if not Path(f"{prefix}.idx").exists():
        subprocess.run([sys.executable, "-m", "megatron_streaming.data", "--input",
                        str(REPO.parent / "shared" / "data" / "tinyshakespeare.txt"),
                        "--output-prefix", str(prefix), "--vocab-size", "1024"],
                       cwd=REPO, check=True)
    return ["--data-path", str(prefix), "--tokenizer-model", f"{prefix}.model",
            "--split", "95,5,0"]


def launch(name: str, args: list, out: Path, iters: int) -> dict:
    tag = name.split(" (")[0].replace(" ", "_").replace("+", "plus")
    summary, log = out / f"{tag}.json", out / f"{tag}.jsonl"
    if log.exists():
        log.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "pretrain_gpt.py", *MODEL, *args, "--train-iters", str(iters),
           "--summary-json", str(summary), "--log-jsonl", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    result = json.loads(summary.read_text())
    result["steps"] = [json.loads(line) for line in log.read_text().splitlines()]
    return result


def quiet_step_seconds(result: dict, args: list) -> float:
    """Median step time over steps on which this rank neither sends nor merges."""
    from megatron_streaming.arguments import parse_args
    from megatron_streaming.streaming.builder import sync_schedule

    cfg = parse_args(["--mock-data", *MODEL, *args])
    schedule = sync_schedule(cfg)
    times = [r["train/step_seconds"] for r in result["steps"] if "train/step_seconds" in r
             and r["iteration"] > 5 and not schedule.sends_after(r["iteration"])
             and not schedule.merges_after(r["iteration"])]
    return statistics.median(times)


def main():
    from megatron_streaming.traffic import ring_all_reduce_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    data = dataset(out)
    results = {name: launch(name, [*data, *args], out, opts.iters)
               for name, args in METHODS.items()}
    dp = results["data parallel"]
    params = dp["parameters"]
    dp_bytes = opts.iters * ring_all_reduce_bytes(params, ranks=2)
    print(f"{opts.iters} iterations, {dp['tokens']:,} tokens per method, {params:,} parameters")
    print(f"{'method':34} {'valid loss':>10} {'cross-worker bytes':>20} {'vs DP':>8}")
    for name, r in results.items():
        if name.startswith("no sync"):
            continue
        sent = dp_bytes if name == "data parallel" else r["cross_worker_bytes"]
        print(f"{name:34} {r['valid_loss']:>10.4f} {sent:>20,.0f} {dp_bytes / sent:>7.0f}x")
    on = quiet_step_seconds(results["Streaming + overlap + FP4"],
                            METHODS["Streaming + overlap + FP4"])
    off = quiet_step_seconds(results["no sync (reference for step time)"], [])
    print(f"median step time on steps without a send or merge: sync on {on * 1e3:.1f} ms, "
          f"off {off * 1e3:.1f} ms, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()

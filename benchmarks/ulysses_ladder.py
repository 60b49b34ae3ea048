"""Step time of standard vs Ladder-residual blocks at TP=2, and tokens/s of Ulysses SP=1 vs
SP=2 at a long sequence, each pair measured in one invocation on this machine.

    .venv/bin/python benchmarks/ulysses_ladder.py [--iters 30]

Ratios, not absolute speeds, are the point: on 2 CPU cores with gloo, the TP all-reduce that
Ladder hides is a shared-memory copy, so little is there to hide; the same command on GPUs
with NCCL measures the real effect.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LADDER_MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "256",
                "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "4",
                "--tensor-model-parallel-size", "2", "--eval-iters", "0", "--hidden-dropout",
                "0", "--attention-dropout", "0"]
LONG_SEQUENCE = ["--mock-data", "--num-layers", "2", "--hidden-size", "128",
                 "--num-attention-heads", "8", "--seq-length", "4096", "--micro-batch-size", "1",
                 "--max-position-embeddings", "4096", "--eval-iters", "0", "--hidden-dropout",
                 "0", "--attention-dropout", "0"]


def run(nproc: int, args: list, summary: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "pretrain_gpt.py", *args, "--summary-json", str(summary)]
    subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True,
                   capture_output=True)
    return json.loads(summary.read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=str(REPO / "runs" / "bench_layers"))
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    iters = ["--train-iters", str(opts.iters)]
    standard = run(2, [*LADDER_MODEL, *iters], out / "standard.json")
    ladder = run(2, [*LADDER_MODEL, *iters, "--ladder-residual"], out / "ladder.json")
    s, l = standard["seconds_per_iteration"], ladder["seconds_per_iteration"]
    print(f"TP=2, 4 layers, hidden 256, seq 256: standard {s * 1e3:.1f} ms/step, ladder "
          f"{l * 1e3:.1f} ms/step, ladder speed-up {s / l:.3f}x")
    sp1 = run(1, [*LONG_SEQUENCE, *iters], out / "sp1.json")
    sp2 = run(2, [*LONG_SEQUENCE, *iters, "--ds-sequence-parallel-size", "2"], out / "sp2.json")
    for name, r in (("SP=1 (1 rank)", sp1), ("SP=2 (2 ranks)", sp2)):
        tokens_per_s = 4096 / r["seconds_per_iteration"]
        print(f"seq 4096, {name}: {tokens_per_s:,.0f} tokens/s, "
              f"{r['seconds_per_iteration'] * 1e3:.0f} ms/step, peak RSS per rank "
              f"{r['peak_rss_mib_per_rank']} MiB")


if __name__ == "__main__":
    main()

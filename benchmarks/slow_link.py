"""Step time over an emulated slow link: data parallel vs Streaming DiLoCo, as a ratio.

    sudo .venv/bin/python benchmarks/slow_link.py [--rate 50mbit] [--iters 60]

Needs root (network namespaces and tc, see launch/slow_link.sh). Two "clusters" of one rank
each are joined by a rate-limited veth pair. Data parallel all-reduces its fp32 gradients
across the link every step; Streaming DiLoCo (2 fragments, H=30, FP4, tau=1) sends one
fragment's 4-bit outer gradient every 15 steps, overlapped with the next step. Reports the
mean step time (after the first step) of each, measured in the same run.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads",
         "4", "--seq-length", "128", "--micro-batch-size", "8", "--eval-iters", "0",
         "--log-interval", "10"]
METHODS = {
    "data parallel": ["--diloco-workers", "1", "--global-batch-size", "16"],
    "Streaming DiLoCo + overlap + FP4": [
        "--diloco-workers", "2", "--diloco-inner-steps", "30", "--diloco-fragments", "2",
        "--diloco-overlap-steps", "1", "--diloco-quantize", "fp4"],
}


def run_two_nodes(args, summary: Path) -> dict:
    script = str(REPO / "launch" / "slow_link.sh")
    peer = subprocess.Popen([script, "run", "1", "2", "1", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([script, "run", "0", "2", "1", *args, "--summary-json", str(summary)],
                   cwd=REPO, check=True, capture_output=True)
    peer.wait(timeout=120)
    return json.loads(summary.read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="50mbit")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--out", default=str(REPO / "runs" / "slow_link"))
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(REPO / "launch" / "slow_link.sh"), "up", opts.rate], check=True)
    try:
        results = {}
        for i, (name, args) in enumerate(METHODS.items()):
            results[name] = run_two_nodes([*MODEL, *args, "--train-iters", str(opts.iters)],
                                          out / f"summary{i}.json")
    finally:
        subprocess.run([str(REPO / "launch" / "slow_link.sh"), "down"], check=False)
    dp = results["data parallel"]["seconds_per_iteration"]
    params = results["data parallel"]["parameters"]
    # Data parallel's traffic is its gradient all-reduce (ring, fp32, 2 ranks), not counted
    # by the streaming transport: 2 (N-1)/N x 4 bytes x parameters per rank per step.
    dp_bytes = opts.iters * 2 * (2 * (2 - 1) / 2) * 4 * params
    print(f"link {opts.rate}, {opts.iters} iterations, {params:,} parameters")
    for name, r in results.items():
        sent = dp_bytes if name == "data parallel" else r["cross_worker_bytes"]
        print(f"{name:34} {r['seconds_per_iteration'] * 1e3:9.1f} ms/step  "
              f"{dp / r['seconds_per_iteration']:6.2f}x faster  cross-worker bytes {sent:,.0f}")


if __name__ == "__main__":
    sys.exit(main())

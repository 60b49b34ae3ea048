"""Both directions of a rate-limited link at once: gloo's all-to-all and all-gather against
the transport's chunked point-to-point exchange (``streaming.transport._swap``).

    sudo .venv/bin/python benchmarks/wire_directions.py [--rates 10,100] [--rtt 0] \
        [--megabytes 2.5] [--repeats 6] [--out runs/wire_directions]

Two processes, one per network namespace of ``launch/slow_link.sh`` (a veth pair with a
``tc tbf`` rate limit per direction), one gloo group between them. Each sends ``--megabytes``
to the other at the same time, four ways, interleaved (ABCD, then DCBA): gloo's
``all_to_all_single`` and ``all_gather``, and the transport's ``_all_to_all`` and
``_all_gather`` (the same bytes as tagged messages of at most ``WIRE_CHUNK``, all in flight).
Reported: the median share of the link rate each direction reached (bytes over the time,
over the tc rate). Writes ``wire_directions.json`` under ``--out``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = str(REPO / "launch" / "slow_link.sh")
PORT = 29617

CHILD = r'''
import json, sys, time, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from megatron_streaming.streaming import transport
rank, nbytes, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=sys.argv[5], rank=rank, world_size=2)
x = torch.zeros(2 * nbytes, dtype=torch.uint8)
y = x[:nbytes].clone()
post = transport.Poster(None)
ways = {
    "gloo all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
    "transport all-to-all (chunked)": lambda: transport._all_to_all(x, post),
    "gloo all_gather": lambda: dist.all_gather([torch.empty_like(y), torch.empty_like(y)], y),
    "transport all-gather (chunked)": lambda: transport._all_gather(y, post, 2),
}
def seconds(fn):
    dist.barrier(); t = time.perf_counter(); fn(); return time.perf_counter() - t
seconds(ways["gloo all_to_all_single"])  # the connection's first burst, untimed
out = {k: [] for k in ways}
for i in range(repeats):
    for k in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
        out[k].append(seconds(ways[k]))
if rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
'''


def run(rate_mbit: float, rtt_ms: float, nbytes: int, repeats: int) -> dict:
    subprocess.run([LINK, "up", f"{rate_mbit:g}mbit", f"{rtt_ms:g}"], check=True,
                   capture_output=True)
    try:
        init = f"tcp://10.213.77.1:{PORT}"
        procs = [subprocess.Popen([LINK, "exec", str(w), sys.executable, "-c", CHILD, str(w),
                                   str(nbytes), str(repeats), str(REPO), init],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for w in (1, 0)]
        outs = [p.communicate(timeout=1800) for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("\n".join(err[-2000:] for _, err in outs))
        times = json.loads(outs[1][0].strip().splitlines()[-1])
    finally:
        subprocess.run([LINK, "down"], capture_output=True)
    rate = rate_mbit * 1e6 / 8
    return {k: {"seconds": v, "share_of_rate": [nbytes / rate / t for t in v],
                "median_share": statistics.median(nbytes / rate / t for t in v)}
            for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="10,100", help="Mbit/s, comma-separated")
    ap.add_argument("--rtt", type=float, default=0.0, help="round trip in ms")
    ap.add_argument("--megabytes", type=float, default=2.5, help="each way, per transfer")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=str(REPO / "runs" / "wire_directions"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces and tc)")
    started, results = time.perf_counter(), {}
    for rate in (float(r) for r in args.rates.split(",")):
        # the same duration at every rate: the bytes scale with it
        nbytes = int(args.megabytes * 1e6 * rate / 10)
        results[f"{rate:g}"] = run(rate, args.rtt, nbytes, args.repeats)
        for way, r in results[f"{rate:g}"].items():
            print(f"{rate:g} Mbit/s, {args.rtt:g} ms, {nbytes / 1e6:g} MB each way: {way:32s} "
                  f"median {r['median_share']:.0%} of the rate each way (" +
                  " ".join(f"{x:.0%}" for x in r["share_of_rate"]) + ")", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "wire_directions.json"), "w") as f:
        json.dump({"rtt_ms": args.rtt, "megabytes_at_10mbit": args.megabytes,
                   "repeats": args.repeats, "results": results,
                   "seconds": time.perf_counter() - started}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

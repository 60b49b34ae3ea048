"""Elastic workers: how long a loss and a rejoin take, and what a rejoin sends, by model size.

    .venv/bin/python benchmarks/elastic.py [--sizes 128,512,1024] [--out runs/elastic]

Per model size: three workers of one rank each (one launch per worker, the multi-cluster form,
on this machine's loopback, CPU, gloo), ``--diloco-min-workers 2``. Worker 0 is paced (a
fixed sleep per step) so that the job runs long enough. Once training runs, worker 1's rank
is killed with SIGKILL (no warning, mid-step); it is relaunched with the same command as soon
as the others have gone on. The times come from the log lines as they appear (polled every
50 ms):

* detected: kill -> the first survivor rank logs a failed cross-worker collective;
* recovered: kill -> the survivors log the new membership epoch (the heartbeat survey, the
  membership record, the new groups);
* start-up: relaunch -> the restarted worker asks to rejoin (process start, imports, model);
* admitted: its request -> it logs that it rejoined (the leader's heartbeat, the stop flag's
  lag, the merge of the exchanges in flight, the new groups, the state it receives).

Then a SIGTERM to worker 0 stops every worker after the same step. Bytes of a rejoin: what
the newcomer receives, theta_g and the outer momentum in fp32 (8
bytes per parameter of its shard), from the lowest live worker. Written to OUT/elastic.json
and printed as a table.
"""

import argparse
import json
import os
import re
import signal
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from harness import free_port, start  # noqa: E402

FAULTS = "tests/pretrain_with_faults.py"


def flags(hidden: int, port: int, train_iters: int):
    return ["--mock-data", "--vocab-size", "1024", "--num-layers", "4", "--hidden-size",
            str(hidden), "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters",
            str(train_iters), "--eval-iters", "0", "--log-interval", "1",
            "--diloco-workers", "3", "--diloco-min-workers", "2", "--diloco-inner-steps", "10",
            "--diloco-fragments", "2", "--diloco-overlap-steps", "1", "--diloco-timeout",
            "60", "--master-addr", "127.0.0.1", "--master-port", str(port)]


def when(path, pattern: str, proc, timeout: float = 300.0) -> float:
    """The time the first line matching ``pattern`` appears in ``path``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if re.search(pattern, f.read(), re.M):
                return time.monotonic()
        if proc.poll() is not None:
            raise RuntimeError(f"{path}: ended ({proc.returncode}) before /{pattern}/")
        time.sleep(0.05)
    raise TimeoutError(f"{path}: no /{pattern}/ within {timeout} s")


def measure(hidden: int, out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    port = free_port()
    args = flags(hidden, port, 2000)  # ended by a SIGTERM once the rejoin is measured
    logs = {w: os.path.join(out, f"h{hidden}_w{w}.log") for w in range(3)}
    paced = {"MEGATRON_STREAMING_SLOW_WORKER": "0:0.15"}
    summary = os.path.join(out, f"h{hidden}_summary.json")
    procs = {w: start(1, [*args, "--diloco-worker-index", str(w)] +
                      (["--summary-json", summary] if w == 0 else []), logs[w],
                      paced if w == 0 else None, FAULTS) for w in range(3)}
    try:
        when(logs[0], r"iteration +20/", procs[0])
        killed = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)  # one rank, no launcher: the whole worker
        detected = min(when(logs[w], r"^rank \d+: \S", procs[w])
                       for w in (0, 2))
        recovered = when(logs[0], r"membership epoch 1: workers \[0, 2\]", procs[0])
        procs[1].wait(timeout=60)
        logs[1] = os.path.join(out, f"h{hidden}_w1_again.log")
        relaunched = time.monotonic()
        procs[1] = start(1, [*args, "--diloco-worker-index", "1"], logs[1], None, FAULTS)
        asked = when(logs[1], r"asks to rejoin", procs[1])
        admitted = when(logs[1], r"rejoined after step", procs[1])
        text = open(logs[1]).read()
        procs[0].send_signal(signal.SIGTERM)  # every worker stops after the same step
        codes = [p.wait(timeout=300) for p in procs.values()]
        params = json.load(open(summary))["parameters"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                for c in psutil.Process(p.pid).children(recursive=True):
                    c.kill()
                p.kill()
    step = int(re.search(r"rejoined after step (\d+)", text).group(1))
    return {"hidden": hidden, "parameters": params, "detected_s": detected - killed,
            "recovered_s": recovered - killed, "startup_s": asked - relaunched,
            "admitted_s": admitted - asked, "rejoined_after_step": step, "exit_codes": codes,
            "rejoin_bytes": 8 * params if params else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="128,512,1024")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "elastic"))
    opts = ap.parse_args()
    rows = []
    for h in opts.sizes.split(","):
        rows.append(measure(int(h), opts.out))
        print(rows[-1], flush=True)
        with open(os.path.join(opts.out, "elastic.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("| hidden | parameters | detected (s) | recovered (s) | restart to request (s) | "
          "request to rejoined (s) | rejoin bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hidden']} | {r['parameters'] or '?':,} | {r['detected_s']:.2f} | "
              f"{r['recovered_s']:.2f} | {r['startup_s']:.1f} | {r['admitted_s']:.2f} | "
              f"{r['rejoin_bytes'] or 0:,} |")


if __name__ == "__main__":
    main()

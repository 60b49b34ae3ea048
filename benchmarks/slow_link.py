"""Compute utilisation over an emulated slow link, per method and link rate (paper Figure 4).

    sudo .venv/bin/python benchmarks/slow_link.py --lock /tmp/bench.lock
    sudo .venv/bin/python benchmarks/slow_link.py --rates 10,100 --out /tmp/sl   # a subset
    sudo .venv/bin/python benchmarks/slow_link.py --rates 10,30,100 --rtts 0,50,100  # latency

Needs root (network namespaces and tc, see launch/slow_link.sh). Two "clusters" of one rank
each, in two network namespaces joined by a veth pair rate-limited with ``tc tbf`` (with
``--rtts``, through a router namespace that delays every packet in user space); each
worker is its own launch inside its namespace (``--diloco-worker-index W --master-addr
--master-port``), so only cross-worker traffic crosses the limited link. Per rate, the
methods run back to back:

* ceiling: two workers with ``--no-diloco-sync`` (compute only; only the 8-byte per-step stop
  flag and the rendezvous store's heartbeats cross the link);
* data parallel: one worker of two ZeRO data-parallel ranks, one rank per namespace
  (RANK/WORLD_SIZE from the environment), so its fp32 gradient traffic crosses every step;
* DiLoCo: one fragment, blocking (tau = 0), fp32 outer gradients (as in the paper's Fig. 4);
* Streaming DiLoCo + overlap + FP4: P fragments, tau = 1, FP4 E3M0, with the default
  ``--diloco-control-lag 1`` and again with ``--diloco-control-lag 4``; by ``--methods``,
  tau = 3, or eager outer updates (an exchange may take a whole round of H steps).

Step time is wall clock on worker 0 between progress reports (tokens over
``train/tokens_per_s``: it includes the stop-flag wait, which ``train/step_seconds`` does
not), averaged over a window after warm-up that spans exactly two rounds of H steps, so every
fragment's exchange (and DiLoCo's sync) is counted twice, and ends one report before the last
step (which waits for every exchange still in flight, a once-per-run cost); data parallel, whose steps are
all alike and seconds long at low rates, over 6 steps. Utilisation = ceiling step
time / method step time, both measured at the same rate in the same sweep. Each run also
records the bytes both veth ends sent. Writes ``slow_link.json`` and ``slow_link.png``
(utilisation against link rate, log x) under ``--out``; ``--plot-only`` redraws one.
Namespaces are removed before each rate lets the lock go, also on an error, SIGINT or
SIGTERM.
"""

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = str(REPO / "launch" / "slow_link.sh")
MASTER_ADDR = "10.213.77.1"  # worker 0's end of the veth pair (launch/slow_link.sh)
NAMESPACE_PREFIX = "ms-cluster"
PYTHON = str(REPO / ".venv" / "bin" / "python")

# 842k parameters, ~125 ms per step per rank on this 2-core machine when it is quiet.
MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads",
         "4", "--seq-length", "128", "--micro-batch-size", "8", "--eval-iters", "0",
         "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--adam-beta2", "0.95"]
H, P, TAU = 40, 4, 1  # one fragment (one layer) every H/P = 10 steps, merged 1 step later
STREAMING = ["--diloco-workers", "2", "--diloco-inner-steps", str(H), "--diloco-fragments",
             str(P), "--diloco-overlap-steps", str(TAU), "--diloco-quantize", "fp4"]


class Method:
    """How to launch one method and which steps to time: ``measured`` steps after ``warmup``,
    reported every ``log_interval`` steps (a multiple of it: the window is whole reports)."""

    def __init__(self, kind, flags, warmup=10, measured=2 * H, log_interval=10):
        self.kind, self.flags = kind, flags
        self.warmup, self.measured, self.log_interval = warmup, measured, log_interval


# Progress reports every 10 steps for the sync methods: each one computes the sync's drift
# norms over the whole shard (a few % of a step here, see benchmarks/micro.py), a cost the
# ceiling does not pay; a real run reports every 10-100 steps, not every step.
METHODS = {
    "ceiling (no cross-worker sync)": Method("workers", ["--diloco-workers", "2",
                                                          "--no-diloco-sync"]),
    "Streaming DiLoCo + overlap + FP4": Method("workers", STREAMING),
    "Streaming DiLoCo + overlap + FP4, control lag 4": Method(
        "workers", [*STREAMING, "--diloco-control-lag", "4"]),
    "DiLoCo (blocking, fp32)": Method("workers", [
        "--diloco-workers", "2", "--diloco-inner-steps", str(H), "--diloco-fragments", "1",
        "--diloco-overlap-steps", "0", "--diloco-quantize", "none"]),
    # Every step alike (and seconds long at low rates): a short window suffices.
    "data parallel": Method("data_parallel", ["--diloco-workers", "1",
                                              "--global-batch-size", "16"],
                            warmup=2, measured=6, log_interval=1),
    # Not in the default sweep (--methods 5,6): a longer overlap for a slower link. The stop
    # flag posted after a send queues behind the fragment in tbf's FIFO: do steps stall on
    # it when the lag is shorter than tau? (Not measurably at 3 Mbit/s, see
    # docs/results/slow_link.md.)
    "Streaming DiLoCo + overlap 3 + FP4": Method("workers", [
        *STREAMING[:-4], "--diloco-overlap-steps", "3", "--diloco-quantize", "fp4"]),
    "Streaming DiLoCo + overlap 3 + FP4, control lag 4": Method("workers", [
        *STREAMING[:-4], "--diloco-overlap-steps", "3", "--diloco-quantize", "fp4",
        "--diloco-control-lag", "4"]),
    # With lag 1 every step waits for the other worker's flag of the step before, so the
    # workers also wait for each other's slow steps; the ceiling under the same lag as method 2.
    "ceiling, control lag 4": Method("workers", ["--diloco-workers", "2", "--no-diloco-sync",
                                                 "--diloco-control-lag", "4"]),
    # Eager outer updates: each exchange has a whole round (H steps) instead of tau.
    "Streaming DiLoCo + eager + FP4, control lag 4": Method("workers", [
        *STREAMING[:-4], "--diloco-overlap-steps", "0", "--diloco-eager",
        "--diloco-quantize", "fp4", "--diloco-control-lag", "4"]),
    # The per-step stop flag queues behind a fragment's bytes in the link's FIFO: on a link
    # where one exchange outlasts 4 steps, a lag of H/P steps keeps it off the critical path.
    "Streaming DiLoCo + eager + FP4, control lag 10": Method("workers", [
        *STREAMING[:-4], "--diloco-overlap-steps", "0", "--diloco-eager",
        "--diloco-quantize", "fp4", "--diloco-control-lag", str(H // P)]),
    # The sparse exchange (--methods 10; issue 58): the same schedule as method 2, 64 of every
    # 4,096 entries at 2 bits in one all-gather, about 1/18 of FP4's bytes.
    "Streaming DiLoCo + overlap + sparse (64 of 4,096, 2-bit)": Method("workers", [
        *STREAMING[:-2], "--diloco-quantize", "sparse"]),
}
DEFAULT_METHODS = "1,2,3,4"
CEILING = "ceiling (no cross-worker sync)"
RUN_TIMEOUT = 300  # seconds per run; a hung run fails the sweep (and tears down)


class Terminated(Exception):
    pass


def _on_signal(signum, frame):
    raise Terminated(signal.Signals(signum).name)


def link(*args, check=True):
    return subprocess.run([LINK, *map(str, args)], cwd=REPO, check=check,
                          capture_output=True, text=True)


def namespaces() -> list:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(NAMESPACE_PREFIX)]


@contextmanager
def bench_lock(path):
    """Holds ``path`` (flock) for one rate's runs, so other benchmarks take turns."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Children:
    """The processes of the current run; each in its own session, killed as a group."""

    def __init__(self):
        self.procs = []

    def start(self, cmd, env, log_path):
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def kill_all(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        self.procs = []


def _probe(port: int, server: str, client: str) -> tuple:
    """(what ``server`` printed, what ``client`` printed): ``server`` runs in namespace 0 on
    one accepted connection ``c``, ``client`` in namespace 1 on its connection ``c`` to it."""
    accept = ("import socket,threading,time\n"
              "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
              f"s.bind(('{MASTER_ADDR}',{port}));s.listen(1);c,_=s.accept()\n")
    connect = ("import socket,threading,time\n"
               "for i in range(100):\n"
               f" try: c=socket.create_connection(('{MASTER_ADDR}',{port}));break\n"
               " except OSError: time.sleep(0.1)\n")
    proc = subprocess.Popen([LINK, "exec", "0", PYTHON, "-c", accept + server], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        there = link("exec", "1", PYTHON, "-c", connect + client).stdout
        here, _ = proc.communicate(timeout=60)
        return here, there
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure_link(rate_mbit: float, seconds: float = 1.5) -> float:
    """Mbit/s of one TCP stream from namespace 1 to namespace 0 (a check of tbf's rate)."""
    nbytes = int(rate_mbit * 1e6 / 8 * seconds)
    here, _ = _probe(29400, "n=0;t=None\n"
                     f"while n<{nbytes}:\n b=c.recv(1<<20)\n if not b: break\n"
                     " t=t or time.perf_counter();n+=len(b)\n"
                     "print(n*8/(time.perf_counter()-t)/1e6)",
                     f"c.sendall(bytes({nbytes}));c.close()")
    return float(here.strip())


def measure_link_both_ways(rate_mbit: float, seconds: float = 1.5) -> float:
    """Mbit/s each way (the mean of the two) with one TCP stream each way at once: what an
    exchange, which sends the same bytes both ways, gets of the link (``iperf3 --bidir``)."""
    nbytes = int(rate_mbit * 1e6 / 8 * seconds)
    # each end sends n bytes while reading the peer's n, and prints the Mbit/s it read
    both = ("t=threading.Thread(target=c.sendall,args=(bytes(n),));t.start();got=0;t0=None\n"
            "while got<n:\n b=c.recv(1<<20)\n if not b: break\n"
            " t0=t0 or time.perf_counter();got+=len(b)\n"
            "print(got*8/(time.perf_counter()-t0)/1e6,flush=True);t.join()\n")
    here, there = _probe(29402, f"n={nbytes}\n" + both, f"n={nbytes}\n" + both)
    return (float(here.strip()) + float(there.strip())) / 2


def measure_rtt(probes: int = 10) -> float:
    """Median round trip (ms) of a 1-byte TCP echo from namespace 1 to namespace 0."""
    _, there = _probe(29401, "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
                      "while True:\n b=c.recv(1)\n if not b: break\n c.sendall(b)",
                      "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1);r=[]\n"
                      f"for i in range({probes}):\n"
                      " t=time.perf_counter();c.sendall(b'x');c.recv(1)\n"
                      " r.append(1e3*(time.perf_counter()-t))\n"
                      "print(sorted(r)[len(r)//2])")
    return float(there.strip())


def report_intervals(jsonl: Path) -> list:
    """(iteration, steps, wall seconds) per progress report of worker 0, since the previous
    report: tokens over tokens/s, so everything between reports counts."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows = [r for r in rows if "train/tokens_per_s" in r]
    out, tokens, iteration = [], 0, 0
    for r in rows:
        out.append((r["iteration"], r["iteration"] - iteration,
                    (r["train/tokens"] - tokens) / r["train/tokens_per_s"]))
        tokens, iteration = r["train/tokens"], r["iteration"]
    return out


def link_bytes() -> int:
    """Bytes both ends of the veth pair have sent so far (frames, headers included): what
    really crossed the limited link, whoever sent it."""
    total = 0
    for w in (0, 1):
        total += int(link("exec", w, "cat", f"/sys/class/net/ms-veth{w}/statistics/tx_bytes")
                     .stdout)
    return total


def run_method(children, method: Method, port, out: Path, tag: str) -> dict:
    jsonl, summary = out / f"{tag}.jsonl", out / f"{tag}.summary.json"
    for f in (jsonl, summary):
        if f.exists():
            f.unlink()
    m = method
    common = [PYTHON, str(REPO / "pretrain_gpt.py"), *MODEL, *m.flags,
              # One report interval past the window: the last step drains the exchanges
              # still in flight (for eager, every fragment's), an end-of-run cost the steady
              # state does not pay.
              "--train-iters", str(m.warmup + m.measured + m.log_interval),
              "--log-interval", str(m.log_interval)]
    procs, sent_before = [], link_bytes()
    for w in (1, 0):  # worker 0 last: it hosts the rendezvous store, the peer waits for it
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [LINK, "exec", str(w), *common]
        if m.kind == "workers":
            cmd += ["--diloco-worker-index", str(w), "--master-addr", MASTER_ADDR,
                    "--master-port", str(port)]
        else:  # one data-parallel rank per namespace, placed by the environment
            env.update(RANK=str(w), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=MASTER_ADDR,
                       MASTER_PORT=str(port))
        if w == 0:
            cmd += ["--log-jsonl", str(jsonl), "--summary-json", str(summary)]
        procs.append(children.start(cmd, env, out / f"{tag}.worker{w}.log"))
    started = time.perf_counter()
    for proc in procs:
        remaining = RUN_TIMEOUT - (time.perf_counter() - started)
        try:
            code = proc.wait(timeout=max(remaining, 1))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{tag}: no result within {RUN_TIMEOUT} s; see {out}/{tag}.*.log")
        if code:
            raise RuntimeError(f"{tag}: a worker exited with {code}; see {out}/{tag}.*.log")
    children.procs = []
    on_link = link_bytes() - sent_before
    reports = report_intervals(jsonl)
    window = [(n, s) for i, n, s in reports if m.warmup < i <= m.warmup + m.measured]
    steps = sum(n for n, _ in window)
    if steps != m.measured:
        raise RuntimeError(f"{tag}: reports cover {steps} of the {m.measured} measured steps")
    result = json.loads(summary.read_text())
    return {"ms_per_step": 1e3 * sum(s for _, s in window) / steps, "steps_measured": steps,
            "ms_per_step_by_report": [(i, round(1e3 * s / n, 2)) for i, n, s in reports],
            "cross_worker_bytes": result["cross_worker_bytes"],
            "cross_worker_control_bytes": result.get("cross_worker_control_bytes"),
            # The whole run (set-up and rendezvous included) over its training steps.
            "link_bytes": on_link, "link_bytes_per_step": on_link / result["iteration"],
            "parameters": result["parameters"], "run_wall_s": time.perf_counter() - started}


def measure_rate(rate, rtt, methods, out: Path, children, port: int) -> dict:
    """Every method at one link rate and round trip; the ceiling runs first and again last,
    and the point's ceiling is their mean, so a drift of the shared machine's speed during the
    point cancels."""
    link("up", f"{rate}mbit", rtt)
    measured, measured_rtt = measure_link(rate), measure_rtt()
    both_ways = measure_link_both_ways(rate)
    print(f"link {rate} Mbit/s, RTT {rtt} ms: measured {measured:.1f} Mbit/s ({both_ways:.1f} "
          f"each way with both busy), RTT {measured_rtt:.1f} ms", flush=True)
    point, ceilings = {"measured_mbit": measured, "measured_mbit_both_ways": both_ways,
                       "rtt_ms": rtt, "measured_rtt_ms": measured_rtt, "methods": {}}, []
    for i, name in enumerate([*methods, CEILING]):
        tag = f"{rate}mbit_{rtt}ms_{name.split(' (')[0].replace(' ', '_').replace('+', 'p')}"
        tag = tag.replace(",", "") + ("_repeat" if i == len(methods) else "")
        r = run_method(children, METHODS[name], port + i, out, tag)
        print(f"  {name:50} {r['ms_per_step']:9.1f} ms/step ({r['steps_measured']} steps, "
              f"run {r['run_wall_s']:.0f} s, {r['link_bytes_per_step'] / 1e3:.0f} kB/step "
              "on the link)", flush=True)
        if name == CEILING:
            ceilings.append(r["ms_per_step"])
            r["ms_per_step"] = sum(ceilings) / len(ceilings)
        point["methods"][name] = r
    ceiling = point["methods"][CEILING]["ms_per_step"]
    for r in point["methods"].values():
        r["utilisation"] = ceiling / r["ms_per_step"]
    point["ceiling_runs_ms"] = [round(c, 2) for c in ceilings]
    return point


def sweep(rates, rtts, methods, out: Path, lock) -> dict:
    """{RTT ms: {rate: point}}."""
    children = Children()
    results, k = {}, 0
    for rtt in rtts:
        for rate in rates:
            with bench_lock(lock):
                # Torn down before the lock is let go: another sweep may build them next.
                try:
                    results.setdefault(str(rtt), {})[str(rate)] = measure_rate(
                        rate, rtt, methods, out, children, 29610 + 10 * k)
                finally:
                    children.kill_all()
                    link("down", check=False)
            k += 1
    return results


def plot(by_rtt: dict, path: Path) -> None:
    """One panel per round trip: utilisation against link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rtts = sorted(by_rtt, key=float)
    fig, axes = plt.subplots(1, len(rtts), figsize=(6.4 * len(rtts), 5.0), squeeze=False)
    for ax, rtt in zip(axes[0], rtts):
        _plot_panel(ax, by_rtt[rtt], f"RTT {rtt} ms" if len(rtts) > 1 else "")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_panel(ax, results: dict, label: str) -> None:
    rates = sorted(results, key=float)
    x = [float(r) for r in rates]
    # The two ceiling runs of each rate, relative to their mean: the run-to-run noise.
    spread = [[100 * c / results[r]["methods"][CEILING]["ms_per_step"]
               for c in results[r]["ceiling_runs_ms"]] for r in rates]
    ax.fill_between(x, [min(s) for s in spread], [max(s) for s in spread], color="grey",
                    alpha=0.25, label="ceiling runs (run-to-run spread)")
    names = [n for n in results[rates[0]]["methods"] if n != CEILING]
    for name in names:
        ax.plot([float(r) for r in rates],
                [100 * results[r]["methods"][name]["utilisation"] for r in rates],
                marker="o", label=name, linestyle="--" if "lag 4" in name else "-")
    ax.axhline(95, color="grey", linewidth=0.8, linestyle=":")
    ax.axhline(50, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_xticks([float(r) for r in rates], [str(r) for r in rates])
    top = max(100 * p["methods"][n]["utilisation"] for p in results.values() for n in names)
    ax.set_ylim(0, max(105, top + 5))
    ax.set_xlabel("link rate (Mbit/s, tc tbf)")
    ax.set_ylabel("compute utilisation (%)")
    ax.set_title("2 workers x 1 rank, 842k-param GPT, CPU + gloo" + (f", {label}" if label
                                                                    else ""))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax.grid(True, which="both", alpha=0.3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="10,30,100,300", help="Mbit/s, comma-separated")
    ap.add_argument("--rtts", default="0", help="round trips in ms, comma-separated (a delay "
                    "in user space, launch/delay_link.py); 0: the direct veth pair")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help="indices into METHODS (the ceiling, 0, always runs)")
    ap.add_argument("--lock", default=None,
                    help="flock this file around each rate's runs (e.g. /tmp/bench.lock)")
    ap.add_argument("--out", default=str(REPO / "runs" / "slow_link"))
    ap.add_argument("--plot-only", metavar="JSON", help="redraw the PNG of an earlier sweep")
    opts = ap.parse_args()
    if opts.plot_only:
        path = Path(opts.plot_only)
        record = json.loads(path.read_text())
        return plot(record.get("results_by_rtt") or {"0": record["results"]},
                    path.with_suffix(".png"))
    if os.geteuid() != 0:
        sys.exit("benchmarks/slow_link.py: needs root (ip netns, tc)")
    names = list(METHODS)
    methods = [CEILING] + [names[int(i)] for i in opts.methods.split(",") if int(i) != 0]
    rates = [float(r) if "." in r else int(r) for r in opts.rates.split(",")]
    rtts = [int(r) for r in opts.rtts.split(",")]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)
    began = time.perf_counter()
    try:
        by_rtt = sweep(rates, rtts, methods, out, opts.lock)
    except (KeyboardInterrupt, Terminated) as e:
        print(f"interrupted ({type(e).__name__} {e}): stopped the runs, removed the namespaces",
              file=sys.stderr)
        return 130
    finally:
        left = namespaces()
        print(f"namespaces left after teardown: {left or 'none'}", flush=True)
    record = {"rates_mbit": rates, "rtts_ms": rtts, "results_by_rtt": by_rtt,
              "results": by_rtt.get("0", {}), "model_flags": MODEL,
              "inner_steps": H, "fragments": P, "overlap_steps": TAU,
              "methods": {n: vars(METHODS[n]) for n in methods},
              "sweep_wall_s": time.perf_counter() - began, "namespaces_left": left}
    (out / "slow_link.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(by_rtt, out / "slow_link.png")
    for rtt, results in by_rtt.items():
        for rate, point in results.items():
            print(f"{rate} Mbit/s, RTT {rtt} ms (measured {point['measured_mbit']:.1f} Mbit/s, "
                  f"{point['measured_rtt_ms']:.1f} ms): ms/step, utilisation")
            for name in methods:
                r = point["methods"][name]
                print(f"  {name:50} {r['ms_per_step']:8.1f} {100 * r['utilisation']:6.1f} %")
    print(f"wrote {out / 'slow_link.json'} and {out / 'slow_link.png'}")


if __name__ == "__main__":
    sys.exit(main())

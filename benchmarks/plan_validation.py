"""The planner's memory and step-time models against measured runs on this machine (CPU).

    .venv/bin/python benchmarks/plan_validation.py [--out docs/results/plan] [--iters 8]

Every layout runs two ranks (one thread each, the machine's two cores), the same model
(``MODEL``), real launches of pretrain_gpt.py (torchrun), eight iterations (the resident peak
still grows over the first four steps here, as the allocator settles, then stays); measured:
the peak resident memory of the busiest rank (``peak_rss_mib_per_rank`` of the summary) and
the mean step time after the first two (``SETTLING``). Every launch runs as a user's does,
torch.compile on (``COMPILED``). Predicted (``megatron_streaming.plan``):

* memory = the model's terms (weights, gradients, optimizer, outer state, activations,
  logits) + a runtime term measured per layout: the same layout with a tiny model (its own
  small model terms subtracted), so that the interpreter, the libraries and the process
  groups are not counted as a model term;
* step time from the sustained FLOP/s of one rank while every core is busy and the memory
  speed its optimizer step reaches (two one-rank workers of the same model training side by
  side without syncing, ``--no-diloco-sync``, at the row's micro-batch: not one of the
  layouts below; a rank alone on the machine runs about 10 % faster, since the two share
  the memory bandwidth; the FLOP/s from their forward-backward time, the optimizer's bytes
  per second from their optimizer time, both read off Megatron's timers,
  ``--timing-log-level 1``), the loopback bandwidth between two processes (a gloo
  all-reduce of 64 MiB, and an all-gather's rate against it: gloo's all-gather is about
  three times slower per byte) and what a collective costs between two busy ranks beyond
  its bytes (``collective_costs``), and the local attention's elementwise forward per score
  (``score_forward_seconds``: what a recompute runs again beyond its FLOPs), all measured
  here. The calibration runs right before
  each of the row's timed launches (the machine's speed drifts by tens of percent over ten
  minutes), ``--repeats`` pairs of them, averaged. Each row also compares the two timers
  on their own: the model's optimizer and (ZeRO-0/1, whose step reduces the gradients)
  data-parallel terms against the optimizer phase, the rest against forward-backward. A
  plain copy's speed (``memory_bandwidth``) is printed beside the optimizer's for
  comparison.

Memory is measured in launches with glibc's ``MALLOC_MMAP_THRESHOLD_=131072`` (the runtime
term's tiny-model launch too): blocks of 128 KiB and more are mapped and unmapped one by one,
so the resident peak is the peak of what the process holds at once, the quantity the model
predicts (and the one a GPU's allocator reports as its allocated peak). With glibc's default
the threshold rises with every large block freed, the heap keeps what the backward and the
optimizer step freed, and the resident peak becomes about the sum of their peaks (the first
table, docs/RESULTS.md). Step time is measured in a second launch with glibc's default: the
mapping and unmapping cost page faults every step (about half again the step time here),
which is not a cost of training.

Written to OUT/validation.json and printed as a table (docs/RESULTS.md, "Planner models").
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from harness import command, env, free_port  # noqa: E402

from megatron_streaming.plan.memory import GIB, Layout, ModelShape, Training, estimate  # noqa
from megatron_streaming.plan.step_time import (Fabric, optimizer_bytes, step_flops_per_token,
                                               step_time)

# megatron-core's unfused attention: the one whose score passes the step-time model prices
# (``Training.attention`` "unfused"); ``auto`` would run torch's fused one.
MODEL = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "256", "--vocab-size", "8192", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1", "--attention-backend", "unfused"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "256", "--vocab-size", "512"]
GLOBAL_BATCH = 4

# (name, layout, workers): two ranks each.
LAYOUTS = [
    ("DP=2 ZeRO-0", Layout(dp=2, zero_stage=0, micro_batch=2), 1),
    ("DP=2 ZeRO-1", Layout(dp=2, zero_stage=1, micro_batch=2), 1),
    ("DP=2 ZeRO-2", Layout(dp=2, zero_stage=2, micro_batch=2), 1),
    ("TP=2", Layout(tp=2, micro_batch=2), 1),
    ("TP=2 recompute", Layout(tp=2, micro_batch=4, recompute="full"), 1),
    ("TP=2 selective recompute", Layout(tp=2, micro_batch=4, recompute="selective"), 1),
    ("PP=2", Layout(pp=2, micro_batch=1), 1),
    ("PP=2 micro-batch 2", Layout(pp=2, micro_batch=2), 1),
    ("SP=2 (Ulysses)", Layout(sp=2, micro_batch=2), 1),
    ("2 workers, streaming", Layout(micro_batch=2), 2),
]


def model_args(model_flags, layout: Layout, workers: int, iters: int, summary: str):
    streaming = ["--diloco-inner-steps", "4", "--diloco-fragments", "2",
                 "--diloco-overlap-steps", "1"] if workers > 1 else []
    return ["--mock-data", *model_flags, *layout.flags(), "--global-batch-size",
            str(GLOBAL_BATCH), "--train-iters", str(iters), "--eval-iters", "0",
            "--log-interval", "1", "--lr", "1e-4", "--diloco-workers", str(workers),
            "--timing-log-level", "1", *streaming, "--summary-json", summary, "--log-jsonl",
            os.path.join(os.path.dirname(summary), "log.jsonl")]


MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # large blocks go back when freed
# As a user runs it: torch.compile on (the tests' launches turn it off to start faster; the
# sync's FP4 codec then runs eagerly, about 20x slower, which the first tables' streaming row
# paid every exchange).
COMPILED = {"TORCHDYNAMO_DISABLE": "0"}
SETTLING = 2  # step time: the mean over the steps after the first two
FUSED = False  # on CPU the engine's AdamW takes torch's single-tensor path


def launch(model_flags, layout: Layout, workers: int, iters: int, extra=(),
           malloc=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "summary.json")
        nproc = layout.ranks * workers
        cmd = command(nproc, [*model_args(model_flags, layout, workers, iters, summary),
                              *extra])
        proc = subprocess.run(cmd, cwd=REPO, env=env({"MASTER_PORT": str(free_port()),
                                                       **COMPILED, **(malloc or {})}),
                              capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        with open(summary) as f:
            out = json.load(f)
        return {**out, **step_means(os.path.join(tmp, "log.jsonl"), SETTLING)}


def step_means(jsonl: str, settling: int) -> dict:
    """The step and Megatron's forward-backward and optimizer timers (seconds), averaged over
    the steps of a ``--log-jsonl`` file after the first ``settling``."""
    with open(jsonl) as f:
        lines = [json.loads(line) for line in f]
    lines = [r for r in lines if "train/step_seconds" in r][settling:]
    return {key: statistics.mean(r[tag] * scale for r in lines) if lines else None
            for key, tag, scale in (("step_s", "train/step_seconds", 1.0),
                                    ("forward_backward_s", "timers/forward-backward-time", 1e-3),
                                    ("optimizer_s", "timers/optimizer-time", 1e-3))}


def shape_of(model_flags) -> ModelShape:
    from megatron_streaming.cli.arguments import parse_args

    cfg = parse_args(["--mock-data", *model_flags])
    return ModelShape.from_config(cfg.model, cfg.data.vocab_size)


def training_of(workers: int) -> Training:
    return Training(global_batch=GLOBAL_BATCH, streaming=workers > 1, fragments=2,
                    overlap_steps=1, device="cpu")


def _two_ranks(code: str) -> str:
    """Runs ``code`` on two gloo ranks (torchrun); the last line rank 0 printed. The group is
    destroyed at the end (left to the interpreter's exit, gloo aborts the process)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code + "dist.destroy_process_group()\n")
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node=2", f.name], env=env(), capture_output=True,
                             text=True, timeout=600, check=True).stdout
    finally:
        os.unlink(f.name)
    return out.strip().splitlines()[-1]


def loopback_rates() -> tuple:
    """(bytes/s of a gloo all-reduce of 64 MiB between two processes here, as the ring model
    counts it: ``2 (n - 1) / n`` of the tensor over the time; an all-gather's rate against
    that one, counting ``(n - 1) / n`` of its 64 MiB output: gloo's is about a third)."""
    code = (
        "import os, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "x, out = torch.ones(16 * 2**20), torch.empty(16 * 2**20)\n"
        "part = x[:8 * 2**20]\n"
        "def rate(collective, moved):\n"
        "    collective(); dist.barrier(); t = time.perf_counter()\n"
        "    for _ in range(5): collective()\n"
        "    return moved * 5 / (time.perf_counter() - t)\n"
        "reduce = rate(lambda: dist.all_reduce(x), x.numel() * 4 * 2 * (2 - 1) / 2)\n"
        "gather = rate(lambda: dist.all_gather_into_tensor(out, part),\n"
        "              out.numel() * 4 * (2 - 1) / 2)\n"
        "if dist.get_rank() == 0: print(reduce, gather / reduce)\n")
    reduce, gather_speed = map(float, _two_ranks(code).split())
    return reduce, gather_speed


def collective_costs(rounds: int = 3) -> tuple:
    """(seconds per collective, rank skew): two one-thread processes alternate a stretch of
    matrix multiplies with a 1 KiB all-reduce, against the same stretches without it; the
    cost per collective, read at stretches of about 10 and 160 ms, is taken as a latency plus
    a share of the stretch (the slower rank's lead). Interleaved, medians of ``rounds``."""
    code = (
        "import statistics, time, torch, torch.distributed as dist\n"
        "torch.set_num_threads(1)\n"
        "dist.init_process_group('gloo')\n"
        "a, b, x = torch.randn(512, 512), torch.randn(512, 2048), torch.ones(256)\n"
        "def run(n, k, collective):\n"
        "    dist.barrier(); t = time.perf_counter()\n"
        "    for _ in range(n):\n"
        "        for _ in range(k): a @ b\n"
        "        if collective: dist.all_reduce(x)\n"
        "    dist.barrier(); return (time.perf_counter() - t) / n\n"
        "out = {1: [], 16: []}\n"
        f"for _ in range({rounds}):\n"
        "    for k, n in ((1, 100), (16, 24)):\n"
        "        alone = run(n, k, False)\n"
        "        out[k].append((alone, run(n, k, True) - alone))\n"
        "if dist.get_rank() == 0:\n"
        "    print(*[v for k in (1, 16) for v in (statistics.median(a for a, _ in out[k]),\n"
        "                                         statistics.median(c for _, c in out[k]))])\n")
    short, short_cost, long, long_cost = map(float, _two_ranks(code).split())
    skew = max(0.0, (long_cost - short_cost) / (long - short))
    return max(0.0, short_cost - skew * short), skew


def memory_bandwidth() -> float:
    """Bytes/s one process moves copying 256 MiB tensors while a second one does the same
    (read and written bytes both counted, as the optimizer-step term counts them)."""
    code = (
        "import time, torch\n"
        "torch.set_num_threads(1)\n"
        "x, y = torch.ones(64 * 2**20), torch.empty(64 * 2**20)\n"
        "y.copy_(x)\n"
        "t = time.perf_counter()\n"
        "for _ in range(10): y.copy_(x)\n"
        "print(10 * 2 * x.numel() * 4 / (time.perf_counter() - t))\n")
    return min(_side_by_side(code))


def score_forward_seconds() -> float:
    """Seconds per score element of the local core attention's elementwise forward (the mask,
    the fp32 softmax and the attention dropout megatron-core runs on the CPU), one process
    while a second one does the same: what a recompute adds beyond its FLOPs, since the
    calibration's FLOP/s holds the first pass's only."""
    heads, seq = (int(MODEL[MODEL.index(f) + 1]) for f in ("--num-attention-heads",
                                                           "--seq-length"))
    dropout = float(MODEL[MODEL.index("--attention-dropout") + 1])
    code = (
        "import time, torch\n"
        "torch.set_num_threads(1)\n"
        f"x = torch.randn(2, {heads}, {seq}, {seq})\n"
        f"mask = torch.ones({seq}, {seq}, dtype=torch.bool).triu(1)\n"
        "def forward():\n"
        "    y = torch.softmax(x.masked_fill(mask, -10000.0), dim=-1, dtype=torch.float32)\n"
        f"    return torch.nn.functional.dropout(y, {dropout}, training=True)\n"
        "forward(); t = time.perf_counter()\n"
        "for _ in range(20): forward()\n"
        "print((time.perf_counter() - t) / 20 / x.numel())\n")
    return max(_side_by_side(code))


def _side_by_side(code: str) -> list:
    """The number ``code`` prints last, from two processes running it at once (both cores
    busy, as in every layout)."""
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    return [float(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]


def calibration_layout(micro_batch: int) -> Layout:
    """One rank, ZeRO-1, the row's micro-batch: the GEMMs of a micro-batch of 1 run slower
    per FLOP here than those of 2 or 4 (as a GPU's MFU falls with the micro-batch), so each
    row's FLOP/s is measured at its own micro-batch."""
    return Layout(micro_batch=micro_batch)


def calibrate(iters: int, micro_batch: int = 2) -> dict:
    """Two one-rank workers side by side, not syncing (ZeRO-1 over one rank): their
    forward-backward and optimizer times (``constants`` reads the model's speeds off them)."""
    one = launch(MODEL, calibration_layout(micro_batch), 2, iters, ["--no-diloco-sync"])
    return {"one_rank_step_s": one["step_s"], "forward_backward_s": one["forward_backward_s"],
            "optimizer_s": one["optimizer_s"], "micro_batch": micro_batch}


def constants(shape, calibration: dict) -> tuple:
    """(FLOP/s of a rank, bytes/s of its optimizer step) under the current models: the
    calibration's FLOPs over its forward-backward time, the optimizer term's bytes over its
    optimizer time (DeepSpeed's flat-partition path and torch's single-tensor AdamW on one
    core, not a plain copy's speed)."""
    flops = step_flops_per_token(shape) * GLOBAL_BATCH * shape.seq
    layout = calibration_layout(calibration.get("micro_batch", 2))
    moved = optimizer_bytes(shape, layout, Training(global_batch=GLOBAL_BATCH, streaming=False),
                            FUSED)
    return flops / calibration["forward_backward_s"], moved / calibration["optimizer_s"]


def split(times: dict, layout: Layout) -> tuple:
    """(forward-backward, optimizer) seconds of the model's components, as Megatron's timers
    cut the step: the optimizer phase is DeepSpeed's step, which also reduces the gradients
    except under ZeRO-2 (reduced in the backward's hooks)."""
    opt = times.get("optimizer", 0.0)
    if layout.zero_stage < 2:
        opt += times.get("data parallel", 0.0)
    return times["total"] - opt, opt


def runtime_of(layout: Layout, workers: int, tiny_peak: float) -> float:
    """The runtime term: the tiny model's measured peak less its own model terms."""
    return tiny_peak - estimate(shape_of(TINY), layout, training_of(workers)).total


def predict(name: str, layout: Layout, workers: int, tiny_peak: float, peak: float,
            timed: dict, calibration: dict, loopback: float, latency: float,
            gather_speed: float = 1.0, score_forward: float = 0.0) -> dict:
    """One row: the models' predictions for a layout against what its launches measured."""
    shape, training = shape_of(MODEL), training_of(workers)
    runtime = runtime_of(layout, workers, tiny_peak)
    flops, speed = constants(shape, calibration)
    # The scores' first passes are in the calibration's FLOP/s; a recompute's second forward
    # is not: its measured seconds per element, as bytes at the memory speed the model uses.
    fabric = Fabric(flops, loopback, loopback, devices_per_node=2, memory_bytes_per_s=speed,
                    collective_seconds=latency, fused_optimizer=FUSED, score_bytes=0.0,
                    score_bytes_again=score_forward * speed, gather_speed=gather_speed)
    predicted = estimate(shape, layout, training, runtime)
    times = step_time(shape, layout, training, fabric)
    fb, opt = split(times, layout)
    row = {"layout": name, "flags": layout.flags(), "workers": workers,
           "runtime_gib": runtime / GIB, "runtime_peak_gib": tiny_peak / GIB,
           "predicted_gib": predicted.total / GIB, "measured_gib": peak / GIB,
           "memory_error": predicted.total / peak - 1,
           "model_terms_predicted_gib": (predicted.total - runtime) / GIB,
           "model_terms_measured_gib": (peak - runtime) / GIB,
           "components_gib": predicted.gib(),
           "predicted_step_s": times["total"], "measured_step_s": timed["step_s"],
           "time_error": times["total"] / timed["step_s"] - 1,
           "predicted_forward_backward_s": fb, "predicted_optimizer_s": opt,
           "measured_forward_backward_s": timed["forward_backward_s"],
           "measured_optimizer_s": timed["optimizer_s"],
           "time_components_s": times,
           "calibration": {**calibration, "flops_per_rank": flops,
                           "optimizer_bytes_per_s": speed}}
    print(f"{name:24s} memory {row['predicted_gib']:.2f} vs {row['measured_gib']:.2f} GiB "
          f"({row['memory_error']:+.1%}), step {row['predicted_step_s']:.2f} vs "
          f"{row['measured_step_s']:.2f} s ({row['time_error']:+.1%}; forward-backward "
          f"{fb:.2f} vs {timed['forward_backward_s']:.2f}, optimizer {opt:.2f} vs "
          f"{timed['optimizer_s']:.2f}; calibration {flops / 1e9:.1f} GFLOP/s, optimizer "
          f"{speed / 1e9:.2f} GB/s)", flush=True)
    return row


def mean_of(runs: list) -> dict:
    """The step-time keys of several launches, averaged (calibrations and timed launches
    alternate, so that the machine's drift weighs on both alike)."""
    keys = ("step_s", "forward_backward_s", "optimizer_s", "one_rank_step_s")
    return {**runs[0], **{k: statistics.mean(r[k] for r in runs) for k in keys
                          if k in runs[0]}}


def measure(args) -> dict:
    """Every launch: the machine's constants, then per layout its memory, its calibration
    right before its timed launch, and that launch."""
    tiny = shape_of(TINY)
    (bandwidth, gather_speed), memory = loopback_rates(), memory_bandwidth()
    latency, skew = collective_costs()
    score_forward = score_forward_seconds()
    print(f"loopback {bandwidth / 1e9:.2f} GB/s (all-gather x{gather_speed:.2f}); copy "
          f"{memory / 1e9:.2f} GB/s per core; a collective {latency * 1e3:.2f} ms + "
          f"{skew:.1%} of the compute since the last; the scores' forward "
          f"{score_forward * 1e9:.1f} ns an element")
    rows = []
    for name, layout, workers in LAYOUTS:
        if args.layouts and not name.startswith(tuple(args.layouts)):
            continue
        training = training_of(workers)
        if args.step_time_only:
            tiny_peak, peak = estimate(tiny, layout, training).total, float("nan")  # runtime 0
        else:
            small = launch(TINY, layout, workers, 2, malloc=MMAP)
            tiny_peak = max(small["peak_rss_mib_per_rank"]) * 2**20
            measured = launch(MODEL, layout, workers, args.iters, malloc=MMAP)  # memory
            peak = max(measured["peak_rss_mib_per_rank"]) * 2**20
        pairs = [(calibrate(args.iters, layout.micro_batch),
                  launch(MODEL, layout, workers, args.iters))
                 for _ in range(args.repeats)]  # each calibration right before its launch
        calibration, timed = (mean_of([pair[i] for pair in pairs]) for i in (0, 1))
        rows.append(predict(name, layout, workers, tiny_peak, peak, timed, calibration,
                            bandwidth, latency, gather_speed, score_forward))
    return {"model": MODEL, "global_batch": GLOBAL_BATCH, "repeats": args.repeats,
            "calibration": {"loopback_bytes_per_s": bandwidth, "gather_speed": gather_speed,
                            "collective_seconds": latency, "rank_skew": skew,
                            "copy_bytes_per_s": memory,
                            "score_forward_seconds_per_element": score_forward},
            "rows": rows}


def predict_again(path: str) -> dict:
    """The stored measurements of an earlier run under the models as they are now."""
    with open(path) as f:
        old = json.load(f)
    c, layouts = old["calibration"], {name: (layout, w) for name, layout, w in LAYOUTS}
    if "score_forward_seconds_per_element" not in c:  # older runs: timed now (no launch)
        c = {**c, "score_forward_seconds_per_element": score_forward_seconds()}
        print(f"the scores' forward, timed now: "
              f"{c['score_forward_seconds_per_element'] * 1e9:.1f} ns an element")
    rows = []
    for r in old["rows"]:
        layout, workers = layouts[r["layout"]]
        timed = {"step_s": r["measured_step_s"],
                 "forward_backward_s": r["measured_forward_backward_s"],
                 "optimizer_s": r["measured_optimizer_s"]}
        rows.append(predict(r["layout"], layout, workers, r["runtime_peak_gib"] * GIB,
                            r["measured_gib"] * GIB, timed, r["calibration"],
                            c["loopback_bytes_per_s"], c["collective_seconds"],
                            c.get("gather_speed", 1.0), c["score_forward_seconds_per_element"]))
    return {**old, "calibration": c, "rows": rows, "predicted_again_from": path}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/plan")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--layouts", nargs="+", metavar="NAME",
                    help="only the layouts whose names start with these")
    ap.add_argument("--repeats", type=int, default=2,
                    help="calibration and timed launch pairs per layout, averaged")
    ap.add_argument("--step-time-only", action="store_true",
                    help="skip the memory launches (half the time)")
    ap.add_argument("--predict-again", metavar="JSON",
                    help="launch nothing: the measurements of this earlier validation.json "
                         "under the current models")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    result = predict_again(args.predict_again) if args.predict_again else measure(args)
    result["seconds"] = time.perf_counter() - started
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump(result, f, indent=1)
    rows = result["rows"]
    worst = max(abs(r["memory_error"]) for r in rows), max(abs(r["time_error"]) for r in rows)
    print(f"worst: memory {worst[0]:.1%}, step time {worst[1]:.1%}; median step time error "
          f"{statistics.median(abs(r['time_error']) for r in rows):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

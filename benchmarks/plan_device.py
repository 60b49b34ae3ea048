"""The planner's memory and step-time models against one GPU: its layouts of one rank.

    python3 benchmarks/plan_device.py [--cluster FILE] [--out OUT] [--iters 12]
    python3 benchmarks/plan_device.py --tiny            # a CPU rehearsal (resident memory)

Each row launches pretrain_gpt.py as a user does (one rank, NCCL, bf16, mock data, a global
batch of 8) with one of two models (``--models``): ``gpt`` a 1.28B-parameter GPT (24 layers,
hidden 2048, 16 heads, sequence 2048, vocabulary 32000, Megatron's dropout defaults) and
``llama`` a 0.85B Llama-style model (16 layers, hidden 2048, SwiGLU 5632, GQA 16/4, RMSNorm,
RoPE, no biases, untied, no dropout, sequence 4096); and compares with what
``megatron_streaming.plan`` predicts for the cluster description of the GPU in hand
(``launch/clusters/h200_8.yaml`` or ``h100_64.yaml``, by the device's name; the public
specifications and the examples' MFU of 0.40):

* memory: the model's terms (runtime 0) against the caching allocator's allocated peak
  (``peak_device_mib_per_rank`` of the summary: Megatron's "max allocated"); the reserved
  peak beside it shows what the allocator kept on top, part of the description's runtime term;
* step time: the mean after the first ``SETTLING`` steps against the model's total, and
  Megatron's timers (``--timing-log-level 1``, which synchronise the device) against the
  compute and optimizer terms; the MFU the measured forward-backward implies is printed,
  and each row's step is predicted again at the first row's implied MFU (``calibrated``), as
  a user who measured one layout would describe the cluster.

Written to OUT/plan_device.json (docs/RESULTS.md, "The planner on a GPU").
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from megatron_streaming.plan.clusters import load_cluster  # noqa: E402
from megatron_streaming.plan.memory import GIB, Layout, ModelShape, Training, estimate  # noqa
from megatron_streaming.plan.step_time import step_flops_per_token, step_time  # noqa: E402
from plan_validation import step_means  # noqa: E402

# megatron-core's unfused attention, whose score passes SCORE_BYTES prices (``auto`` would
# run torch's fused one): the runs these rows were measured with.
GPT = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
       "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "32000",
       "--bf16", "--attention-backend", "unfused"]
LLAMA = ["--num-layers", "16", "--hidden-size", "2048", "--ffn-hidden-size", "5632",
         "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4",
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--hidden-dropout",
         "0", "--attention-dropout", "0", "--seq-length", "4096", "--max-position-embeddings",
         "4096", "--vocab-size", "32000", "--bf16", "--attention-backend", "unfused"]
TINY = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1024"]
GLOBAL_BATCH = 8
# (model, its flags, row label, layout)
ROWS = [("gpt", GPT, "micro-batch 4", Layout(micro_batch=4)),
        ("gpt", GPT, "micro-batch 8, recompute", Layout(micro_batch=8, recompute="full")),
        ("llama", LLAMA, "micro-batch 2", Layout(micro_batch=2)),
        ("llama", LLAMA, "micro-batch 4, recompute", Layout(micro_batch=4, recompute="full"))]
SETTLING = 3  # step time: the mean over the steps after the first three
CLUSTERS = {"H200": "launch/clusters/h200_8.yaml", "H100": "launch/clusters/h100_64.yaml"}


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def launch(model_flags, layout: Layout, iters: int, gpu: bool) -> dict:
    """One rank of pretrain_gpt.py; its summary, with the step and timer means added."""
    with tempfile.TemporaryDirectory() as tmp:
        summary, jsonl = os.path.join(tmp, "summary.json"), os.path.join(tmp, "log.jsonl")
        backend = ["--distributed-backend", "nccl"] if gpu else []
        cmd = [sys.executable, "pretrain_gpt.py", "--mock-data", *model_flags, *backend,
               *layout.flags(), "--global-batch-size", str(GLOBAL_BATCH), "--train-iters",
               str(iters), "--eval-iters", "0", "--log-interval", "1", "--lr", "1e-4",
               "--diloco-workers", "1", "--timing-log-level", "1", "--summary-json", summary,
               "--log-jsonl", jsonl]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": os.environ.get(
            "MASTER_PORT", "29511")}
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        with open(summary) as f:
            out = json.load(f)
        return {**out, **step_means(jsonl, SETTLING),
                "launch_s": time.perf_counter() - started}


def remeasured(old: dict) -> dict:
    """What ``launch`` returned, from a row of an earlier run."""
    return {"peak_device_mib_per_rank": [old["measured_gib"] * 1024],
            "peak_device_reserved_mib_per_rank": [old["reserved_gib"] * 1024],
            "step_s": old["measured_step_s"],
            "forward_backward_s": old["measured_forward_backward_s"],
            "optimizer_s": old["measured_optimizer_s"], "launch_s": old["launch_s"]}


def shape_and_training(model_flags) -> tuple:
    from megatron_streaming.cli.arguments import parse_args

    cfg = parse_args(["--mock-data", *model_flags])
    return (ModelShape.from_config(cfg.model, cfg.data.vocab_size),
            Training(precision="bf16" if "--bf16" in model_flags else "fp32",
                     global_batch=GLOBAL_BATCH, streaming=False))


def row(name, layout, model_flags, cluster, measured: dict) -> dict:
    shape, training = shape_and_training(model_flags)
    memory = estimate(shape, layout, training)  # runtime 0: the allocator's own peak
    times = step_time(shape, layout, training, cluster.fabric())
    key = "peak_device_mib_per_rank" if "peak_device_mib_per_rank" in measured \
        else "peak_rss_mib_per_rank"
    peak = max(measured[key]) * 2**20
    flops = step_flops_per_token(shape, layout.recompute) * GLOBAL_BATCH * shape.seq
    out = {"layout": name, "flags": layout.flags(), "parameters": shape.parameters(),
           "predicted_gib": memory.total / GIB, "measured_gib": peak / GIB,
           "measured_from": key, "memory_error": memory.total / peak - 1,
           "reserved_gib": max(measured.get("peak_device_reserved_mib_per_rank", [0])) / 1024,
           "components_gib": memory.gib(),
           "predicted_step_s": times["total"], "measured_step_s": measured["step_s"],
           "time_error": times["total"] / measured["step_s"] - 1,
           "predicted_compute_s": times["compute"] + times.get("attention scores", 0.0),
           "measured_forward_backward_s": measured["forward_backward_s"],
           "predicted_optimizer_s": times.get("optimizer", 0.0),
           "measured_optimizer_s": measured["optimizer_s"],
           # The GEMMs' share of the peak: the forward-backward less the unfused attention's
           # passes through memory, which the model counts apart.
           "implied_mfu": flops / (measured["forward_backward_s"] - times.get(
               "attention scores", 0.0)) / (cluster.peak_tflops * 1e12),
           "time_components_s": times, "launch_s": measured["launch_s"]}
    print(f"{name:34s} memory {out['predicted_gib']:.2f} vs {out['measured_gib']:.2f} GiB "
          f"({out['memory_error']:+.1%}; reserved {out['reserved_gib']:.2f}), step "
          f"{out['predicted_step_s']:.3f} vs {out['measured_step_s']:.3f} s "
          f"({out['time_error']:+.1%}; compute {out['predicted_compute_s']:.3f} vs "
          f"forward-backward {measured['forward_backward_s']:.3f}, optimizer "
          f"{out['predicted_optimizer_s']:.4f} "
          f"vs {measured['optimizer_s']:.4f}; implied MFU {out['implied_mfu']:.2f})",
          flush=True)
    return out


def calibrated(rows: list, cluster) -> None:
    """Each row's step at the first row's implied MFU (the cluster described as measured)."""
    measured_cluster = dataclasses.replace(cluster, mfu=rows[0]["implied_mfu"])
    entries = {label_of(entry): entry for entry in ROWS}
    for r in rows:
        _, flags, _, layout = entries[r["layout"]]
        shape, training = shape_and_training(flags)
        total = step_time(shape, layout, training, measured_cluster.fabric())["total"]
        r["calibrated_mfu"] = measured_cluster.mfu
        r["calibrated_step_s"] = total
        r["calibrated_time_error"] = total / r["measured_step_s"] - 1
        print(f"{r['layout']:34s} step at MFU {measured_cluster.mfu:.3f}: {total:.3f} vs "
              f"{r['measured_step_s']:.3f} s ({r['calibrated_time_error']:+.1%})", flush=True)


def label_of(entry) -> str:
    return f"{entry[0]}, {entry[2]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", help="the GPU's cluster description (default: by its name)")
    ap.add_argument("--out", default="docs/results/plan")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--tiny", action="store_true", help="a CPU rehearsal with a tiny model")
    ap.add_argument("--models", nargs="+", choices=["gpt", "llama"], default=["gpt", "llama"])
    ap.add_argument("--predict-again", metavar="JSON",
                    help="launch nothing: the measurements of an earlier plan_device.json "
                         "under the current models")
    args = ap.parse_args(argv)
    old = None
    if args.predict_again:
        with open(args.predict_again) as f:
            old = json.load(f)
    name = old["device"] if old else gpu_name()
    path = args.cluster or (old["cluster"] if old else next(
        (p for k, p in CLUSTERS.items() if k in name), CLUSTERS["H100"]))
    cluster = load_cluster(os.path.join(REPO, path) if not os.path.isabs(path) else path)
    print(f"device {name}; cluster description {path}", flush=True)
    rows = []
    for entry in ROWS:
        model, flags, _, layout = entry
        label = label_of(entry)
        if old:
            found = [r for r in old["rows"] if r["layout"] == label]
            if not found:
                continue
            measured = remeasured(found[0])
        elif model in args.models:
            measured = launch(TINY if args.tiny else flags, layout, args.iters,
                              gpu=not args.tiny)
        else:
            continue
        rows.append({"model": model, "model_flags": flags,
                     **row(label, layout, TINY if args.tiny else flags, cluster, measured)})
    if rows and not args.tiny:
        calibrated(rows, cluster)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan_device.json"), "w") as f:
        json.dump({"device": name, "cluster": path,
                   "global_batch": GLOBAL_BATCH, "iters": old["iters"] if old else args.iters,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

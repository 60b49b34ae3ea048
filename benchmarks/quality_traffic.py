"""Quality and traffic at equal tokens: data parallel vs DiLoCo vs Streaming DiLoCo (+ overlap,
+ FP4), after Streaming DiLoCo (Douillard et al., arXiv 2501.18512), Table 1.

    .venv/bin/python benchmarks/quality_traffic.py [--iters 600] [--inner-steps 60] \\
        [--workers 2] [--also-inner-steps 30 120] [--also-workers 4] [--out runs/quality_traffic]

(about 20 minutes on 2 CPU cores; the defaults are the configuration of
docs/results/quality_traffic.md; ``--reuse`` skips runs already finished under ``--out``).

A small GPT (4 layers, so P = 2 fragments of two whole layers each) trains on
``../shared/data/tinyshakespeare.txt`` (SentencePiece vocabulary of 1024, built on first use).
Every method sees the same global batch B per step and the same total tokens:

* data parallel: one worker of M data-parallel ranks (ZeRO over all of them), batch B;
* DiLoCo (P=1, tau=0), Streaming DiLoCo (P fragments), + overlap (tau=1), + FP4: M workers of
  one rank, each with batch B/M.

Inner hyperparameters (model, AdamW, learning-rate schedule, clipping) are the same for every
method; only the outer ones (``--outer-lr``, ``--outer-momentum``, Nesterov) apply to the
DiLoCo variants. Every method runs ``--iters`` + 1 steps: ``--iters`` is a multiple of H, and
the extra step is where a fragment sent at step ``--iters`` with overlap merges, on schedule,
before the final evaluation. (Training now also merges whatever is still in flight after its
last step; the extra step keeps the published runs' configuration.)

Reported per method (JSON, ``--out``/quality_traffic.json): validation loss on the global
parameters (``--eval-params global``), its gap to data parallel in %; total cross-worker bytes
(the transport's own count for the DiLoCo variants; for data parallel the ring all-reduce volume
of its fp32 gradients, ``megatron_streaming.comm.traffic``), and the largest amount moved in any one
step (data parallel: one step's all-reduce; the others: the largest step-to-step difference of
the cumulative ``streaming/cross_worker_bytes``, with the exchanges still in flight at the end
counted in the last step); ratios of bytes, bits and peak against data parallel and DiLoCo.
The PNG (quality_traffic.png) has loss against tokens for every setting (train: smoothed line,
raw faint; valid: dots) and the cumulative cross-worker bytes of the first setting.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"



def model_args(hidden: int) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4",
            "--seq-length", "128", "--clip-grad", "1.0", "--log-interval", "1",
            # The published runs' settings, from before the defaults became Megatron's.
            "--hidden-dropout", "0", "--attention-dropout", "0", "--adam-beta2", "0.95",
            "--lr-decay-style", "cosine"]


def model_note(hidden: int) -> str:
    return f"4 layers, hidden {hidden}, 4 heads, seq 128, vocab 1024"


@dataclass(frozen=True)
class Setting:
    """One comparison: every method at M workers, H inner steps, P fragments."""
    workers: int
    inner_steps: int
    fragments: int
    iters: int
    global_batch: int

    @property
    def name(self) -> str:
        return f"M={self.workers} H={self.inner_steps} P={self.fragments}"

    def methods(self, outer: list[str], fp4: list[str]) -> dict[str, list[str]]:
        """Each method's flags; ``outer`` goes to every DiLoCo variant, ``fp4`` to + FP4."""
        M, H, P = self.workers, self.inner_steps, self.fragments
        per_worker = self.global_batch // M
        diloco = ["--diloco-workers", str(M), "--diloco-inner-steps", str(H),
                  "--global-batch-size", str(per_worker), "--micro-batch-size",
                  str(per_worker), *outer]
        return {
            "data parallel": ["--diloco-workers", "1", "--global-batch-size",
                              str(self.global_batch), "--micro-batch-size", str(per_worker)],
            "DiLoCo": [*diloco, "--diloco-fragments", "1", "--diloco-quantize", "none"],
            "Streaming DiLoCo": [*diloco, "--diloco-fragments", str(P),
                                 "--diloco-quantize", "none"],
            "+ overlap": [*diloco, "--diloco-fragments", str(P), "--diloco-overlap-steps", "1",
                          "--diloco-quantize", "none"],
            "+ FP4": [*diloco, "--diloco-fragments", str(P), "--diloco-overlap-steps", "1",
                      "--diloco-quantize", "fp4", *fp4],
        }


def dataset(out: Path) -> list[str]:
    prefix = out / "tinyshakespeare"
    if not Path(f"{prefix}.idx").exists():
        subprocess.run([sys.executable, "-m", "megatron_streaming.data", "--input", str(CORPUS),
                        "--output-prefix", str(prefix), "--vocab-size", "1024"],
                       cwd=REPO, check=True)
    return ["--data-path", str(prefix), "--tokenizer-model", f"{prefix}.model",
            "--split", "95,5,0", "--data-cache-path", str(out / "cache")]


def launch(args: list[str], ranks: int, out: Path, reuse: bool) -> dict:
    """One training run; its directory is named by a hash of its arguments, so ``--reuse``
    picks up a finished run of exactly the same command."""
    key = hashlib.sha1(json.dumps([ranks, *args]).encode()).hexdigest()[:12]
    run_dir = out / "runs" / key
    summary, log = run_dir / "summary.json", run_dir / "log.jsonl"
    if not (reuse and summary.exists()):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps([ranks, *args]))
        for f in (summary, log):
            if f.exists():
                f.unlink()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", "pretrain_gpt.py", *args,
               "--summary-json", str(summary), "--log-jsonl", str(log)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              check=False)
        (run_dir / "stderr.txt").write_text(done.stderr[-20000:])
        if done.returncode:
            raise RuntimeError(f"run failed ({run_dir}): {done.stderr[-3000:]}")
    result = json.loads(summary.read_text())
    result["log"] = [json.loads(line) for line in log.read_text().splitlines()]
    result["run_dir"] = str(run_dir)
    return result


def step_bytes(result: dict) -> list[int]:
    """Cross-worker bytes of every step: differences of the cumulative count; what completed
    after the last logged step (close() at the end) is added to the last step."""
    cumulative = {r["iteration"]: r["streaming/cross_worker_bytes"] for r in result["log"]
                  if "streaming/cross_worker_bytes" in r}
    previous, out = 0.0, []
    for it in sorted(cumulative):
        out.append(round(cumulative[it] - previous))
        previous = cumulative[it]
    if out:
        out[-1] += int(result["cross_worker_bytes"] - previous)
    return out


def measure(setting: Setting, data: list[str], common: list[str], outer: list[str], out: Path,
            reuse: bool, only: list[str] | None = None, fp4: list[str] = ()) -> dict:
    from megatron_streaming.comm.traffic import ring_all_reduce_bytes

    steps = setting.iters + 1
    rows = {}
    for name, args in setting.methods(outer, list(fp4)).items():
        if only and name not in only:
            continue
        ranks = setting.workers
        r = launch([*common, *data, *args, "--train-iters", str(steps)], ranks, out,
                   reuse)
        if name == "data parallel":
            one_step = ring_all_reduce_bytes(r["parameters"], ranks=setting.workers)
            total, peak = steps * one_step, one_step
        else:
            per_step = step_bytes(r)
            total, peak = r["cross_worker_bytes"], max(per_step, default=0)
        rows[name] = {
            "valid_loss": r["valid_loss"], "train_loss": r["train_loss"], "tokens": r["tokens"],
            "parameters": r["parameters"], "total_bytes": total, "total_bits": 8 * total,
            "peak_step_bytes": peak, "seconds_per_iteration": r["seconds_per_iteration"],
            # The run's own training time (also when reused), not the launcher's start-up.
            "wall_seconds": round(r["wall_seconds"], 1), "run_dir": r["run_dir"],
            "curve": curve(r)}
        print(f"  {setting.name} {name}: valid {r['valid_loss']:.4f} bytes {total:,} "
              f"peak {peak:,} ({rows[name]['wall_seconds']} s)", flush=True)
    dp, diloco = rows.get("data parallel"), rows.get("DiLoCo")
    for row in rows.values():
        if dp:
            row["valid_loss_gap_vs_dp_pct"] = 100 * (row["valid_loss"] / dp["valid_loss"] - 1)
            row["bytes_ratio_dp_over_this"] = dp["total_bytes"] / row["total_bytes"]
            row["bits_ratio_dp_over_this"] = dp["total_bits"] / row["total_bits"]
            row["peak_ratio_dp_over_this"] = dp["peak_step_bytes"] / row["peak_step_bytes"]
        if diloco:
            row["peak_ratio_diloco_over_this"] = (diloco["peak_step_bytes"]
                                                  / row["peak_step_bytes"])
    return {"setting": setting.__dict__ | {"name": setting.name, "steps": steps},
            "methods": rows}


def curve(r: dict) -> dict:
    train = [(x["train/tokens"], x["train/loss"]) for x in r["log"] if "train/loss" in x]
    tokens_per_step = train[0][0] if train else 0
    valid = [(x["iteration"] * tokens_per_step, x["valid/loss"]) for x in r["log"]
             if "valid/loss" in x]
    cum = [(x["train/tokens"], x["streaming/cross_worker_bytes"]) for x in r["log"]
           if "streaming/cross_worker_bytes" in x]
    return {"train": train, "valid": valid, "cumulative_bytes": cum}


def thinned(results: list[dict], every: int = 10) -> list[dict]:
    """The results with every ``every``-th point of each curve, rounded: a small JSON."""
    out = json.loads(json.dumps(results))
    for res in out:
        for m in res["methods"].values():
            c = m["curve"]
            c["train"] = [(t, round(v, 4)) for t, v in c["train"][every - 1::every]]
            c["valid"] = [(t, round(v, 4)) for t, v in c["valid"]]
            c["cumulative_bytes"] = [(t, int(v))
                                     for t, v in c["cumulative_bytes"][every - 1::every]]
    return out


def smooth(values: list[float], beta: float = 0.95) -> list[float]:
    out, avg = [], None
    for i, v in enumerate(values):
        avg = v if avg is None else beta * avg + (1 - beta) * v
        out.append(avg)
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results) + 1
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.4))
    names = ["data parallel", "DiLoCo", "Streaming DiLoCo", "+ overlap", "+ FP4"]
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, res in zip(axes, results):
        lo = min(m["valid_loss"] for m in res["methods"].values())
        for name, m in res["methods"].items():
            tok, loss = zip(*m["curve"]["train"])
            ax.plot(tok, loss, color=colors[name], alpha=0.15, lw=0.6)
            ax.plot(tok, smooth(list(loss)), color=colors[name], lw=1.4,
                    label=f"{name} (valid {m['valid_loss']:.3f})")
            if m["curve"]["valid"]:
                ax.plot(*zip(*m["curve"]["valid"]), "o", color=colors[name], ms=4)
        ax.set_ylim(lo - 0.3, lo + 1.6)
        ax.set_xlabel("tokens (all workers)")
        ax.set_ylabel("loss")
        ax.set_title(f"{res['setting']['name']}: train (smoothed) and valid (dots)",
                     fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax, first = axes[-1], results[0]
    for name, m in first["methods"].items():
        if name == "data parallel":
            tok = [t for t, _ in m["curve"]["train"]]
            per_step = m["peak_step_bytes"]
            ax.plot(tok, [per_step * (i + 1) for i in range(len(tok))], color=colors[name],
                    label=f"{name} (ring all-reduce, computed)")
        elif any(c > 0 for _, c in m["curve"]["cumulative_bytes"]):
            tok, cum = zip(*[(t, c) for t, c in m["curve"]["cumulative_bytes"] if c > 0])
            ax.plot(tok, cum, color=colors[name], drawstyle="steps-post",
                    label=f"{name} (transport)")
    ax.set_yscale("log")
    ax.set_xlabel("tokens (all workers)")
    ax.set_ylabel("cumulative cross-worker bytes")
    ax.set_title(f"{first['setting']['name']}: traffic", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=72)


def table(results: list[dict]) -> str:
    def fmt(m, key, spec):
        return format(m[key], spec) if key in m else "-"

    lines = [("| setting | method | valid loss | gap vs DP | total bytes "
              "| DP / this (bytes = bits) | peak bytes in one step | DP peak / this "
              "| DiLoCo peak / this |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for name, m in res["methods"].items():
            lines.append(
                f"| {res['setting']['name']} | {name} | {m['valid_loss']:.4f} | "
                f"{fmt(m, 'valid_loss_gap_vs_dp_pct', '+.2f')} % | {m['total_bytes']:,} | "
                f"{fmt(m, 'bytes_ratio_dp_over_this', ',.1f')}x | {m['peak_step_bytes']:,} | "
                f"{fmt(m, 'peak_ratio_dp_over_this', ',.1f')}x | "
                f"{fmt(m, 'peak_ratio_diloco_over_this', '.2f')}x |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=600,
                    help="steps per method (a multiple of every H; one more step is run)")
    ap.add_argument("--inner-steps", type=int, default=60, help="H of the main setting")
    ap.add_argument("--workers", type=int, default=2, help="M of the main setting")
    ap.add_argument("--fragments", type=int, default=2, help="P (divides the 4 layers)")
    ap.add_argument("--global-batch", type=int, default=16, help="samples per step, all ranks")
    ap.add_argument("--also-inner-steps", type=int, nargs="*", default=[30, 120],
                    help="further settings at these H (M of the main setting); none: omit")
    ap.add_argument("--also-workers", type=int, nargs="*", default=[4],
                    help="further settings at these M (H of the main setting); none: omit")
    ap.add_argument("--also-workers-iters", type=int, default=300,
                    help="steps of the settings at other M (M processes share the cores)")
    ap.add_argument("--also-methods", nargs="*",
                    default=["data parallel", "DiLoCo", "+ FP4"],
                    help="methods of the further settings")
    ap.add_argument("--hidden-size", type=int, default=128, help="model width (4 layers)")
    ap.add_argument("--lr", default="2e-3", help="inner peak learning rate (every method)")
    ap.add_argument("--min-lr", default="2e-4", help="end of the inner cosine decay")
    ap.add_argument("--warmup", default="30", help="inner warmup iterations")
    ap.add_argument("--outer-lr", default="1.3", help="outer SGD learning rate (DiLoCo variants)")
    ap.add_argument("--outer-momentum", default="0.0", help="outer momentum (DiLoCo variants)")
    ap.add_argument("--no-nesterov", action="store_true", help="plain outer momentum")
    ap.add_argument("--error-feedback", action="store_true",
                    help="+ FP4 carries its quantization error into the next send")
    ap.add_argument("--eval-interval", type=int, default=50,
                    help="iterations between validation points (and one at the end)")
    ap.add_argument("--eval-iters", default="8", help="validation batches per evaluation")
    ap.add_argument("--out", default=str(REPO / "runs" / "quality_traffic"),
                    help="runs, quality_traffic.json and quality_traffic.png go here")
    ap.add_argument("--methods", nargs="*", default=None,
                    help="run only these methods (names as in the table); for exploring")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse finished runs of exactly the same command under --out")
    opts = ap.parse_args()

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    data = dataset(out)
    outer = ["--diloco-outer-lr", opts.outer_lr, "--diloco-outer-momentum", opts.outer_momentum,
             *(["--no-diloco-nesterov"] if opts.no_nesterov else [])]
    workers_iters = opts.also_workers_iters
    settings = [Setting(opts.workers, opts.inner_steps, opts.fragments, opts.iters,
                        opts.global_batch)]
    settings += [Setting(opts.workers, h, opts.fragments, opts.iters, opts.global_batch)
                 for h in opts.also_inner_steps]
    settings += [Setting(m, opts.inner_steps, opts.fragments, workers_iters, opts.global_batch)
                 for m in opts.also_workers]
    for s in settings:
        if s.iters % s.inner_steps or s.global_batch % s.workers:
            raise SystemExit(f"{s.name}: --iters ({s.iters}) must be a multiple of H and "
                             f"--global-batch ({s.global_batch}) of M")
    started = time.perf_counter()
    results = []
    for i, s in enumerate(settings):
        only = opts.methods if i == 0 else (opts.also_methods or opts.methods)
        common = [*model_args(opts.hidden_size), "--lr", opts.lr, "--min-lr", opts.min_lr,
                  "--lr-warmup-iters", opts.warmup, "--eval-iters", opts.eval_iters,
                  "--eval-interval", str(opts.eval_interval)]
        fp4 = ["--diloco-error-feedback"] if opts.error_feedback else []
        results.append(measure(s, data, common, outer, out, opts.reuse, only, fp4))
    wall = time.perf_counter() - started
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "model": model_note(opts.hidden_size), "corpus": CORPUS.name,
              "inner": {"lr": opts.lr, "min_lr": opts.min_lr, "warmup": opts.warmup,
                        "optimizer": "AdamW (pretrain_gpt.py defaults)", "clip_grad": 1.0},
              "outer": {"lr": opts.outer_lr, "momentum": opts.outer_momentum,
                        "nesterov": not opts.no_nesterov,
                        "fp4_error_feedback": opts.error_feedback},
              "wall_seconds": round(wall, 1),
              # Training time of every distinct run (a reused data-parallel run counts once).
              "runs_wall_seconds": round(sum({m["run_dir"]: m["wall_seconds"] for res in results
                                              for m in res["methods"].values()}.values()), 1),
              "results": thinned(results)}
    (out / "quality_traffic.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "quality_traffic.png")
    print(table(results))
    print(f"wall {wall:.0f} s; {out / 'quality_traffic.json'}, {out / 'quality_traffic.png'}")


if __name__ == "__main__":
    main()

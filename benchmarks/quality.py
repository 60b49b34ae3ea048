"""Held-out loss at equal tokens: data parallel against named DiLoCo variants, on several
corpora and model sizes, one change at a time.

    .venv/bin/python benchmarks/quality.py                       # the whole sweep (hours)
    .venv/bin/python benchmarks/quality.py --corpora code --sizes small --variants dp h1 h30
    .venv/bin/python benchmarks/quality.py --list                # the variants and their flags
    .venv/bin/python benchmarks/quality.py --report              # tables and plot only
    .venv/bin/python benchmarks/quality.py --steps 2400 ...      # longer runs: cell size@2400

Runs go one after another on the cores there are (2 ranks each: data parallel is one worker of
two ranks with global batch B, every DiLoCo variant two workers of one rank with B/2 each, but
the ``m1_`` ones: data parallel's worker with its own outer optimizer, the papers' M=1).
Each run is named by a hash of its command and of the resolved sync settings
(``KEYED_SETTINGS``), so a half-done sweep resumes where it stopped: a finished run is never
redone, and a changed library default reruns only the variants that rely on it. A finished run
leaves a small record in ``docs/results/quality/records/`` (kept in the repository, so a sweep
resumes from a fresh clone too), its full logs in the scratch folder. For the sweep:
``quality.json`` (every run: held-out loss, gap to data parallel, bytes, curves),
``quality.md`` (the tables) and ``quality.png`` (held-out loss against tokens).

Corpora (training and held-out text disjoint; both built here, nothing downloaded):

* ``code``: the Python standard library's own ``.py`` files (tests, idlelib and lib2to3 left
  out), one document per module; a module is held out when crc32 of its path is 0 mod 20.
* ``wiki``: ``../shared/data/wikitext2-valid.txt``, one document per article; every fifth
  article held out. Small: 1200 steps of 16 x 128 tokens read it about ten times.

Each corpus gets its own sentencepiece vocabulary of 2048, trained on its training text.
Held-out loss: mean over the same ``--eval-samples`` sequences for every method (the number
of evaluation iterations is set per method from its ranks and micro-batch), on the global
parameters (``--eval-params global``; ``alone``: the worker's own).
"""

import argparse
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared" / "data"

# The corpus builder and the keyed, resumable runs, shared with benchmarks/protocol.py.
from benchmarks.quality_common import (  # noqa: E402,F401
    KEYED_SETTINGS, launch, resolved_settings, run_key, tokenize_splits)

SIZES = {
    # 6 x 12 x 128^2 + 2048 x 128 + 128 x 128 = 1.46M parameters.
    "small": ["--num-layers", "6", "--hidden-size", "128", "--num-attention-heads", "4"],
    # 6 x 12 x 288^2 + 2048 x 288 + 128 x 288 = 6.6M parameters.
    "large": ["--num-layers", "6", "--hidden-size", "288", "--num-attention-heads", "6"],
    # "small" with every MLP a mixture of 4 experts of the dense MLP's width, top-1: the
    # same active parameters a token (one MLP's and a 4 x 128 router), 3.8M in all.
    "moe_small": ["--num-layers", "6", "--hidden-size", "128", "--num-attention-heads", "4",
                  "--num-experts", "4", "--moe-router-topk", "1", "--moe-router-pre-softmax",
                  "--moe-aux-loss-coeff", "0.01"],
}

# Every run: the small GPT and schedule (seq 128, warm-up 30, cosine to lr/10, seed 1).
COMMON = ["--seq-length", "128", "--max-position-embeddings", "128", "--clip-grad", "1.0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--adam-beta2", "0.95",
          "--lr-decay-style", "cosine", "--lr-warmup-iters", "30", "--seed", "1",
          "--log-interval", "10"]

STEPS = 1200  # the default run length; records of other lengths carry it in their label
DILOCO = ["--diloco-workers", "2"]
# Plain averaging; Nesterov stays on (the default) so that a variant may add momentum to it.
PLAIN_N = ["--diloco-outer-lr", "1", "--diloco-outer-momentum", "0", "--diloco-alpha", "0",
           "--diloco-overlap-steps", "0"]
PLAIN = ["--diloco-outer-lr", "1", "--diloco-outer-momentum", "0", "--no-diloco-nesterov",
         "--diloco-alpha", "0", "--diloco-overlap-steps", "0"]
PAPER = ["--diloco-outer-lr", "0.7", "--diloco-outer-momentum", "0.9"]
STREAM = ["--diloco-fragments", "3", "--diloco-overlap-steps", "1"]
# Periodic averaging, one fragment, no overlap: typed since the library chooses P and tau
# where they are not (their old defaults, 1 and 0, were what these variants ran with).
P1 = ["--diloco-fragments", "1", "--diloco-overlap-steps", "0"]

# name -> (what changes, flags on top of DILOCO; None = data parallel). Later flags win.
VARIANTS = {
    "dp": ("data parallel: one worker of 2 ranks, batch B", None),
    "alone": ("one worker alone (--no-diloco-sync), half the tokens",
              ["--no-diloco-sync", "--eval-params", "local"]),
    "h1": ("averaging every step (H=1, P=1, outer lr 1, no momentum, alpha 0, fp32)",
           [*PLAIN, "--diloco-inner-steps", "1", "--diloco-quantize", "none", *P1]),
    "h30": ("averaging every 30 steps (P=1, fp32)",
            [*PLAIN, "--diloco-inner-steps", "30", "--diloco-quantize", "none", *P1]),
    # The number of outer steps: 1200 / H per fragment (240 at H=5, 40 at H=30).
    "h5": ("averaging every 5 steps (P=1, fp32)",
           [*PLAIN, "--diloco-inner-steps", "5", "--diloco-quantize", "none", *P1]),
    "h5_nesterov": ("h5 + outer lr 0.7, Nesterov momentum 0.9 (the papers')",
                    ["--diloco-inner-steps", "5", "--diloco-quantize", "none", *PAPER, *P1]),
    "h30_nesterov": ("h30 + outer lr 0.7, Nesterov momentum 0.9 (the papers')",
                     ["--diloco-inner-steps", "30", "--diloco-quantize", "none", *PAPER, *P1]),
    "h30_heavyball": ("h30 + outer lr 0.7, heavy-ball momentum 0.9",
                      ["--diloco-inner-steps", "30", "--diloco-quantize", "none", *PAPER,
                       "--no-diloco-nesterov", *P1]),
    "p3": ("h30 + P=3 fragments",
           [*PLAIN, "--diloco-inner-steps", "30", "--diloco-quantize", "none",
            "--diloco-fragments", "3"]),
    "p3_tau1": ("p3 + overlap tau=1 (alpha 0)",
                [*PLAIN, "--diloco-inner-steps", "30", "--diloco-quantize", "none", *STREAM]),
    "p3_tau1_fp4": ("p3_tau1 + FP4",
                    [*PLAIN, "--diloco-inner-steps", "30", *STREAM, "--diloco-quantize",
                     "fp4"]),
    "p3_tau1_int8": ("p3_tau1 + int8",
                     [*PLAIN, "--diloco-inner-steps", "30", *STREAM, "--diloco-quantize",
                      "int8"]),
    "p3_tau1_bf16": ("p3_tau1 + bf16",
                     [*PLAIN, "--diloco-inner-steps", "30", *STREAM, "--diloco-quantize",
                      "bf16"]),
    "p3_tau1_fp4_ef": ("p3_tau1_fp4 + error feedback",
                       [*PLAIN, "--diloco-inner-steps", "30", *STREAM, "--diloco-quantize",
                        "fp4", "--diloco-error-feedback"]),
    "p3_tau1_fp4_alpha05": ("p3_tau1_fp4 + alpha 0.5",
                            [*PLAIN, "--diloco-inner-steps", "30", *STREAM,
                             "--diloco-quantize", "fp4", "--diloco-alpha", "0.5"]),
    "p3_tau1_fp4_nesterov": ("p3_tau1_fp4 + outer 0.7 / Nesterov 0.9",
                             [*PLAIN_N, "--diloco-inner-steps", "30", *STREAM,
                              "--diloco-quantize", "fp4", *PAPER]),
    # Candidates for the defaults: P=3, tau=1, FP4 under other outer optimizers.
    "p3_tau1_fp4_lr1.3": ("p3_tau1_fp4 with outer lr 1.3 (no momentum)",
                          [*PLAIN, "--diloco-inner-steps", "30", *STREAM, "--diloco-quantize",
                           "fp4", "--diloco-outer-lr", "1.3"]),
    "p3_tau1_fp4_n0.5": ("p3_tau1_fp4 with outer lr 1, Nesterov momentum 0.5",
                         [*PLAIN_N, "--diloco-inner-steps", "30", *STREAM, "--diloco-quantize",
                          "fp4", "--diloco-outer-momentum", "0.5"]),
    "p3_tau1_fp4_n0.9_lr0.2": ("p3_tau1_fp4 with outer lr 0.2, Nesterov momentum 0.9",
                               [*PLAIN_N, "--diloco-inner-steps", "30", *STREAM,
                                "--diloco-quantize", "fp4", "--diloco-outer-lr", "0.2",
                                "--diloco-outer-momentum", "0.9"]),
    "p3_tau1_fp4_n0.5_lr0.5": ("p3_tau1_fp4 with outer lr 0.5, Nesterov momentum 0.5 "
                               "(the same long-run step as plain averaging, smoothed)",
                               [*PLAIN_N, "--diloco-inner-steps", "30", *STREAM,
                                "--diloco-quantize", "fp4", "--diloco-outer-lr", "0.5",
                                "--diloco-outer-momentum", "0.5"]),
    "benchmark_setting": ("the old quality benchmark's setting: P=3, tau=1, FP4, alpha 0.5, "
                          "outer 0.7 / Nesterov 0.9",
                          ["--diloco-inner-steps", "30", *STREAM, "--diloco-quantize", "fp4",
                           "--diloco-alpha", "0.5", *PAPER]),
    "defaults": ("H=30, P=3, tau=1, FP4 as E3M0 (--diloco-quantize fp4; the library's "
                 "defaults until 2026-11-28)",
                 ["--diloco-inner-steps", "30", *STREAM, "--diloco-quantize", "fp4"]),
    # The same bytes, the 4-bit values as E2M1 (a mantissa bit) instead of E3M0.
    "defaults_e2m1": ("the library's defaults with H=30, P=3, tau=1, FP4 as E2M1 "
                      "(--diloco-quantize fp4-e2m1: the same bytes)",
                      ["--diloco-inner-steps", "30", *STREAM, "--diloco-quantize", "fp4-e2m1"]),
    # As many syncs, placed at equal shares of the summed lr (often early, seldom late).
    "h30_lr_spaced": ("h30 with --diloco-sync-spacing lr",
                      [*PLAIN, "--diloco-inner-steps", "30", "--diloco-quantize", "none",
                       "--diloco-sync-spacing", "lr", *P1]),
    "defaults_lr_spaced": ("defaults with --diloco-sync-spacing lr",
                           ["--diloco-inner-steps", "30", *STREAM, "--diloco-quantize", "fp4",
                            "--diloco-sync-spacing", "lr"]),
    # As many syncs, by the lr's inverse square root: sparse at the peak, dense in the warm-up
    # and the decay, where the gap to data parallel opens (the curves' gap by step).
    "defaults_decay_spaced": ("defaults with --diloco-sync-spacing decay",
                              ["--diloco-inner-steps", "30", *STREAM, "--diloco-quantize",
                               "fp4", "--diloco-sync-spacing", "decay"]),
    # Each exchange applied a whole round late, the worker's own share at once.
    "defaults_eager": ("defaults with eager outer updates instead of tau=1",
                       ["--diloco-inner-steps", "30", *STREAM, "--diloco-quantize", "fp4",
                        "--diloco-overlap-steps", "0", "--diloco-eager"]),
    # One worker (the papers' M=1 row): data parallel's ranks and batch, the outer optimizer
    # on top of them (its flags typed turn it on), no wire and no quantization.
    "m1_h30_nesterov": ("dp + one worker's outer optimizer every 30 steps: outer lr 0.7, "
                        "Nesterov 0.9 (the papers' M=1)",
                        ["--diloco-inner-steps", "30", *PAPER, *P1]),
    "m1_h30": ("dp + one worker's outer optimizer every 30 steps, plain averaging (outer lr 1, "
               "no momentum): dp itself, bit for bit",
               ["--diloco-inner-steps", "30", "--diloco-outer-lr", "1",
                "--diloco-outer-momentum", "0", *P1]),
}
LADDER = list(VARIANTS)
# Variants run as data parallel runs (one worker of 2 ranks, batch B), their flags on top.
ONE_WORKER = {"m1_h30_nesterov", "m1_h30"}


# ---- corpora --------------------------------------------------------------------------------
def _stdlib_modules():
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages"}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not skip & set(rel.parts):
            yield str(rel), path.read_text(encoding="utf-8", errors="replace")


def _wiki_articles():
    article = []
    for line in (SHARED / "wikitext2-valid.txt").read_text(encoding="utf-8").splitlines():
        heading = line.startswith(" = ") and not line.startswith(" = = ")
        if heading and article:
            yield article[0].strip(" ="), "\n".join(article)
            article = []
        article.append(line)
    if article:
        yield article[0].strip(" ="), "\n".join(article)


def _split_documents(corpus: str):
    """(train, held-out) lists of documents: disjoint by module / article."""
    train, held = [], []
    if corpus == "code":
        for name, text in _stdlib_modules():
            (held if zlib.crc32(name.encode()) % 20 == 0 else train).append(text)
    elif corpus == "wiki":
        for i, (_, text) in enumerate(_wiki_articles()):
            (held if i % 5 == 4 else train).append(text)
    else:
        raise SystemExit(f"--corpora: unknown corpus {corpus!r} (code, wiki)")
    return train, held


def corpus_flags(corpus: str, out: Path) -> tuple[list[str], dict]:
    """Build the corpus once (tokenizer on its training text, two indexed datasets)."""
    d = out / "data" / corpus
    meta_path = d / "meta.json"
    if not meta_path.exists():
        d.mkdir(parents=True, exist_ok=True)
        train, held = _split_documents(corpus)
        tokens = tokenize_splits(d, {"train": train, "heldout": held}, 2048)
        meta = {"corpus": corpus, "train_documents": len(train), "heldout_documents": len(held),
                "train_tokens": tokens["train"], "heldout_tokens": tokens["heldout"],
                "python": sys.version.split()[0]}
        meta_path.write_text(json.dumps(meta, indent=1))
    meta = json.loads(meta_path.read_text())
    d = Path(os.path.relpath(d, REPO))  # runs start in REPO; the run keys hold no absolute path
    flags = ["--train-data-path", str(d / "train_text_document"),
             "--valid-data-path", str(d / "heldout_text_document"),
             "--test-data-path", str(d / "heldout_text_document"),
             "--tokenizer-model", str(d / "train.model"),
             "--data-cache-path", os.path.relpath(out / "cache", REPO)]
    return flags, meta


# ---- runs -----------------------------------------------------------------------------------
def run_flags(variant: str, opts, lr: float) -> tuple[list[str], int]:
    """The variant's flags (without data) and its evaluation iterations."""
    _, extra = VARIANTS[variant]
    B = opts.global_batch
    if extra is None or variant in ONE_WORKER:
        flags = ["--diloco-workers", "1", "--global-batch-size", str(B), "--micro-batch-size",
                 str(B // 2), *(extra or [])]
        samples_per_eval_iter = B
    else:
        flags = [*DILOCO, "--global-batch-size", str(B // 2), "--micro-batch-size",
                 str(B // 2), *extra]
        samples_per_eval_iter = B // 2
    flags += ["--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", "--train-iters", str(opts.steps),
              "--eval-interval", str(opts.eval_interval),
              "--eval-iters", str(opts.eval_samples // samples_per_eval_iter)]
    return flags, samples_per_eval_iter


def run_label(job: dict, steps: int) -> str:
    """corpus/size/variant/lrX/seedN; a run length other than ``STEPS`` is a cell of its own
    in the tables (size@steps)."""
    size = job["size"] if steps == STEPS else f"{job['size']}@{steps}"
    return f"{job['corpus']}/{size}/{job['variant']}/lr{job['lr']:g}/seed{job['seed']}"


def plan(opts) -> list[dict]:
    jobs = []
    for corpus in opts.corpora:
        for size in opts.sizes:
            for variant in opts.variants:
                for lr in opts.lrs:
                    for seed in opts.seeds:
                        jobs.append({"corpus": corpus, "size": size, "variant": variant,
                                     "lr": lr, "seed": seed})
    return jobs


def run_sweep(opts, out: Path, records: Path) -> None:
    jobs = plan(opts)
    started, ran = time.perf_counter(), 0
    for i, job in enumerate(jobs, 1):
        data, _ = corpus_flags(job["corpus"], out)
        flags, _ = run_flags(job["variant"], opts, job["lr"])
        # COMMON has --seed 1; another seed is appended (the last flag wins), so the keys of
        # the seed-1 runs stay as they were.
        seed = [] if job["seed"] == 1 else ["--seed", str(job["seed"])]
        args = [*COMMON, *SIZES[job["size"]], *data, *flags, *seed]
        label = run_label(job, opts.steps)
        t0 = time.perf_counter()
        fresh = not (records / f"{run_key(args)}.json").exists()
        r = launch(args, out, records, label)
        ran += fresh
        row = _row(job, run_key(args), r, opts.global_batch)
        elapsed = time.perf_counter() - started
        eta = elapsed / ran * (len(jobs) - i) if ran else 0
        print(f"[{i}/{len(jobs)}] {label}: held-out {_loss(row['test_loss'], 4)} "
              f"({'ran' if fresh else 'done before'} {time.perf_counter() - t0:.0f} s; "
              f"at most {eta / 60:.0f} min left)", flush=True)


def _row(job: dict, key: str, record: dict, global_batch: int) -> dict:
    s = record["summary"]
    # A diverged run ends with no finite held-out loss: it ranks last, as infinity.
    test_loss = math.inf if s["test_loss"] is None else s["test_loss"]
    return {**job, "label": record["label"], "key": key, "test_loss": test_loss,
            "train_loss": s["train_loss"], "parameters": s["parameters"],
            "cross_worker_bytes": s.get("cross_worker_bytes") or 0,
            "wall_seconds": round(s["wall_seconds"], 1),
            "curve": [(it * global_batch * 128, loss) for it, loss in record["held_out"]]}


def recorded_rows(records: Path, global_batch: int) -> list[dict]:
    """Every finished run's row, from its record (its label names corpus/size/variant/lr/seed),
    so the report covers all runs so far, whichever command ran them."""
    rows = []
    for path in sorted(records.glob("*.json")):
        record = json.loads(path.read_text())
        corpus, size, variant, lr, seed = record["label"].split("/")
        # A record whose key no longer matches its command ran under a library default that
        # has changed since (e.g. the ``defaults`` variant): history, not today's result.
        if variant in VARIANTS and run_key(record["args"]) == path.stem:
            job = {"corpus": corpus, "size": size, "variant": variant,
                   "lr": float(lr.removeprefix("lr")), "seed": int(seed.removeprefix("seed"))}
            rows.append(_row(job, path.stem, record, global_batch))
    return rows


# ---- report ---------------------------------------------------------------------------------
def _loss(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "diverged"


def over_seeds(rows: list[dict]) -> list[dict]:
    """One row per (corpus, size, variant, lr): the mean held-out loss over its seeds, with
    their number and spread (max - min)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["corpus"], r["size"], r["variant"], r["lr"]), []).append(r)
    out = []
    for rs in groups.values():
        losses = [r["test_loss"] for r in rs]
        out.append({**rs[0], "test_loss": sum(losses) / len(losses), "seeds": len(rs),
                    "spread": max(losses) - min(losses)})
    return out


def best_by_lr(rows: list[dict]) -> dict:
    """(corpus, size, variant) -> the row of its best inner lr."""
    best = {}
    for r in rows:
        k = (r["corpus"], r["size"], r["variant"])
        if k not in best or r["test_loss"] < best[k]["test_loss"]:
            best[k] = r
    return best


def tables(rows: list[dict], variants: list[str]) -> str:
    rows = over_seeds(rows)
    cells = sorted({(r["corpus"], r["size"]) for r in rows})
    lrs = sorted({r["lr"] for r in rows})
    by = {(r["corpus"], r["size"], r["variant"], r["lr"]): r for r in rows}
    lines = []
    dp_lr = {}
    for c in cells:
        dps = [by[(*c, "dp", lr)] for lr in lrs if (*c, "dp", lr) in by]
        if dps:
            dp_lr[c] = min(dps, key=lambda r: r["test_loss"])["lr"]
    header = "| variant | what changes | " + " | ".join(
        f"{c} {s} (lr {dp_lr.get((c, s), 0):g})" for c, s in cells) + " |"
    lines += ["Held-out loss and gap to data parallel, every method at data parallel's best "
              "inner lr:", "", header, "|---|---|" + "---|" * len(cells)]
    for v in variants:
        out = []
        for c in cells:
            r, dp = by.get((*c, v, dp_lr.get(c))), by.get((*c, "dp", dp_lr.get(c)))
            out.append("-" if r is None else _loss(r["test_loss"]) + (
                f" ±{r['spread'] / 2:.3f} ({r['seeds']} seeds)" if r["seeds"] > 1 else "") + (
                f" ({100 * (r['test_loss'] / dp['test_loss'] - 1):+.1f} %)"
                if dp and v != "dp" and math.isfinite(r["test_loss"]) else ""))
        if any(x != "-" for x in out):
            lines.append(f"| {v} | {VARIANTS[v][0]} | " + " | ".join(out) + " |")
    if len(lrs) > 1:
        best = best_by_lr(rows)
        lines += ["", "Each method at its own best inner lr (" + ", ".join(
            f"{lr:g}" for lr in lrs) + "):", "", header.replace(" (lr", " (dp lr"),
            "|---|---|" + "---|" * len(cells)]
        for v in variants:
            out = []
            for c in cells:
                r, dp = best.get((*c, v)), best.get((*c, "dp"))
                out.append("-" if r is None else f"{_loss(r['test_loss'])} @ {r['lr']:g}" + (
                    f" ({100 * (r['test_loss'] / dp['test_loss'] - 1):+.1f} %)"
                    if dp and v != "dp" and math.isfinite(r["test_loss"]) else ""))
            if any(x != "-" for x in out):
                lines.append(f"| {v} | {VARIANTS[v][0]} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_by_lr([r for r in rows if r["seed"] == 1])
    cells = sorted({(c, s) for c, s, _ in best})
    fig, axes = plt.subplots(1, len(cells), figsize=(5.5 * len(cells), 4.5), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        finals = []
        for (c, s, v), r in sorted(best.items(), key=lambda kv: LADDER.index(kv[0][2])):
            if (c, s) != cell or not r["curve"] or not math.isfinite(r["test_loss"]):
                continue
            tok, loss = zip(*r["curve"])
            ax.plot(tok, loss, marker=".", lw=1.2 if v in ("dp", "defaults_e2m1") else 0.8,
                    label=f"{v} ({r['test_loss']:.3f})")
            finals.append(r["test_loss"])
        lo = min(finals)
        ax.set_ylim(lo - 0.1, lo + 1.2)
        ax.set_title(f"{cell[0]}, {cell[1]}: held-out loss (best inner lr)", fontsize=9)
        ax.set_xlabel("tokens (all workers)")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=72)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", nargs="+", default=["code", "wiki"])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--variants", nargs="+", default=LADDER, choices=LADDER)
    ap.add_argument("--lrs", nargs="+", type=float, default=[3e-3],
                    help="inner peak learning rates (cosine to a tenth); several: a sweep")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1],
                    help="several: every run once per seed; the tables give the mean")
    ap.add_argument("--steps", type=int, default=STEPS,
                    help="training steps of every run; another number than the default is "
                    "reported as a cell of its own (size@steps)")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step, all "
                    "workers together")
    ap.add_argument("--eval-interval", type=int, default=100)
    ap.add_argument("--eval-samples", type=int, default=256,
                    help="held-out sequences per evaluation, the same for every method")
    ap.add_argument("--out", default=str(REPO / "runs" / "quality"),
                    help="scratch: corpora, data caches, full logs")
    ap.add_argument("--results", default=str(REPO / "docs" / "results" / "quality"),
                    help="one record per finished run (records/KEY.json), quality.json/.md/.png")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: tabulate every recorded run")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    opts = ap.parse_args()
    if opts.list:
        for name, (what, flags) in VARIANTS.items():
            print(f"{name:22s} {what}\n{'':22s} {' '.join(flags or [])}")
        return
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(opts.results)
    if not opts.report:
        run_sweep(opts, out, results / "records")
    rows = recorded_rows(results / "records", opts.global_batch)
    if not rows:
        raise SystemExit("no finished runs")
    corpora = {d.name: json.loads((d / "meta.json").read_text())
               for d in sorted((out / "data").glob("*")) if (d / "meta.json").exists()}
    (results / "quality.json").write_text(json.dumps(
        {"command": " ".join([Path(sys.executable).name, *sys.argv]),
         "common_flags": COMMON, "sizes": SIZES, "corpora": corpora, "runs": rows}, indent=1))
    (results / "quality.md").write_text(tables(rows, LADDER) + "\n")
    plot(rows, results / "quality.png")
    print(tables(rows, LADDER))


if __name__ == "__main__":
    main()

"""The report of ``benchmarks/protocol.py`` (the DiLoCo scaling-law paper's protocol): from
the records, ``protocol.json`` (every run, every cell), ``protocol.md`` (the tables: the two
sweeps, held-out loss and gap to data parallel per rung, M and outer optimizer, the gap along
the top rung's runs) and ``protocol.png`` (the gap against tokens per parameter, per M; the top
rung's held-out curves)."""

import json
import math
import sys
from pathlib import Path

from benchmarks.protocol import (COMMON, H, MOMENTUM, SEQ, _validation, best_dp,
                                 best_outer_lr, parameters, recorded_rows, steps_of)
from benchmarks.quality import _loss

TARGETS = {1: 0.5, 2: 2.0, 4: 4.0}  # % over data parallel at 20 tokens per parameter
PAPER = {1: -0.1, 2: 0.7, 4: 2.0}  # the paper's 35M, Table 4


def _held_out(r: dict) -> float:
    v = r["summary"].get("valid_loss")
    return math.inf if v is None else v


def _outer_name(r: dict) -> str:
    if r["workers"] == 0:
        return "-"
    return "plain" if r["outer_lr"] is None else f"Nesterov {MOMENTUM:g}, lr {r['outer_lr']:g}"


def cells(rows: list[dict], dp, best: dict) -> list[dict]:
    """One cell per (rung, method) at the held settings: its seeds' mean held-out loss and
    curve, and its gap to data parallel over the seeds both ran (all of data parallel's
    where they share none: ``paired`` False)."""
    keep = [r for r in rows if (r["lr"], r["batch"]) == dp and
            (r["workers"] == 0 or r["outer_lr"] is None or r["outer_lr"] == best.get(r["workers"]))]
    groups = {}
    for r in keep:
        groups.setdefault((r["rung"], r["method"]), []).append(r)
    out = []
    for (rung, method), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[1][0]["workers"], kv[1][0]["outer_lr"] is None)):
        dps = {r["seed"]: r for r in groups.get((rung, "dp"), [])}
        seeds = sorted(r["seed"] for r in rs)
        common = [s for s in seeds if s in dps]
        mine = {r["seed"]: r for r in rs}
        base = [dps[s] for s in common] or list(dps.values())
        loss = sum(_held_out(mine[s]) for s in seeds) / len(seeds)
        ref = sum(map(_held_out, base)) / len(base) if base else None
        sel = [mine[s] for s in common] or list(mine.values())
        gap_loss = sum(map(_held_out, sel)) / len(sel)
        out.append({"rung": rung, "method": method, "workers": rs[0]["workers"],
                    "outer": _outer_name(rs[0]), "seeds": seeds,
                    "held_out": loss, "spread": max(map(_held_out, rs)) - min(map(_held_out, rs)),
                    "gap": None if ref is None or method == "dp" else 100 * (gap_loss / ref - 1),
                    "paired": bool(common), "steps": steps_of(rung, dp[1]),
                    "outer_steps": steps_of(rung, dp[1]) // H if rs[0]["workers"] else None,
                    "gap_along": _gap_along(sel, base) if method != "dp" and base else None})
    return out


def _gap_along(mine: list[dict], dps: list[dict]) -> list:
    """(fraction of the run, gap %) at each evaluation both curves have, means over seeds."""
    def mean_curve(rs):
        points = {}
        for r in rs:
            for it, loss in r["held_out"]:
                points.setdefault(it, []).append(loss)
        return {it: sum(v) / len(v) for it, v in points.items() if len(v) == len(rs)}

    a, b = mean_curve(mine), mean_curve(dps)
    last = max(a) if a else 1
    return [(round(it / last, 2), round(100 * (a[it] / b[it] - 1), 2))
            for it in sorted(a) if it in b]


def tables(rows: list[dict], opts) -> str:
    from benchmarks.protocol import SPARSE, size_of

    sized = [r for r in rows if size_of(r["change"])]
    ablated = [r for r in rows if r["change"] and not size_of(r["change"]) and
               r["change"] not in SPARSE]
    sparse = [r for r in rows if r["change"] in SPARSE]
    every, rows = rows, [r for r in rows if not r["change"]]
    rung, top = opts.tune_rung, max(opts.rungs)
    dp = best_dp(rows, rung)
    if dp is None:
        return "No data parallel run at the tuning rung yet."
    best = {m: best_outer_lr(rows, rung, m, dp) for m in (1, 2, 4)}
    lines = [f"Data parallel's inner lr and batch at {rung:g} tokens per parameter, seed 1: "
             "validation loss (held-out in brackets); held: lr "
             f"{dp[0]:g}, batch {dp[1]} x {SEQ} = {dp[1] * SEQ} tokens.", ""]
    tune = [r for r in rows if r["method"] == "dp" and r["rung"] == rung and r["seed"] == 1]
    lrs, batches = sorted({r["lr"] for r in tune}), sorted({r["batch"] for r in tune})
    by = {(r["lr"], r["batch"]): r for r in tune}
    lines += ["| batch (sequences of 256) | " + " | ".join(f"lr {x:g}" for x in lrs) + " |",
              "|---|" + "---|" * len(lrs)]
    for b in batches:
        lines.append(f"| {b} | " + " | ".join(
            "-" if (x, b) not in by else
            f"{_loss(_validation(by[(x, b)]))} ({_loss(_held_out(by[(x, b)]))})"
            for x in lrs) + " |")
    sweep = [r for r in rows if r["workers"] and r["rung"] == rung and r["seed"] == 1 and
             (r["lr"], r["batch"]) == dp]
    if sweep:
        olrs = sorted({r["outer_lr"] for r in sweep if r["outer_lr"] is not None})
        dpv = _validation(by[dp])
        lines += ["", f"The outer lr at {rung:g} tokens per parameter, seed 1: validation loss "
                  "and its gap to data parallel's; each M holds its best Nesterov lr for "
                  "every rung.", "",
                  "| M | plain averaging | " + " | ".join(
                      f"Nesterov {MOMENTUM:g}, lr {x:g}" for x in olrs) + " | held |",
                  "|---|---|" + "---|" * len(olrs) + "---|"]
        for m in sorted({r["workers"] for r in sweep}):
            mine = {r["outer_lr"]: r for r in sweep if r["workers"] == m}
            lines.append(f"| {m} | " + " | ".join(
                "-" if x not in mine else f"{_loss(_validation(mine[x]))} "
                f"({100 * (_validation(mine[x]) / dpv - 1):+.1f} %)" for x in [None, *olrs])
                + (f" | {best[m]:g} |" if best[m] is not None else " | - |"))
    table = cells(rows, dp, best)
    lines += ["", "Held-out loss against data parallel at equal tokens and global batch "
              f"(mean over seeds; gap over the seeds both ran; H={H}, P=3, tau=1, FP4 E2M1 for "
              "M > 1):", "",
              "| tokens per parameter | M | outer optimizer | held-out loss | gap to data "
              "parallel | target | outer steps per fragment | steps | seeds |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in table:
        m = c["workers"]
        target = f"+{TARGETS[m]:g} % (paper {PAPER[m]:+g} %)" if m and c["rung"] == top else ""
        gap = "" if c["gap"] is None else f"{c['gap']:+.2f} %" + (
            "" if c["paired"] else " (unpaired)")
        spread = f" ±{c['spread'] / 2:.3f}" if len(c["seeds"]) > 1 else ""
        lines.append(f"| {c['rung']:g} | {m or 'data parallel'} | {c['outer']} | "
                     f"{_loss(c['held_out'])}{spread} | {gap} | {target} | "
                     f"{c['outer_steps'] or '-'} | {c['steps']} | "
                     f"{', '.join(map(str, c['seeds']))} |")
    along = [c for c in table if c["rung"] == top and c["gap_along"]]
    if along:
        fractions = [f for f, _ in along[0]["gap_along"]]
        lines += ["", f"The gap along the run at {top:g} tokens per parameter (held-out, "
                  "mean over seeds), by the fraction of the run done:", "",
                  "| M | outer optimizer | " + " | ".join(f"{f:.0%}" for f in fractions)
                  + " |", "|---|---|" + "---|" * len(fractions)]
        for c in along:
            g = dict(c["gap_along"])
            lines.append(f"| {c['workers']} | {c['outer']} | " + " | ".join(
                f"{g[f]:+.1f} %" if f in g else "-" for f in fractions) + " |")
    return "\n".join(lines + ablation_table(ablated, rows, dp) + sparse_table(sparse, rows)
                     + [x for at in sorted({r["rung"] for r in sized})
                        for x in size_table([r for r in sized if r["rung"] == at], every, at, dp)])


def ablation_table(ablated: list[dict], rows: list[dict], dp) -> list[str]:
    """M=2 under plain averaging with one change at a time (phase ``ablate``), against the
    unchanged run and data parallel at the same rung and seed."""
    if not ablated:
        return []
    from benchmarks.protocol import ABLATIONS

    out = ["", "One change at a time to M=2 under plain averaging (held-out loss, gap to data "
           "parallel; seed 1):", "", "| tokens per parameter | change | held-out loss | gap to "
           "data parallel | unchanged |", "|---|---|---|---|---|"]
    for r in sorted(ablated, key=lambda r: (r["rung"], r["change"])):
        same = [x for x in rows if (x["rung"], x["seed"], x["lr"], x["batch"]) ==
                (r["rung"], r["seed"], r["lr"], r["batch"])]
        ref = next((x for x in same if x["method"] == "dp"), None)
        base = next((x for x in same if x["method"] == "m2-plain"), None)

        def gap(x):
            return "-" if x is None or ref is None else \
                f"{100 * (_held_out(x) / _held_out(ref) - 1):+.2f} %"
        out.append(f"| {r['rung']:g} | {ABLATIONS[r['change']][0]} | {_loss(_held_out(r))} | "
                   f"{gap(r)} | {gap(base)} |")
    return out


def sparse_table(sparse: list[dict], rows: list[dict]) -> list[str]:
    """The sparse exchange at two densities (phase ``sparse``) beside the dense FP4 one and
    data parallel at the same rung, seed, lr and batch: held-out loss, its gap, the bytes
    across workers and data parallel's for the same steps (``comm.traffic``: a ring
    all-reduce of fp32 gradients over the M workers every step) over them."""
    if not sparse:
        return []
    from benchmarks.protocol import SPARSE
    from megatron_streaming.comm.traffic import ring_all_reduce_bytes

    out = ["", "The sparse exchange against the dense FP4 one (plain averaging, H=30, P=3, tau=1; "
           "held-out loss, seed 1; bytes: all workers' cross-worker sends, data parallel's: a ring "
           "all-reduce of fp32 gradients over the M workers at every step):", "",
           "| tokens per parameter | M | exchange | held-out loss | gap to data parallel | bytes "
           "across workers | data parallel's bytes / these |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["rung"], r["workers"], r["seed"], r["lr"], r["batch"]) for r in sparse})
    for rung, m, seed, lr, batch in keys:
        same = [x for x in [*rows, *sparse] if (x["rung"], x["seed"], x["lr"], x["batch"]) ==
                (rung, seed, lr, batch)]
        ref = next((x for x in same if x["method"] == "dp"), None)
        runs = [x for x in same if x["workers"] == m and x["outer_lr"] is None and
                (x["change"] is None or x["change"] in SPARSE)]
        for r in sorted(runs, key=lambda x: (x["change"] is not None, x["change"] or "")):
            s = r["summary"]
            dp_bytes = ring_all_reduce_bytes(s["parameters"], m) * s["iteration"]
            sent = s["cross_worker_bytes"]
            gap = "-" if ref is None else f"{100 * (_held_out(r) / _held_out(ref) - 1):+.2f} %"
            what = "dense FP4 (E2M1, block 128)" if r["change"] is None else \
                SPARSE[r["change"]][0]
            out.append(f"| {rung:g} | {m} | {what} | {_loss(_held_out(r))} | {gap} | "
                       f"{sent / 1e6:.2f} MB | {dp_bytes / sent:,.0f}x |")
    return out


def size_table(sized: list[dict], rows: list[dict], rung: float, dp) -> list[str]:
    """Phase ``size``: data parallel and M workers with the model scaled down and up, beside
    the protocol's own model at the same rung, seeds, lr and batch; each run's gap against
    data parallel of its size (and of its other changes but the exchange)."""
    if not sized:
        return []
    from benchmarks.protocol import CHANGES, SPARSE, changes_of, parameters, size_of

    seeds = {r["seed"] for r in sized}
    exchanges = {None, *(c for r in sized for c in changes_of(r["change"]) if c in SPARSE)}
    own = [r for r in rows if r["rung"] == rung and r["seed"] in seeds and (r["lr"], r["batch"])
           == dp and r["outer_lr"] is None and r["change"] in exchanges and r["workers"] != 1]
    out = ["", f"The model's size (phase size; {rung:g} tokens per parameter, plain averaging, "
           "held lr and batch; gap against data parallel of the same size and seed):", "",
           "| model | parameters | steps | seed | M | exchange | held-out loss | gap to data "
           "parallel |", "|---|---|---|---|---|---|---|---|"]

    def dense(r):  # its change without the exchange's settings
        return "+".join(c for c in changes_of(r["change"]) if c not in SPARSE)

    def order(r):
        return parameters(change=r["change"]), dense(r), r["seed"], r["workers"], r["change"] or ""
    for r in sorted([*own, *sized], key=order):
        ref = next((x for x in [*own, *sized] if x["workers"] == 0 and x["seed"] == r["seed"]
                    and (x["change"] or "") == dense(r)), None)
        gap = "" if r["workers"] == 0 or ref is None else \
            f"{100 * (_held_out(r) / _held_out(ref) - 1):+.2f} %"
        size = size_of(r["change"])
        what = ", ".join(CHANGES[c][0] for c in changes_of(r["change"]) if c != size)
        exchange = "-" if r["workers"] == 0 else (what or "dense FP4")
        name = CHANGES[size][0] if size else "the protocol's (6 layers, d 96, 3 heads)"
        out.append(f"| {name} | {parameters(change=r['change']):,} | "
                   f"{steps_of(r['rung'], r['batch'], r['change'])} | {r['seed']} | "
                   f"{r['workers'] or 'data parallel'} | {exchange} | {_loss(_held_out(r))} | "
                   f"{gap} |")
    return out


def plot(rows: list[dict], opts, path: Path) -> None:
    import matplotlib

    rows = [r for r in rows if not r["change"]]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dp = best_dp(rows, opts.tune_rung)
    best = {m: best_outer_lr(rows, opts.tune_rung, m, dp) for m in (1, 2, 4)}
    table = cells(rows, dp, best)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {1: "tab:green", 2: "tab:blue", 4: "tab:red"}
    for m in (1, 2, 4):
        for plain in (False, True):
            cs = [c for c in table if c["workers"] == m and c["gap"] is not None and
                  (c["outer"] == "plain") == plain]
            if cs:
                left.plot([c["rung"] for c in cs], [c["gap"] for c in cs], marker="o",
                          ls="--" if plain else "-", color=colors[m],
                          label=f"M={m}, {cs[0]['outer']}")
        left.scatter([max(opts.rungs)], [TARGETS[m]], marker="_", s=300, color=colors[m])
    left.axhline(0, color="k", lw=0.8)
    left.set_xscale("log", base=2)
    left.set_xlabel("tokens per parameter")
    left.set_ylabel("held-out loss over data parallel's (%)")
    left.set_title("gap to data parallel (bars: the targets)", fontsize=9)
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    top = [r for r in rows if r["rung"] == max(opts.rungs) and r["seed"] == 1 and
           (r["lr"], r["batch"]) == dp and (r["workers"] == 0 or r["outer_lr"] is None or
                                             r["outer_lr"] == best.get(r["workers"]))]
    for r in sorted(top, key=lambda r: (r["workers"], r["outer_lr"] is None)):
        it, loss = zip(*r["held_out"])
        right.plot([i * dp[1] * SEQ / 1e6 for i in it], loss, marker=".",
                   color=colors.get(r["workers"], "k"),
                   ls="--" if r["workers"] and r["outer_lr"] is None else "-",
                   label=f"{r['method']} ({_held_out(r):.3f})")
    right.set_xlabel("tokens (millions, all workers)")
    right.set_ylabel("held-out loss")
    right.set_title(f"{max(opts.rungs):g} tokens per parameter, seed 1", fontsize=9)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def report(opts, results: Path, meta: dict) -> str:
    rows = recorded_rows(results / "records")
    if not rows:
        raise SystemExit(f"no finished runs in {results / 'records'}")
    dp = best_dp(rows, opts.tune_rung)
    best = {m: best_outer_lr(rows, opts.tune_rung, m, dp) for m in (1, 2, 4)}
    cell_rows = [r for r in rows if not r["change"]]
    (results / "protocol.json").write_text(json.dumps(
        {"command": " ".join([Path(sys.executable).name, *sys.argv]), "common_flags": COMMON,
         "parameters": parameters(), "corpus": meta,
         "held": {"lr": dp and dp[0], "batch": dp and dp[1], "outer_lr": best},
         "cells": cells(cell_rows, dp, best) if dp else [],
         "runs": [{k: v for k, v in r.items()} for r in rows]}, indent=1))
    text = tables(rows, opts)
    (results / "protocol.md").write_text(text + "\n")
    if dp:
        plot(rows, opts, results / "protocol.png")
    return text

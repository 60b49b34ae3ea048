"""The plan as text: per worker its layout, memory and step time, the sync settings with
their reasons and predictions, and one sbatch line per worker (``--explain``: the cuts into
workers that were weighed, and each cluster's top candidates and why each lost)."""

from __future__ import annotations

import shlex
from typing import List

from .clusters import Link
from .memory import GIB, ModelShape
from .search import MORE_WORKERS_FOR, TIE, Plan

EXPLAINED = 6  # candidates shown per cluster


def format_plan(result: Plan, shape: ModelShape, link: Link, flags: List[str],
                rendezvous: str, explain: bool = False) -> str:
    workers = result.workers
    host, _, port = rendezvous.rpartition(":")
    sizes = [w.best.layout.ranks for w in workers]
    per_cluster = {}
    for w in workers:
        per_cluster.setdefault(w.cluster, []).append(w)
    cut = ", ".join(f"{len(ws)} on {c.name}" for c, ws in per_cluster.items())
    each = f"of {sizes[0]} devices each" if len(set(sizes)) == 1 else \
        f"of {' / '.join(str(d) for d in sizes)} devices"
    lines = [f"Plan: {len(workers)} workers {each} ({cut}), "
             f"{shape.parameters() / 1e6:,.1f}M parameters, global batch "
             f"{sum(w.global_batch for w in workers)} shared by speed"]
    for i, w in enumerate(workers):
        c, b = w.cluster, w.best
        lines.append(
            f"  worker {i} ({c.name}): {b.layout.describe()}; batch {w.global_batch}; "
            f"{b.memory_gib:.1f} of {c.device_memory_gib:g} GiB per device, "
            f"{w.step_seconds:.2f} s per step, {b.tokens_per_s:,.0f} tokens/s")
        if w.host is not None:
            lines.append("    " + host_line(w))
    for c, ws in per_cluster.items():
        idle = c.devices - sum(w.best.layout.ranks for w in ws)
        if idle:
            lines.append(f"  {idle} of {c.name}'s {c.devices} devices idle (every worker has "
                         f"{ws[0].best.layout.ranks} devices)")
    step = max(w.step_seconds for w in workers)
    if not result.sync_flags:
        lines += [f"Sync: none ({result.reasons[0]})"]
    else:
        lines += _sync_lines(result, link, step)
    lines += [
        "",
        f"# the rendezvous, on {host} (a host every cluster reaches):",
        f"bash launch/rendezvous.sh --port {port}",
    ]
    for i, w in enumerate(workers):
        c, layout = w.cluster, w.best.layout
        devices = layout.ranks
        nodes = -(-devices // c.devices_per_node)
        args = [*flags, *layout.flags(), "--global-batch-size", str(w.global_batch),
                "--diloco-workers", str(len(workers)), "--diloco-worker-index", str(i),
                *result.sync_flags, "--master-addr", host, "--master-port", port,
                "--rendezvous-external"]
        sbatch = ["sbatch", f"--nodes={nodes}",
                  f"--gpus-per-node={min(devices, c.devices_per_node)}", "--exclusive",
                  *shlex.split(c.sbatch), "launch/slurm.sh", *args]
        lines += [f"# worker {i}, on {c.name}:", shlex.join(sbatch)]
    if explain:
        lines += ["", "Cuts into workers (the chosen first; each worker more than the "
                  f"fewest must make the step {MORE_WORKERS_FOR:.0%} faster, as each costs "
                  "loss):"]
        chosen = result.options[0].step_seconds
        for o in result.options:
            what = o.why_not or f"slowest step {o.step_seconds:.2f} s"
            if not o.why_not and o is not result.options[0]:
                change = 1 - o.step_seconds / chosen
                what += f" ({abs(change):.1%} {'faster' if change > 0 else 'slower'})"
            lines.append(f"  {o.describe()}: {what}")
        shown_clusters = set()
        for w in workers:
            if w.cluster in shown_clusters:
                continue
            shown_clusters.add(w.cluster)
            lines += ["", f"Candidates on {w.cluster.name} (of {len(w.ranked)}), the chosen "
                      "first:"]
            chosen = w.best
            others = [c for c in w.ranked if c.layout != chosen.layout]
            shown = [chosen, *[c for c in others if not c.why_not][:EXPLAINED - 1],
                     *[c for c in others if c.why_not][:2]]
            for c in shown:
                ratio = c.tokens_per_s / chosen.tokens_per_s - 1
                if c is chosen:
                    why = "chosen"
                elif c.why_not:
                    why = c.why_not
                elif ratio < -TIE:
                    why = f"{-ratio:.1%} slower"
                else:
                    why = "as fast; more memory or more ranks per replica"
                lines.append(f"  {c.layout.describe():58s} {c.memory_gib:6.1f} GiB "
                             f"{c.step_seconds:7.2f} s  {why}")
    return "\n".join(lines)


def _sync_lines(result: Plan, link: Link, step: float) -> List[str]:
    """The sync over the link: its flags, the exchange's prediction and the rule's reasons."""
    return [
        f"Sync over the link ({link.bandwidth_gbit_per_s:g} Gbit/s, RTT {link.rtt_ms:g} ms): "
        f"{' '.join(result.sync_flags)}",
        f"  one fragment's exchange {result.exchange_seconds:.2f} s "
        f"({result.exchange_seconds / step:.2f} steps of the slowest worker); predicted "
        f"compute utilisation {result.utilisation:.1%}; link rate {result.mean_link_gbit_per_s:.2f}"
        f" Gbit/s on average, {result.peak_link_gbit_per_s:.2f} at the peak; "
        f"{result.fewer_bytes_than_data_parallel:.0f}x fewer bytes than data parallel across "
        "the clusters (bf16 gradients every step)",
        *(f"  - {r}" for r in result.reasons)]


def host_line(w) -> str:
    """A worker's host memory per node: its ranks on a node times one rank's, what of it is
    pinned, by component; and whether it fits the node's, where the cluster says."""
    n, host = w.ranks_per_node, w.host
    parts = ", ".join(f"{name} {n * v / GIB:.1f}" for name, v in host.parts.items() if v)
    line = (f"host memory per node: {n * host.total / GIB:.1f} GiB, "
            f"{n * host.pinned / GIB:.1f} of it pinned ({n} ranks"
            + (f": {parts} GiB)" if parts else ")"))
    budget = w.cluster.host_memory_gib
    if budget:
        line += (f"; fits the node's {budget:g} GiB" if n * host.total <= budget * GIB
                 else f"; more than the node's {budget:g} GiB: --async-save or "
                 "--diloco-offload-outer-state off, or fewer ranks per node")
    return line


__all__ = ["format_plan", "host_line"]

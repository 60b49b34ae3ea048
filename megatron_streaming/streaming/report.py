"""Turns every rank's sync statistics into one worker's scalars (for TensorBoard and logs).

Collective over the worker's ranks (in-worker traffic only): every rank of the worker must
call ``worker_scalars`` at the same iterations. Every worker puts the same bytes on the
cross-worker wire (one layout: the same shards; different layouts: lanes of the same sizes),
so traffic totals are the reporting worker's times M; outer-gradient norms and drift are the
reporting worker's own (with workers of different batches they differ between workers).

Per-fragment bytes count the exchanges merged since the last point (a report at which the
caller resets them, ``reset_interval_stats``);
``streaming/cross_worker_bytes`` is the whole job's cumulative count, for plotting traffic
against steps: the transport's own, as in the summary's ``cross_worker_bytes``, so an exchange
counts once it completes, which with overlap may be a step or more before its merge.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from ..parallel.topology import device_of
from .sync import FragmentStats, StreamingSync

_SUMMED = ("grad_sq", "bytes_sent", "bytes_received", "skipped")
_MAXED = ("latency", "wait", "quant_error")


def worker_scalars(sync: StreamingSync, worker_group,
                   control_bytes: float = 0.0) -> Dict[str, float]:
    """The worker's sync scalars; none without a sync (``NoSync``, on every rank alike)."""
    if not sync.enabled:
        return {}
    P = sync.schedule.num_fragments
    # Rows 0..P-1: per fragment; row P: per rank (the transport's cumulative bytes sent and
    # the rank's cross-worker control bytes), reduced in the same all-reduce rather than by a
    # collective of its own.
    sums = torch.zeros(P + 1, len(_SUMMED) + 2, dtype=torch.float64)
    maxes = torch.zeros(P, len(_MAXED), dtype=torch.float64)
    for p, stats in sync.stats.items():
        sums[p, :len(_SUMMED)] = torch.tensor([float(getattr(stats, k)) for k in _SUMMED])
        maxes[p] = torch.tensor([float(getattr(stats, k)) for k in _MAXED])
    sums[:P, len(_SUMMED):] = sync.drift_terms()
    sums[P, 0] = float(sync.transport.bytes_sent)
    sums[P, 1] = float(control_bytes)
    device = device_of(worker_group)  # NCCL on a GPU job: the reduction runs on the GPU
    sums, maxes = sums.to(device), maxes.to(device)
    dist.all_reduce(sums, group=worker_group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=worker_group)
    sums, maxes = sums.cpu(), maxes.cpu()
    out: Dict[str, float] = {}
    for p in range(P):
        prefix = f"streaming/fragment_{p}/"
        out[prefix + "outer_grad_norm"] = float(sums[p, 0].sqrt())
        out[prefix + "bytes_sent"] = float(sums[p, 1])
        out[prefix + "bytes_received"] = float(sums[p, 2])
        out[prefix + "skipped"] = float(sums[p, 3])
        out[prefix + "drift"] = _ratio(sums[p, 4], sums[p, 5])
        out[prefix + "send_to_merge_s"] = float(maxes[p, 0])
        out[prefix + "merge_wait_s"] = float(maxes[p, 1])
        out[prefix + "quant_rel_error"] = float(maxes[p, 2])
    out["streaming/drift"] = _ratio(sums[:P, 4].sum(), sums[:P, 5].sum())
    out["streaming/worker_bytes_sent"] = float(sums[:P, 1].sum())
    out["streaming/skipped_fragments"] = float(sums[:P, 3].sum())
    # sync.workers is M (with workers of one size, the size of this rank's data group).
    out["streaming/cross_worker_bytes"] = float(sums[P, 0]) * sync.workers
    # Control (stop flags, checkpoint agreement, ...): this worker's ranks' own count, as
    # counted so far. Not times M: the door and the heartbeats cross at the workers without
    # the store only. The job-wide total (``streaming/cross_worker_control_bytes``) takes a
    # collective across workers: it is written once, at the end, with the summary's value.
    out["streaming/worker_control_bytes"] = float(sums[P, 1])
    return out


def reset_interval_stats(sync: StreamingSync) -> None:
    """Byte counts and waits are per report interval; the rest keep their latest value."""
    for stats in sync.stats.values():
        stats.bytes_sent = stats.bytes_received = 0
        stats.wait = 0.0


def total_bytes_sent(sync: StreamingSync, worker_group, workers: int) -> int:
    """Bytes all ranks of all workers put on the cross-worker wire (collective in-worker;
    0 without a sync, on every rank alike)."""
    if not sync.enabled:
        return 0
    mine = torch.tensor([sync.transport.bytes_sent], dtype=torch.float64,
                        device=device_of(worker_group))
    dist.all_reduce(mine, group=worker_group)
    return int(mine.item()) * workers


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float((num / den).sqrt()) if den > 0 else 0.0


__all__ = ["FragmentStats", "worker_scalars", "reset_interval_stats", "total_bytes_sent"]

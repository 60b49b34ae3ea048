"""Per-phase step timers, as Megatron-LM's ``--timing-log-level`` / ``--timing-log-option``.

Level 1 times each iteration's ``forward-backward`` (the schedule: every micro-batch's forward
and backward, the pipeline's sends and receives, the reductions DeepSpeed runs in backward
hooks) and ``optimizer`` (DeepSpeed's step: the remaining gradient reductions, the clip, the
inner optimizer, ZeRO's gather of the updated weights, and the Streaming DiLoCo hook that runs
inside it). Level 2 adds ``diloco-sync``: the part of ``optimizer`` spent in that hook on the
training thread (reading shards, the delta, handing the exchange to its thread, merging).

The times accumulate over the log interval and are reported per iteration (their mean), as
Megatron's timers with its normaliser: a block under the progress line,
``(min, max) time across ranks (ms):`` over the worker's ranks (``minmax``, the default),
the maximum only (``max``), or every rank (``all``); and TensorBoard scalars
``timers/<name>-time`` (the worker's maximum, in ms). On CUDA each phase is closed with a
device synchronize, so the times are the device's, at that cost; level 0 (the default)
times nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, List

LEVELS = (0, 1, 2)
OPTIONS = ("max", "minmax", "all")
PHASES = {1: ("forward-backward", "optimizer"), 2: ("diloco-sync",)}


def phases(level: int) -> List[str]:
    """The phases timed at ``level``, in report order."""
    return [name for lv in sorted(PHASES) if lv <= level for name in PHASES[lv]]


class StepTimers:
    """Seconds per phase since the last ``report``; every method is a no-op at level 0."""

    def __init__(self, level: int = 0, option: str = "minmax",
                 synchronize: Callable[[], None] = lambda: None):
        self.level, self.option, self.names = level, option, phases(level)
        self._synchronize = synchronize
        self.seconds: Dict[str, float] = dict.fromkeys(self.names, 0.0)
        self.iterations = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            yield
            return
        self._synchronize()
        started = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.seconds[name] += time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        """A phase measured elsewhere (the sync's hook times itself)."""
        if name in self.seconds:
            self.seconds[name] += seconds

    def end_iteration(self) -> None:
        self.iterations += 1

    def report(self, group) -> Dict[str, List[float]]:
        """Collective over ``group`` (every rank of the worker calls it): each phase's mean
        seconds per iteration since the last report, one value per rank of the group; the
        counters start again."""
        if not self.names:
            return {}
        import torch
        import torch.distributed as dist

        from ..parallel.topology import device_of

        n = max(1, self.iterations)
        mine = torch.tensor([self.seconds[k] / n for k in self.names], dtype=torch.float64)
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        device = device_of(group) if size > 1 else torch.device("cpu")
        rows = [torch.zeros_like(mine, device=device) for _ in range(size)]
        if size > 1:
            dist.all_gather(rows, mine.to(device), group=group)
        else:
            rows = [mine]
        self.seconds = dict.fromkeys(self.names, 0.0)
        self.iterations = 0
        return {k: [float(r[i]) for r in rows] for i, k in enumerate(self.names)}


def format_report(times: Dict[str, List[float]], option: str) -> str:
    """Megatron's block: one line per phase, in ms, padded with dots."""
    if not times:
        return ""
    head = {"max": "max time across ranks (ms):",
            "minmax": "(min, max) time across ranks (ms):",
            "all": "times across ranks (ms):"}[option]
    lines = [head]
    for name, values in times.items():
        ms = [v * 1e3 for v in values]
        if option == "max":
            shown = f"{max(ms):.2f}"
        elif option == "minmax":
            shown = f"({min(ms):.2f}, {max(ms):.2f})"
        else:
            shown = ", ".join(f"{i}: {v:.2f}" for i, v in enumerate(ms))
        lines.append(f"    {name + ' ':.<40}: {shown}")
    return "\n".join(lines)


def scalars(times: Dict[str, List[float]]) -> Dict[str, float]:
    """TensorBoard's: each phase's worker maximum in ms, as Megatron names them."""
    return {f"timers/{name}-time": max(values) * 1e3 for name, values in times.items()}


__all__ = ["LEVELS", "OPTIONS", "StepTimers", "format_report", "phases", "scalars"]

"""When each fragment is sent and merged: a pure function of the step number.

Streaming DiLoCo (arXiv 2501.18512): with H inner steps per round and P fragments, fragment p
starts its k-th sync after inner step ``s = k*H - p*H/P`` (s > 0), so one fragment goes out
every H/P steps and every fragment once per H steps. Its result is merged tau steps later
(tau = 0: at once, blocking). With eager outer updates (arXiv 2502.12996) an exchange is
instead applied at the fragment's next send, a whole round later: each send is also the merge
of that fragment's previous exchange, and after its first send a fragment always has one
exchange in flight. All workers must run the same fragment at the same step in the
same order, whatever their speed, or their collectives pair up wrongly and deadlock: nothing
here may depend on anything but the step.

Steps are counted from 1: "after step s" is after the s-th optimizer step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class SyncSchedule:
    inner_steps: int      # H
    num_fragments: int    # P
    overlap_steps: int = 0  # tau
    # ``--diloco-sync-spacing lr|decay``: the steps after which the 1st, 2nd, ... send starts (one
    # fragment each, in the same rotation as evenly spaced sends); past the last of them,
    # sends go on every H/P steps. None: every H/P steps from the start.
    send_steps: Optional[Tuple[int, ...]] = None
    eager: bool = False  # ``--diloco-eager``: an exchange merges at its fragment's next send

    def __post_init__(self):
        H, P, tau = self.inner_steps, self.num_fragments, self.overlap_steps
        if self.eager and tau:
            raise ValueError(f"--diloco-eager overlaps each exchange with a whole round (it "
                             f"merges at the fragment's next send): --diloco-overlap-steps "
                             f"({tau}) must be 0 with it")
        if H < 1 or P < 1:
            raise ValueError(f"--diloco-inner-steps ({H}) and --diloco-fragments ({P}) must "
                             "be >= 1")
        if H % P:
            raise ValueError(f"--diloco-inner-steps ({H}) is not divisible by "
                             f"--diloco-fragments ({P})")
        if not 0 <= tau < H // P:
            raise ValueError(f"--diloco-overlap-steps ({tau}) must satisfy 0 <= tau < "
                             f"H/P = {H}/{P} = {H // P}")

    @property
    def interval(self) -> int:
        """Steps between two consecutive fragment sends (H/P)."""
        return self.inner_steps // self.num_fragments

    def sends_after(self, step: int) -> List[int]:
        """Fragments whose sync starts after ``step`` (at most one)."""
        k = self._send_number(step)
        # The k-th send, after k*H/P in even spacing: s = k*H - p*H/P  <=>  p = -k mod P.
        return [] if k is None else [(-k) % self.num_fragments]

    def _send_number(self, step: int) -> Optional[int]:
        """k when the k-th send (from 1) starts after ``step``, else None."""
        if step <= 0:
            return None
        if self.send_steps:
            last = self.send_steps[-1]
            if step <= last:
                i = bisect.bisect_left(self.send_steps, step)
                return i + 1 if self.send_steps[i] == step else None
            after = step - last
            return None if after % self.interval else len(self.send_steps) + after // \
                self.interval
        return None if step % self.interval else step // self.interval

    def _sends_through(self, step: int) -> int:
        """How many sends started after steps 1 .. ``step``."""
        if step <= 0:
            return 0
        if self.send_steps:
            last = self.send_steps[-1]
            if step <= last:
                return bisect.bisect_right(self.send_steps, step)
            return len(self.send_steps) + (step - last) // self.interval
        return step // self.interval

    def merges_after(self, step: int) -> List[int]:
        """Fragments whose in-flight sync is merged after ``step``."""
        if self.eager:  # the previous send of the fragment sent now, if there was one
            k = self._send_number(step)
            return [] if k is None or k <= self.num_fragments else [(-k) % self.num_fragments]
        return self.sends_after(step - self.overlap_steps)

    def send_step_of(self, fragment: int, round_index: int) -> int:
        """The step after which ``fragment`` starts its ``round_index``-th sync (1-based)."""
        return round_index * self.inner_steps - fragment * self.interval

    def in_flight_after(self, step: int) -> List[int]:
        """Fragments sent at or before ``step`` whose merge comes after it."""
        if self.eager:  # the last P sends, one per fragment
            k = self._sends_through(step)
            return [(-i) % self.num_fragments for i in range(max(1, k - self.num_fragments + 1),
                                                              k + 1)]
        return [p for s in range(max(1, step - self.overlap_steps + 1), step + 1)
                for p in self.sends_after(s)]


def spaced_sends(weights: Sequence[float], interval: int,
                 overlap_steps: int) -> Tuple[int, ...]:
    """``--diloco-sync-spacing lr|decay``: as many sends as every ``interval`` steps would make
    over ``len(weights)`` steps, placed where the summed weight crosses equal shares of its
    total, so the sends are dense where the weight is high. ``weights[i]`` is step i+1's
    (``sync_weights``). Two sends are at least ``overlap_steps + 1`` apart: where the weight
    crowds them closer, the later ones move on, and at the end of the run the earlier ones
    move back, so the count stays."""
    total, sends, gap = sum(weights), len(weights) // interval, overlap_steps + 1
    if sends == 0 or total <= 0:
        return ()
    out, running, k = [], 0.0, 1
    for step, weight in enumerate(weights, start=1):
        running += weight
        while k <= sends and running >= total * k / sends * (1 - 1e-12):
            out.append(max(step, out[-1] + gap if out else 1))
            k += 1
    latest = len(weights)  # interval > overlap_steps: sends x gap fits in the run
    for i in reversed(range(len(out))):
        out[i] = latest = min(out[i], latest)
        latest -= gap
    return tuple(out)


def sync_weights(spacing: str, lrs: Sequence[float]) -> List[float]:
    """Each step's share of the sends under ``--diloco-sync-spacing``: ``lr``, the learning
    rate itself (often while it is high, where the workers drift apart fastest); ``decay``,
    its inverse square root (sparse at the peak, dense in the warm-up and at the end of the
    decay, where the quality benchmark saw the gap to data parallel open; floored at a
    hundredth of the peak so that a zero lr stays finite; an lr of zero throughout spaces
    them evenly)."""
    if spacing == "lr":
        return list(lrs)
    if spacing == "decay":
        floor = max(lrs) / 100 or 1.0
        return [max(lr, floor) ** -0.5 for lr in lrs]
    raise ValueError(f"--diloco-sync-spacing {spacing!r}: one of steps, lr, decay")

"""When each fragment is sent and merged: a pure function of the step number.

Streaming DiLoCo (arXiv 2501.18512): with H inner steps per round and P fragments, fragment p
starts its k-th sync after inner step ``s = k*H - p*H/P`` (s > 0), so one fragment goes out
every H/P steps and every fragment once per H steps. Its result is merged tau steps later
(tau = 0: at once, blocking). All workers must run the same fragment at the same step in the
same order, whatever their speed, or their collectives pair up wrongly and deadlock: nothing
here may depend on anything but the step.

Steps are counted from 1: "after step s" is after the s-th optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class SyncSchedule:
    inner_steps: int      # H
    num_fragments: int    # P
    overlap_steps: int = 0  # tau

    def __post_init__(self):
        H, P, tau = self.inner_steps, self.num_fragments, self.overlap_steps
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
        if step <= 0 or step % self.interval:
            return []
        # s = k*H - p*H/P  <=>  p = (k*P - s/(H/P)) mod P with k chosen so that 0 <= p < P.
        return [(-(step // self.interval)) % self.num_fragments]

    def merges_after(self, step: int) -> List[int]:
        """Fragments whose in-flight sync is merged after ``step``."""
        return self.sends_after(step - self.overlap_steps)

    def send_step_of(self, fragment: int, round_index: int) -> int:
        """The step after which ``fragment`` starts its ``round_index``-th sync (1-based)."""
        return round_index * self.inner_steps - fragment * self.interval

    def in_flight_after(self, step: int) -> List[int]:
        """Fragments sent at or before ``step`` whose merge comes after it."""
        return [p for s in range(max(1, step - self.overlap_steps + 1), step + 1)
                for p in self.sends_after(s)]

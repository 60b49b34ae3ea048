"""Fault injection for tests and drills, switched on only by environment variables.

* ``MEGATRON_STREAMING_SLOW_WORKER=W:SECONDS``: worker W sleeps SECONDS after every step, so
  it runs slower than the others (the schedule must keep every worker in step anyway).
* ``MEGATRON_STREAMING_STALL_WORKER=W:STEP``: worker W stops answering after step STEP (it
  sleeps instead of training), so its peers must end in the sync timeout, not hang.
"""

from __future__ import annotations

import os
import time
from typing import Optional, Tuple

SLOW = "MEGATRON_STREAMING_SLOW_WORKER"
STALL = "MEGATRON_STREAMING_STALL_WORKER"


def _parse(name: str) -> Optional[Tuple[int, float]]:
    value = os.environ.get(name)
    if not value:
        return None
    worker, amount = value.split(":")
    return int(worker), float(amount)


def after_step(worker: int, step: int) -> None:
    slow = _parse(SLOW)
    if slow and slow[0] == worker:
        time.sleep(slow[1])
    stall = _parse(STALL)
    if stall and stall[0] == worker and step >= stall[1]:
        while True:  # a peer that never answers again
            time.sleep(3600)

"""Which errors mean a lost or stuck peer (``crossworker.CrossWorker.failed`` decides what
then happens)."""

from __future__ import annotations

import torch.distributed as dist

from ..errors import JobFailure


def is_communication_error(e: BaseException) -> bool:
    """A failed or timed-out collective (a lost or stuck peer), as opposed to a bug."""
    from .transport import SyncTimeout

    if isinstance(e, (SyncTimeout, ConnectionError, TimeoutError)):
        return True
    if isinstance(e, JobFailure):  # already says what happened (e.g. a full disk)
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()  # e.g. gloo's "Application timeout caused pair closure"
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("gloo", "connection", "nccl", "timed out", "timeout", "socket",
                            "pair closure"))

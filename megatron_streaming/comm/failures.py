"""Which errors mean a lost or stuck peer, and where such an error goes in an elastic run."""

from __future__ import annotations

import torch.distributed as dist

from ..errors import JobFailure


def hand_over(on_lost, error: BaseException) -> None:
    """A failed cross-worker collective of an elastic run goes to ``on_lost``
    (``elastic.Elastic.note``); without one, or for any other error, it is raised."""
    if on_lost is None or not is_communication_error(error):
        raise error
    on_lost(error)


def is_communication_error(e: BaseException) -> bool:
    """A failed or timed-out collective (a lost or stuck peer), as opposed to a bug."""
    from ..comm.transport import SyncTimeout

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

"""A save that failed, told the same way on every rank: the OSError behind what torch's
checkpoint writer raised, every rank's failures merged in rank order, and the message that
names --save, the iteration and the checkpoint that is still the latest
(``CheckpointWriteError``). The save's start (``save_load``) and its commit (``commit``) fail
through these; a read that fails is told by ``is_read_error``.
"""

from __future__ import annotations

from typing import Optional

from ..errors import JobFailure, first_line
from .resume import CheckpointError
from .store import find_checkpoint


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


# torch's checkpoint reader and writer report failures as a CheckpointException, which is a
# BaseException: caught alongside ordinary ones.
ERRORS = (Exception, _checkpoint_exception())


class CheckpointWriteError(JobFailure):
    """A checkpoint that could not be written; the message names --save, the path and the
    checkpoint that is still the latest."""


def attempt(action) -> Optional[OSError]:
    """Run ``action``; the OSError it raised (or the one behind the writer's report), or None.
    Anything else is raised."""
    try:
        action()
    except ERRORS as e:
        error = os_error(e)
        if error is None:
            raise
        return error
    return None


def merged(failure_lists) -> list:
    """(rank, text) of every failure in ``failure_lists`` (each a list of them), once per
    rank, in rank order."""
    every = {}
    for failures in failure_lists:
        for rank, text in failures:
            every.setdefault(rank, text)
    return sorted(every.items())


def text_of(error: Optional[OSError]) -> Optional[str]:
    return None if error is None else str(error)


def os_error(e: BaseException):
    """The OSError behind ``e``, or None. torch's checkpoint writer reports a failed write
    (disk full) as a CheckpointException carrying each rank's failure as text."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            for failure in e.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure  # (exc, trace)
                found = os_error(inner) if isinstance(inner, BaseException) else None
                text = first_line(inner).replace("Worker failure: ", "")
                return found or OSError(text)
            # No failure of its own: the writer failed on another rank, which reports it.
            return OSError("the checkpoint writer failed on another rank")
        e = e.__cause__ or e.__context__
    return None


def is_read_error(e: BaseException) -> bool:
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(e, (OSError, pickle.UnpicklingError, EOFError, CheckpointException))


def write_error_message(root: str, iteration: int, failed, error) -> str:
    mine = f": {error}" if error is not None else ""
    try:
        directory, _ = find_checkpoint(root)
        previous = f"the latest checkpoint is still {directory}"
    except CheckpointError:
        previous = "no earlier checkpoint exists there"
    return (f"--save {root}: writing the checkpoint of iteration {iteration} failed on "
            f"rank(s) {failed}{mine}; {previous}")

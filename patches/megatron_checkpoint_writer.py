"""Adapter: where megatron-core's torch_dist writer leaves its write results (megatron-core
0.16.1).

``FileSystemWriterAsync`` (``dist_checkpointing.strategies.filesystem_async``) writes a rank's
files in processes it forks, and the function that waits for them puts their results into a
queue that the finalisation reads: a module-level ``_results_queue``, made on first use as a
queue of a *spawned* ``multiprocessing`` Manager, so that megatron-core's own asynchronous
callers can put into it from another process. The Manager's server then unpickles the results
(torch's ``WriteResult``s), which imports torch in that server: 5.5 s of a rank's first save
on CPU, and a process that lives as long as the rank.

Here the writer's waiting function runs in the saving process itself (the step loop, or a
thread with ``--async-save``: ``megatron_streaming.checkpoint.background``), never in another
process, so ``in_process_results`` sets that queue to an in-process ``queue.Queue`` once,
before the first save plans its write. Megatron-core's ``AsyncCallsQueue`` (a forked or
persistent caller process) would not see it; nothing here uses those.
"""

import queue

from ._pinning import require_version_once

NAME = "megatron_checkpoint_writer"
PACKAGE, VERSION = "megatron-core", "0.16.1"


def in_process_results() -> None:
    """Write results go through a queue of this process (idempotent)."""
    require_version_once(PACKAGE, VERSION, NAME)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()

"""Writing a rank's checkpoint files, in the step loop's thread or beside it (``--async-save``).

megatron-core's torch_dist save comes in three parts (``dist_checkpointing.save`` with
``async_sharded_save``): planning (collective: the write plan and ``common.pt``), the write of
this rank's ``__<rank>_<n>.distcp`` files (no collective: ``AsyncRequest.async_fn``, which
forks megatron-core's writer processes), and finalisation (collective: every rank's write
results go to the worker's first rank, which writes torch's ``.metadata`` index and
megatron-core's ``metadata.json``). ``Checkpointer`` plans and finalises in the step loop; the
write, and the SHA-256 of the files it wrote, run here: at once (a synchronous save) or on a
thread while training goes on.

Before a background write the tensors are copied out: ``preload_fn`` copies device tensors to
host memory; host tensors that may still change (the model's weights, views of the optimizer's
and the sync's buffers) are cloned, the main replica's only (the others are not written).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Optional

from .store import checkpoint_files, file_table

# The files of one rank of a worker's part; the others (``.metadata``, ``common.pt``,
# ``metadata.json``) are the worker's first rank's.
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


def own_files(directory: str, local: int) -> list:
    """The files rank ``local`` of the worker wrote into its part ``directory``; for the first
    rank also the worker's shared ones."""
    out = []
    for f in checkpoint_files(directory):
        m = _RANK_FILE.match(f)
        if (m is not None and int(m.group(1)) == local) or (m is None and local == 0):
            out.append(f)
    return out


def snapshot(sharded: dict) -> dict:
    """Clone the host tensors this rank writes (a background write must not see the next
    step's updates); device tensors are copied to the host by the request's ``preload_fn``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    for value in sharded.values():
        if isinstance(value, ShardedTensor) and value.data is not None and \
                value.data.device.type == "cpu" and is_main_replica(value.replica_id):
            value.data = value.data.clone()
    return sharded


class FileWrite:
    """This rank's files of one checkpoint being written: ``run`` writes them at once,
    ``start`` on a thread. ``wait`` returns the table (path -> size, SHA-256) of the files it
    wrote, or raises what the write raised; ``error`` is the OSError of a failed write."""

    def __init__(self, request, directory: str, local: int):
        self.request, self.directory, self.local = request, directory, local
        self.table: dict = {}
        self.error: Optional[BaseException] = None
        self.seconds = {"write": 0.0, "hash": 0.0}
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()
        if request is not None and request.preload_fn is not None:  # device -> host, here
            args = list(request.async_fn_args)
            args[1] = request.preload_fn()
            self.request = request._replace(async_fn_args=tuple(args))

    def run(self) -> "FileWrite":
        try:
            started = time.perf_counter()
            r = self.request
            if r is not None and r.async_fn is not None:
                r.async_fn(*r.async_fn_args, **r.async_fn_kwargs)
            written = time.perf_counter()
            mine = [f for f in own_files(self.directory, self.local)
                    if _RANK_FILE.match(f)]
            self.table = file_table(self.directory, mine)
            self.seconds = {"write": written - started, "hash": time.perf_counter() - written}
        except BaseException as e:  # reported by ``wait``, in the step loop's thread
            self.error = e
        finally:
            self._done.set()
        return self

    def start(self) -> "FileWrite":
        self._thread = threading.Thread(target=self.run, name="checkpoint-write", daemon=True)
        self._thread.start()
        return self

    def is_background(self) -> bool:
        return self._thread is not None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> dict:
        self._done.wait()
        if self._thread is not None:
            self._thread.join()
        return self.table

    def finalize(self) -> None:
        """megatron-core's finalisation (collective within the worker: ``.metadata``)."""
        for fn in self.request.finalize_fns if self.request is not None else ():
            fn()


class PendingSave:
    """A checkpoint whose files are being written; ``Checkpointer.finish_save`` commits it."""

    def __init__(self, root: str, iteration: int, partial: str, final: str, part: str,
                 infos: list, write: FileWrite, timings: dict, run_state: dict, describe):
        self.root, self.iteration, self.partial, self.final = root, iteration, partial, final
        self.part, self.infos, self.write, self.timings = part, infos, write, timings
        # What the checkpoint's JSON records: the run's state, the job's description
        # (``JobState.describe``, called on the leading rank at the commit).
        self.run_state, self.describe = run_state, describe
        self.started = time.perf_counter()

    def written(self) -> bool:
        """This rank's files are all written and hashed (or the write failed)."""
        return self.write.done()


__all__ = ["FileWrite", "PendingSave", "own_files", "snapshot"]

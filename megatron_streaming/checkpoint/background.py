"""Writing a rank's checkpoint files, in the step loop's thread or beside it (``--async-save``).

megatron-core's torch_dist save comes in three parts (``dist_checkpointing.save`` with
``async_sharded_save``): planning (collective: the write plan and ``common.pt``), the write of
this rank's ``__<rank>_<n>.distcp`` files (no collective), and finalisation (every rank's
write results go to the worker's first rank, which writes torch's ``.metadata`` index and
megatron-core's ``metadata.json``). ``Checkpointer`` plans in the step loop (a save that
plans afresh) or on the write's thread (one that reuses the kept plan) and carries the
results itself (``patches.megatron_save_plan.SavePlans.finish``); the write runs here
(``patches.megatron_checkpoint_writer.write_files``: a thread per file, each hashed as it is
written, ``store.HASH``): at once (a synchronous save) or on a thread while training goes on,
which then leaves the rank's results beside the files for the worker's first rank (``report``).
The stages of a background save's commit run on threads too (``Task``).

What is written is never copied for a synchronous save: nothing changes the tensors while the
step loop waits, so a view of a larger buffer (a parameter in ZeRO's flat buffer, a master in
its partition) is handed to the writer as a tensor over the same memory whose storage is
exactly its bytes (``exact``; megatron-core would otherwise clone it, since ``torch.save``
writes a tensor's whole storage). Before a background write the host tensors are copied out
(and the device tensors out of the device) into a staging buffer kept from one save to the
next (``Staging``: made beside training before the first save, every save only copies; pinned
on a GPU, at its exact size: ``comm.pinned``); a synchronous save's device tensors go to host
memory by megatron-core's ``preload_fn``.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from typing import Optional

import torch

from ..comm import pinned
from .store import HASH, checkpoint_files, new_hash

# The files of one rank of a worker's part; the others (``.metadata``, ``common.pt``,
# ``metadata.json``) are the worker's first rank's.
_RANK_FILE = re.compile(r"__\d+_\d+\.distcp$")


def shared_files(directory: str) -> list:
    """The files of a worker's part ``directory`` that its first rank's finalisation wrote
    (the others are each rank's own ``__<rank>_<n>.distcp``)."""
    return [f for f in checkpoint_files(directory) if not _RANK_FILE.match(f)]


def _written(sharded: dict, host_only: bool = True):
    """The tensors of ``sharded`` that this rank writes (its main replicas), those in host
    memory only unless not ``host_only``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    return [v for v in sharded.values()
            if isinstance(v, ShardedTensor) and v.data is not None and
            (v.data.device.type == "cpu" or not host_only) and is_main_replica(v.replica_id)]


def exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a host tensor) over the same memory, as a tensor whose storage is exactly its
    bytes, so that the writer writes it in place rather than a clone (``t`` itself when it
    already is, or is not contiguous)."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() == nbytes or not t.is_contiguous() or nbytes == 0:
        return t
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()  # keeps ``t``'s memory alive
    return torch.from_numpy(raw).view(t.dtype).view(t.shape)


def in_place(sharded: dict) -> dict:
    """A synchronous save: this rank's host tensors written from where they are."""
    for value in _written(sharded):
        value.data = exact(value.data)
    return sharded


class Staging:
    """A host buffer that a background save copies this rank's tensors into (from host or
    device memory), so the next steps may change them while the files are written. Kept for
    the next save, which copies into memory already mapped (a fresh allocation costs a page
    fault per 4 KiB, most of a copy's time); reallocated only when the save needs more. The
    views of its slices that the writer writes from are kept too while the saves' dtypes and
    shapes stay the same. ``reserve`` makes it ahead of the first save, on a thread beside
    training, so that the first save only copies too. Where a save has device tensors and
    CUDA is available the buffer is pinned and the copies asynchronous, waited for once.
    Used by one save at a time (a save waits for the write before it)."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._reserving: Optional[threading.Thread] = None
        self._layout: Optional[tuple] = None  # the dtypes and shapes ``_views`` are for
        self._views: list = []

    @staticmethod
    def _sizes(values) -> list:
        return [v.data.numel() * v.data.element_size() for v in values]

    @staticmethod
    def _device(values) -> Optional[torch.device]:
        """The GPU the copies come from, for which the buffer is pinned (None: no GPU)."""
        return next((v.data.device for v in values if v.data.is_cuda), None) \
            if torch.cuda.is_available() else None

    def reserve(self, sharded: dict) -> int:
        """Start making (and touching) the buffer a save of ``sharded`` needs, on a thread;
        returns its bytes."""
        values = _written(sharded, host_only=False)
        need, device = pinned.layout(self._sizes(values))[1], self._device(values)

        def make():  # pinned at its exact size (not torch's power of two), else faulted in
            self.buffer, self._layout = pinned.host_buffer(need, device), None

        if need > self.buffer.numel():
            self._reserving = threading.Thread(target=make, name="checkpoint-staging",
                                               daemon=True)
            self._reserving.start()
        return need

    def snapshot(self, sharded: dict) -> dict:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        values = _written(sharded, host_only=False)
        layout = tuple((v.data.dtype, tuple(v.data.shape)) for v in values)
        if layout != self._layout:  # the views into the buffer, kept while it holds
            sizes = self._sizes(values)
            offsets, need = pinned.layout(sizes)
            if need > self.buffer.numel():
                self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one freed first
                self.buffer = pinned.host_buffer(need, self._device(values))
            self._views = [exact(self.buffer[offset:offset + n].view(v.data.dtype)
                                 .view(v.data.shape))
                           for v, offset, n in zip(values, offsets, sizes)]
            self._layout = layout
        asynchronous = any(v.data.is_cuda for v in values) and self.buffer.is_pinned()
        for value, view in zip(values, self._views):
            view.copy_(value.data, non_blocking=asynchronous)
            value.data = view
        if asynchronous:
            torch.cuda.synchronize()  # the copies landed before the writer reads them
        return sharded


class FileWrite:
    """This rank's files of one checkpoint being written: ``run`` writes them at once,
    ``start`` on a thread. ``wait`` returns the table (path -> size, hash) of the files it
    wrote, or raises what the write raised; ``results`` are its write results (for torch's
    index); ``error`` is the OSError of a failed write. With ``report`` (a path) the table
    and results are also written there as JSON once the files are, for the worker's first
    rank to read (``Checkpointer.advance``). ``request`` is megatron-core's write request, or
    a function that makes it (on the write's thread: the rest of a start that needs neither
    the step loop nor another rank; the tensors it writes already copied out)."""

    def __init__(self, request, directory: str, report: Optional[str] = None):
        self.request, self.directory = request, directory
        self.report = report
        self.table: dict = {}
        self.results: list = []
        self.error: Optional[BaseException] = None
        self.seconds = {"write": 0.0}  # hashed as written: the time of both
        self._background = False
        self._done = threading.Event()

    def run(self) -> "FileWrite":
        from patches.megatron_checkpoint_writer import results_to_json, write_files

        try:
            started = time.perf_counter()
            r = self.request() if callable(self.request) else self.request
            r = self.request = _preloaded(r)  # a synchronous save's device tensors
            if r is not None and r.async_fn is not None:
                written, self.results = write_files(r, new_hash)
                self.table = {name: {"size": size, HASH: digest}
                              for name, (size, digest) in written.items()}
            if self.report is not None:
                write_json(self.report, {"table": self.table,
                                         "results": results_to_json(self.results)})
            self.seconds = {"write": time.perf_counter() - started}
        except BaseException as e:  # reported by ``wait``, in the step loop's thread
            self.error = e
        finally:
            self._done.set()
        return self

    def start(self, runner: "Runner") -> "FileWrite":
        self._background = True
        runner.submit(self.run)
        return self

    def is_background(self) -> bool:
        return self._background

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> dict:
        self._done.wait()
        return self.table


def _preloaded(request):
    """``request`` with its tensors in host memory (megatron-core's ``preload_fn``: a copy of
    each device tensor; host tensors are taken as they are)."""
    if request is None or request.preload_fn is None:
        return request
    args = list(request.async_fn_args)
    args[1] = request.preload_fn()
    return request._replace(async_fn_args=tuple(args))


def write_json(path: str, value) -> None:
    """``value`` as JSON at ``path`` (its folder made), for another rank to read once told."""
    import json
    import os

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f)


def read_json(path: str):
    import json

    with open(path) as f:
        return json.load(f)


class Runner:
    """The thread of a rank's background work (a save's write, then its commit's stages),
    kept from one save to the next, running what it is given in turn. Handing it an action
    costs the step loop no thread start (on shared cores a new thread waited up to 0.04 s
    for a CPU before ``Thread.start`` returned)."""

    def __init__(self, name: str = "checkpoint-background"):
        self.name = name
        self._actions: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Runner":
        """Start the thread unless it runs (``submit`` starts it too)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def submit(self, action) -> None:
        self.start()._actions.put(action)

    def _run(self) -> None:
        while True:
            self._actions.get()()  # each catches what it raises (FileWrite, Task)


class Task:
    """One action of a save's commit (the worker's finalisation, the job's commit) on the
    background thread (``Runner``) beside training: ``done`` once it ran; ``wait``
    returns what it returned, or raises what it raised."""

    def __init__(self, action, runner: Runner):
        self._result, self._raised = None, None
        self._done = threading.Event()

        def run():
            try:
                self._result = action()
            except BaseException as e:  # raised by ``wait``, in the step loop's thread
                self._raised = e
            finally:
                self._done.set()

        runner.submit(run)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self):
        self._done.wait()
        if self._raised is not None:
            raise self._raised
        return self._result


# A save after its start: its files being written (every rank), the worker's part being
# finalised (torch's index, megatron-core's metadata.json: the worker's first rank), the job's
# checkpoint being committed (the leading rank), then done.
WRITING, FINALISING, COMMITTING, DONE = "writing", "finalising", "committing", "done"


class PendingSave:
    """A checkpoint whose files are being written; ``Checkpointer.advance`` (a step at a
    time, from the flags every rank reads after the same step) or ``finish_save`` (at once)
    commits it."""

    def __init__(self, root: str, iteration: int, partial: str, final: str, part: str,
                 infos: list, write: FileWrite, timings: dict, run_state: dict, describe,
                 error: Optional[OSError] = None):
        self.root, self.iteration, self.partial, self.final = root, iteration, partial, final
        self.part, self.infos, self.write, self.timings = part, infos, write, timings
        # What the checkpoint's JSON records: the run's state, the job's description
        # (``JobState.describe``, called on the leading rank at the commit).
        self.run_state, self.describe = run_state, describe
        self.error = error  # this rank's failure (before the write, or of a later stage)
        self.stage = WRITING
        self.task: Optional[Task] = None  # this rank's finalisation or commit, on a thread
        self.summary: Optional[dict] = None  # the worker's part (its first rank's)
        self.started = time.perf_counter()

    def written(self) -> bool:
        """This rank's files are all written and hashed (or the write failed)."""
        return self.write.done()


__all__ = ["COMMITTING", "DONE", "FINALISING", "FileWrite", "PendingSave", "Runner", "Staging",
           "Task", "WRITING", "exact", "in_place", "read_json", "shared_files", "write_json"]

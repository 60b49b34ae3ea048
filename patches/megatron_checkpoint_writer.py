"""Adapter: megatron-core's torch_dist writer, its files written and hashed in the saving
process, its results returned there (megatron-core 0.16.1; torch's private ``_write_item`` and
``_StorageInfo``: the torch series of ``_pinning.TORCH_VERSIONS``).

``FileSystemWriterAsync`` (``dist_checkpointing.strategies.filesystem_async``) writes a rank's
files in processes it forks, and the function that waits for them puts their results into a
queue that the finalisation reads: a module-level ``_results_queue``, made on first use as a
queue of a *spawned* ``multiprocessing`` Manager, so that megatron-core's own asynchronous
callers can put into it from another process. The Manager's server then unpickles the results
(torch's ``WriteResult``s), which imports torch in that server: 5.5 s of a rank's first save
on CPU, and a process that lives as long as the rank.

Here the files are written in the saving process itself (the step loop, or a thread with
``--async-save``: ``megatron_streaming.checkpoint.background``), never in another process, and
the results are returned, not queued; the queue is still made when a save is planned
(``get_save_function_and_args``), so ``in_process_results`` sets it to an in-process
``queue.Queue`` once, before the first save plans its write. Megatron-core's
``AsyncCallsQueue`` (a forked or persistent caller process) and its finalisation would not
see the results; nothing here uses those.

``write_files`` does the writer's part of a planned save (``FileSystemWriterAsync``'s write
buckets: each a file name, its storage key and the items in it) itself, through torch's
``_write_item``, which is what megatron-core's writer processes call for each item, and
returns the write results (what torch's ``.metadata`` index records of each item: its file,
offset and length) to its caller, which carries them to the worker's first rank
(``megatron_save_plan.SavePlans.finish``), in memory or as JSON (``results_to_json``).
"""

import queue

from ._pinning import TORCH_VERSIONS, require_version_once

NAME = "megatron_checkpoint_writer"
PACKAGE, VERSION = "megatron-core", "0.16.1"


def _check_torch() -> None:
    require_version_once("torch", TORCH_VERSIONS, NAME)


def in_process_results() -> None:
    """The queue of write results a save's plan makes is one of this process (idempotent)."""
    require_version_once(PACKAGE, VERSION, NAME)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def write_files(request, digest) -> tuple:
    """The files of a planned torch_dist save (the request ``dist_checkpointing.save(...,
    async_sharded_save=True)`` returns) written by this process, one thread per file instead
    of megatron-core's forked writer processes (forking a rank of many GiB costs seconds, and
    the results would come back through a queue), each file hashed with ``digest()`` as its
    bytes are written instead of being read back afterwards. Every record's bytes are covered
    by that hash, so torch's own per-record CRC-32 is left out meanwhile (``torch.load``
    reads such files; a zip tool warns). A failed write raises here. Returns ({file name:
    (size, hex digest)}, names relative to the checkpoint directory; this rank's write
    results)."""
    require_version_once(PACKAGE, VERSION, NAME)
    _check_torch()
    import concurrent.futures
    import os

    import torch
    from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item

    transform_list, use_msc = request.async_fn.args
    if use_msc:
        raise NotImplementedError("multi-storage client checkpoints are not supported")
    _, buckets, _ = request.async_fn_args

    def write(bucket):
        file_name, storage_key, (bytes_data, tensor_data) = bucket
        with open(file_name, "wb") as f:
            stream = _Hashed(f, digest())
            results = [_write_item(*transform_list, stream, data, item, storage_key,
                                   serialization_format=SerializationFormat.TORCH_SAVE)
                       for item, data in [*bytes_data, *tensor_data]]
            f.flush()
            os.fsync(f.fileno())
        return results, storage_key, (stream.size, stream.hash.hexdigest())

    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(buckets))) as pool:
            done = list(pool.map(write, buckets))
    finally:
        torch.serialization.set_crc32_options(crc)
    return ({name: info for _, name, info in done},
            [result for results, _, _ in done for result in results])


def results_to_json(results) -> list:
    """Write results (torch's ``WriteResult``: an item's index, its file, offset and length)
    as JSON values, for ``results_from_json`` on another rank."""
    out = []
    for r in results:
        s, i = r.storage_data, r.index
        out.append({"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset),
                    "index": i.index, "size": r.size_in_bytes, "path": s.relative_path,
                    "at": s.offset, "length": s.length,
                    "transforms": None if s.transform_descriptors is None
                    else list(s.transform_descriptors)})
    return out


def results_from_json(items: list) -> list:
    _check_torch()
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    return [WriteResult(index=MetadataIndex(d["fqn"], d["offset"], d["index"]),
                        size_in_bytes=d["size"],
                        storage_data=_StorageInfo(d["path"], d["at"], d["length"],
                                                  d["transforms"]))
            for d in items]


class _Hashed:
    """A file being written from its start, hashing what passes (the file-like object torch's
    ``_write_item`` and ``torch.save`` write to: ``write``, ``tell``, ``flush``)."""

    def __init__(self, f, hash_):
        self.f, self.hash, self.size = f, hash_, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.size += len(view)
        return self.f.write(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

"""Where megatron's GPTDataset writes its index caches (document, sample and shuffle indices).

raw text -> tokenizer -> indexed dataset -> **GPTDataset (+ index cache)** -> sampler -> batches.

Megatron builds the caches on global rank 0, barriers, and then has every other rank *load* them
from the same path; a rank that cannot see rank 0's files crashes in ``numpy.load`` while the
rest wait in the next barrier. So the directory is chosen once, on rank 0, and every rank checks
that it can see a probe file rank 0 wrote there. If any cannot (nodes without a shared file
system, a node-local tmp dir), all ranks fall back to building the indices in memory, which
megatron does when the cache path is the empty string; the indices are a pure function of the
seed, so every rank still gets the same ones.

Each DiLoCo worker is its own world (its own rank 0), and the workers of a job share the cache
directory: two rank 0s would write the same files at once, and a rank of one worker could load a
file the other worker's rank 0 is still writing. So a worker's rank 0 builds under an exclusive
lock on the directory (``build_lock``): the second worker's rank 0 then finds every file whole.
"""

import contextlib
import fcntl
import logging
import os
import tempfile
import uuid
from typing import Optional, Sequence

from megatron_streaming.errors import UsageError

logger = logging.getLogger(__name__)

NO_CACHE = ""  # megatron's "build in memory, save nothing"


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
        return True
    except OSError:
        return False


def pick_cache_dir(data_cache_path: Optional[str], prefixes: Sequence[str]) -> str:
    """This process's choice: the given path, else ``<data dir>/cache``, else a tmp dir.

    The data directory is often read-only (a shared corpus), hence the fallbacks; an explicit
    ``--data-cache-path`` that cannot be written is an error, not something to route around.
    """
    if data_cache_path is not None:
        if data_cache_path == NO_CACHE or _writable_dir(data_cache_path):
            return data_cache_path
        raise UsageError(f"--data-cache-path {data_cache_path!r}: cannot create or write to it")
    candidates = [os.path.join(os.path.dirname(prefix), "cache") for prefix in prefixes[:1]]
    candidates.append(os.path.join(tempfile.gettempdir(), f"megatron_streaming_cache_{os.getuid()}"))
    for candidate in candidates:
        if _writable_dir(candidate):
            return candidate
    return NO_CACHE


def sees_probe(path: str) -> bool:
    """Whether this rank sees rank 0's probe file (a seam for tests)."""
    return os.path.isfile(path)


def resolve_cache_path(data_cache_path: Optional[str], prefixes: Sequence[str]) -> str:
    """The cache path every rank passes to megatron: the same on all ranks, or ``NO_CACHE``.

    Collective over the default process group when one is initialized (megatron's builder
    barriers on it anyway); raises the same ValueError on every rank for a bad path.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return pick_cache_dir(data_cache_path, prefixes)
    rank = dist.get_rank()
    message = [None, None, None]  # path, probe file, error
    if rank == 0:
        try:
            path = pick_cache_dir(data_cache_path, prefixes)
            probe = os.path.join(path, f".probe-{uuid.uuid4().hex}") if path else None
            if probe:
                open(probe, "w").close()
            message = [path, probe, None]
        except ValueError as err:
            message = [None, None, str(err)]
    dist.broadcast_object_list(message, src=0)
    path, probe, error = message
    if error is not None:
        raise UsageError(error)
    if not probe:
        return NO_CACHE
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, sees_probe(probe))
    if rank == 0:
        os.remove(probe)
    if all(seen):
        return path
    if rank == 0:
        blind = [r for r, ok in enumerate(seen) if not ok]
        logger.warning("data cache %r is not visible from ranks %s; every rank builds the "
                       "dataset indices in memory instead", path, blind)
    return NO_CACHE


@contextlib.contextmanager
def build_lock(cache_path: Optional[str]):
    """Held by a worker's rank 0 while it builds (or loads) the indices in ``cache_path``, so
    that no two workers write the same cache files at once; nothing without a cache."""
    import torch.distributed as dist

    if not cache_path or (dist.is_initialized() and dist.get_rank() != 0):
        yield
        return
    with open(os.path.join(cache_path, ".build.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

"""Checkpoints: one file per rank, committed atomically for the whole job.

Layout under ``--save DIR``::

    DIR/iter_0000020/rank_00003.pt      this rank's model shard, optimizer partition, RNG,
                                         and whatever extra state hooks registered
    DIR/iter_0000020/metadata.json      layout, iteration, every rank file and its size
    DIR/latest_checkpointed_iteration.txt

All ranks write into ``iter_N.partial``; once every rank of every worker has written, global
rank 0 writes the metadata and renames the directory to ``iter_N`` (an atomic rename), then
replaces the tracker file (also atomic). A crash at any point leaves either the previous
checkpoint or the new complete one as "latest", never a half-written one.

The ZeRO optimizer is saved as each rank's fp32 master partitions plus the inner optimizer's
state, and restored into the same places, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Callable, Dict, List, Optional

import torch

from .errors import JobFailure, UsageError

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


class CheckpointError(UsageError):
    """A checkpoint directory that cannot be used; the message names the flag and the path."""


class CheckpointWriteError(JobFailure):
    """A checkpoint that could not be written; the message names --save, the path and the
    checkpoint that is still the latest."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def optimizer_state(optimizer) -> dict:
    """ZeRO: fp32 master partitions + inner optimizer; otherwise the optimizer itself."""
    if hasattr(optimizer, "single_partition_of_fp32_groups"):
        return {"fp32_partitions": [p.detach().clone()
                                    for p in optimizer.single_partition_of_fp32_groups],
                "inner": optimizer.optimizer.state_dict()}
    return {"plain": optimizer.state_dict()}


def load_optimizer_state(optimizer, state: dict) -> None:
    if "fp32_partitions" in state:
        with torch.no_grad():
            for dst, src in zip(optimizer.single_partition_of_fp32_groups,
                                state["fp32_partitions"]):
                if dst.shape != src.shape:
                    raise CheckpointError(f"fp32 partition of shape {tuple(src.shape)} does not "
                                          f"fit {tuple(dst.shape)}: was the layout changed?")
                dst.copy_(src)
        optimizer.optimizer.load_state_dict(state["inner"])
        optimizer.update_lp_params()  # fp32 masters -> model weights, all-gathered over DP
    else:
        optimizer.load_state_dict(state["plain"])


class Checkpointer:
    """Saves and loads this rank's part of a job-wide checkpoint."""

    def __init__(self, topology, failed_ranks: Callable[[bool], List[int]]):
        self.topology = topology
        # Collective over every rank of every worker: the ranks whose argument is True.
        self.failed_ranks = failed_ranks
        self.rank = topology.rank
        self.extra_state: Dict[str, object] = {}  # name -> object with state_dict/load_state_dict

    def save(self, root: str, iteration: int, model, optimizer, run_state: dict) -> str:
        """Write this rank's file, then commit on rank 0. A write that fails on any rank
        (disk full, read-only, no permission) fails the save on every rank with
        ``CheckpointWriteError``; the previous checkpoint stays the latest."""
        final = iteration_dir(root, iteration)
        partial = final + ".partial"

        def prepare():
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash mid-save
            os.makedirs(partial)

        self._agree(root, iteration, partial, prepare if self.rank == 0 else None)
        payload = {"format_version": FORMAT_VERSION, "iteration": iteration,
                   "model": model.state_dict(), "optimizer": optimizer_state(optimizer),
                   "rng": rng_state(), "run": run_state,
                   "extra": {k: v.state_dict() for k, v in self.extra_state.items()}}
        self._agree(root, iteration, partial,
                    lambda: _atomic_torch_save(payload, rank_file(partial, self.rank)))
        self._agree(root, iteration, partial, (lambda: self._commit(
            root, partial, final, iteration)) if self.rank == 0 else None)
        return final

    def _agree(self, root: str, iteration: int, partial: str, action) -> None:
        """Run ``action`` (None: nothing) and learn whether it failed on any rank; the
        collective doubles as the barrier between the phases of a save."""
        error = None
        if action is not None:
            try:
                action()
            except OSError as e:
                error = e
        failed = self.failed_ranks(error is not None)
        if not failed:
            return
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # give back the space it took
        raise CheckpointWriteError(_write_error_message(root, iteration, failed, error))

    def _commit(self, root: str, partial: str, final: str, iteration: int) -> None:
        layout = self.topology.layout
        files = {}
        for r in range(layout.world_size):
            path = rank_file(partial, r)
            files[os.path.basename(path)] = os.path.getsize(path)
        meta = {"format_version": FORMAT_VERSION, "iteration": iteration,
                "layout": _layout_dict(layout), "files": files}
        _atomic_write(os.path.join(partial, "metadata.json"), json.dumps(meta, indent=2))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(root)
        _atomic_write(os.path.join(root, TRACKER), f"{iteration}\n")

    def load(self, root: str, model, optimizer) -> dict:
        """Restore everything; returns the run state saved with it (iteration, ...)."""
        path = check_loadable(root, self.topology.layout, self.rank)
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # any unpickling failure means a corrupt file
            raise CheckpointError(f"--load {root}: cannot read {path}: {e}") from None
        model.load_state_dict(payload["model"])
        load_optimizer_state(optimizer, payload["optimizer"])
        set_rng_state(payload["rng"])
        for name, obj in self.extra_state.items():
            obj.load_state_dict(payload["extra"][name])
        return payload["run"]


def _write_error_message(root: str, iteration: int, failed, error) -> str:
    mine = f": {error}" if error is not None else ""
    try:
        directory, _ = find_checkpoint(root)
        previous = f"the latest checkpoint is still {directory}"
    except CheckpointError:
        previous = "no earlier checkpoint exists there"
    return (f"--save {root}: writing the checkpoint of iteration {iteration} failed on "
            f"rank(s) {failed}{mine}; {previous}")


def find_checkpoint(root: str):
    """(directory, metadata) of the latest complete checkpoint under ``root``."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isdir(root):
        raise CheckpointError(f"--load {root}: no such directory")
    if not os.path.isfile(tracker):
        raise CheckpointError(f"--load {root}: no checkpoint in this directory "
                              f"({TRACKER} is missing)")
    text = open(tracker).read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"--load {root}: {TRACKER} holds {text!r}, not an "
                              "iteration") from None
    directory = iteration_dir(root, iteration)
    meta_path = os.path.join(directory, "metadata.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--load {root}: checkpoint of iteration {iteration} is "
                              f"incomplete or corrupt ({meta_path}: {e})") from None
    if meta.get("format_version") != FORMAT_VERSION or meta.get("iteration") != iteration:
        raise CheckpointError(f"--load {root}: {meta_path} does not describe iteration "
                              f"{iteration} in format {FORMAT_VERSION}")
    return directory, meta


def check_loadable(root: str, layout, rank: int) -> str:
    """This rank's file of the latest checkpoint, after checking it fits this run.

    Needs no process group, so a wrong --load fails before any collective."""
    directory, meta = find_checkpoint(root)
    expected = _layout_dict(layout)
    if meta.get("layout") != expected:
        raise CheckpointError(f"--load {root}: checkpoint was written by layout "
                              f"{meta.get('layout')}, this run is {expected}")
    path = rank_file(directory, rank)
    size = meta.get("files", {}).get(os.path.basename(path))
    if size is None or not os.path.isfile(path) or os.path.getsize(path) != size:
        raise CheckpointError(f"--load {root}: {path} is missing or truncated")
    return path


def check_writable(root: str, rank: int) -> None:
    """Fail before training when --save cannot take a file (read-only, no permission)."""
    probe = os.path.join(root, f".write_test_rank_{rank:05d}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save {root} is not writable: {e}") from None


def has_checkpoint(root: Optional[str]) -> bool:
    return bool(root) and os.path.isfile(os.path.join(root, TRACKER))


def _layout_dict(layout) -> dict:
    return {"world_size": layout.world_size, "workers": layout.workers, "tp": layout.tp,
            "pp": layout.pp, "dp": layout.dp}


def _atomic_torch_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as e:  # torch's zip writer reports a failed write (ENOSPC) this way
        if isinstance(e.__context__, OSError):
            raise OSError(e.__context__.errno, f"{e.__context__.strerror}: {tmp}") from None
        raise
    os.replace(tmp, path)


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

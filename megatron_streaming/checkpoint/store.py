"""Checkpoint directories: atomic commits, the JSON that describes them, and file checks.

Layout under ``--save DIR``::

    DIR/iter_0000020/
        worker0/                         worker 0's part: megatron-core dist_checkpointing,
            __<rank>_<n>.distcp          torch_dist format, written by its ranks in parallel
            .metadata                    torch.distributed.checkpoint's index of them
            common.pt, metadata.json     megatron-core's own small files
        worker1/ ...                     one per worker, each written by that worker alone
        checkpoint.json                  ours: iteration, layout, workers, sync, every file's
                                         size and SHA-256
    DIR/latest_checkpointed_iteration.txt

Each worker is its own world (``distributed.init_distributed``) and saves its own part: its
weights, inner optimizer and RNG, and a whole copy of the global state (theta_g, the outer
momentum, the exchange in flight), so that any one worker's part can start a new or replaced
worker. Every worker writes into ``iter_N.partial/worker<w>``; once all have, global rank 0
writes ``checkpoint.json`` and renames the directory to ``iter_N`` (atomic), then replaces
the tracker file (atomic too). A crash at any point leaves the previous checkpoint or the new
complete one as the latest, never a half-written one. (Format 2, still read: one
dist_checkpointing directory for the whole job, ``iter_N`` itself.)

Loading never runs code from a file: the sizes and SHA-256 of every file are checked against
``checkpoint.json`` first, megatron-core's ``common.pt`` is read with ``weights_only``, and
torch's ``.metadata`` through a restricted unpickler (``patches.torch_dcp_safe_metadata``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from ..errors import first_line
from .resume import FORMAT_VERSION, READABLE_VERSIONS, CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
META = "checkpoint.json"
RELEASE = "release"  # Megatron-LM's tracker names this directory instead of an iteration


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_files(directory: str) -> list:
    """Relative paths of every file of a checkpoint directory but ours, sorted."""
    return sorted(os.path.relpath(os.path.join(d, n), directory)
                  for d, _, files in os.walk(directory) for n in files
                  if os.path.relpath(os.path.join(d, n), directory) != META)


def share(files: list, rank: int, world: int) -> list:
    """This rank's share of ``files`` to hash (round robin: the ranks hash in parallel)."""
    return [f for i, f in enumerate(files) if i % world == rank]


def file_table(directory: str, files=None) -> dict:
    """relative path -> {size, HASH} of ``files`` (default: every file but ours)."""
    files = checkpoint_files(directory) if files is None else files
    return {rel: {"size": os.path.getsize(os.path.join(directory, rel)),
                  HASH: file_hash(os.path.join(directory, rel))} for rel in files}


# The hash each file's entry in checkpoint.json records: xxHash's XXH3 (128 bits), which
# catches a truncated, torn or altered file as SHA-256 does at six times its speed (the hashes
# sit unsigned beside the files, so a cryptographic one would stop no one who can rewrite
# them). Checkpoints that recorded SHA-256 are still checked with it.
HASH = "xxh3_128"
HASHES = ("xxh3_128", "sha256")


def new_hash(name: str = HASH):
    """A running hash (``update``, ``hexdigest``) of the kind ``name``."""
    if name == "sha256":
        return hashlib.sha256()
    import xxhash

    return xxhash.xxh3_128()


def file_hash(path: str, name: str = HASH) -> str:
    h = new_hash(name)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def resolve(path: str):
    """``path`` is a --save directory (its latest checkpoint) or an ``iter_N`` directory:
    returns (iteration directory, its JSON)."""
    if os.path.isfile(os.path.join(path, META)):
        return path, read_meta(path, path)
    return find_checkpoint(path)


def read_meta(root: str, directory: str) -> dict:
    meta_path = os.path.join(directory, META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--load {root}: checkpoint {directory} is incomplete or "
                              f"corrupt ({meta_path}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"--load {root}: {meta_path} is not a checkpoint of format "
                              + " or ".join(map(str, READABLE_VERSIONS)))
    return meta


def worker_part(meta: dict, worker: Optional[int] = None) -> str:
    """The relative directory of ``worker``'s part of a checkpoint (default: the lowest
    worker that saved one; "" for format 2, one directory for the whole job)."""
    if meta.get("format_version", FORMAT_VERSION) < 3:
        return ""
    saved = sorted(int(w) for w in meta["workers"])
    w = saved[0] if worker is None else worker
    if w not in saved:
        raise CheckpointError(f"the checkpoint holds no part of worker {w} (saved: {saved})")
    return f"worker{w}"


def part_keys(meta: dict, part: str) -> set:
    """The tensor keys stored in ``part`` (``worker_part``)."""
    by_part = meta["kinds"].get("keys_by_part")
    return set(by_part[part]) if by_part is not None else set(meta["kinds"]["keys"])


def find_checkpoint(root: str):
    """(directory, metadata) of the latest complete checkpoint under ``root``."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isdir(root):
        raise CheckpointError(f"--load {root}: no such directory")
    if not os.path.isfile(tracker):
        if os.path.isfile(os.path.join(root, "rank_00000.pt")) or any(
                os.path.isfile(os.path.join(root, d, "rank_00000.pt"))
                for d in os.listdir(root)):
            raise CheckpointError(f"--load {root}: a checkpoint of the earlier one-file-per-"
                                  "rank format; it cannot be read by this version")
        raise CheckpointError(f"--load {root}: no checkpoint in this directory "
                              f"({TRACKER} is missing)")
    text = open(tracker).read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"--load {root}: {TRACKER} holds {text!r}, not an "
                              "iteration") from None
    directory = iteration_dir(root, iteration)
    if not os.path.isfile(os.path.join(directory, META)):
        if is_megatron_lm(root):
            raise CheckpointError(f"--load {root}: a checkpoint written by Megatron-LM "
                                  f"({directory}): pretrain_gpt.py --load starts from its "
                                  "weights; this tool reads checkpoints of this package")
    meta = read_meta(root, directory)
    if meta.get("iteration") != iteration:
        raise CheckpointError(f"--load {root}: {os.path.join(directory, META)} does not "
                              f"describe iteration {iteration}")
    return directory, meta


def iteration_directory(root: str) -> Optional[str]:
    """The directory Megatron-LM's tracker names under ``root`` (None: no tracker, or it
    names nothing); reads only the tracker."""
    try:
        text = open(os.path.join(root, TRACKER)).read().strip()
    except OSError:
        return None
    if text == RELEASE:
        return os.path.join(root, RELEASE)
    try:
        return os.path.join(root, f"iter_{int(text):07d}")
    except ValueError:
        return None


def is_megatron_lm(root: Optional[str]) -> bool:
    """Whether ``root`` holds a checkpoint written by Megatron-LM rather than by this package:
    its latest directory has megatron-core's files (or Megatron-LM's legacy ones) and none of
    our ``checkpoint.json``. Cheap (reads no file's contents but the tracker's): the flag
    parser asks it too. Reading one: ``megatron_lm``."""
    directory = iteration_directory(root) if root else None
    return bool(directory) and not os.path.isfile(os.path.join(directory, META)) and (
        os.path.isfile(os.path.join(directory, "metadata.json"))
        or os.path.isfile(os.path.join(directory, "common.pt"))
        or legacy_megatron_lm(directory))


def legacy_megatron_lm(directory: str) -> bool:
    """Megatron-LM's earlier one-file-per-rank format (``mp_rank_00/model_optim_rng.pt``)."""
    return os.path.isdir(directory) and any(
        name.startswith("mp_rank_") for name in os.listdir(directory))


def check_files(root: str, directory: str, meta: dict, hashes, part=None) -> None:
    """Every file listed is there with its size (and, for those in ``hashes``, or all when
    it is True, its hash); no other file is. ``part``: only that worker's part
    (``worker_part``)."""
    listed = meta.get("files", {})
    present = {os.path.relpath(os.path.join(d, n), directory)
               for d, _, files in os.walk(directory) for n in files} - {META}
    if part:
        listed = {k: v for k, v in listed.items() if k.startswith(part + "/")}
        present = {k for k in present if k.startswith(part + "/")}
    for rel in sorted(present - set(listed)):
        raise CheckpointError(f"--load {root}: {os.path.join(directory, rel)} is not part of "
                              "the checkpoint (not listed in checkpoint.json)")
    for rel, entry in sorted(listed.items()):
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"--load {root}: {path} is missing")
        if os.path.getsize(path) != entry["size"]:
            raise CheckpointError(f"--load {root}: {path} is truncated or altered (size "
                                  f"{os.path.getsize(path)}, written as {entry['size']})")
        if not (hashes is True or (hashes and rel in hashes)):
            continue
        name = next((n for n in HASHES if n in entry), None)
        if name is None:
            raise CheckpointError(f"--load {root}: checkpoint.json records no known hash of "
                                  f"{path} ({', '.join(HASHES)})")
        if file_hash(path, name) != entry[name]:
            raise CheckpointError(f"--load {root}: {path} was altered after it was written "
                                  f"(its {name} hash differs from checkpoint.json)")


def check_safe(root: str, directory: str, parts=("",)) -> None:
    """The two pickled files of the format hold only data, in each of ``parts``: torch's
    ``.metadata`` (through the restricted unpickler) and megatron-core's ``common.pt``
    (``weights_only``)."""
    for part in parts:
        _check_safe(root, os.path.join(directory, part))


def all_parts(meta: dict) -> list:
    """Every worker's part of a checkpoint (``worker_part``)."""
    if meta.get("format_version", FORMAT_VERSION) < 3:
        return [""]
    return [worker_part(meta, int(w)) for w in sorted(meta["workers"], key=int)]


def _check_safe(root: str, directory: str) -> None:
    import pickle

    import torch

    from patches.torch_dcp_safe_metadata import SafeUnpickler

    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            SafeUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure means the file is not metadata
        raise CheckpointError(f"--load {root}: {path} is not checkpoint metadata and was not "
                              f"loaded ({type(e).__name__}: {first_line(e)[:200]})"
                              ) from None
    path = os.path.join(directory, "common.pt")
    if os.path.exists(path):
        try:
            torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
            raise CheckpointError(f"--load {root}: {path} holds more than data and was not "
                                  f"loaded ({type(e).__name__}: "
                                  f"{first_line(e)[:200]})") from None


def check_writable(root: str, rank: int) -> None:
    """Fail before training when --save cannot take a file (read-only, no permission). The
    probe's name is the process's own: every worker's launch numbers its ranks from 0 until
    the door has the others' shapes, so two launches' ranks of one number probe together."""
    import tempfile

    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".write_test_rank_{rank:05d}_", dir=root)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save {root} is not writable: {e}") from None


def has_checkpoint(root: Optional[str]) -> bool:
    return bool(root) and os.path.isfile(os.path.join(root, TRACKER))


def atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dump_meta(meta: dict) -> str:
    return json.dumps(meta, indent=1, sort_keys=True)


def commit(root: str, partial: str, final: str, meta: dict) -> None:
    """Write ``checkpoint.json`` into ``partial`` (its ``files`` already listed), rename it to
    ``final`` (atomic), then point the tracker at it (atomic too). What ``partial`` holds
    beyond its files (left there by a save of the same iteration that crashed) goes first."""
    import shutil

    _remove_unlisted(partial, meta["files"])
    meta["size_bytes"] = sum(f["size"] for f in meta["files"].values())
    atomic_write(os.path.join(partial, META), dump_meta(meta))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync_dir(root)
    atomic_write(os.path.join(root, TRACKER), f"{meta['iteration']}\n")


def _remove_unlisted(directory: str, files: dict) -> None:
    """Delete the files under ``directory`` that ``files`` does not list, then the folders
    left empty."""
    for name in checkpoint_files(directory):
        if name not in files:
            os.remove(os.path.join(directory, name))
    for folder, _, _ in os.walk(directory, topdown=False):
        if folder != directory and not os.listdir(folder):
            os.rmdir(folder)


def prune(root: str, keep: int) -> list:
    """``--keep-last``: delete the committed checkpoints under ``root`` beyond the newest
    ``keep`` (by iteration), never the one the tracker points at; returns the deleted
    directories. Called after a commit, so a crash in between leaves one more, never fewer.
    Directories being written (``.partial``) and anything not named ``iter_NNNNNNN`` stay."""
    import re
    import shutil

    if keep <= 0:
        return []
    try:
        latest = int(open(os.path.join(root, TRACKER)).read().strip())
    except (OSError, ValueError):
        return []  # nothing committed that a resume would find: delete nothing
    committed = sorted(int(m.group(1)) for m in (re.fullmatch(r"iter_(\d{7,})", name)
                                                 for name in os.listdir(root))
                       if m and os.path.isfile(os.path.join(root, m.group(0), META)))
    kept = set(committed[-keep:]) | {latest}
    deleted = []
    for iteration in committed:
        if iteration not in kept:
            directory = iteration_dir(root, iteration)
            shutil.rmtree(directory, ignore_errors=True)
            deleted.append(directory)
    return deleted

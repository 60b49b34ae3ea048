"""Checkpoints read and written by one process, without a job: for inspecting, exporting to
and importing from Hugging Face. Parallel layouts do not appear here: every tensor is read
or written whole (TP=1 shape), by its global name, through torch.distributed.checkpoint's
reader and writer (the files of megatron-core's torch_dist format).
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, Optional

import torch

from . import keys
from .resume import CheckpointError
from .store import (all_parts, atomic_write, check_files, check_safe, commit, file_table,
                    iteration_dir, resolve, worker_part)


def open_checkpoint(path: str, verify: bool = True):
    """(iteration directory, JSON) of a --save directory's latest checkpoint or of an
    ``iter_N`` directory; ``verify`` checks every file's size and SHA-256 first."""
    directory, meta = resolve(path)
    if verify:
        check_files(path, directory, meta, hashes=True)
        check_safe(path, directory, all_parts(meta))
    return directory, meta


def read_tensors(directory: str, keys) -> Dict[str, torch.Tensor]:
    """Whole tensors by key (CPU), through torch's checkpoint reader (metadata unpickled
    by the restricted unpickler of ``patches.torch_dcp_safe_metadata``)."""
    import patches
    import torch.distributed.checkpoint as dcp

    try:
        patches.apply()
    except patches.UpstreamVersionError as e:  # an unsupported torch: one line, not a traceback
        raise CheckpointError(str(e)) from None
    reader = dcp.FileSystemReader(directory)
    index = reader.read_metadata().state_dict_metadata
    missing = [k for k in keys if k not in index]
    if missing:
        raise CheckpointError(f"{directory}: holds no tensor {missing[0]!r}")
    state = {k: torch.empty(index[k].size, dtype=index[k].properties.dtype) for k in keys}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def parameters(path: str, params: str = "global", worker: Optional[int] = None):
    """(model config dict, vocabulary size, {global name: fp32 tensor at TP=1}).

    ``params="global"``: the global parameters theta_g of a streaming run (of a run without
    the sync, its only worker's weights); ``"local"``: worker ``worker``'s own weights."""
    directory, meta = open_checkpoint(path)
    prefixes = set(meta["kinds"]["prefixes"])

    def weights_of(w):  # the fp32 masters where there are any
        master = keys.worker(w, keys.MASTER)
        return master if master in prefixes else keys.worker(w, keys.MODEL)

    w = None  # global: any worker's part holds theta_g (the lowest's is read)
    if params == "global":
        if keys.outer(keys.THETA_G) in prefixes:
            prefix = keys.outer(keys.THETA_G)
        else:
            w = 0
            prefix = weights_of(w)
    elif params == "local":
        w = 0 if worker is None else worker
        workers = meta["layout"]["workers"]
        if not 0 <= w < workers:
            raise CheckpointError(f"--worker {w}: the checkpoint has {workers} worker(s)")
        prefix = weights_of(w)
    else:
        raise CheckpointError(f"--params {params!r}: expected global or local")
    names = list(meta["params"])
    loaded = read_tensors(os.path.join(directory, worker_part(meta, w)),
                          [keys.tensor(prefix, n) for n in names])
    out = {}
    for n in names:
        t = loaded[keys.tensor(prefix, n)].float()
        out[n] = t.reshape(-1, *t.shape[2:]) if _gated(n, t, meta) else t
    return meta["model"]["config"], meta["model"]["vocab_size"], out


def _gated(name: str, t: torch.Tensor, meta: dict) -> bool:
    return meta["model"]["config"].get("swiglu") and ".linear_fc1." in f".{name}" and \
        t.dim() >= 2 and t.shape[0] == 2


def write(root: str, model_cfg, params: Dict[str, torch.Tensor], vocab_size: int,
          flags, source: str) -> str:
    """A checkpoint of iteration 0 holding only one worker's weights (fp32): ``--load`` it to
    start training from them, in any layout and with any number of workers."""
    import torch.distributed.checkpoint as dcp

    from .meta import description, document
    from .resume import streaming_description
    from ..config import Config

    directory = iteration_dir(root, 0)
    partial = directory + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    part = os.path.join(partial, "worker0")
    os.makedirs(part)
    stored = {}
    for name, t in params.items():
        t = t.detach().float().contiguous()
        if model_cfg.swiglu and ".linear_fc1." in f".{name}":
            t = t.view(2, -1, *t.shape[1:])
        stored[name] = t
    prefix = keys.worker(0, keys.MODEL)
    dcp.save({keys.tensor(prefix, n): t for n, t in stored.items()},
             storage_writer=dcp.FileSystemWriter(part), no_dist=True)
    # megatron-core's own two files, as its torch_dist save writes them.
    atomic_write(os.path.join(part, "metadata.json"),
                 '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                 '"common_backend": "torch", "common_backend_version": 1}')
    torch.save({}, os.path.join(part, "common.pt"))
    # One rank of one worker that holds only weights (no optimizer state, no sync).
    rank = {"rank": 0, "worker": 0, "prefixes": [prefix],
            "keys": [keys.tensor(prefix, n) for n in stored],
            "shapes": {n: list(t.shape) for n, t in stored.items()}}
    described = description(
        [rank], layout={"world_size": 1, "workers": 1, "tp": 1, "pp": 1, "dp": 1, "sp": 1,
                        "zero_stage": 0},
        model_cfg=model_cfg, vocab_size=vocab_size, tokenizer={}, precision="fp32",
        optimizer=None,
        streaming={**streaming_description(Config(model=model_cfg)), "enabled": False})
    meta = document(0, {"iteration": 0, "consumed_samples": 0, "tokens": 0}, described,
                    {f"worker0/{k}": v for k, v in file_table(part).items()},
                    source=source, model_flags=list(flags))
    commit(root, partial, directory, meta)
    return directory

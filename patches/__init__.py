"""Run-time fixes that let megatron-core 0.16.1 and DeepSpeed 0.19.8 train on CPU with gloo,
and the few this package needs on a GPU too.

Nothing here edits installed files. One call applies every fix this process needs::

    import patches
    patches.apply()          # -> ["megatron_rng", "megatron_devices", ...]

Each fix lives in its own module (``megatron_rng``, ``megatron_devices``, ``megatron_embedding``,
``megatron_norm``, ``deepspeed_shm``, ``deepspeed_cpu_fp16``, ``torch_dcp_safe_metadata``,
``megatron_moe``) whose docstring names the upstream
call sites it covers.
Each is pinned to the upstream versions it was verified on and refuses any other
(``UpstreamVersionError``), and each applies only where its ``is_needed`` says: the CPU fixes
(``megatron_rng``, ``megatron_devices``, ``megatron_embedding``) only without CUDA, the
DeepSpeed fixes only on DeepSpeed's CPU accelerator, ``megatron_moe`` only where Transformer
Engine does not import, and ``megatron_norm`` and ``torch_dcp_safe_metadata`` always (with
apex or without, some model's norms are torch's: RMSNorm ones, and LayerNorm ones without
apex's kernel).

``apply()`` may run before or after megatron/deepspeed are imported, but must run before
``deepspeed.init_distributed`` and before models are built. It is idempotent. It imports
megatron-core, and with it Transformer Engine where that is installed, which may make a CUDA
context on the current device at import: set the process's GPU first
(``megatron_streaming.parallel.distributed.claim_device``).

Adapters (not patches: they change nothing upstream, and ``apply()`` does not list them) reach
private upstream state through one module per package, version-pinned the same way:
``deepspeed_zero`` (the ZeRO and FP16_UnfusedOptimizer fields the engine, the sync and the
checkpoint use), ``deepspeed_moe`` (DeepSpeed's expert groups, for megatron-core's MoE layers)
and ``megatron_parallel_state`` (``parallel_state``'s module globals, pointed at
a worker's own groups; it also creates megatron's global memory buffer, which
``DotProductAttention`` and the sequence-parallel layers need and which only
``initialize_model_parallel`` would otherwise create), ``megatron_row_parallel`` (a
``RowParallelLinear``'s partial sum before its all-reduce, for the ladder residual),
``megatron_checkpoint_writer`` (the torch_dist writer's files written by the saving process,
a thread per file, hashed as they are written, and its results through an in-process queue,
not a spawned Manager that imports torch to unpickle them), ``megatron_save_plan`` (a
torch_dist save's plan kept and reused by the saves of the same structure) and
``torch_process_group`` (process groups made on a store, outside the world).

Importing ``patches`` installs one import hook (``megatron_jit``): megatron-core's own import
leaves ``torch.compile``'s decorations to each fused function's first call, which halves the
import time of every rank.
"""

import importlib
import logging
import os
from typing import Iterable, List, Union

from . import _pinning
from ._pinning import UpstreamVersionError
from .megatron_jit import install_hook as _install_megatron_jit_hook

_install_megatron_jit_hook()  # before megatron-core's first import (megatron_jit.py)

__all__ = ["PATCH_NAMES", "SKIP_ENV", "UpstreamVersionError", "applied", "apply"]

PATCH_NAMES = (
    "megatron_rng",
    "megatron_devices",
    "megatron_embedding",
    "megatron_norm",
    "deepspeed_shm",
    "deepspeed_cpu_fp16",
    "torch_dcp_safe_metadata",
    "megatron_moe",
)

SKIP_ENV = "MEGATRON_STREAMING_SKIP_PATCHES"
"""Comma-separated patch names ``apply()`` leaves out (to check a patch is still needed)."""

# The one piece of module state: names of the patches installed in this process, in order.
_APPLIED: List[str] = []


def _names(listed: str) -> set:
    return {name.strip() for name in listed.split(",") if name.strip()}


def _skipped(skip: Union[str, Iterable[str]]) -> set:
    names = _names(skip) if isinstance(skip, str) else set(skip)
    names |= _names(os.environ.get(SKIP_ENV, ""))
    unknown = names - set(PATCH_NAMES)
    if unknown:
        raise ValueError(
            f"unknown patch names {sorted(unknown)} (skip= or {SKIP_ENV}); "
            f"known: {list(PATCH_NAMES)}"
        )
    return names


def apply(skip: Union[str, Iterable[str]] = ()) -> List[str]:
    """Install every needed patch not yet installed; return the names installed so far.

    ``skip`` (names, or one comma-separated string) and the env var
    ``MEGATRON_STREAMING_SKIP_PATCHES`` name patches to leave out.
    All version pins are checked before anything is installed, so a refusal changes nothing.
    """
    skipped = _skipped(skip)
    todo = []
    for name in PATCH_NAMES:
        if name in _APPLIED or name in skipped:
            continue
        patch = importlib.import_module(f"{__name__}.{name}").PATCH
        if _pinning.installed_version(patch.package) is None:
            continue  # nothing to patch
        if patch.is_needed():
            todo.append(patch)
    for patch in todo:
        _pinning.require_version(patch.package, patch.version, patch.name)
    for patch in todo:
        patch.install()
        _APPLIED.append(patch.name)
    if todo:
        logging.getLogger(__name__).info("applied %s", ", ".join(p.name for p in todo))
    return list(_APPLIED)


def applied() -> List[str]:
    """Names of the patches installed in this process, in installation order."""
    return list(_APPLIED)

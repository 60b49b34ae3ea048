"""Checkpoints keyed by global parameter names, resumable under any layout.

Format: megatron-core's ``dist_checkpointing`` (Megatron-LM's ``torch_dist``, i.e.
``torch.distributed.checkpoint`` files): every rank writes its own tensor slices in parallel,
and a load under another TP / PP / SP / DP / ZeRO layout reads the boxes it needs from them.
What is stored (``job``, under the names of ``keys``), the JSON that describes it (``meta``),
how a resume under other flags is decided (``resume``), the directory and its checks
(``store``). A rank saves and loads its part (``save_load``: ``Checkpointer``), a save's
commit runs in stages (``commit``), a failed one is told alike on every rank (``failures``),
and the run's saves go from start to commit or abandonment in one place (``saves``).
``python -m megatron_streaming.checkpoint`` inspects,
exports to and imports from Hugging Face and Megatron-LM. A checkpoint written by Megatron-LM
itself gives its weights to start from (``megatron_lm``).

This module only hands on the names the rest of the package's users import.
"""

from __future__ import annotations

from . import megatron_lm
from .failures import CheckpointWriteError
from .resume import FORMAT_VERSION, CheckpointError
from .save_load import Checkpointer, check_loadable
from .saves import Saves
from .store import TRACKER, check_writable, find_checkpoint, has_checkpoint, iteration_dir

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpointer", "FORMAT_VERSION",
           "Saves", "TRACKER", "check_loadable", "check_writable", "find_checkpoint",
           "has_checkpoint", "iteration_dir", "megatron_lm"]

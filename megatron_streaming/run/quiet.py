"""Expected upstream warnings, once per job instead of once per rank.

megatron-core and DeepSpeed warn about what is expected on a CPU machine (no apex, no
Transformer Engine, the CPU accelerator) from every rank, several times each: on 8 ranks that
is dozens of lines that hide the one warning that matters. The messages listed here show once,
on the launch's rank 0; on other ranks they are dropped. Any other warning is untouched.

``install`` runs first thing in ``pretrain_gpt.py`` (before deepspeed or megatron is imported,
since DeepSpeed warns at import); ``metrics.setup_logging`` re-attaches the filter to the
handlers it creates.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# Messages (regular expressions) of expected upstream warnings: Python warnings and log records.
EXPECTED = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"Setting accelerator to CPU",
    r"Unable to save \w+ indexes because path_to_cache is None",
    r"it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    r"full scope is deprecated\. Use empty cuda_graph_scope",
)
_PATTERN = re.compile("|".join(f"(?P<p{i}>{p})" for i, p in enumerate(EXPECTED)))


class OncePerJob(logging.Filter):
    """Passes an expected message on rank 0, the first time its pattern is met (one line for
    a family of similar messages); anything else always."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.seen: set = set()

    def passes(self, message: str) -> bool:
        match = _PATTERN.search(message)
        if match is None:
            return True
        if self.rank != 0 or match.lastgroup in self.seen:
            return False
        self.seen.add(match.lastgroup)
        return True

    def filter(self, record: logging.LogRecord) -> bool:
        return self.passes(record.getMessage())


_FILTER = None  # the process's filter, so handlers made later can take it too


def launch_rank() -> int:
    """This process's rank as its launcher numbered it (0 when run alone; a bare srun's task
    number, which ``slurm.task_environment`` makes the rank later)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def install(rank: int = None) -> OncePerJob:
    """Filter Python warnings and DeepSpeed's logger; idempotent."""
    global _FILTER
    if _FILTER is None:
        _FILTER = OncePerJob(launch_rank() if rank is None else rank)
        show = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if _FILTER.passes(str(message)):
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        # Every occurrence reaches showwarning, which decides (Python's own "once" would
        # show each variant of a family's text).
        warnings.filterwarnings("always", message=f".*({_PATTERN.pattern})")
        # DeepSpeed's logger does not propagate: it takes the filter itself.
        logging.getLogger("DeepSpeed").addFilter(_FILTER)
    return _FILTER


def attach_to_root_handlers() -> None:
    """After logging is (re)configured: megatron's records reach the root handlers."""
    if _FILTER is not None:
        for handler in logging.getLogger().handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)

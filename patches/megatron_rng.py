"""CPU generator for megatron-core's model-parallel RNG tracker (megatron-core 0.16.1).

Why: ``megatron.core.tensor_parallel.random`` keeps per-parallel-region RNG streams (data
parallel, tensor parallel, expert parallel) as *CUDA* generator states. On a CPU-only torch:

* ``_get_cuda_rng_state`` calls ``torch.cuda.random.get_rng_state`` -> "Torch not compiled with
  CUDA enabled";
* ``_set_cuda_rng_state`` hands the state to ``torch.cuda._lazy_call``, which on a host without
  CUDA queues the callback forever: the state is silently never set;
* ``CudaRNGStatesTracker.add`` and ``model_parallel_cuda_manual_seed`` call
  ``torch.cuda.get_rng_state`` (fails) and ``torch.cuda.manual_seed`` (silently queued).

Fix: on CPU the tracked streams live in the default CPU generator, the one every CPU op draws
from. ``_get_cuda_rng_state``/``_set_cuda_rng_state`` are replaced (every caller - ``fork``,
``add``, activation checkpointing's ``_get_all_rng_states``/``_set_all_rng_states`` - looks
them up as module globals), and the module's ``torch.cuda`` RNG calls see the CPU generator.
``model_parallel_cuda_manual_seed(seed)`` therefore seeds the CPU generator with ``seed`` as
the default (data-parallel) stream, as it seeds the CUDA generator on a GPU.

``fork()`` warns when the CPU RNG state changes inside a forked region; on CPU the forked stream
*is* the CPU generator, so every dropout in a forked region would warn. That one message is
filtered on the module's logger.

CUDA-graph-safe states (``use_cudagraphable_rng``) have no CPU meaning and raise.
"""

import importlib
import logging

import torch

from ._cpu_torch import install_view
from ._patch import Patch, cuda_unavailable

NAME = "megatron_rng"
_MODULE = "megatron.core.tensor_parallel.random"
_SPURIOUS_WARNING = "CPU RNG state changed within GPU RNG context"


def _refuse_graph_safe(graph_safe: bool) -> None:
    if graph_safe:
        raise NotImplementedError(
            "graph-safe RNG states exist only for CUDA graphs; "
            "leave use_cudagraphable_rng off on CPU"
        )


def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    """Stand-in for ``_get_cuda_rng_state``: the CPU generator's state (always a fresh copy)."""
    _refuse_graph_safe(graph_safe)
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device=-1, graph_safe=False) -> None:
    """Stand-in for ``_set_cuda_rng_state``: sets the CPU generator's state immediately."""
    _refuse_graph_safe(graph_safe)
    torch.set_rng_state(new_state)


def _cpu_rng_cuda_calls() -> dict:
    """What ``torch.cuda`` RNG calls inside the tracker module resolve to."""
    return {
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "manual_seed": torch.manual_seed,
    }


class _DropSpuriousForkWarning(logging.Filter):
    """Drops fork()'s "CPU RNG state changed" warning, always true on CPU (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _SPURIOUS_WARNING


def install() -> None:
    module = importlib.import_module(_MODULE)
    module._get_cuda_rng_state = _get_cpu_rng_state
    module._set_cuda_rng_state = _set_cpu_rng_state
    install_view(module, cuda_overrides=_cpu_rng_cuda_calls())
    logger = logging.getLogger(_MODULE)
    if not any(isinstance(f, _DropSpuriousForkWarning) for f in logger.filters):
        logger.addFilter(_DropSpuriousForkWarning())


PATCH = Patch(
    name=NAME,
    package="megatron-core",
    version="0.16.1",
    is_needed=cuda_unavailable,
    install=install,
)

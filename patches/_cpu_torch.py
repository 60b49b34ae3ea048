"""A CPU-facing view of ``torch``, installed as the name ``torch`` inside single upstream modules.

Several megatron-core modules allocate with ``device=torch.cuda.current_device()`` or
``device="cuda"`` and call ``torch.cuda.synchronize()``; a CPU-only torch fails on each. Instead
of monkeypatching torch for the whole process, a patch rebinds the global name ``torch`` of one
such module to a ``CpuTorchView``. Code in that module then sees:

* ``torch.cuda.current_device()`` -> ``torch.device("cpu")``, so allocations land on the CPU;
* ``torch.cuda.synchronize()`` -> no-op (gloo work is complete once ``wait()`` returns);
* ``device="cuda"`` (or a bare ordinal) in the few tensor factories megatron calls -> CPU;
* any extra ``torch.cuda`` overrides the patch passes in (the RNG patch maps the CUDA
  generator calls to the CPU generator);
* everything else is the real ``torch``, looked up on every access.

Because Python resolves a module's globals at call time, the view works whether the module was
imported before or after the patch, and code in other modules is unaffected.
"""

import functools
import types
from typing import Callable, Mapping, Optional

import torch

# Factories that megatron-core 0.16.1 calls with a literal device="cuda" in the shimmed modules.
_FACTORIES = ("empty", "full", "ones", "tensor", "zeros")


def _cpu_device(device):
    """Map a CUDA device spec to the CPU; leave every other spec alone."""
    if isinstance(device, int):  # a bare ordinal means a CUDA device to torch factories
        return torch.device("cpu")
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def factory_on_cpu(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return factory_on_cpu


def _current_device() -> torch.device:
    return torch.device("cpu")


def _synchronize(device=None) -> None:
    # Megatron synchronizes the CUDA stream after batch_isend_irecv; on gloo the transfers are
    # finished once every request's wait() has returned, which megatron does first.
    return None


class _CpuStream:
    """A CUDA stream and its events on the CPU: work is done when a call returns, so there is
    nothing to wait for or record."""

    def wait_stream(self, other) -> None:
        return None

    def record_event(self, event=None):
        return self

    def synchronize(self) -> None:
        return None


_ONE_STREAM = _CpuStream()


def stream_overrides() -> dict:
    """``torch.cuda`` stream calls answered on the CPU: one stream, events that are done."""
    import contextlib

    return {"Stream": lambda *a, **k: _CpuStream(), "current_stream": lambda *a: _ONE_STREAM,
            "stream": lambda s=None: contextlib.nullcontext()}


class _CpuCuda:
    """``torch.cuda`` as seen through the view: CPU answers for the overridden names."""

    def __init__(self, overrides: Mapping[str, Callable]):
        self.__dict__.update(current_device=_current_device, synchronize=_synchronize)
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class CpuTorchView(types.ModuleType):
    """Stands in for ``torch`` inside one upstream module; see the module docstring."""

    def __init__(self, cuda_overrides: Optional[Mapping[str, Callable]] = None):
        super().__init__("torch", doc="CPU-facing view of torch (patches._cpu_torch)")
        self.cuda = _CpuCuda(cuda_overrides or {})
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def install_view(module: types.ModuleType, cuda_overrides=None) -> None:
    """Rebind ``module.torch`` to a CpuTorchView; no-op if it already is one."""
    current = module.__dict__.get("torch")
    if isinstance(current, CpuTorchView):
        return
    if current is not torch:
        raise RuntimeError(
            f"{module.__name__}.torch is {current!r}, not the torch module: something else "
            "already replaced it, refusing to stack a second shim on top"
        )
    module.torch = CpuTorchView(cuda_overrides)

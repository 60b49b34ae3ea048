"""Stand-in for NVIDIA Transformer Engine (tests/stand_ins/README.md): importable, with every
name megatron-core binds at import, and nothing that computes.

Any ``transformer_engine.*`` module imports (made on request); a lower-case attribute is such a
module, a capitalised one a class that raises when built. So megatron-core sees Transformer
Engine as present, as in NVIDIA's containers, and a layer of it that this project builds
without being asked to fails loudly instead of passing unseen.
"""

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
import types

import torch

ran = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "..", "record.py"))["ran"]

__version__ = "2.8.0"

# Transformer Engine may touch the GPU at import (a CUDA context on the current device, device
# 0 unless one was set): with STAND_IN_IMPORTS=<file>, note the device current at import.
if os.environ.get("STAND_IN_IMPORTS"):
    with open(os.environ["STAND_IN_IMPORTS"], "a") as _f:
        _f.write(f"transformer_engine imported on device "
                 f"{torch.cuda.current_device() if torch.cuda.is_available() else None}\n")


def _refuse(what: str):
    raise RuntimeError(f"stand-in transformer_engine: {what} was used; a Transformer Engine "
                       "path runs where none was asked for")


class _StandInType(type):
    def __getattr__(cls, name):  # class attributes megatron binds (``Function.apply``)
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: _refuse(f"{cls.__qualname__}.{name}")


class StandInLayer(metaclass=_StandInType):
    def __init__(self, *args, **kwargs):
        _refuse(f"{type(self).__qualname__} (built)")


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[0].islower():
            value = importlib.import_module(f"{self.__name__}.{name}")
        else:
            value = type(name, (StandInLayer,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def _cpu_offload_context(enabled, *args, **kwargs):
    """What Transformer Engine returns with offloading off: megatron-core's block asks for
    it at every build whenever Transformer Engine imports, local layers or not."""
    if enabled:
        _refuse("get_cpu_offload_context(enabled=True)")
    return contextlib.nullcontext(), lambda tensor: tensor


class _SplitAlongDim:
    """The fused QKV's split that megatron-core's local attention takes from Transformer
    Engine whenever it imports: torch's split (Transformer Engine's saves a concatenation
    in the backward)."""

    @staticmethod
    def apply(mixed, split_dim, split_sizes):
        ran("transformer_engine._SplitAlongDim")
        return torch.split(mixed, list(split_sizes), dim=split_dim)


# The few functions that run, with Transformer Engine merely importable, on paths that do
# not use it: as it behaves there.
_FUNCTIONS = {"transformer_engine.pytorch.cpu_offload":
              {"get_cpu_offload_context": _cpu_offload_context},
              "transformer_engine.pytorch.attention": {"_SplitAlongDim": _SplitAlongDim}}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []
        module.__dict__.update(_FUNCTIONS.get(module.__name__, {}))


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module

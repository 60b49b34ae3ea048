"""megatron-core's import without torch.compile's machinery (megatron-core 0.16.1).

Why: ``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and some twenty functions of
``megatron.core.fusions`` are decorated with it as ``megatron.core`` imports. Decorating with
``torch.compile`` imports ``torch._dynamo`` and ``torch._inductor`` at once: about half of every
process's import of megatron-core (4 of 8 s on a 2-core CPU), paid by every rank of every
launch, whether or not a fused function is ever called (the CPU runs call none of them).

Fix: while ``megatron.core`` itself executes, ``torch.compile`` is a decorator that compiles
at the first call instead (with the same arguments, through the real ``torch.compile``), so
``jit_fuser`` and the functions decorated with it compile when first used, as
``torch.compile`` itself does; outside that import ``torch.compile`` is torch's. An import
hook (``install_hook``) does it, since it must act before megatron-core is first imported;
``patches`` and ``megatron_streaming`` install it when imported. On another megatron-core
version, or once megatron-core is imported, the hook does nothing (an import-time saving,
never a behaviour: it has no refusal to make).
"""

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys

NAME = "megatron_jit"
PACKAGE, VERSION = "megatron-core", "0.16.1"
TARGET = "megatron.core"


def compile_on_first_call(real_compile):
    """A ``torch.compile`` that defers the real one to each function's first call."""

    def lazy_compile(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: lazy_compile(fn, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return lazy_compile


@contextlib.contextmanager
def _lazy_torch_compile():
    import torch

    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        yield
    finally:
        torch.compile = real


class _Hook(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` as the path finder does and runs its module under
    ``_lazy_torch_compile``; removes itself at its first use."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        _remove()
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not _pinned():
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            with _lazy_torch_compile():
                execute(module)

        spec.loader.exec_module = exec_module
        return spec


def _pinned() -> bool:
    from ._pinning import installed_version

    found = installed_version(PACKAGE)
    return found is not None and found.split("+", 1)[0] == VERSION


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]


def install_hook() -> None:
    """Before megatron-core's first import (idempotent; nothing once it is imported)."""
    if TARGET in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())

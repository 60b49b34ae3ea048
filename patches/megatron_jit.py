"""Upstream imports without torch.compile's machinery (megatron-core 0.16.1, DeepSpeed 0.19.8).

Why: decorating a function with ``torch.compile`` imports ``torch._dynamo`` and
``torch._inductor`` at once (3-4 s of CPU on these 2 cores), paid by every rank of every launch
whether or not the function is ever called. Two imports do it:

* ``megatron.core``: ``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and some twenty
  functions of ``megatron.core.fusions`` are decorated with it (the CPU runs call none);
* ``deepspeed.runtime.zero.muon.original_muon``: its Muon steps are decorated with
  ``compiler.compile()`` (that is, ``torch.compile``), and ``deepspeed.initialize`` imports it
  to check whether the optimizer is one ZeRO supports.

Fix: while one of those modules itself executes, ``torch.compile`` is a decorator that
compiles at the first call instead (with the same arguments, through the real
``torch.compile``), so the functions decorated there compile when first used, as
``torch.compile`` itself does; outside those imports ``torch.compile`` is torch's. An import
hook (``install_hook``) does it, since it must act before their first import; ``patches`` and
``megatron_streaming`` install it when imported. For a module of another version than pinned
here, or one imported already, the hook does nothing (an import-time saving, never a
behaviour: it has no refusal to make).
"""

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys

NAME = "megatron_jit"
# Module -> the distribution and version whose import of it was measured.
TARGETS = {
    "megatron.core": ("megatron-core", "0.16.1"),
    "deepspeed.runtime.zero.muon.original_muon": ("deepspeed", "0.19.8"),
}


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
    """Finds each of ``TARGETS`` as the path finder does and runs its module under
    ``_lazy_torch_compile``; removes itself once it has seen them all."""

    def __init__(self):
        self.waiting = {name for name in TARGETS if name not in sys.modules}

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        self.waiting.discard(name)
        if not self.waiting:
            _remove()
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not _pinned(*TARGETS[name]):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            with _lazy_torch_compile():
                execute(module)

        spec.loader.exec_module = exec_module
        return spec


def _pinned(package: str, version: str) -> bool:
    from ._pinning import installed_version

    found = installed_version(package)
    return found is not None and found.split("+", 1)[0] == version


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]


def install_hook() -> None:
    """Before the first import of ``TARGETS`` (idempotent; nothing for those imported)."""
    if all(name in sys.modules for name in TARGETS) or \
            any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())

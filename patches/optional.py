"""Optional CUDA libraries megatron-core switches on when importable: apex, Transformer Engine
and Megatron-LM's fused softmax kernels.

``HAVE_APEX`` / ``HAVE_TE`` are computed on first access by trying the same imports megatron-core
tries (``import apex``, ``import transformer_engine``), so importing this module costs nothing.
"""

import functools
import importlib

__all__ = ["HAVE_APEX", "HAVE_TE", "have_apex", "have_apex_layer_norm",
           "have_apex_persistent_layer_norm", "have_te", "have_fused_softmax"]


def _importable(module_name: str) -> bool:
    try:
        importlib.import_module(module_name)
    except ImportError:
        return False
    return True


@functools.cache
def have_apex() -> bool:
    """Whether apex imports (megatron then uses its FusedLayerNorm in the local spec)."""
    return _importable("apex")


@functools.cache
def have_apex_layer_norm() -> bool:
    """Whether apex's fused LayerNorm kernel imports (what megatron-core's ``FusedLayerNorm``
    runs; ``model.norm_impl`` then takes it for LayerNorm models)."""
    try:
        from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction  # noqa
    except ImportError:
        return False
    return True


@functools.cache
def have_apex_persistent_layer_norm() -> bool:
    """Whether apex's persistent LayerNorm kernel imports (``persist_layer_norm``)."""
    try:
        from apex.contrib.layer_norm.layer_norm import FastLayerNormFN  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def have_te() -> bool:
    """Whether Transformer Engine imports."""
    return _importable("transformer_engine")


@functools.cache
def have_fused_softmax() -> bool:
    """Whether Megatron-LM's fused softmax kernels import (built with Megatron-LM, not shipped
    by megatron-core): megatron-core's ``FusedScaleMaskSoftmax`` imports them for 16-bit
    inputs whenever ``masked_softmax_fusion`` is set, so without them it must not be."""
    return _importable("scaled_masked_softmax_cuda") and \
        _importable("scaled_upper_triang_masked_softmax_cuda")


def __getattr__(name: str) -> bool:
    if name == "HAVE_APEX":
        return have_apex()
    if name == "HAVE_TE":
        return have_te()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Megatron-core's MoE router without Transformer Engine (megatron-core 0.16.1).

Why: ``transformer.moe.moe_utils`` imports ``te_general_gemm`` only inside its
``import transformer_engine`` ``try:``, but ``RouterGatingLinearFunction`` (the router's gating
GEMM, called by ``TopKRouter.gating`` at every forward and backward) reads the name
unconditionally: without Transformer Engine every MoE forward raises ``NameError``, on a GPU
as on the CPU.

Fix: bind ``te_general_gemm = None`` in that module, which is what its own code tests for
(``if te_general_gemm is not None``) before falling back to a torch matmul. Needed when
Transformer Engine does not import; with it the module is left alone.

The router's other CUDA-only line (``TopKRouter.gating`` moves a CPU weight to
``torch.cuda.current_device()``) is ``megatron_devices``'s: it gives that module its CPU view.
"""

import importlib

from ._patch import Patch

NAME = "megatron_moe"
MODULE = "megatron.core.transformer.moe.moe_utils"


def _is_needed() -> bool:
    return not getattr(importlib.import_module(MODULE), "HAVE_TE", False)


def install() -> None:
    module = importlib.import_module(MODULE)
    if not hasattr(module, "te_general_gemm"):
        module.te_general_gemm = None


PATCH = Patch(
    name=NAME,
    package="megatron-core",
    version="0.16.1",
    is_needed=_is_needed,
    install=install,
)

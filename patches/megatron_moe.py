"""Megatron-core's MoE router without Transformer Engine (megatron-core 0.16.1).

Why: ``transformer.moe.moe_utils`` imports ``te_general_gemm`` only inside its
``import transformer_engine`` ``try:``, but ``RouterGatingLinearFunction`` (the router's gating
GEMM, called by ``TopKRouter.gating`` at every forward and backward) reads the name
unconditionally: without Transformer Engine every MoE forward raises ``NameError``, on a GPU
as on the CPU.

Fix: bind ``te_general_gemm = None`` in that module, which is what its own code tests for
(``if te_general_gemm is not None``) before falling back to a torch matmul. Needed when
Transformer Engine does not import; with it the module is left alone.

``unshared_expert_outputs(model)`` (called on a built model, not by ``apply``): at expert
parallel and expert tensor-parallel size 1 an expert's ``RowParallelLinear`` "reduces" its
output over a group of one, which returns its input as it is, from a custom autograd
function; the expert MLP then adds its bias in place to that output (``MLP.forward``,
``per_token_scale`` branch), which autograd refuses at the first forward. Marking the layer
``explicit_expert_comm`` (what it is at EP > 1) hands the matmul's own output on instead:
over one rank the reduction is the identity, so nothing else changes.

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


def unshared_expert_outputs(model) -> int:
    """Mark the experts' row-parallel layers of expert tensor-parallel size 1 as explicit
    expert communication (see the module docstring); returns how many."""
    from ._pinning import require_version_once

    require_version_once("megatron-core", "0.16.1", NAME)
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    marked = 0
    for module in model.modules():
        if isinstance(module, RowParallelLinear) and module.is_expert and \
                module.tp_group.size() == 1 and not module.explicit_expert_comm:
            module.explicit_expert_comm = True  # its bias is added by the MLP: skip_bias_add
            marked += 1
    return marked


PATCH = Patch(
    name=NAME,
    package="megatron-core",
    version="0.16.1",
    is_needed=_is_needed,
    install=install,
)

"""CPU allocations and no-op CUDA syncs in megatron-core's training path (megatron-core 0.16.1).

Why: these modules allocate with ``device=torch.cuda.current_device()`` or ``device="cuda"``, or
call ``torch.cuda.synchronize()``, all of which fail on a CPU-only torch. Each gets a
CpuTorchView as its ``torch`` (see ``_cpu_torch``); nothing outside them changes.

Call sites covered (all hit by a GPTModel with the local spec trained through megatron's
pipeline schedules on gloo):

* ``pipeline_parallel.schedules``: ``total_num_tokens = torch.zeros(..., device="cuda")`` in
  every ``forward_backward_*`` function.
* ``pipeline_parallel.p2p_communication``: receive buffers and shape tensors of
  ``P2PCommunicator._communicate``/``_communicate_shapes``, and ``torch.cuda.synchronize()``
  after ``batch_isend_irecv``.
* ``utils``: ``GlobalMemoryBuffer.get_tensor`` (the attention ``baddbmm`` buffer of
  ``DotProductAttention`` and the sequence-parallel all-gather buffers).
* ``distributed.param_and_grad_buffer``: the contiguous grad (and param) buffers of megatron DDP.
* ``tensor_parallel.mappings``: sequence-parallel gather / reduce-scatter outputs.
* ``tensor_parallel.layers``: the reduce-scatter output in the sequence-parallel backward of
  ``LinearWithGradAccumulationAndAsyncCommunication``, its dummy wgrad, and the weights of
  ``use_cpu_initialization=False`` layers.
* ``tensor_parallel.utils``: ``split_tensor_into_1d_equal_chunks`` / ``gather_split_1d_tensor``
  (activation checkpointing with ``distribute_saved_activations``).
* ``transformer.utils``: ``get_default_causal_mask`` (causal attention called with
  ``attention_mask=None``).
* ``models.common.embeddings.rotary_pos_embedding``: ``RotaryEmbedding`` moves its inverse
  frequencies to ``torch.cuda.current_device()`` (``--position-embedding-type rope``).
* ``dist_checkpointing.strategies.filesystem_async`` / ``state_dict_saver``: the torch_dist
  writer stages tensors with ``torch.cuda`` stream and device calls before writing.
* ``transformer.moe.router``: ``TopKRouter.gating`` moves a weight it finds on the CPU to
  ``torch.cuda.current_device()`` at every forward (mixture-of-experts layers).
"""

import importlib

from ._cpu_torch import install_view
from ._patch import Patch, cuda_unavailable

NAME = "megatron_devices"

MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.transformer.moe.router",
)


def install() -> None:
    for name in MODULES:
        install_view(importlib.import_module(name))


PATCH = Patch(
    name=NAME,
    package="megatron-core",
    version="0.16.1",
    is_needed=cuda_unavailable,
    install=install,
)

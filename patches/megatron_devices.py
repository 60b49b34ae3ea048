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
* ``transformer.moe.token_dispatcher``: ``MoEAlltoAllTokenDispatcher`` makes a
  ``torch.cuda.Stream`` when it is built and copies its token counts to the host on it, with
  an event to wait for (``--moe-token-dispatcher-type alltoall``): a CPU stream whose work is
  done when each call returns (``_cpu_torch.stream_overrides``). Its all-to-all takes the
  split sizes as the host arrays ``moe_utils.maybe_move_tensor_to_cpu`` makes of CUDA
  tensors; a CPU tensor it returns as it is, which ``all_to_all_single`` refuses: the
  dispatcher's name is bound to one that makes the array of a CPU tensor too.
"""

import importlib

import torch

from ._cpu_torch import install_view, stream_overrides
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
    "megatron.core.transformer.moe.token_dispatcher",
)
# Modules whose view also answers torch.cuda's stream calls.
WITH_STREAMS = ("megatron.core.transformer.moe.token_dispatcher",)


def _host_copy(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
    maybe_move_tensor_to_cpu.patched = True
    return maybe_move_tensor_to_cpu


def install() -> None:
    for name in MODULES:
        install_view(importlib.import_module(name),
                     stream_overrides() if name in WITH_STREAMS else None)
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    if not getattr(dispatcher.maybe_move_tensor_to_cpu, "patched", False):
        dispatcher.maybe_move_tensor_to_cpu = _host_copy(dispatcher.maybe_move_tensor_to_cpu)


PATCH = Patch(
    name=NAME,
    package="megatron-core",
    version="0.16.1",
    is_needed=cuda_unavailable,
    install=install,
)

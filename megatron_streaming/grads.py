"""The gradient reductions Megatron does outside its data-parallel wrapper.

Megatron's ``finalize_model_grads`` expects its own DDP wrapper; here DeepSpeed ZeRO owns the
data-parallel reduction, so the two model-parallel reductions are done here instead:

* parameters tagged ``sequence_parallel`` (norms and row-parallel biases under Megatron
  sequence parallelism) see only this rank's slice of the sequence: their gradients are
  summed over the tensor-parallel group. This is done in a tensor hook, before the gradient is
  accumulated, because ZeRO-2 takes gradients away for reduction as soon as they are
  accumulated. TP ranks run the same backward graph, so the hooks fire in the same order.
* a tied embedding held by both the first and the last pipeline stage: its two gradients are
  summed over the embedding group after the schedule, before the optimizer step (the stages
  reach that weight's backward at different times, so a hook would deadlock the pipeline).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def register_sequence_parallel_grad_hooks(model: torch.nn.Module, tp_group) -> list:
    handles = []
    if dist.get_world_size(tp_group) == 1:
        return handles

    def allreduce(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=tp_group)
        return grad

    for param in model.parameters():
        if param.requires_grad and getattr(param, "sequence_parallel", False):
            handles.append(param.register_hook(allreduce))
    return handles


def tied_embedding_weight(model, topology):
    """The copy of the tied embedding this rank holds, when it must be summed across stages."""
    if topology.layout.pp == 1 or not getattr(model, "share_embeddings_and_output_weights",
                                              False):
        return None
    if "embd" not in topology.groups:
        return None
    return model.shared_embedding_or_output_weight()


def mark_pipeline_replicas(model, topology) -> None:
    """Count the last stage's copy of the tied embedding once in DeepSpeed's gradient norm."""
    weight = tied_embedding_weight(model, topology)
    if weight is not None and topology.is_last_stage and not topology.is_first_stage:
        weight.ds_pipe_replicated = True


def allreduce_tied_embedding_grads(model, topology) -> None:
    weight = tied_embedding_weight(model, topology)
    if weight is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=topology.groups["embd"])

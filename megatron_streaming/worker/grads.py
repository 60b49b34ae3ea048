"""The gradient reductions Megatron does outside its data-parallel wrapper.

Megatron's ``finalize_model_grads`` expects its own DDP wrapper; here DeepSpeed ZeRO owns the
data-parallel reduction, so the two model-parallel reductions are done here instead:

* parameters tagged ``sequence_parallel`` (norms and row-parallel biases under Megatron
  sequence parallelism) see only this rank's slice of the sequence: their gradients are
  summed over the tensor-parallel group once per step, all of them flattened into one
  all-reduce, as Megatron's ``_allreduce_non_tensor_model_parallel_grads`` does. Sums over
  TP, over data-parallel ranks and over micro-batches commute, so the step may sum over TP
  wherever DeepSpeed leaves the accumulated gradients (``SequenceParallelGrads``).
* a tied embedding held by both the first and the last pipeline stage: its two gradients are
  summed over the embedding group after the schedule, before the optimizer step (the stages
  reach that weight's backward at different times, so a hook would deadlock the pipeline).
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from patches import deepspeed_zero


def is_sequence_parallel(param: torch.nn.Parameter) -> bool:
    return param.requires_grad and getattr(param, "sequence_parallel", False)


def allreduce_coalesced(tensors: List[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place, in one all-reduce of their concatenation."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()


def allreduce_sequence_parallel_grads(model: torch.nn.Module, tp_group,
                                      grad_of=lambda p: p.grad) -> None:
    """Sum the accumulated gradients (``grad_of(param)``, default ``.grad``) of the
    ``sequence_parallel`` parameters over TP."""
    if dist.get_world_size(tp_group) == 1:
        return
    params = [p for p in model.parameters() if is_sequence_parallel(p)]
    # A parameter without a gradient adds zeros, so that every rank sends the same sizes.
    allreduce_coalesced([g if g is not None else torch.zeros_like(p)
                         for p, g in ((p, grad_of(p)) for p in params)], tp_group)


class SequenceParallelGrads:
    """The sequence-parallel sum over TP, where the accumulated gradients are at the step.

    Without ZeRO and at ZeRO-1 DeepSpeed leaves the gradients in ``param.grad`` until its step
    reduces them over the data-parallel group: ``after_schedule`` sums them there. ZeRO-2
    reduces over data-parallel ranks and takes the gradients away at every backward: the sum
    runs inside DeepSpeed's step on this rank's reduced gradient partition, once DeepSpeed has
    finalized it and before its overflow check, norm and clipping (``deepspeed_zero``'s
    hook), so the norm is that of the summed gradients either way. The TP ranks of a group
    hold same-shaped shards in the same order, so their partitions cut the same slices out
    of the same parameters; checked once here, since a mismatch would hang the all-reduce.
    """

    def __init__(self, model: torch.nn.Module, optimizer, tp_group):
        self.model, self.optimizer, self.tp_group = model, optimizer, tp_group
        self.active = dist.get_world_size(tp_group) > 1 and any(
            is_sequence_parallel(p) for p in model.parameters())
        self.in_step = self.active and deepspeed_zero.reduces_per_backward(optimizer)
        if not self.active:
            return
        if self.in_step:
            layout = [(i, s.first, s.size, s.at)
                      for i, group in enumerate(deepspeed_zero.partition_layout(optimizer))
                      for s in group if is_sequence_parallel(s.param)]
            deepspeed_zero.after_gradient_partition(optimizer, self._sum_partition_slices)
        else:
            layout = [tuple(p.shape) for p in model.parameters() if is_sequence_parallel(p)]
        _require_same_on_group(layout, tp_group)

    def after_schedule(self) -> None:
        """After the micro-batches' backwards, before ``engine.step()``."""
        if self.active and not self.in_step:
            allreduce_sequence_parallel_grads(
                self.model, self.tp_group,
                lambda p: deepspeed_zero.accumulated_grad(self.optimizer, p))

    def _sum_partition_slices(self, slices) -> None:
        allreduce_coalesced([grad for group in slices for p, grad in group
                             if is_sequence_parallel(p)], self.tp_group)


def _require_same_on_group(layout: list, group) -> None:
    """All ranks of ``group`` hold the same ``layout`` (one small all-reduce), else raise on
    every rank alike."""
    from ..parallel.topology import device_of

    mine = hash(tuple(layout))  # ints and tuples hash the same in every process
    seen = torch.tensor([mine, -mine], dtype=torch.int64, device=device_of(group))
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    if seen[0] != -seen[1]:
        raise RuntimeError("the sequence-parallel gradients are laid out differently on the "
                           f"tensor-parallel ranks {dist.get_process_group_ranks(group)}: "
                           f"this rank's {layout}")


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


def allreduce_tied_embedding_grads(model, topology, optimizer) -> None:
    """Sum the tied embedding's accumulated gradient (the one ``optimizer``'s step reads:
    ``deepspeed_zero.accumulated_grad``) over the embedding group."""
    weight = tied_embedding_weight(model, topology)
    if weight is None:
        return
    grad = deepspeed_zero.accumulated_grad(optimizer, weight)
    if grad is None:
        weight.grad = grad = torch.zeros_like(weight)
    dist.all_reduce(grad, group=topology.groups["embd"])

"""What the run reports of the inner optimizer's own tensors: the zeros of the gradient it
steps on (Megatron-LM's ``num-zeros``, --log-num-zeros-in-grad) and the norms of its Adam
state (Megatron-DeepSpeed's ``optimizer/...``, --log-optimizer-states-to-tensorboard).

Both read the fp32 tensors the inner torch optimizer steps (``WorkerEngine.master_views``):
under ZeRO each rank's partition of every param group, else the fp32 masters or the
parameters themselves. ``counted_spans`` says which of their elements this rank counts so
that one sum over the worker's ranks covers every element of the model exactly once: a
ZeRO partition's padding never, a parameter replicated over tensor-parallel ranks (a norm, a
bias) on the first of them, the last stage's copy of the tied embedding not at all, and
without ZeRO, where every data-parallel rank holds the whole gradient and state, the first
data-parallel rank only. Megatron-LM counts its zeros the same way (each parameter once
over the model-parallel group, a shard of its distributed optimizer on its rank);
Megatron-DeepSpeed sums its optimizer norms over the tensor- and pipeline-parallel ranks as
they come, a replicated norm weight once per TP rank.
"""

from __future__ import annotations

import bisect
from typing import Callable, Dict, List, Optional, Tuple

import torch

Spans = Dict[int, List[Tuple[int, int]]]  # id(stepped tensor) -> [(first element, count)]


def counted_spans(engine, topology, model) -> Spans:
    """Per tensor the inner optimizer steps, the element ranges this rank counts (above)."""
    from ..worker.grads import tied_embedding_weight
    from ..worker.moe import is_expert

    stepped = sorted(stepped_tensors(engine.inner_optimizer), key=lambda t: t.data_ptr())
    starts = [t.data_ptr() for t in stepped]
    experts = {id(p) for name, p in model.named_parameters() if is_expert(name)}
    replica = tied_embedding_weight(model, topology)
    c, e = topology.coords, topology.expert_coords
    spans: Spans = {id(t): [] for t in stepped}
    for group in engine.master_views():
        for param, view in group:
            expert = id(param) in experts
            if param is replica and not topology.is_first_stage:
                continue
            if not getattr(param, "tensor_model_parallel", False) and \
                    (e["etp"] if expert else c["tp"]) != 0:
                continue
            if not engine.zero and ((e["edp"] if expert else c["sp"] + c["dp"]) != 0):
                continue
            # The view lies inside one stepped tensor (a ZeRO partition: a slice of it).
            t = stepped[bisect.bisect_right(starts, view.data_ptr()) - 1]
            first = (view.data_ptr() - t.data_ptr()) // t.element_size()
            spans[id(t)].append((first, view.numel()))
    return spans


def stepped_tensors(optimizer) -> List[torch.Tensor]:
    return [t for group in optimizer.param_groups for t in group["params"]]


class CountedSpans:
    """``counted_spans`` made once and again only should the optimizer's tensors ever be
    replaced (each report reads them, at its points only)."""

    def __init__(self, engine, topology, model):
        self.engine, self.topology, self.model = engine, topology, model
        self._spans: Optional[Spans] = None

    def get(self) -> Spans:
        if self._spans is None or any(id(t) not in self._spans
                                      for t in stepped_tensors(self.engine.inner_optimizer)):
            self._spans = counted_spans(self.engine, self.topology, self.model)
        return self._spans


# Elements read at once: the statistics are taken in float64, a copy of this many elements at
# a time rather than of a whole ZeRO partition.
_CHUNK = 1 << 24


def _pieces(tensor: torch.Tensor, spans: List[Tuple[int, int]]):
    """The tensor's elements in ``spans``, flat, in pieces of at most ``_CHUNK``."""
    flat = tensor.detach().reshape(-1)
    for first, count in spans:
        for at in range(first, first + count, _CHUNK):
            yield flat.narrow(0, at, min(_CHUNK, first + count - at))


class GradZeros:
    """--log-num-zeros-in-grad: at the steps whose report is due (``due(step)``, the 1-based
    step), the zeros this rank counts of the gradient the inner optimizer steps on, read in
    its step (after DeepSpeed unscaled and clipped it, as Megatron-LM counts after its
    clipping); ``total`` sums them over the worker. A step the optimizer skipped (an fp16
    overflow) counts nothing, and Megatron-LM writes no num-zeros for it either."""

    def __init__(self, spans: CountedSpans, due: Callable[[int], bool]):
        self.spans, self.due = spans, due
        self.engine, self.topology = spans.engine, spans.topology
        self._spans: Optional[Spans] = None  # the armed step's
        self._armed = False
        self._count: Optional[torch.Tensor] = None  # on the gradients' device
        self._handle = self.engine.inner_optimizer.register_step_pre_hook(self._on_inner_step)

    # ---- a step hook of the engine (``WorkerEngine.step_hooks``) ----------------------------
    def before_step(self, step: int) -> None:
        self._armed, self._count = self.due(step), None
        if self._armed:
            self._spans = self.spans.get()

    def after_step(self) -> None:
        self._armed = False

    def _on_inner_step(self, optimizer, args, kwargs) -> None:
        if not self._armed:
            return
        tensors = stepped_tensors(optimizer)
        if self._count is None and tensors:  # a rank that counts nothing here counts 0
            self._count = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
        # Under ZeRO the optimizer's groups are narrowed to the one being stepped.
        for t in tensors:
            if t.grad is None:
                continue
            for part in _pieces(t.grad, self._spans[id(t)]):
                self._count += part.numel() - torch.count_nonzero(part)

    def total(self) -> Optional[int]:
        """The worker's count for the latest armed step (collective over the worker); None
        where the optimizer did not step."""
        import torch.distributed as dist

        from ..parallel.topology import device_of

        group = self.topology.groups["worker"]
        # [zeros, ranks without a count]: every rank joins even when the step was skipped.
        mine = torch.tensor([0, 1] if self._count is None else [int(self._count), 0],
                            dtype=torch.int64, device=device_of(group))
        dist.all_reduce(mine, group=group)
        return None if int(mine[1]) else int(mine[0])

    def detach(self) -> None:
        self._handle.remove()


# Megatron-DeepSpeed's names, in the order of ``optimizer_states``'s sums and maxima.
_MOMENTS = ("variance", "variance_sqrt", "momentum", "weight")


def optimizer_states(spans: CountedSpans) -> dict:
    """--log-optimizer-states-to-tensorboard (collective over the worker): over the whole
    model's elements, each once, of Adam's variance v (``exp_avg_sq``), its square root, the
    momentum m (``exp_avg``) and the fp32 weights w, as Megatron-DeepSpeed names them:
    ``optimizer/<x>_l2`` (the L2 norm), ``optimizer/<x>_l1`` (the sum of magnitudes) and
    ``optimizer/<x>_abs_max`` (the largest magnitude). A tensor with no state yet (before
    its first step) counts zeros for its moments."""
    import torch.distributed as dist

    from ..parallel.topology import device_of

    engine, topology, spans = spans.engine, spans.topology, spans.get()
    optimizer = engine.inner_optimizer
    group = topology.groups["worker"]
    device = device_of(group)
    squares = torch.zeros(4, dtype=torch.float64, device=device)
    magnitudes = torch.zeros(4, dtype=torch.float64, device=device)
    largest = torch.zeros(4, dtype=torch.float64, device=device)
    for t in stepped_tensors(optimizer):
        state = optimizer.state.get(t, {})
        has_moments = "exp_avg_sq" in state  # else (before its first step) they are zero
        tensors = (state["exp_avg_sq"], state["exp_avg"], t) if has_moments else (t, t, t)
        for v, m, w in zip(*(_pieces(x, spans[id(t)]) for x in tensors)):
            if not has_moments:
                v = m = torch.zeros_like(w)
            v = v.double()
            for i, x in enumerate((v, v.sqrt(), m.double(), w.double())):
                squares[i] += x.square().sum().to(device)
                magnitudes[i] += x.abs().sum().to(device)
                largest[i] = torch.maximum(largest[i], x.abs().max().to(device))
    sums = torch.cat([squares, magnitudes])
    dist.all_reduce(sums, group=group)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    out = {}
    for i, name in enumerate(_MOMENTS):
        out[f"optimizer/{name}_l2"] = float(sums[i].sqrt())
        out[f"optimizer/{name}_l1"] = float(sums[4 + i])
        out[f"optimizer/{name}_abs_max"] = float(largest[i])
    return out

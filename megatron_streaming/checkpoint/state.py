"""One rank's training state as tensors keyed by global parameter names, and back.

Every kind of state (``keys``) is stored per parameter as a megatron-core ``ShardedTensor`` of
the parameter's full (TP=1) shape; this rank supplies its tensor-parallel slice, and among the
ranks that hold the same slice (data and sequence parallel replicas, a tied embedding's copy
on the last stage, other workers for the global state) exactly one writes it.

A rank's state comes in three shapes, which ``LayoutMap`` converts between: whole parameters
by global name (``Slot``, what the checkpoint stores); per inner param group, one flat fp32
vector of this rank's part (``GroupSpace``: ZeRO's partition, gathered into whole parameters
over ZeRO's group and sliced back, so the file never depends on the DP size; the inner
optimizer's state); and the sync's shard groups, flat views into those spaces (its outer
state).

A SwiGLU ``linear_fc1`` holds ``[gate_r; up_r]`` on TP rank r (``weights.tp_shard``); it is
stored as a ``(2, ffn, hidden)`` tensor, so its TP slices are regular boxes.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from patches import deepspeed_zero

from . import keys
from ..worker.moe import expert_offset, is_expert
from ..worker.weights import global_name, local_spec_name

EMBEDDING = "embedding.word_embeddings.weight"
VOCAB_PARAMS = (EMBEDDING, "output_layer.weight")


@dataclass
class Slot:
    """One parameter of this rank's model chunk."""

    index: int
    name: str              # local name (layer numbers of this pipeline stage)
    gname: str             # global name: the key in the checkpoint
    param: torch.Tensor
    tp_axis: Optional[int]  # the dimension split over TP ranks, None when replicated
    gated: bool            # SwiGLU fc1: stored as (2, ffn, ...) so TP slices are boxes
    tied_copy: bool        # the last stage's copy of a tied embedding: never written

    @property
    def vocab(self) -> bool:
        return self.gname in VOCAB_PARAMS

    def stored_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (shaped like the parameter) as stored: gated fc1 gets its leading 2."""
        return t.view(2, -1, *t.shape[1:]) if self.gated else t

    def stored_axis(self) -> Optional[int]:
        if self.tp_axis is None:
            return None
        return self.tp_axis + 1 if self.gated else self.tp_axis

    def global_shape(self, tp: int) -> tuple:
        shape = list(self.stored_view(self.param.detach()).shape)
        axis = self.stored_axis()
        if axis is not None:
            shape[axis] *= tp
        return tuple(shape)


def build_slots(model, layer_offset: int, tied: bool, swiglu: bool,
                expert_offset: int = 0) -> List[Slot]:
    slots = []
    for name, param in model.named_parameters():
        tied_copy = tied and name == "output_layer.weight"
        # TE's fused norm names -> the local spec's: GPU checkpoints load on CPU and back.
        gname = EMBEDDING if tied_copy else \
            local_spec_name(global_name(name, layer_offset, expert_offset))
        tp_axis = param.partition_dim if getattr(param, "tensor_model_parallel", False) \
            else None
        gated = swiglu and ".linear_fc1." in f".{gname}" and tp_axis == 0
        slots.append(Slot(len(slots), name, gname, param, tp_axis, gated, tied_copy))
    return slots


class GroupSpace:
    """One inner param group's flat fp32 space on this rank: ZeRO's partition (a slice of
    the group's flattened parameters) or, without ZeRO, the group's parameters one after
    another. ``gather`` turns a vector of this space into whole parameters, ``scatter`` the
    reverse; ``position`` locates a view of a master tensor in it."""

    def __init__(self, slots_and_views, zero=None):
        self.slots = [s for s, _ in slots_and_views]
        self.zero = zero  # (flat, partition, start, size, group) under ZeRO
        self.offsets: Dict[int, int] = {}
        self._view_positions: Dict[int, int] = {}
        if zero is not None:
            flat, partition, start, size, _ = zero
            self.length = size
            for slot, view in slots_and_views:
                # ZeRO made each parameter a view of ``flat``.
                self.offsets[slot.index] = \
                    (slot.param.data_ptr() - flat.data_ptr()) // slot.param.element_size()
            self._base = partition
        else:
            offset = 0
            for slot, view in slots_and_views:
                self.offsets[slot.index] = offset
                self._view_positions[view.data_ptr()] = offset
                offset += slot.param.numel()
            self.length = offset

    def position(self, view: torch.Tensor) -> int:
        """Where a master view (a shard group's tensor) starts in this space."""
        if self.zero is not None:
            return (view.data_ptr() - self._base.data_ptr()) // view.element_size()
        return self._view_positions[view.data_ptr()]

    def views(self, vector: torch.Tensor) -> Dict[int, torch.Tensor]:
        """Under ZeRO, slot index -> a view of ``vector`` (this rank's partition, flat) shaped
        as the parameter, for each parameter that lies whole in it: where a read may land
        directly, so that ``scatter`` has nothing left to copy."""
        if self.zero is None or vector is None or vector.device.type != "cpu":
            return {}
        _, _, start, size, _ = self.zero
        out = {}
        for slot in self.slots:
            lo, n = self.offsets[slot.index], slot.param.numel()
            if start <= lo and lo + n <= start + size:
                out[slot.index] = vector[lo - start:lo - start + n].view(slot.param.shape)
        return out

    def gather(self, vector: torch.Tensor) -> Dict[int, torch.Tensor]:
        """slot index -> whole parameter (fp32, the parameter's shape)."""
        vector = vector.detach().float()
        if self.zero is not None and dist.get_world_size(self.zero[4]) > 1:
            flat, _, _, size, group = self.zero
            parts = [torch.empty(size, dtype=vector.dtype, device=vector.device)
                     for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, vector.contiguous(), group=group)
            vector = torch.cat(parts)
        out = {}
        for slot in self.slots:
            offset = self.offsets[slot.index]
            out[slot.index] = vector[offset:offset + slot.param.numel()].view(slot.param.shape)
        return out

    def scatter(self, tensors: Dict[int, torch.Tensor], device=None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's vector of the space from whole parameters (``gather``'s inverse);
        under ZeRO written into ``out`` when given (a live partition: no new memory)."""
        if self.zero is not None:  # this rank's partition [start, start + size) of them
            _, _, start, size, _ = self.zero
            if out is None:
                out = torch.empty(size, dtype=torch.float32, device=device)
            covered = []
            for slot in self.slots:
                offset, n = self.offsets[slot.index], slot.param.numel()
                lo, hi = max(offset, start), min(offset + n, start + size)
                if lo < hi:
                    dst = out[lo - start:hi - start]
                    src = tensors[slot.index].reshape(-1)[lo - offset:hi - offset]
                    if src.data_ptr() != dst.data_ptr():  # else read there already
                        dst.copy_(src)
                    covered.append((lo - start, hi - start))
            _zero_between(out, covered)  # ZeRO's padding
            return out
        return torch.cat([tensors[s.index].reshape(-1).float().to(device) for s in self.slots]) \
            if self.slots else torch.zeros(0, device=device)


def _zero_between(vector: torch.Tensor, covered: List[tuple]) -> None:
    """Zeros of ``vector`` outside the ``covered`` (start, end) ranges."""
    position = 0
    for lo, hi in sorted(covered):
        if lo > position:
            vector[position:lo].zero_()
        position = max(position, hi)
    if position < vector.numel():
        vector[position:].zero_()


def group_spaces(engine, slots: List[Slot]) -> List[GroupSpace]:
    by_param = {id(s.param): s for s in slots}
    spaces = []
    zero_groups = deepspeed_zero.zero_groups(engine.optimizer) if engine.zero else None
    for i, views in enumerate(engine.master_views()):
        pairs = [(by_param[id(p)], v) for p, v in views]
        if zero_groups is not None:
            z = zero_groups[i]
            # Every parameter of the group, also those without elements on this rank.
            pairs = [(by_param[id(p)], None) for p in z.params]
            spaces.append(GroupSpace(pairs, (z.flat, z.partition, z.start, z.size, z.group)))
        else:
            spaces.append(GroupSpace(pairs))
    return spaces


def replica_writer(gname: str, rank: int, size: int) -> bool:
    """Which of ``size`` ranks holding the same slice writes it: spread by name, so the
    writes of a data-parallel group are shared instead of all landing on its first rank."""
    return zlib.crc32(gname.encode()) % size == rank


def sharded(key: str, slot: Slot, data: torch.Tensor, tp_rank: int, tp: int, writer: bool):
    """A megatron-core ShardedTensor of ``data`` (this rank's slice, the parameter's shape)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    axis = slot.stored_axis()
    replica = (int(slot.tied_copy), tp_rank if axis is None else 0, 0 if writer else 1)
    offsets = [(axis, tp_rank, tp)] if axis is not None and tp > 1 else []
    return ShardedTensor.from_rank_offsets(key, slot.stored_view(data), *offsets,
                                           replica_id=replica)


def whole(key: str, shape, dtype, device=None):
    """A request for the whole tensor ``key`` (used where this rank's slice is not a box of
    the stored tensor, e.g. a vocabulary padded for another TP size)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype, device=device),
                                           replica_id=1)


def vocab_rows(slot: Slot, full: torch.Tensor, current: torch.Tensor, tp_rank: int,
               tp: int) -> torch.Tensor:
    """This rank's rows of a vocabulary-parallel tensor stored with another padding: the
    stored rows where they exist, the current value (initial padding) beyond them."""
    rows = current.shape[0]
    lo = tp_rank * rows if slot.tp_axis == 0 else 0
    out = current.detach().clone().to(full.dtype)
    n = max(0, min(rows, full.shape[0] - lo))
    out[:n] = full[lo:lo + n]
    return out


class LayoutMap:
    """This rank's parameters as the checkpoint sees them (``slots``), as the inner optimizer
    does (``spaces``) and as the sync does (``groups``, its shard groups), and the tensors of
    one shape turned into another."""

    def __init__(self, cfg, topology, model, engine, groups):
        layout = topology.layout
        self.tp_rank, self.tp = topology.tp_rank, layout.tp
        offset = topology.first_layer(cfg.model.num_layers)
        tied = not cfg.model.untie_embeddings_and_output_weights
        self.slots = build_slots(model, offset, tied, cfg.model.swiglu,
                                 expert_offset(cfg.model, topology))
        self.spaces: List[GroupSpace] = group_spaces(engine, self.slots)
        # The ranks holding the same slices: ZeRO's group (sequence x data parallel).
        sdp = topology.groups.get("sdp")
        self.sdp_rank = dist.get_rank(sdp) if sdp is not None else 0
        self.sdp_size = dist.get_world_size(sdp) if sdp is not None else 1
        # An expert's shard is held by its expert-data-parallel ranks (MoE).
        edp = topology.groups.get("expt_dp", sdp)
        self.edp_rank = dist.get_rank(edp) if edp is not None else 0
        self.edp_size = dist.get_world_size(edp) if edp is not None else 1
        self.groups = groups
        # Per shard group: (position in its space, length) of each of its views.
        self.pieces = [[(self.spaces[g.param_group].position(t), t.numel()) for t in g.tensors]
                       for g in groups]
        self._in_groups = self._slot_in_groups()

    def stored_shapes(self) -> dict:
        """global name -> stored shape (this rank's parameters)."""
        return {s.gname: list(s.global_shape(self.tp)) for s in self.slots}

    def params(self, vectors: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
        """Per space vectors -> slot index -> whole parameter (collective: ZeRO gathers)."""
        out = {}
        for space, vector in zip(self.spaces, vectors):
            out.update(space.gather(vector))
        return out

    def scatter(self, tensors: Dict[int, torch.Tensor], zeros_for_missing=False,
                out: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """``params``' inverse: per space, this rank's vector of whole-parameter ``tensors``
        (every slot's, or zeros where one is missing); into ``out``'s (ZeRO's partitions)
        when given."""
        if zeros_for_missing:
            tensors = self._or_zeros(tensors)
        return [space.scatter(tensors, out=o)
                for space, o in zip(self.spaces, out or [None] * len(self.spaces))]

    def from_groups(self, values: List[torch.Tensor]) -> List[torch.Tensor]:
        """Per shard group values (flat) -> per space vectors (CPU; zeros elsewhere)."""
        vectors = [torch.zeros(space.length) for space in self.spaces]
        for g, value in zip(self.groups, values):
            offset = 0
            for position, n in self.pieces[g.index]:
                vectors[g.param_group][position:position + n] = \
                    value[offset:offset + n].detach().float().cpu()
                offset += n
        return vectors

    def params_of_groups(self, values: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
        """Per shard group values (flat) -> slot index -> whole parameter: views of ``values``
        when every parameter lies whole on this rank, inside one piece of a shard group (no
        copy); otherwise through the spaces (``from_groups``, ``params``: ZeRO gathers).
        A parameter in no shard group is zeros either way."""
        if self._in_groups is None:
            return self.params(self.from_groups(values))
        views = self._views_in_groups([v.detach().float() for v in values])
        return self._or_zeros(views)

    def _or_zeros(self, tensors: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """slot index -> ``tensors``' tensor, or zeros of the parameter's shape where it has
        none (made only there: ``dict.get``'s default would be made for every slot)."""
        return {s.index: tensors[s.index] if s.index in tensors else torch.zeros(s.param.shape)
                for s in self.slots}

    def group_views(self, values: Optional[List[torch.Tensor]]) -> Dict[int, torch.Tensor]:
        """slot index -> a view of per shard group ``values`` shaped as the parameter, for
        each parameter that lies whole in one piece of a group on this rank; empty when
        they do not (``_slot_in_groups``) or ``values`` are not the groups' flat fp32."""
        if self._in_groups is None or not self._fit_groups(values):
            return {}
        return self._views_in_groups(values)

    def _views_in_groups(self, values: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
        return {index: values[g][start:start + self.slots[index].param.numel()]
                .view(self.slots[index].param.shape)
                for index, (g, start) in self._in_groups.items()}

    def slot_views(self, vectors: Optional[List[torch.Tensor]]) -> Dict[int, torch.Tensor]:
        """slot index -> a view of per-space ``vectors`` (ZeRO's partitions, or state of
        their shape) shaped as the parameter, where one lies whole in this rank's part."""
        out = {}
        for space, vector in zip(self.spaces, vectors or ()):
            out.update(space.views(vector))
        return out

    def _fit_groups(self, values) -> bool:
        return values is not None and len(values) == len(self.groups) and all(
            v.dtype == torch.float32 and v.dim() == 1 and v.numel() == g.numel
            and v.device.type == "cpu" for v, g in zip(values, self.groups))

    def _slot_in_groups(self) -> Optional[Dict[int, tuple]]:
        """slot index -> (shard group, first element in its value); None when some space is
        spread over ZeRO ranks or some parameter lies across pieces (then it is assembled
        through the spaces)."""
        if any(space.zero is not None and dist.get_world_size(space.zero[4]) > 1
               for space in self.spaces):
            return None
        where = {}
        for g in self.groups:
            space, start = self.spaces[g.param_group], 0
            for position, n in self.pieces[g.index]:
                for slot in space.slots:
                    lo, hi = space.offsets[slot.index], \
                        space.offsets[slot.index] + slot.param.numel()
                    if position <= lo and hi <= position + n:
                        where[slot.index] = (g.index, start + lo - position)
                    elif lo < position + n and position < hi:
                        return None  # in part only
                start += n
        return where

    def groups_of_params(self, tensors: Dict[int, torch.Tensor],
                         out: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """Whole-parameter ``tensors`` -> one flat fp32 tensor per shard group (zeros where
        one is missing): ``params_of_groups``' inverse, copied straight into place when every
        parameter lies whole on this rank (into ``out``'s when given and of the groups'
        sizes: no new memory), else through the spaces."""
        where = self._in_groups
        if where is None:
            return self.to_groups(self.scatter(tensors, zeros_for_missing=True))
        values = out if self._fit_groups(out) else \
            [torch.empty(g.numel) for g in self.groups]
        covered = [[] for _ in self.groups]
        for index, (g, start) in where.items():
            t = tensors.get(index)
            if t is not None:
                dst = values[g][start:start + t.numel()]
                if t.data_ptr() != dst.data_ptr():  # else read there already
                    dst.copy_(t.reshape(-1))
                covered[g].append((start, start + t.numel()))
        for value, ranges in zip(values, covered):
            _zero_between(value, ranges)
        return values

    def to_groups(self, vectors: List[torch.Tensor]) -> List[torch.Tensor]:
        """``from_groups``' inverse: one flat tensor per shard group."""
        values = []
        for g in self.groups:
            vector = vectors[g.param_group]
            values.append(torch.cat([vector[p:p + n] for p, n in self.pieces[g.index]])
                          if self.pieces[g.index] else torch.zeros(0))
        return values

    def sharded(self, prefix: str, tensors: Dict[int, torch.Tensor]):
        """``ShardedTensor``s of whole-parameter ``tensors`` under ``prefix`` (``keys``), and
        the bytes this rank writes of them: one rank among those holding a slice writes it,
        also of the global state (each worker's part has it)."""
        out, written = {}, 0
        for slot in self.slots:
            if slot.index not in tensors:
                continue
            key, t = keys.tensor(prefix, slot.gname), tensors[slot.index]
            write = replica_writer(slot.gname, self.edp_rank, self.edp_size) if \
                is_expert(slot.name) else \
                replica_writer(slot.gname, self.sdp_rank, self.sdp_size)
            if write:
                written += t.numel() * t.element_size()
            out[key] = sharded(key, slot, t, self.tp_rank, self.tp, write)
        return out, written

"""The exchange of workers with different layouts: by a layout-free partition of each fragment.

Workers cut the same way exchange shard with shard, rank with rank (``sync``). Workers of
different layouts (one TP=2, another PP=2, a third ZeRO-1 over DP=2) hold different pieces
of a fragment on their ranks, so each worker first moves its pieces into one partition that
does not depend on the layout, and back after the exchange:

* the **canonical vector** of fragment p: its parameters in the order of their global names
  (``weights.local_spec_name`` of ``weights.global_name``; a last stage's tied output layer is
  the embedding), each the full (TP=1) tensor, row-major; the same on every worker since the
  model is;
* **lanes**: the canonical vector cut in L nearly equal contiguous pieces, L the ranks of the
  smallest worker (R, the ranks per worker, when all have as many); local rank l < L holds
  lane l and exchanges it across workers over its cross-worker group (which pairs the local
  ranks l of all workers), with the transport, codec and bytes of the homogeneous exchange:
  the cross-worker bytes are the same (fewer where ranks hold replicas, which travel once
  here); the ranks of a larger worker beyond L hold no lane;
* **routes** (``Route``, one per fragment, set up once, collective over the worker): where
  each element this rank holds sits in the canonical vector. An element held by several ranks
  (replicas across DP without ZeRO, across TP for a norm, a tied embedding on two stages) is
  sent by one of them (the lowest); the mean goes back to all of them.

A round of fragment p: the deltas of the rank's shards, concatenated, go to the lane holders
(one all-to-all over the worker), the lanes are exchanged across workers (asynchronously, as
always), and at the merge the lanes' means come back (a second all-to-all) and are split over
the shards. The in-worker cost, counted in ``Route.bytes``: each element's fp32 value once
each way (its replicas once more on the way back), and, once at set-up, its int64 position.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..comm.codec import ErrorFeedback
from .sync import StreamingSync, sum_of_squares, timed
from ..comm.transport import ExchangeResult, Pending

log = logging.getLogger("megatron_streaming")


class CanonicalOrder:
    """Every fragment's parameters in canonical order, with their offsets and sizes."""

    def __init__(self, sizes: Dict[str, int], fragment_of):
        self.offsets: Dict[str, Tuple[int, int]] = {}  # name -> (fragment, offset)
        self.numel: Dict[int, int] = {}
        for name in sorted(sizes):
            p = fragment_of(name)
            self.offsets[name] = (p, self.numel.get(p, 0))
            self.numel[p] = self.numel.get(p, 0) + sizes[name]

    def lane_bounds(self, fragment: int, lanes: int, holders: int = 0) -> List[int]:
        """Where each of ``holders`` local ranks' lane starts, and the end: ``lanes`` nearly
        equal pieces on the first ranks, none on the ranks beyond (a worker larger than the
        smallest)."""
        n = self.numel.get(fragment, 0)
        bounds = [lane * n // lanes for lane in range(lanes + 1)]
        return bounds + [n] * (max(holders, lanes) - lanes)


def parameter_positions(param: torch.Tensor, first: int, count: int, tp_rank: int,
                        tp_size: int, gated: bool) -> torch.Tensor:
    """Positions, in the full (TP=1) tensor's row-major elements, of the ``count`` elements
    of this rank's ``param`` from its flat element ``first`` on (``weights.tp_shard``'s
    split, gated MLP included)."""
    k = torch.arange(first, first + count, dtype=torch.int64)
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return k
    d = param.partition_dim
    local = list(param.shape)
    inner = 1
    for size in local[d + 1:]:
        inner *= size
    rows, full = local[d], local[d] * tp_size
    low, coord, high = k % inner, (k // inner) % rows, k // (inner * rows)
    if gated:  # [gate_r; up_r] on this rank: rows of each half of the full tensor
        half = rows // 2
        upper = coord >= half
        coord = tp_rank * half + coord + upper.long() * (full // 2 - half)
    else:
        coord = tp_rank * rows + coord
    return (high * full + coord) * inner + low


class Route:
    """How fragment p's elements on this rank travel to the lane holders and back."""

    def __init__(self, group, device, positions: torch.Tensor, bounds: Sequence[int],
                 rank: int):
        lanes = len(bounds) - 1
        self.group, self.device, self.rank = group, device, rank
        self.local_numel = positions.numel()
        self.lane_start, self.lane_numel = bounds[rank], bounds[rank + 1] - bounds[rank]
        self.bytes = 0  # in-worker bytes this rank sent, set-up included
        self._indices: Dict[tuple, torch.Tensor] = {}  # (name, device) -> index tensor there
        lane = torch.bucketize(positions, torch.tensor(bounds[1:-1], dtype=torch.int64),
                               right=True)
        self.order = torch.argsort(lane, stable=True)  # local elements in lane order
        self.send_counts = torch.bincount(lane, minlength=lanes).tolist()
        self.recv_counts = self._exchange_counts(self.send_counts)
        # Each lane holder learns where every element it will receive sits in its lane.
        received = self._all_to_all(positions[self.order], self.recv_counts, self.send_counts)
        self.back_positions = received - self.lane_start
        # The first sender of each position contributes it; the others only get it back.
        taken = torch.zeros(self.lane_numel, dtype=torch.bool)
        masks, start = [], 0
        for count in self.recv_counts:
            mine = self.back_positions[start:start + count]
            fresh = ~taken[mine]
            taken[mine] = True
            masks.append(fresh)
            start += count
        if not bool(taken.all()):
            raise RuntimeError(f"{int((~taken).sum())} elements of lane {rank} are held by no "
                               "rank of this worker: the shards do not cover the fragment")
        keep = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
        self.recv_positions = self.back_positions[keep]
        self.contrib_recv_counts = [int(m.sum()) for m in masks]
        mine = self._all_to_all(keep.to(torch.uint8), self.send_counts, self.recv_counts)
        self.contrib = self.order[mine.bool()]
        starts = [0]
        for count in self.send_counts:
            starts.append(starts[-1] + count)
        self.contrib_send_counts = [int(mine[a:b].sum()) for a, b in zip(starts, starts[1:])]

    def _exchange_counts(self, counts: List[int]) -> List[int]:
        out = torch.empty(len(counts), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(out, torch.tensor(counts, dtype=torch.int64, device=self.device),
                               group=self.group)
        self.bytes += 8 * (len(counts) - 1)
        return out.tolist()

    def _all_to_all(self, x: torch.Tensor, recv: List[int], send: List[int]) -> torch.Tensor:
        out = torch.empty(sum(recv), dtype=x.dtype, device=self.device)
        dist.all_to_all_single(out, x.to(self.device), recv, send, group=self.group)
        self.bytes += (x.numel() - send[self.rank]) * x.element_size()  # what left the rank
        return out.cpu() if x.device.type == "cpu" else out.to(x.device)

    def _index(self, name: str, device) -> torch.Tensor:
        """The index tensor ``name`` on ``device``, copied there once (not every round)."""
        key = (name, str(device))
        if key not in self._indices:
            self._indices[key] = getattr(self, name).to(device)
        return self._indices[key]

    def to_lane(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's elements (flat fp32, in shard order) -> the lane this rank holds,
        every element from its contributing rank."""
        got = self._all_to_all(local[self._index("contrib", local.device)],
                               self.contrib_recv_counts, self.contrib_send_counts)
        lane = torch.empty(self.lane_numel, dtype=local.dtype, device=local.device)
        lane[self._index("recv_positions", local.device)] = got
        return lane

    def from_lane(self, lane: torch.Tensor) -> torch.Tensor:
        """The lanes' values -> this rank's elements (every holder of each)."""
        got = self._all_to_all(lane[self._index("back_positions", lane.device)],
                               self.send_counts, self.recv_counts)
        local = torch.empty(self.local_numel, dtype=lane.dtype, device=lane.device)
        local[self._index("order", lane.device)] = got
        return local


def build_routes(groups, sources, worker_group, device, rank: int, lanes: int,
                 fragment_of_canonical, model_name, tp_rank: int,
                 tp_size: int, gated: bool) -> Dict[int, Route]:
    """One ``Route`` per fragment (collective over the worker: every rank builds every
    fragment's, also one holding none of it). ``sources[g.index]``: per tensor of shard group
    ``g``, ``(local name, parameter, first element)``; ``model_name``: local name -> its
    name in the whole model (``builder.model_name_function``)."""
    from ..worker.weights import _full_shape

    sizes = {}
    for name, param in _named(sources):
        shape = _full_shape(param, tp_size)
        numel = 1
        for size in shape:
            numel *= size
        sizes[model_name(name)] = numel
    gathered: List[Dict[str, int]] = [None] * dist.get_world_size(worker_group)
    dist.all_gather_object(gathered, sizes, group=worker_group)
    merged: Dict[str, int] = {}
    for part in gathered:
        merged.update(part)
    order = CanonicalOrder(merged, fragment_of_canonical)
    routes = {}
    for p in sorted(order.numel):
        pieces = []
        for g in groups:
            if g.fragment != p:
                continue
            for (name, param, first), tensor in zip(sources[g.index], g.tensors):
                _, offset = order.offsets[model_name(name)]
                fc1 = gated and ".linear_fc1." in f".{name}"  # as weights.tp_shard splits
                pieces.append(offset + parameter_positions(param, first, tensor.numel(),
                                                           tp_rank, tp_size, fc1))
        positions = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        routes[p] = Route(worker_group, device, positions,
                          order.lane_bounds(p, lanes, len(gathered)), rank)
    return routes


def _named(sources):
    seen = set()
    for group in sources:
        for name, param, _ in group:
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param


class CanonicalSync(StreamingSync):
    """``StreamingSync`` for workers of different layouts: a fragment's exchange goes by lanes
    (``Route``). Every rank of the worker takes part in every fragment's round, also one that
    holds none of it, so the rounds run after the optimizer step (``after_step``, the same
    point on every rank) rather than in the per-param-group hook; a merge then copies the
    partitions to the model once more (``push_to_model``).

    A fragment's round is one decision for the whole worker: when any lane's exchange failed
    or carried a non-finite outer gradient, every rank of the worker skips it (an all-reduce
    of one flag over the worker).

    Error feedback keeps its residual where the quantization happens, on the lane (one per
    fragment, ``lane_feedback``). The shards' residuals (``feedback``, what a checkpoint saves
    and restores) are its image: ``settle`` writes the lanes' residuals to them, and a lane
    takes its residual from them at its next send (after a resume, or after a checkpoint)."""

    def __init__(self, groups, routes: Dict[int, Route], *args, **kwargs):
        super().__init__(groups, *args, **kwargs)
        self.routes = routes
        self.lanes: Dict[int, Pending] = {}  # fragment -> its lane's exchange in flight
        self.fragments_merged_early: set = set()
        self._groups_of = {p: [g for g in groups if g.fragment == p] for p in routes}
        self.error_feedback = any(f is not None for f in self.feedback)
        self.lane_feedback: Dict[int, ErrorFeedback] = {}  # fragment -> its lane's residual

    @property
    def in_worker_bytes(self) -> int:
        return sum(r.bytes for r in self.routes.values())

    def attach(self, inner_optimizer, step_hooks=None) -> None:
        self._handle = None
        self._hooks = step_hooks
        if step_hooks is not None:
            step_hooks.append(self)

    @timed
    def after_step(self) -> None:
        if self.paused:
            return
        self._stale = False
        for p in self.schedule.sends_after(self.step):
            self._send_fragment(p)
        merged = self._stale
        # Eager: a round's mean is applied at the fragment's next send, never merged alone.
        for p in self.schedule.merges_after(self.step) if self.own is None else ():
            merged = self._merge_fragment(p) or merged
        if merged:
            self.push_to_model()

    def _send_fragment(self, p: int) -> None:
        groups = self._groups_of[p]
        if self.own is not None and p in self.lanes:  # eager: the previous round's mean
            self._settle(p)
        deltas = []
        stats = self.stats[p]
        stats.grad_sq, stats.send_step = 0.0, self.step
        for g in groups:
            theta_g = self.theta_g[g.index]
            delta = theta_g - self._local_on(g, theta_g.device)
            stats.grad_sq += sum_of_squares(delta)
            if self.share != 1.0:
                delta.mul_(self.share)
            deltas.append(delta)
            self._event("send", g)
        device = self.theta_g[groups[0].index].device if groups else torch.device("cpu")
        local = torch.cat(deltas) if deltas else torch.zeros(0, device=device)
        if self.own is not None:  # eager: step at once (the local weights change: sent first)
            for g, delta in zip(groups, deltas):
                self._eager_step(g, delta)
            self._stale = True
        lane = self.routes[p].to_lane(local)
        feedback = self._lane_feedback(p) if self.error_feedback else None
        self.lanes[p] = self.transport.all_reduce_mean_many(
            [lane], self.step, [f"fragment {p} (lane {self.routes[p].lane_start})"],
            [feedback])[0]

    def _shard_vector(self, tensors, p: int) -> torch.Tensor:
        """Fragment p's shards of ``tensors`` (one per shard group), concatenated."""
        groups = self._groups_of[p]
        return torch.cat([tensors[g.index][:g.numel] for g in groups]) if groups else \
            torch.zeros(0)

    def _to_shards(self, tensors, p: int, values: torch.Tensor) -> None:
        start = 0
        for g in self._groups_of[p]:
            tensors[g.index][:g.numel].copy_(values[start:start + g.numel])
            start += g.numel

    def _lane_feedback(self, p: int) -> ErrorFeedback:
        """Fragment p's lane residual, taken from the shards' the first time (collective
        over the worker: every rank sends every fragment)."""
        if p not in self.lane_feedback:
            route = self.routes[p]
            residuals = [f.residual for f in self.feedback]
            lane = route.to_lane(self._shard_vector(residuals, p))
            fresh = self.transport.codec.error_feedback(
                self.transport.padded_numel(route.lane_numel), self.transport.codec_device)
            fresh.residual[:route.lane_numel] = lane.to(fresh.residual.device)
            self.lane_feedback[p] = fresh
        return self.lane_feedback[p]

    def _merge_fragment(self, p: int) -> bool:
        """Merge fragment p's exchange (its lanes' or, restored or settled, its shards');
        whether anything changed on this rank."""
        if p in self.fragments_merged_early:
            self.fragments_merged_early.discard(p)
            return False
        if p in self.lanes:
            self._settle(p)
        merged = False
        for g in self._groups_of[p]:
            if g.index in self.pending:
                self._merge(g)
                merged = True
        return merged

    def settle(self) -> None:
        """Bring every lane in flight back into the shards' pending means, and the lanes'
        error-feedback residuals into the shards' (collective over the worker; before a
        checkpoint reads them). The lanes take their residuals from the shards again at
        their next send."""
        for p in sorted(self.lanes):
            self._settle(p)
        for p in sorted(self.lane_feedback):
            route, lane = self.routes[p], self.lane_feedback[p].residual
            self._to_shards([f.residual for f in self.feedback], p,
                            route.from_lane(lane[:route.lane_numel]))
        self.lane_feedback.clear()

    def _settle(self, p: int) -> None:
        pending = self.lanes.pop(p)
        route = self.routes[p]
        stats = self.stats[p]
        started = time.perf_counter()
        result, ok = None, True
        try:
            result = pending.wait()
        except Exception as e:
            self._exchange_failed(e)
            ok = False
        flag = torch.tensor([1.0 if ok and result.all_finite else 0.0], device=route.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=route.group)
        if result is not None:
            stats.wait += time.perf_counter() - started
            stats.latency = time.perf_counter() - pending.started
            stats.bytes_sent += result.bytes_sent
            stats.bytes_received += result.bytes_received
            stats.quant_error = result.quant_error
            stats.merge_step = self.step
        lane = result.mean[:route.lane_numel] if result is not None else \
            torch.zeros(route.lane_numel)
        mean = route.from_lane(lane)
        finite = bool(flag.item())
        if not finite:
            stats.skipped += 1
            if ok:
                log.warning("step %d: non-finite outer gradient in fragment %d on some worker "
                            "(or a lane's exchange failed): outer step skipped", self.step, p)
        start = 0
        for g in self._groups_of[p]:
            part = mean[start:start + g.numel]
            start += g.numel
            if finite:
                done = Pending.completed(ExchangeResult(part, True, 0, 0, 0.0, 0.0),
                                         pending.step, "settled")
                done.started = pending.started  # the latency runs from the send
                self.pending[g.index] = done
            else:
                self._event("skip" if ok else "lost", g)

    def finish(self) -> int:
        fragments = self.schedule.in_flight_after(self.step)
        self.finished_step = self.step
        merged = 0
        for p in fragments:
            if self.own is not None:  # eager: the round in flight, with nothing fresh
                if p in self.lanes:
                    self._settle(p)
                for g in self._groups_of[p]:
                    if g.index in self.pending:
                        merged += 1
                        self._eager_step(g, None)
                        self.merged_early.add(g.index)
                continue
            merged += int(self._merge_fragment(p))
            self.fragments_merged_early.add(p)
        self.push_to_model()
        return merged

    def share_global_state(self, src: int, cross) -> None:
        """As ``StreamingSync``'s, lane by lane: each worker moves its shards to the lanes,
        the lanes of member ``src`` go to every member, and come back to the shards."""
        for p in sorted(self.routes):
            route, groups = self.routes[p], self._groups_of[p]
            for tensors in (self.theta_g, self.momentum):
                local = torch.cat([tensors[g.index] for g in groups]) if groups else \
                    torch.zeros(0)
                lane = route.to_lane(local)
                on_wire = lane.to(cross.data_device)
                if cross.data_group is not None:  # else a rank beyond the lanes: none here
                    dist.broadcast(on_wire, group_src=src, group=cross.data_group)
                    cross.count_control(on_wire.numel() * on_wire.element_size()
                                        * (cross.workers - 1))
                back, start = route.from_lane(on_wire.to(lane.device)), 0
                for g in groups:
                    tensors[g.index].copy_(back[start:start + g.numel])
                    start += g.numel

    def mark_merged(self, fragments) -> None:
        self.fragments_merged_early = set(fragments)

    def regroup(self, cross) -> None:
        """As ``StreamingSync``'s; the lanes' residuals carry over too (repadded)."""
        super().regroup(cross)
        for p, f in list(self.lane_feedback.items()):
            n = self.routes[p].lane_numel
            self.lane_feedback[p] = f.resized(self.transport.padded_numel(n), n)

    def abandon(self) -> None:
        super().abandon()
        self.lanes.clear()
        self.fragments_merged_early.clear()

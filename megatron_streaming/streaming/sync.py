"""Streaming DiLoCo's sync module, hooked into the inner optimizer's step.

Where it sits: DeepSpeed's ZeRO optimizer steps each param group on this rank's flat fp32
master partition and then copies the partitions to the model weights. A post-step hook on the
inner torch optimizer fires for each group in between, so an edit of the partition here
reaches every model weight through DeepSpeed's own copy and all-gather, with no extra traffic.
Within a param group, the shard of fragment p is the set of slices of the partition that hold
fragment p's parameters (``ShardGroup``). Without ZeRO (stage 0) the groups hold the model's
own parameters.

Per group, after inner step s (schedule.py):

* send: ``delta = theta_g - theta_local``, handed to the transport (quantized, asynchronous);
  a fragment's shards in all param groups go in one exchange, once the last has stepped;
* merge (tau steps later): wait for the mean, outer step on ``theta_g``, then
  ``theta_local = alpha * theta_local + (1 - alpha) * theta_g``. The inner optimizer state is
  left alone. With tau = 0 a shard of an earlier param group merges when that exchange
  returns, after DeepSpeed copied its group to the model, so the step ends with one more copy
  (``push_to_model``); that copy is collective over the worker (ZeRO all-gathers), so every
  rank makes it after every step that sends and merges a fragment, whichever shards it holds.
* eager (``--diloco-eager``, arXiv 2502.12996): at each send the worker steps at once with
  ``mean_prev - delta_prev / M + delta / M``: the previous round's mean (in flight for a whole
  round) with this worker's share of it taken out, since that share was applied a round ago,
  and the fresh ``delta`` standing in for this worker's share of the mean now in flight. Each
  worker's outer gradients are applied exactly once; its ``theta_g`` leads the others' by its
  own latest share, so the workers' ``theta_g`` differ (by momentum's memory of those shares
  too, when there is momentum) and are checkpointed per worker.

The outer state (``theta_g``, momentum, error-feedback residual) is fp32 and shard-sized,
optionally on the CPU. An outer gradient with an inf or NaN on any worker skips that outer
step everywhere (the transport agrees on it), so it never reaches ``theta_g``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union

import torch

from ..comm.codec import ErrorFeedback
from .global_view import GlobalView
from .membership import MembershipChanges
from .outer import OuterOptimizer, eager_grad, merge
from .saved import OuterStateful
from .schedule import SyncSchedule
from ..comm import pinned
from ..comm.transport import Pending, Transport

log = logging.getLogger("megatron_streaming")


class ShardGroup:
    """This rank's shard of one fragment within one inner param group, seen as one flat fp32
    vector: views into the group's flat ZeRO partition (or, without ZeRO, parameters)."""

    def __init__(self, index: int, param_group: int, fragment: int,
                 tensors: List[torch.Tensor], sources: Optional[List[tuple]] = None):
        self.index, self.param_group, self.fragment = index, param_group, fragment
        self.tensors = list(tensors)
        # Per tensor, (local parameter name, parameter, first element of the parameter it
        # starts at): where its elements sit in the model (``canonical``).
        self.sources = list(sources or [])
        self.numel = sum(t.numel() for t in self.tensors)

    def read(self) -> torch.Tensor:
        if len(self.tensors) == 1:
            return self.tensors[0].detach().view(-1)  # the ZeRO partition itself, no copy
        return torch.cat([t.detach().reshape(-1).float() for t in self.tensors])

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        if len(self.tensors) == 1 and flat.data_ptr() == self.tensors[0].data_ptr():
            return
        offset = 0
        for t in self.tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """``||x||^2`` of a flat fp32 tensor, accumulated in fp32 without a copy (a monitoring
    number: an fp64 cast would hold two shard-sized copies at the send), as a 0-dim fp64
    tensor on ``x``'s device: the send does not wait for it; the report reads it on the host
    at a log step."""
    return torch.dot(x, x).double()


def timed(method):
    """Adds the call's seconds to the sync's ``hook_seconds`` (its work on the training
    thread, --timing-log-level 2)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.hook_seconds += time.perf_counter() - started
    return wrapper


@dataclass
class FragmentStats:
    """What happened to one fragment on this rank since the last report."""

    # ||outer gradient||^2 of the latest send (this rank's shard): a device tensor once sent
    grad_sq: Union[float, torch.Tensor] = 0.0
    send_step: int = 0        # step of that send: grad_sq sums its shard groups
    bytes_sent: int = 0
    bytes_received: int = 0
    latency: float = 0.0      # send -> merge done, seconds (latest)
    wait: float = 0.0         # time the merge blocked, seconds (sum)
    quant_error: float = 0.0  # relative quantization error of the latest send (worst shard)
    merge_step: int = 0       # step of the latest merge: quant_error covers its shard groups
    skipped: int = 0


class StreamingSync(OuterStateful, MembershipChanges, GlobalView):
    """The sync of one rank; what a checkpoint keeps of it: ``saved.OuterStateful``; what a
    change of the job's members does to it: ``membership.MembershipChanges``."""

    def __init__(self, groups: List[ShardGroup], schedule: SyncSchedule, transport: Transport,
                 outer: OuterOptimizer, alpha: float, error_feedback: bool,
                 offload: bool, push_to_model: Callable[[], None]):
        self.groups, self.schedule, self.transport = groups, schedule, transport
        self.outer, self.alpha = outer, alpha
        self.push_to_model = push_to_model  # fp32 partitions -> model weights, outside a step
        self.theta_g, self.momentum = _outer_state([g.read() for g in groups], offload)
        self.feedback: List[Optional[ErrorFeedback]] = [
            # Where the transport encodes (its codec device), whatever the outer state's.
            transport.codec.error_feedback(transport.padded_numel(g.numel),
                                           transport.codec_device)
            if error_feedback else None for g in groups]
        self.pending: Dict[int, Pending] = {}
        # Eager: this worker's outer gradient of each shard's latest send (applied at once, to
        # be taken out of that exchange's mean when it is applied); None: not eager.
        self.own: Optional[List[torch.Tensor]] = (
            [torch.zeros_like(t) for t in self.theta_g] if schedule.eager else None)
        # Shards whose exchange ``finish`` merged before its scheduled step: that merge step,
        # should training go on past the end (a resume with more iterations), does nothing.
        self.merged_early: set = set()
        self.finished_step: Optional[int] = None  # the step after which ``finish`` ran
        self.stats = {p: FragmentStats() for p in range(schedule.num_fragments)}
        self.step = 0
        self._done_this_step: set = set()
        # A fragment's shards on this rank (one per param group) travel in one exchange: the
        # deltas wait here until the fragment's last shard has stepped.
        self._shards_of = {p: sum(g.fragment == p for g in groups)
                           for p in range(schedule.num_fragments)}
        self._outbox: Dict[int, list] = {}
        self._merge_later: List[ShardGroup] = []  # tau = 0: merges waiting for that exchange
        self._stale = False  # ``CanonicalSync``: a partition changed after DeepSpeed's copy
        # (step, "send" | "merge" | "skip", fragment, shard index): what this rank did, in
        # order; every worker's list must be identical (the schedule is a function of the step).
        # Recorded only when a caller sets it to a list (tests, drills): a long run would
        # otherwise grow it for nothing.
        self.events: Optional[List[tuple]] = None
        # The communicator (``comm.crossworker``; ``builder`` sets it), asked what a failed
        # exchange means: in an elastic run it is skipped, else raised. ``paused`` while a
        # survivor trains up to the step the others reached (``job.elastic``).
        self.cross = None
        self.paused = False
        # This worker's factor on its outer gradients (``workers.JobShape.share``): the plain
        # mean over the workers then weighs each by its tokens in the round.
        self.share = 1.0
        # Workers in the mean: the transport's, except on a rank beyond the lanes of workers
        # of different sizes, whose transport has none across (``builder`` sets it).
        self.workers = transport.workers
        # Seconds the training thread spent in the hook and after_step since the last
        # take_hook_seconds (--timing-log-level 2's diloco-sync).
        self.hook_seconds = 0.0

    def _event(self, kind: str, g: ShardGroup) -> None:
        if self.events is not None:
            self.events.append((self.step, kind, g.fragment, g.index))

    enabled = True
    routes = None  # workers of different layouts: every fragment's lanes (``CanonicalSync``)

    # ---- driven by the engine ----------------------------------------------------------
    def attach(self, inner_optimizer: torch.optim.Optimizer,
               step_hooks: Optional[list] = None) -> None:
        """Hook into the inner optimizer's step (and the engine's ``step_hooks``)."""
        self._handle = inner_optimizer.register_step_post_hook(self._on_inner_step)
        self._hooks = step_hooks
        if step_hooks is not None:
            step_hooks.append(self)

    def detach(self) -> None:
        """Undo ``attach``: the optimizer steps as if there were no sync."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            handle.remove()
        hooks, self._hooks = getattr(self, "_hooks", None), None
        if hooks is not None and self in hooks:
            hooks.remove(self)

    def before_step(self, step: int) -> None:
        """``step`` is the 1-based number of the optimizer step about to run."""
        self.step = step
        self._done_this_step = set()

    @timed
    def after_step(self) -> None:
        """Run what the hook did not (a step the optimizer skipped): the schedule must go on
        on every worker, or their collectives would pair up wrongly. Then copy the partitions
        to the model once more where a merge may have come after DeepSpeed's copy."""
        missed = [g for g in self.groups if g.index not in self._done_this_step]
        for g in missed:
            self._process(g)
        if missed or self._merged_at_send():
            self.push_to_model()

    def _merged_at_send(self) -> bool:
        """Whether this step sent and merged a fragment (tau = 0). A rank holding the
        fragment's shards in two param groups merges the first one only once the last is sent,
        after DeepSpeed copied the first group to the model; another rank of the worker may
        hold no such pair. The copy is an all-gather over the worker: decided by the schedule,
        the same on every rank, or a rank that needs none would leave its peers waiting in
        it (a hang at the first such step with ZeRO over two data-parallel ranks)."""
        if self.own is not None or self.paused:  # eager: the hook's own copy follows its step
            return False
        return bool(set(self.schedule.sends_after(self.step))
                    & set(self.schedule.merges_after(self.step)))

    @timed
    def _on_inner_step(self, optimizer, args, kwargs) -> None:
        # Under ZeRO the optimizer's groups are narrowed to the one being stepped.
        stepped = {group["sync_index"] for group in optimizer.param_groups}
        for g in self.groups:
            if g.param_group in stepped:
                self._process(g)

    def take_hook_seconds(self) -> float:
        """The training thread's seconds in the sync's step work since the last call."""
        seconds, self.hook_seconds = self.hook_seconds, 0.0
        return seconds

    def _process(self, g: ShardGroup) -> None:
        self._done_this_step.add(g.index)
        if self.paused:
            return
        if self.own is not None:
            if g.fragment in self.schedule.sends_after(self.step):
                self._send(g)
            return
        if g.fragment in self.schedule.sends_after(self.step):
            self._send(g)
        if g.fragment in self.schedule.merges_after(self.step):
            if g.index in self.pending or g.index in self.merged_early:
                self._merge(g)
            else:  # tau = 0: sent at this step, with shards of later param groups to come
                self._merge_later.append(g)

    # ---- the algorithm ----------------------------------------------------------------
    def _send(self, g: ShardGroup) -> None:
        theta_g = self.theta_g[g.index]
        # The outer gradient is made in the buffer that travels: no copy on the way out.
        buffer = self.transport.buffer(g.numel, theta_g.device)
        delta = torch.sub(theta_g, self._local_on(g, theta_g.device), out=buffer[:g.numel])
        # A fragment's shard on this rank spans several param groups (decay / no decay),
        # each sent by its own call at the same step: the norm covers all of them.
        stats = self.stats[g.fragment]
        if stats.send_step != self.step:
            stats.grad_sq, stats.send_step = 0.0, self.step
        stats.grad_sq += sum_of_squares(delta)
        if self.share != 1.0:
            delta.mul_(self.share)
        if self.own is not None:
            self._eager_step(g, delta)
        self._event("send", g)
        outbox = self._outbox.setdefault(g.fragment, [])
        outbox.append((g, buffer))
        if len(outbox) < self._shards_of[g.fragment]:
            return
        del self._outbox[g.fragment]
        shards = [s for s, _ in outbox]
        pendings = self.transport.all_reduce_mean_many(
            [b for _, b in outbox], self.step,
            [f"fragment {s.fragment} (param group {s.param_group})" for s in shards],
            [self.feedback[s.index] for s in shards], numels=[s.numel for s in shards])
        for s, pending in zip(shards, pendings):
            self.pending[s.index] = pending
        later = [s for s in self._merge_later if s.fragment == g.fragment]
        self._merge_later = [s for s in self._merge_later if s.fragment != g.fragment]
        for s in later:  # DeepSpeed copied their param groups already: ``_merged_at_send``
            self._merge(s)

    def finish(self) -> int:
        """At the end of training: merge every exchange still in flight now (sent at one of
        the last tau steps), so the final global parameters contain every outer gradient that
        was sent and counted. Every rank calls it after the same step: the push to the model
        is collective within the worker, and a rank may hold no shard of the fragment in
        flight. Returns how many exchanges this rank merged."""
        indices = sorted(self.pending)
        self.finished_step = self.step
        for index in indices:
            if self.own is not None:
                self._eager_step(self.groups[index], None)
            else:
                self._merge(self.groups[index])
            self.merged_early.add(index)
        self.push_to_model()
        return len(indices)

    def _merge(self, g: ShardGroup) -> None:
        if g.index in self.merged_early:  # finish() did it already
            self.merged_early.discard(g.index)
            return
        # Sent at this very step: the shard's local parameters are still those it sent.
        unchanged = self.pending[g.index].step == self.step
        mean = self._arrived(g)
        if mean is not None:
            self._apply(g, mean, unchanged)

    def _eager_step(self, g: ShardGroup, delta: Optional[torch.Tensor]) -> None:
        """The eager outer step at a send of ``delta`` (None: ``finish``, nothing new)."""
        theta_g = self.theta_g[g.index]
        workers = self.workers
        mean = None
        if g.index in self.merged_early:  # finish() applied the previous exchange already
            self.merged_early.discard(g.index)
        elif g.index in self.pending:
            mean = self._arrived(g)  # None: non-finite somewhere, its others' shares dropped
        fresh = torch.zeros_like(theta_g)
        if delta is not None and bool(torch.isfinite(delta).all()):
            fresh = delta.to(theta_g.device)  # a non-finite one is skipped by every worker
        grad = eager_grad(self.own[g.index], mean, fresh, workers)
        self.own[g.index] = fresh
        self._apply(g, grad, unchanged=delta is not None)

    def _arrived(self, g: ShardGroup) -> Optional[torch.Tensor]:
        """Wait for the shard's exchange in flight; its mean, or None if some worker's outer
        gradient was not finite (the outer step is skipped everywhere)."""
        pending = self.pending.pop(g.index)
        started = time.perf_counter()
        stats = self.stats[g.fragment]
        try:
            result = pending.wait()
        except Exception as e:
            self._exchange_failed(e)  # a lost worker: skipped here, dropped everywhere
            stats.skipped += 1
            self._event("lost", g)
            return None
        stats.wait += time.perf_counter() - started
        stats.latency = time.perf_counter() - pending.started
        stats.bytes_sent += result.bytes_sent
        stats.bytes_received += result.bytes_received
        if stats.merge_step != self.step:
            stats.quant_error, stats.merge_step = 0.0, self.step
        stats.quant_error = max(stats.quant_error, result.quant_error)
        if not result.all_finite:
            stats.skipped += 1
            self._event("skip", g)
            log.warning("step %d: non-finite outer gradient in fragment %d on some worker: "
                        "outer step skipped", self.step, g.fragment)
            return None
        self._event("merge", g)
        return result.mean

    def _apply(self, g: ShardGroup, grad: torch.Tensor, unchanged: bool = False) -> None:
        """Outer step on the shard's ``theta_g`` with ``grad``, then the local merge;
        ``unchanged``: the local parameters are still those whose outer gradient ``grad``
        holds (the merge comes at the send's own step)."""
        local = g.read()
        self._outer_update(self.theta_g[g.index], self.momentum[g.index], local, grad,
                           own_mean=unchanged and self._own_mean())
        g.write(local)

    def _own_mean(self) -> bool:
        """Whether the mean this worker merges is its own outer gradient, bit for bit: one
        worker, no codec, no token share."""
        return self.workers == 1 and self.transport.codec.name == "none" and \
            self.share == 1.0

    def _outer_update(self, theta_g: torch.Tensor, momentum: torch.Tensor,
                      local: torch.Tensor, grad: Optional[torch.Tensor],
                      own_mean: bool = False) -> None:
        """In place: the outer step on ``theta_g`` with ``grad`` (None: none), then the merge
        of ``local`` with it; a shard group's tensors, or whole parameters at a resume.
        ``own_mean``: ``grad`` is exactly ``theta_g - local`` (``_own_mean``, merged at its
        send)."""
        offloaded = local.is_cuda and not theta_g.is_cuda
        if offloaded:  # the last copy out of the pinned theta_g may still be reading it
            torch.cuda.current_stream().synchronize()
        if grad is not None:
            self.outer.step(theta_g, momentum, grad.to(theta_g.device))
            if own_mean and self.outer.averages:
                # Plain averaging over one worker makes theta_g its local parameters; the step
                # computes theta_g - (theta_g - local), which rounds away from local wherever
                # the two differ by more than a factor of 2 (a sign change, a weight near 0).
                # The exact value keeps such a run the plain training it is, bit for bit.
                theta_g.copy_(local)
        merge(local, theta_g.to(local.device, non_blocking=offloaded), self.alpha)

    def _exchange_failed(self, error: BaseException) -> None:
        """Skip a failed exchange if the communicator says the run goes on; else raise."""
        if self.cross is None:
            raise error
        self.cross.failed(error)

    def close(self) -> None:
        """Let exchanges in flight finish (their peers are running them too), then stop.
        Their results are not merged (after ``finish`` there are none; a run stopped early
        keeps them in its checkpoint instead)."""
        self.transport.close()


def _outer_state(local: List[torch.Tensor], offload: bool):
    """theta_g (fp32 copies of ``local``) and the outer momentum (zeros), where ``local``
    lives, or in host memory with ``offload``: pinned where ``local`` is on a GPU, so the
    copies to and from it run asynchronously at full rate, all of them in one buffer pinned
    at its exact size (``comm.pinned``; torch's ``pin_memory`` would round each tensor up to
    a power of two)."""
    if offload:
        device = next((t.device for t in local if t.is_cuda), None)
        theta_g, momentum = [], []
        if local:
            tensors = pinned.host_tensors([(t.shape, torch.float32) for t in local] * 2, device)
            theta_g, momentum = tensors[:len(local)], tensors[len(local):]
    else:
        theta_g = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in local]
        momentum = [torch.zeros_like(t) for t in theta_g]
    for out, t in zip(theta_g, local):
        out.copy_(t.detach())
    return theta_g, momentum


class NoSync:
    """The sync of a run that has none (``--no-diloco-sync``, or one worker that did not ask
    for its outer optimizer: ``settings.enabled``): the same calls as ``StreamingSync``, each
    doing nothing, so callers need no branch for it."""

    enabled = False
    routes = None

    def __init__(self):
        self.groups: List[ShardGroup] = []
        self.events: Optional[List[tuple]] = None
        self.own = None
        self.pending: Dict[int, Pending] = {}
        self.stats: Dict[int, FragmentStats] = {}

    def attach(self, inner_optimizer, step_hooks=None) -> None:
        pass

    def detach(self) -> None:
        pass

    def before_step(self, step: int) -> None:
        pass

    def after_step(self) -> None:
        pass

    def finish(self) -> int:
        return 0

    def take_hook_seconds(self) -> float:
        return 0.0

    def abandon(self) -> None:
        pass

    def regroup(self, cross) -> None:
        pass

    def share_global_state(self, src, cross) -> None:
        pass

    def mark_merged(self, fragments) -> None:
        pass

    def global_parameters(self):
        return contextlib.nullcontext()

    def in_flight_fragments(self) -> list:
        return []

    def merged_early_fragments(self) -> list:
        return []

    def settle(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}  # no outer state

    def load_state_dict(self, state: dict) -> None:
        pass

    def merge_at_load(self, theta_g, momentum, local, mean, own, workers) -> None:
        pass

    def close(self) -> None:
        pass

"""The plan: a layout for each cluster, batches that keep the workers in step, and the sync
settings for the link, from the memory and step-time models (``memory``, ``step_time``),
the sync rule (``streaming.rule.advise``) and the link model (``link_utilisation``: the
exchange's bytes over the link's rate and its round trips against the steps that cover it).

The search is exhaustive (a cluster's candidates number in the thousands at most, each
a few formulas): TP among the divisors of a node's devices that divide the heads and the
query groups, PP among the divisors of the layers, Ulysses SP among the divisors of what the
heads have left, data parallel the rest of the cluster, for an MoE model EP among the
divisors of the experts that divide the data x sequence ranks, ZeRO 0-2, micro-batch 1-8, no
recompute, a selective one (the core attention) or a full one. A candidate must fit the
device memory (``--memory-headroom`` kept free); the fastest (tokens per second of the
worker) wins; speeds within 0.5 % of the fastest tie, and less memory, then fewer ranks per
replica, then the least recompute break the tie.

Each worker runs its own cluster's best layout (workers of different layouts exchange by the
layout-free lanes, ``streaming.canonical``). The cuts weighed (``sizes``): one worker per
cluster on all its devices (workers of their own sizes: 64 H100s beside 32 A100s make a
worker of 64 and one of 32), or workers of one size R on every cluster, R the smallest
cluster's size or a divisor of every cluster's, a cluster of n devices running n // R of them
(three workers of 32 there). Each more DiLoCo worker costs loss (docs/RESULTS.md), so a cut
must make the step ``MORE_WORKERS_FOR`` faster for every worker it adds to the fewest: the
plan takes the cut of the least step time x ``(1 + MORE_WORKERS_FOR) ** (workers - fewest)``,
at most ``max_workers``. The global batch is then shared
out in proportion to each worker's speed, so that their steps take about as long
(``balance``): the slower cluster gets the smaller batch, and the outer mean weighs each
worker by its tokens (``--diloco-weighting tokens``). The sync settings follow from the
slowest worker's step and the link.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from ..errors import first_line
from .clusters import Cluster, Link
from .memory import (GIB, RECOMPUTE, HostMemory, Layout, ModelShape, Training, estimate,
                     host_estimate)
from .step_time import step_time
from .wire import DENSE_FP4, Wire, as_wire


@dataclass
class Candidate:
    layout: Layout
    memory_gib: float
    step_seconds: float
    tokens_per_s: float
    why_not: str = ""  # empty: it fits


@dataclass
class WorkerPlan:
    cluster: Cluster
    best: Candidate
    global_batch: int
    step_seconds: float
    ranked: List[Candidate] = field(default_factory=list)
    host: Optional[HostMemory] = None  # one rank's host memory with the chosen sync

    @property
    def ranks_per_node(self) -> int:
        return min(self.cluster.devices_per_node, self.best.layout.ranks)


@dataclass
class Option:
    """One way of cutting the clusters into workers: ``counts[i]`` workers of ``ranks[i]``
    devices on cluster i."""
    ranks: List[int]
    counts: List[int]
    step_seconds: float = 0.0  # the slowest worker's, batches shared by speed
    why_not: str = ""
    workers: List["WorkerPlan"] = field(default_factory=list)

    def describe(self) -> str:
        counts = " + ".join(str(k) for k in self.counts)
        if len(set(self.ranks)) == 1:
            return f"{counts} workers of {self.ranks[0]} devices"
        return f"{counts} workers of {' / '.join(str(r) for r in self.ranks)} devices"


@dataclass
class Plan:
    workers: List[WorkerPlan]
    sync_flags: List[str]
    reasons: List[str]
    exchange_seconds: float
    utilisation: float
    peak_link_gbit_per_s: float
    mean_link_gbit_per_s: float
    fewer_bytes_than_data_parallel: float  # bf16 gradients all-reduced every step
    options: List[Option] = field(default_factory=list)  # the chosen first


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(shape: ModelShape, cluster: Cluster, devices: int,
               global_batch: int) -> List[Layout]:
    """Every layout of ``devices`` of ``cluster`` the model and the batch allow."""
    out = []
    for tp in _divisors(cluster.devices_per_node):
        if shape.heads % tp or shape.query_groups % tp:
            continue
        for pp in _divisors(shape.layers):
            for sp in _divisors(shape.heads // tp):
                if shape.seq % sp or devices % (tp * pp * sp):
                    continue
                dp = devices // (tp * pp * sp)
                # EP: a divisor of the experts and of the data x sequence ranks
                eps = [e for e in _divisors(dp * sp) if shape.experts % e == 0] \
                    if shape.experts else [1]
                for micro in (1, 2, 4, 8):
                    if global_batch % (micro * dp):
                        continue
                    for zero in (0, 1, 2):
                        if zero and dp * sp == 1:
                            continue  # nothing to partition over
                        for ep in eps:
                            if ep > 1 and zero == 0:
                                continue  # refused: stage-0 clipping with experts spread
                            for recompute in RECOMPUTE:
                                out.append(Layout(tp, pp, sp, dp, zero, micro, recompute,
                                                  ep, bool(shape.experts)))
    return out


def rank(shape: ModelShape, cluster: Cluster, devices: int, global_batch: int,
         training: Training, headroom: float, check=None) -> List[Candidate]:
    """Every candidate with its memory and speed, the best first (those that do not fit or
    that ``check(layout, global_batch)`` refuses last, each saying why)."""
    out = []
    training = dataclasses.replace(training, global_batch=global_batch)
    budget = cluster.device_memory_gib * (1 - headroom)
    fabric = cluster.fabric()
    for layout in candidates(shape, cluster, devices, global_batch):
        mem = estimate(shape, layout, training, cluster.runtime_gib * GIB).total / GIB
        seconds = step_time(shape, layout, training, fabric)["total"]
        c = Candidate(layout, mem, seconds, global_batch * shape.seq / seconds)
        refused = check(layout, global_batch) if check else None
        if refused:
            c.why_not = f"pretrain_gpt.py refuses it: {refused}"
        elif mem > budget:
            c.why_not = f"needs {mem:.1f} GiB per device, {budget:.1f} available"
        out.append(c)
    return order(out)


def order(cands: Sequence[Candidate]) -> List[Candidate]:
    """Those that fit first; among them the ones within ``TIE`` of the fastest that fits,
    by memory, ranks per replica and the least recompute; then the rest by speed."""
    fitting = [c.tokens_per_s for c in cands if not c.why_not] or \
        [c.tokens_per_s for c in cands]
    best = max(fitting, default=0.0)
    return sorted(cands, key=lambda c: _preference(c, best))


TIE = 0.005  # speeds within 0.5 % are a tie: less memory, then fewer ranks per replica win


def _preference(c: Candidate, best: float):
    tie = c.tokens_per_s * (1 + TIE) >= best
    return (bool(c.why_not), not tie, 0.0 if tie else -c.tokens_per_s, c.memory_gib,
            c.layout.tp * c.layout.pp * c.layout.sp, RECOMPUTE.index(c.layout.recompute))


MORE_WORKERS_FOR = 0.05  # a cut must make the step this much faster per worker it adds


def sizes(clusters: Sequence[Cluster], max_workers: int) -> List[Option]:
    """The ways to cut the clusters into workers: one per cluster on all its devices (where
    the clusters differ in size), and workers of one size R, the smallest cluster's devices
    or a divisor of every cluster's, each cluster running ``devices // R`` of them (at most
    ``max_workers`` in all; the smallest cluster's cut is always one)."""
    from functools import reduce

    devices = [c.devices for c in clusters]
    smallest = min(devices)
    common = reduce(math.gcd, devices)
    out = [Option(devices, [1] * len(clusters))] if len(set(devices)) > 1 else []
    for r in sorted({smallest, *_divisors(common)}, reverse=True):
        counts = [n // r for n in devices]
        if r == smallest or sum(counts) <= max_workers:
            out.append(Option([r] * len(clusters), counts))
    return out


def plan(shape: ModelShape, clusters: Sequence[Cluster], link: Link, global_batch: int,
         train_iters: int, training: Training, headroom: float = 0.1, check=None,
         link_share: float = 0.5, max_workers: int = 8, wire: Wire = DENSE_FP4) -> Plan:
    """``global_batch``: sequences per step over all workers together; ``check(layout,
    batch)``: why the launcher would refuse a layout (None: it would not); ``wire``: the
    exchange's format whose bytes the sync settings are chosen for (``plan.wire``: the dense
    FP4 the plan's flags ask for, or the sparse exchange where the run's flags say so)."""
    from ..errors import UsageError
    from ..streaming import rule

    options, memo, first_error = sizes(clusters, max_workers), {}, None
    for option in options:
        cut = [(c, r) for c, k, r in zip(clusters, option.counts, option.ranks)
               for _ in range(k)]
        try:
            option.workers = balance(shape, [c for c, _ in cut], [r for _, r in cut],
                                     global_batch, training, headroom, check, memo)
        except UsageError as e:
            first_error = first_error or e
            option.why_not = first_line(e)
            continue
        option.step_seconds = max(w.step_seconds for w in option.workers)
    usable = [o for o in options if not o.why_not]
    if not usable:
        raise first_error
    chosen = pick(usable)
    advice, exchange, util, peak, mean = _sync(shape, link, len(chosen.workers),
                                               chosen.step_seconds, train_iters, rule,
                                               link_share, min(chosen.ranks), wire)
    fewer = wire.fewer_than_data_parallel(advice.inner_steps, shape.parameters(),
                                          len(chosen.workers), min(chosen.ranks))
    synced = dataclasses.replace(training, streaming=len(chosen.workers) > 1,
                                 fragments=advice.fragments,
                                 overlap_steps=advice.overlap_steps, wire=wire,
                                 workers=len(chosen.workers))
    for w in chosen.workers:
        w.host = host_estimate(shape, w.best.layout, synced)
    ordered = [chosen, *[o for o in options if o is not chosen]]
    if len(chosen.workers) == 1:  # no link to plan for; sync flags would turn on one
        # worker's outer optimizer (``cli.arguments._apply_one_worker``), which is opt-in
        return Plan(chosen.workers, [], [ONE_WORKER], 0.0, 1.0, 0.0, 0.0, 0.0, ordered)
    return Plan(chosen.workers, advice.flags(), advice.reasons, exchange, util, peak, mean,
                fewer, ordered)


ONE_WORKER = ("one worker: data parallel inside it, no sync (one worker's outer optimizer is "
              "opt-in: --diloco-workers 1 with --diloco-inner-steps and the outer flags)")


def pick(options: Sequence[Option]) -> Option:
    """The cut of the least step time x ``(1 + MORE_WORKERS_FOR) ** (workers - fewest)``."""
    fewest = min(sum(o.counts) for o in options)
    return min(options, key=lambda o: (
        o.step_seconds * (1 + MORE_WORKERS_FOR) ** (sum(o.counts) - fewest), sum(o.counts)))


BALANCE_ROUNDS = 6


def balance(shape: ModelShape, clusters: Sequence[Cluster], devices: Sequence[int],
            global_batch: int, training: Training, headroom: float, check=None,
            memo: Optional[dict] = None) -> List[WorkerPlan]:
    """Each worker's best layout on its cluster (``clusters``: one per worker, ``devices``:
    its devices there) and a batch per worker in proportion to its speed, so that the
    workers' steps take about as long;
    the batches add up to ``global_batch`` (each a multiple of its layout's micro-batch x
    DP). Rounds: rank at an equal share, split by the speeds found, rank again at the split,
    until the split stays (a step's fixed costs, the bubble and the collectives' latency, make
    a worker's speed depend on its batch) or for ``BALANCE_ROUNDS``. ``memo``: rankings
    already made, by cluster, devices and batch."""
    from ..errors import UsageError

    memo = {} if memo is None else memo

    def ranking(c: Cluster, d: int, b: int) -> List[Candidate]:
        key = (c, d, b)
        if key not in memo:
            memo[key] = rank(shape, c, d, b, training, headroom, check)
        return memo[key]

    M = len(clusters)
    batches = [global_batch // M] * M
    for _ in range(BALANCE_ROUNDS):
        ranked = [ranking(c, d, b) for c, d, b in zip(clusters, devices, batches)]
        for c, d, r, b in zip(clusters, devices, ranked, batches):
            if not r or r[0].why_not:
                raise UsageError(f"no layout of the model fits {c.name} ({d} devices, "
                                 f"batch {b}): --memory-headroom, --global-batch-size, or "
                                 "more devices")
        speeds = [r[0].tokens_per_s for r in ranked]
        grains = [r[0].layout.micro_batch * r[0].layout.dp for r in ranked]
        split = _split(global_batch, speeds, grains)
        if split == batches:
            break
        batches = split
    ranked = [ranking(c, d, b) for c, d, b in zip(clusters, devices, batches)]
    out = []
    for c, r, b in zip(clusters, ranked, batches):
        if not r or r[0].why_not:
            raise UsageError(f"no layout of the model fits {c.name} at batch {b}")
        out.append(WorkerPlan(c, r[0], b, r[0].step_seconds, r))
    return out


def _split(total: int, speeds: Sequence[float], grains: Sequence[int]) -> List[int]:
    """``total`` in parts proportional to ``speeds``, each a positive multiple of its grain;
    the remainder goes where it lengthens the slowest step least."""
    parts = [max(g, int(total * v / sum(speeds)) // g * g) for v, g in zip(speeds, grains)]
    while sum(parts) > total and any(p > g for p, g in zip(parts, grains)):
        i = max((i for i, (p, g) in enumerate(zip(parts, grains)) if p > g),
                key=lambda i: parts[i] / speeds[i])
        parts[i] -= grains[i]
    while True:
        room = [i for i, g in enumerate(grains) if sum(parts) + g <= total]
        if not room:
            return parts
        i = min(room, key=lambda i: (parts[i] + grains[i]) / speeds[i])
        parts[i] += grains[i]


def link_utilisation(step: float, exchange: float, inner_steps: int, fragments: int,
                     overlap_steps: int, eager: bool = False,
                     sync_seconds: float = 0.0) -> float:
    """Compute utilisation of a worker whose fragment exchanges take ``exchange`` seconds
    (bytes over the link's rate plus its round trips): each of the P fragments syncs every H
    steps; the merge waits for what of the exchange the ``overlap_steps`` steps did not
    cover (eager: the whole round of H/P steps covers it). ``sync_seconds``: what each
    exchange's own work (copies, codec, outer step, merge) takes from the compute, whatever
    the link: a few milliseconds on a GPU, tens where the sync shares a CPU's cores with the
    compute. Validated against the slow-link harness (``benchmarks/plan_link_validation.py``,
    docs/RESULTS.md)."""
    stall = _stall(step, exchange, inner_steps, fragments, overlap_steps, eager)
    return step / (step + (stall + sync_seconds) * fragments / inner_steps)


def _stall(step: float, exchange: float, inner_steps: int, fragments: int, overlap_steps: int,
           eager: bool) -> float:
    """What of an exchange the steps that overlap it (tau, or eager's whole round) leave."""
    cover = inner_steps / fragments if eager else overlap_steps
    return max(0.0, exchange - cover * step)


# Linux's initial congestion window: ten segments (RFC 6928) of 1448 bytes (a 1500-byte MTU
# less the IP, TCP and timestamp headers).
INITIAL_WINDOW_BYTES = 10 * 1448
# Linux's floor under the retransmission timeout (TCP_RTO_MIN): RTO = smoothed RTT + max(200
# ms, four times the RTT's mean deviation).
RTO_MIN_SECONDS = 0.2


def slow_start(nbytes: float, window_cap: float, window: float) -> tuple:
    """(round trips, bytes sent in them, window after): TCP's slow start over a burst of
    ``nbytes`` sent from ``window``. The window doubles each round trip until it holds the rest
    of the burst or ``window_cap`` (the connection's share of the bandwidth-delay product);
    the bytes of those rounds travel within their round trips. After the burst the window has
    grown by what was acknowledged, up to twice the largest flight (Linux grows it only while
    it limits the sending: ``tcp_is_cwnd_limited``)."""
    trips, sent, flight, start = 0, 0.0, 0.0, window
    while sent + window < nbytes and window < window_cap:
        sent += window
        flight = window
        window *= 2
        trips += 1
    flight = max(flight, min(window, nbytes - sent))
    return trips, sent, max(window, min(start + nbytes, 2 * flight))


def restarted_window(window: float, idle_seconds: float, rto_seconds: float) -> float:
    """The window a connection starts an exchange with after ``idle_seconds`` without sending
    (Linux's ``tcp_cwnd_restart``): kept when the gap is shorter than the retransmission
    timeout, else halved once per timeout of the gap past the first, not below the initial
    window."""
    if idle_seconds <= rto_seconds:
        return window
    floor = min(window, INITIAL_WINDOW_BYTES)
    halvings = math.ceil(idle_seconds / rto_seconds) - 1 if math.isfinite(idle_seconds) \
        else math.inf
    while halvings > 0 and window > floor:
        window /= 2
        halvings -= 1
    return max(window, floor)


def exchange_seconds(parameters: float, bits: Union[float, Wire], workers: int, fragments: int,
                     gbit_per_s: float, rtt_ms: float, connections: int = 1,
                     slow_start_after_idle: bool = True,
                     idle_seconds: float = math.inf) -> float:
    """One fragment's exchange: its outer gradients over the link and a round trip per
    collective. ``bits``: a dense wire's bits per value (the reduce-scatter and the all-gather,
    ``2 (M-1) / M`` of the fragment each way, two round trips), or a ``plan.wire.Wire`` (a
    sparse one: one all-gather of ``(M-1)`` payloads, ``SparseCodec.wire_bytes`` per lane, one
    round trip). With ``slow_start_after_idle`` (Linux's default,
    ``net.ipv4.tcp_slow_start_after_idle=1``) each of the ``connections`` (the lanes, one per
    rank of the smaller worker, sharing the link) restarts its window after the
    ``idle_seconds`` between exchanges (``restarted_window``; the timeout from the round trip
    and the queueing each direction's burst adds to it; an unknown gap: from the initial
    window): the first collective pays a round trip per doubling until the window holds its
    share, the next goes on from the window the first left, and what those rounds carry is
    sent within them (``slow_start``)."""
    wire = as_wire(bits)
    collectives = wire.collectives
    nbytes = wire.bytes_sent(parameters / fragments, workers, connections)
    rate, rtt = gbit_per_s * 1e9 / 8, rtt_ms / 1e3
    seconds = nbytes / rate + collectives * rtt
    if not (slow_start_after_idle and rtt > 0):
        return seconds
    share, cap = nbytes / collectives / connections, rate * rtt / connections
    # the smoothed RTT: the path's, plus half of a burst's time on the link in each direction
    # (the data queued going, the acknowledgements queued behind the other side's burst)
    rto = rtt + share / (rate / connections) + RTO_MIN_SECONDS
    window = INITIAL_WINDOW_BYTES
    for _ in range(64):  # the window an exchange starts with, exchange after exchange
        trips, sent, after = 0, 0.0, window
        for _ in range(collectives):
            more, carried, after = slow_start(share, cap, after)
            trips, sent = trips + more, sent + carried
        start = restarted_window(min(after, max(cap, INITIAL_WINDOW_BYTES)), idle_seconds, rto)
        if start == window:
            break
        window = start
    return seconds + trips * rtt - sent * connections / rate


def steady_exchange_seconds(step: float, inner_steps: int, overlap_steps: int, eager: bool,
                            sync_seconds: float = 0.0, **link) -> float:
    """``exchange_seconds`` (``link``: its arguments but ``idle_seconds``) with the idle gap
    that the exchanges' period leaves: one fragment every H/P steps (a blocking P=1 exchange:
    every H steps, after them), each step of the period lengthened by what the exchange
    stalls (``link_utilisation``), less the exchange itself."""
    fragments = link["fragments"]
    exchange = exchange_seconds(**link)
    for _ in range(8):
        stall = _stall(step, exchange, inner_steps, fragments, overlap_steps, eager)
        period = inner_steps / fragments * step + stall + sync_seconds
        again = exchange_seconds(**link, idle_seconds=max(0.0, period - exchange))
        if again == exchange:
            break
        exchange = again
    return exchange


def _sync(shape: ModelShape, link: Link, workers: int, step: float, train_iters: int, rule,
          link_share: float, connections: int = 1, wire: Wire = DENSE_FP4):
    """H, P, tau and the wire format for the link (``rule.advise``: H as small as the link
    allows, here: the outer gradients of the whole model on ``wire`` (the dense FP4 unless the
    run asks for the sparse exchange), once per H steps, may use ``link_share`` of its
    bandwidth on average); the predicted compute utilisation, the link's peak rate (a
    fragment's exchange within one step) and its mean rate. The settings are chosen for an
    exchange from TCP's initial window; the utilisation counts the window that the gap
    between exchanges leaves (``steady_exchange_seconds``)."""
    params = shape.parameters()
    model_bits = 8 * wire.bytes_sent(params, workers, connections)
    smallest = max(2, math.ceil(model_bits / (link_share * link.bandwidth_gbit_per_s * 1e9
                                              * step)))

    link_args = dict(parameters=params, bits=wire, workers=workers,
                     gbit_per_s=link.bandwidth_gbit_per_s, rtt_ms=link.rtt_ms,
                     connections=connections, slow_start_after_idle=link.slow_start_after_idle)
    h = 6 * math.ceil(smallest / 6)  # so that P = 3 or 2 fragments divide it
    advice = rule.advise(train_iters, shape.layers, h, None)
    exchange = exchange_seconds(**link_args, fragments=advice.fragments)
    if exchange > step:
        advice = rule.advise(train_iters, shape.layers, h, exchange / step)
    if wire.sparse:  # the rule speaks of its default, FP4: say what replaces it
        ratio = model_bits / 8 / DENSE_FP4.bytes_sent(params, workers)
        advice = dataclasses.replace(
            advice, quantize=wire.quantize, outer_lr=rule.SPARSE_OUTER_LR, reasons=[
                *advice.reasons, f"wire: {wire.describe()} in place of the FP4 above, as the "
                f"run's flags ask: {model_bits / 8e6:,.1f} MB a worker sends per round of the "
                f"whole model, {ratio:.3g}x the dense FP4's; H follows it; outer lr "
                f"{rule.SPARSE_OUTER_LR:g} (the sparse exchange's, measured best)"])
    exchange = steady_exchange_seconds(step, advice.inner_steps, advice.overlap_steps,
                                       advice.eager, **link_args, fragments=advice.fragments)
    util = link_utilisation(step, exchange, advice.inner_steps, advice.fragments,
                            advice.overlap_steps, advice.eager)
    peak = model_bits / advice.fragments / step / 1e9
    mean = model_bits / (advice.inner_steps * step) / 1e9
    return advice, exchange, util, peak, mean


__all__ = ["Candidate", "Option", "Plan", "WorkerPlan", "balance", "candidates", "order", "plan",
           "rank", "sizes"]

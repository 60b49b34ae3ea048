"""The sync module on one worker against hand-computed outer steps, and its report.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_streaming.streaming import report
from megatron_streaming.comm.codec import make_codec
from megatron_streaming.streaming.outer import OuterOptimizer
from megatron_streaming.streaming.schedule import SyncSchedule
from megatron_streaming.streaming.sync import NoSync, ShardGroup, StreamingSync
from megatron_streaming.comm.transport import Transport


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- sync.py ----------------------------------------------------------------------------------

LR, MU = 0.7, 0.9


def _layout(P):
    """(param group, fragment, tensor shapes) per shard group: ZeRO-like, param group 0 holds
    every fragment (two tensors each), param group 1 the first and last (one tensor each)."""
    shards = [(0, p, [(3, 4), (5 + p,)]) for p in range(P)]
    shards += [(1, p, [(2, 3 + p)]) for p in sorted({0, P - 1})]
    return shards


def _initial_tensors(layout, seed=7):
    g = _gen(seed)
    return [[torch.randn(shape, generator=g) for shape in shapes] for _, _, shapes in layout]


def _inner_update(tensors, layout, step, param_group):
    """What an inner optimizer would do to one param group: a deterministic small change."""
    for i, (pg, _, _) in enumerate(layout):
        if pg != param_group:
            continue
        for k, t in enumerate(tensors[i]):
            t.add_(torch.randn(t.shape, generator=_gen(step * 1000 + i * 10 + k)) * 0.05)


def _build_sync(layout, tensors, schedule, alpha):
    groups = [ShardGroup(i, pg, f, ts) for i, ((pg, f, _), ts) in enumerate(zip(layout, tensors))]
    transport = Transport(None, [0], 0, make_codec("none"), 30.0)
    pushes = []
    sync = StreamingSync(groups, schedule, transport, OuterOptimizer(LR, MU, True),
                         alpha, False, False, lambda: pushes.append(sync.step))
    sync.events = []  # recorded on request only
    return sync, pushes


def _hook(sync, param_group):
    sync._on_inner_step(SimpleNamespace(param_groups=[{"sync_index": param_group}]), (), {})


def _drive(sync, layout, steps, hooked=(0, 1), corrupt=None):
    """Inner steps with the post-step hook firing for the param groups in ``hooked``;
    ``corrupt`` = (step, shard): put a NaN into that shard before the hook."""
    for s in steps:
        sync.before_step(s)
        for pg in (0, 1):
            _inner_update([g.tensors for g in sync.groups], layout, s, pg)
            if corrupt and corrupt[0] == s and layout[corrupt[1]][0] == pg:
                sync.groups[corrupt[1]].tensors[0].view(-1)[1] = float("nan")
            if pg in hooked:
                _hook(sync, pg)
        sync.after_step()


class _Reference:
    """Streaming DiLoCo for one worker written out by hand: with M = 1 the mean is the
    worker's own outer gradient. Sends after k*H - p*H/P, merges tau steps later."""

    def __init__(self, layout, tensors, H, P, tau, alpha):
        self.layout, self.alpha = layout, alpha
        self.tensors = [[t.clone() for t in ts] for ts in tensors]
        self.theta_g = [self._flat(i).clone() for i in range(len(layout))]
        self.momentum = [torch.zeros_like(t) for t in self.theta_g]
        self.pending, self.events = {}, []
        self.deferred, self.pushes, self.sent_n = [], set(), 0
        self.sent_sq, self.sent_at = {}, {}  # per fragment: ||outer gradient||^2, its step
        self.send = {k * H - p * (H // P): p for k in range(1, 100) for p in range(P)}
        self.merge = {s + tau: p for s, p in self.send.items()}

    def _flat(self, i):
        return torch.cat([t.reshape(-1) for t in self.tensors[i]])

    def _write(self, i, flat):
        offset = 0
        for t in self.tensors[i]:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def step(self, s, corrupt=None):
        for pg in (0, 1):
            _inner_update(self.tensors, self.layout, s, pg)
            if corrupt and corrupt[0] == s and self.layout[corrupt[1]][0] == pg:
                self.tensors[corrupt[1]][0].view(-1)[1] = float("nan")
            for i, (group_pg, fragment, _) in enumerate(self.layout):
                if group_pg == pg:
                    self._shard(s, i, fragment)

    def _shard(self, s, i, fragment):
        # A fragment's shards go out together once the last has stepped; with tau = 0 a shard
        # stepped earlier merges then, and every step that sends and merges a fragment ends
        # with one more copy to the model (a push: collective, so on every rank alike).
        shards = sum(f == fragment for _, f, _ in self.layout)
        if self.send.get(s) == fragment and self.merge.get(s) == fragment:
            self.pushes.add(s)
        if self.send.get(s) == fragment:
            self.pending[i] = self.theta_g[i] - self._flat(i)
            if self.sent_at.get(fragment) != s:  # a new send: its shards add up
                self.sent_at[fragment], self.sent_sq[fragment], self.sent_n = s, 0.0, 0
            self.sent_sq[fragment] += float(self.pending[i].double().pow(2).sum())
            self.sent_n += 1
            self.events.append((s, "send", fragment, i))
            if self.sent_n == shards:
                for j in self.deferred:
                    self._merge(s, j, fragment)
                self.deferred = []
        if self.merge.get(s) == fragment:
            if self.send.get(s) == fragment and self.sent_n < shards:
                self.deferred.append(i)
            else:
                self._merge(s, i, fragment)

    def finish(self, s):
        """End of training after step s: what is still in flight merges now, and not again."""
        for i in sorted(self.pending):
            fragment = self.layout[i][1]
            self._merge(s, i, fragment)
            del self.merge[min(k for k, p in self.merge.items() if k > s and p == fragment)]

    def _merge(self, s, i, fragment):
        d = self.pending.pop(i)
        if not torch.isfinite(d).all():
            self.events.append((s, "skip", fragment, i))
            return
        self.events.append((s, "merge", fragment, i))
        # Nesterov: m <- mu m + d; theta_g <- theta_g - lr (d + mu m).
        self.momentum[i].mul_(MU).add_(d)
        self.theta_g[i].sub_(d.add(self.momentum[i], alpha=MU), alpha=LR)
        # theta_local <- alpha theta_local + (1 - alpha) theta_g.
        local = self._flat(i) * self.alpha + self.theta_g[i] * (1 - self.alpha) \
            if self.alpha else self.theta_g[i].clone()
        self._write(i, local)


def _assert_matches(sync, ref, context=""):
    for i in range(len(ref.layout)):
        assert torch.equal(sync.theta_g[i], ref.theta_g[i]), (context, "theta_g", i)
        assert torch.equal(sync.momentum[i], ref.momentum[i]), (context, "momentum", i)
        for t, r in zip(sync.groups[i].tensors, ref.tensors[i]):
            # NaN-aware: a corrupted shard keeps its NaN (and nothing else changes).
            assert torch.equal(t.nan_to_num(7.0), r.nan_to_num(7.0)), (context, "local", i)
            assert torch.equal(t.isnan(), r.isnan()), (context, "local nan", i)


SYNC_CASES = [(6, 3, 1, 0.5), (4, 1, 0, 0.0), (6, 2, 2, 0.0), (6, 3, 0, 0.5)]


@pytest.mark.parametrize("H,P,tau,alpha", SYNC_CASES)
def test_sync_on_one_worker_matches_hand_computed_outer_steps(H, P, tau, alpha):
    layout = _layout(P)
    tensors = _initial_tensors(layout)
    ref = _Reference(layout, tensors, H, P, tau, alpha)
    sync, pushes = _build_sync(layout, tensors, SyncSchedule(H, P, tau), alpha)
    for s in range(1, 2 * H + tau + 2):
        _drive(sync, layout, [s])
        ref.step(s)
        _assert_matches(sync, ref, context=s)
        if alpha == 0.0:  # replacement: right after its merge a shard's local is global
            for i, (_, fragment, _) in enumerate(layout):
                if fragment in sync.schedule.merges_after(s):
                    assert torch.equal(sync.groups[i].read(), sync.theta_g[i]), (s, i)
    assert sync.events == ref.events
    assert sum(kind == "merge" for _, kind, _, _ in ref.events) >= 2 * len(layout)
    # The hook fired for every group: after_step pushes only after a step that sent and
    # merged a fragment (tau = 0), whose shard of an earlier param group may have merged after
    # DeepSpeed copied that group to the model.
    assert pushes == sorted(ref.pushes)
    assert bool(pushes) == (tau == 0)


class _HeldTransport(Transport):
    """Records what a send hands over and completes it at once, on the caller's thread."""

    def all_reduce_mean_many(self, xs, step, tags, feedbacks, numels=None):
        from megatron_streaming.comm.transport import ExchangeResult, Pending

        self.handed = list(zip(xs, numels))
        return [Pending.completed(ExchangeResult(x[:n], True, 0, 0, 0.0, 0.0), step, tag)
                for x, n, tag in zip(xs, numels, tags)]


def test_ranks_of_a_worker_copy_to_the_model_at_the_same_steps_whatever_shards_they_hold():
    """The copy after a tau = 0 merge is an all-gather over the worker's ranks. Under ZeRO one
    rank may hold a fragment's shards in two param groups (its first merges only after the
    second is sent, after DeepSpeed's copy of the first group) and another rank only one: both
    must copy, or the first waits in the all-gather for ever."""
    H, P = 4, 2
    two = [(0, 0, [(3, 4)]), (0, 1, [(5,)]), (1, 1, [(2, 3)])]  # fragment 1 in both groups
    one = [(0, 0, [(3, 4)]), (0, 1, [(5,)]), (1, 0, [(2, 3)])]  # each fragment in one group
    pushes = []
    for layout in (two, one):
        sync, pushed = _build_sync(layout, _initial_tensors(layout), SyncSchedule(H, P, 0), 0.0)
        _drive(sync, layout, range(1, 2 * H + 1))
        assert [s for s, kind, _, _ in sync.events if kind == "merge"]
        pushes.append(pushed)
    assert pushes[0] == pushes[1] == [2, 4, 6, 8]


def test_a_send_makes_its_outer_gradient_in_the_buffer_that_travels():
    """No copy between the sync and the wire, and no fp64 copy for the norm: all a send
    allocates is the padded buffer its outer gradient travels in."""
    from torch.profiler import ProfilerActivity, profile

    n = 200_000
    local = torch.randn(n, generator=_gen(3))
    transport = _HeldTransport(None, [0], 0, make_codec("fp4", 128), 30.0)
    sync = StreamingSync([ShardGroup(0, 0, 0, [local])], SyncSchedule(2, 1, 1), transport,
                         OuterOptimizer(1.0, 0.0, False), 0.0, False, False, lambda: None)
    theta_g = sync.theta_g[0].clone()
    local.add_(torch.randn(n, generator=_gen(4)))
    sync.before_step(2)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _hook(sync, 0)
    allocated = sum(e.self_cpu_memory_usage for e in prof.key_averages()
                    if e.self_cpu_memory_usage > 0)
    (buffer, numel), = transport.handed
    assert numel == n and buffer.numel() == transport.padded_numel(n)
    assert torch.equal(buffer[:n], theta_g - local) and not buffer[n:].any()
    assert float(sync.stats[0].grad_sq) == pytest.approx(
        float((theta_g - local).double().pow(2).sum()), rel=1e-5)
    assert allocated < 4 * buffer.numel() + 4096, allocated  # the buffer, nothing shard-sized


def _sgd_over(layout):
    """The layout's tensors as parameters, and an SGD optimizer with one param group per
    inner param group (tagged as the engine tags them)."""
    tensors = [[torch.nn.Parameter(t) for t in ts] for ts in _initial_tensors(layout)]
    opt = torch.optim.SGD([{"params": [t for (pg, _, _), ts in zip(layout, tensors) if pg == q
                                       for t in ts], "sync_index": q} for q in (0, 1)], lr=0.1)
    return tensors, opt


def test_sync_detaches_from_the_optimizer_and_the_engine_hooks():
    layout = _layout(3)
    tensors, opt = _sgd_over(layout)
    sync, _ = _build_sync(layout, tensors, SyncSchedule(1, 1, 0), 0.0)
    hooks = []
    sync.attach(opt, hooks)
    assert hooks == [sync]
    sync.detach()
    assert hooks == []
    sync.detach()  # twice: nothing more to undo
    before = [t.detach().clone() for ts in tensors for t in ts]
    for ts in tensors:
        for t in ts:
            t.grad = torch.ones_like(t)
    sync.before_step(1)
    opt.step()  # H = 1: an attached sync would send (and merge) every fragment here
    assert sync.events == [] and sync.pending == {}
    assert all(torch.allclose(t, b - 0.1) for t, b in zip((t for ts in tensors for t in ts),
                                                          before))


def test_no_sync_answers_every_call_the_run_makes_with_nothing():
    no = NoSync()
    public = {n for n in dir(StreamingSync) if not n.startswith("_")} - {
        "drift_terms"}  # per fragment, read by the report only when there is a sync
    assert public <= set(dir(no)), public - set(dir(no))
    assert not no.enabled and StreamingSync.enabled
    no.attach(None, [])
    no.before_step(1)
    no.after_step()
    assert no.finish() == 0 and no.in_flight_fragments() == [] and no.groups == []
    with no.global_parameters():
        pass
    assert report.worker_scalars(no, None) == {} and report.total_bytes_sent(no, None, 2) == 0
    report.reset_interval_stats(no)
    no.detach(), no.close()


def test_sync_attaches_to_a_real_torch_optimizer():
    layout = _layout(3)
    tensors, opt = _sgd_over(layout)
    sync, pushes = _build_sync(layout, tensors, SyncSchedule(6, 3, 1), 0.5)
    sync.attach(opt)
    for s in range(1, 8):
        sync.before_step(s)
        for ts in tensors:
            for t in ts:
                t.grad = torch.randn(t.shape, generator=_gen(s))
        opt.step()
        sync.after_step()
        if s == 6:  # in flight: shards 0 and 3 of fragment 0, in param groups 0 and 1
            assert {i: sync.pending[i].tag for i in sync.pending} == {
                0: "fragment 0 (param group 0)", 3: "fragment 0 (param group 1)"}
    # Shards (0,2)=2 and (1,2)=4 after 2, (0,1)=1 after 4, (0,0)=0 and (1,0)=3 after 6.
    assert [e for e in sync.events if e[1] == "send"] == [
        (2, "send", 2, 2), (2, "send", 2, 4), (4, "send", 1, 1), (6, "send", 0, 0),
        (6, "send", 0, 3)]
    assert [e for e in sync.events if e[1] == "merge"] == [
        (3, "merge", 2, 2), (3, "merge", 2, 4), (5, "merge", 1, 1), (7, "merge", 0, 0),
        (7, "merge", 0, 3)]
    assert pushes == []


def test_sync_skips_a_non_finite_outer_gradient():
    H, P, tau, alpha = 6, 3, 1, 0.5
    layout = _layout(P)  # shard 1 = fragment 1 (param group 0), sent after step 4
    tensors = _initial_tensors(layout)
    ref = _Reference(layout, tensors, H, P, tau, alpha)
    sync, _ = _build_sync(layout, tensors, SyncSchedule(H, P, tau), alpha)
    theta_before = sync.theta_g[1].clone()
    for s in range(1, 10):
        _drive(sync, layout, [s], corrupt=(4, 1))
        ref.step(s, corrupt=(4, 1))
        _assert_matches(sync, ref, context=s)
    assert torch.equal(sync.theta_g[1], theta_before)
    assert torch.equal(sync.momentum[1], torch.zeros_like(theta_before))
    assert sync.stats[1].skipped == 1
    assert (5, "skip", 1, 1) in sync.events and (5, "merge", 1, 1) not in sync.events
    assert sync.stats[0].skipped == sync.stats[2].skipped == 0
    # The other fragments went on: 2 merged after 3 and 9, 0 after 7.
    merged = [(s, f) for s, kind, f, _ in sync.events if kind == "merge"]
    assert merged == [(3, 2), (3, 2), (7, 0), (7, 0), (9, 2), (9, 2)]
    assert sync.events == ref.events


def test_global_parameters_swap_in_and_back():
    layout = _layout(3)
    sync, pushes = _build_sync(layout, _initial_tensors(layout), SyncSchedule(6, 3, 1), 0.5)
    _drive(sync, layout, range(1, 6))
    local = [[t.clone() for t in g.tensors] for g in sync.groups]
    assert any(not torch.equal(g.read(), theta) for g, theta in zip(sync.groups, sync.theta_g))
    with sync.global_parameters():
        for g, theta in zip(sync.groups, sync.theta_g):
            assert torch.equal(g.read(), theta)
        assert len(pushes) == 1
    for g, saved in zip(sync.groups, local):
        assert all(torch.equal(t, s) for t, s in zip(g.tensors, saved))
    assert len(pushes) == 2


def test_finish_merges_what_is_in_flight_at_the_end():
    """Training ends at step 4 with fragment 1 sent but not merged (tau = 1): finish() merges
    it at once, pushes it to the model, and its scheduled merge step, if training goes on
    (resumed with more iterations), does nothing."""
    H, P, tau, alpha = 6, 3, 1, 0.5
    layout = _layout(P)
    tensors = _initial_tensors(layout)
    ref = _Reference(layout, tensors, H, P, tau, alpha)
    sync, pushes = _build_sync(layout, tensors, SyncSchedule(H, P, tau), alpha)
    _drive(sync, layout, range(1, 5))
    for s in range(1, 5):
        ref.step(s)
    assert set(sync.pending) == {1}
    before = sync.theta_g[1].clone()
    assert sync.finish() == 1 and not sync.pending and pushes[-1] == 4
    ref.finish(4)
    assert not torch.equal(sync.theta_g[1], before)
    _assert_matches(sync, ref, "finish")
    assert sync.events[-1] == (4, "merge", 1, 1)
    assert sync.finish() == 0 and pushes[-2:] == [4, 4]  # nothing left; still pushes
    # What a checkpoint records (checkpoint.job): nothing in flight, fragment 1 merged early.
    assert sync.in_flight_fragments() == [] and sync.merged_early_fragments() == [1]
    for s in range(5, 13):
        _drive(sync, layout, [s])
        ref.step(s)
        _assert_matches(sync, ref, s)
    assert (5, "merge", 1, 1) not in sync.events and (11, "merge", 1, 1) in sync.events


def test_error_feedback_residual_lives_where_the_transport_encodes():
    """The residual must be where the transport encodes (its codec device), whatever the
    outer state's or the wire's, or ``x + residual`` mixes devices at the first send (as it
    did on a GPU job with gloo across workers). A codec device other than the outer state's
    ("meta" here) stands in for it."""
    layout = _layout(2)
    groups = [ShardGroup(i, pg, f, ts)
              for i, ((pg, f, _), ts) in enumerate(zip(layout, _initial_tensors(layout)))]
    transport = Transport(None, [0, 1], 0, make_codec("fp4"), 30.0, codec_device="meta")
    assert transport.wire_device.type == "cpu"
    sync = StreamingSync(groups, SyncSchedule(4, 2, 0), transport, OuterOptimizer(LR, MU, True),
                         0.0, True, False, lambda: None)
    assert all(t.device.type == "cpu" for t in sync.theta_g)
    assert [f.residual.device.type for f in sync.feedback] == ["meta"] * len(groups)
    assert [f.residual.numel() for f in sync.feedback] == [
        transport.padded_numel(g.numel) for g in groups]


def test_after_step_runs_what_the_hook_missed():
    H, P, tau, alpha = 6, 3, 1, 0.5
    layout = _layout(P)
    runs = {}
    for name, hooked in (("hooked", (0, 1)), ("missed", ()), ("half", (0,))):
        sync, pushes = _build_sync(layout, _initial_tensors(layout), SyncSchedule(H, P, tau),
                                   alpha)
        _drive(sync, layout, range(1, 10), hooked=hooked)
        runs[name] = (sync, pushes)
    hooked, _ = runs["hooked"]
    for name in ("missed", "half"):
        sync, pushes = runs[name]
        assert sync.events == hooked.events, name
        for a, b in zip(hooked.theta_g + hooked.momentum + [g.read() for g in hooked.groups],
                        sync.theta_g + sync.momentum + [g.read() for g in sync.groups]):
            assert torch.equal(a, b), name
        assert pushes == list(range(1, 10)), name  # once per step that the hook missed
    assert runs["hooked"][1] == []


# ---- report.py --------------------------------------------------------------------------------

FRAGMENT_KEYS = ("outer_grad_norm", "bytes_sent", "bytes_received", "skipped", "drift",
                 "send_to_merge_s", "merge_wait_s", "quant_rel_error")


def test_worker_scalars_on_one_rank(megatron_world):
    H, P, tau, alpha = 6, 3, 1, 0.5
    layout = _layout(P)
    tensors = _initial_tensors(layout)
    ref = _Reference(layout, tensors, H, P, tau, alpha)
    sync, _ = _build_sync(layout, tensors, SyncSchedule(H, P, tau), alpha)
    for s in range(1, 8):
        _drive(sync, layout, [s])
        ref.step(s)
    scalars = report.worker_scalars(sync, megatron_world.groups["worker"])
    for p in range(P):
        for key in FRAGMENT_KEYS:
            assert f"streaming/fragment_{p}/{key}" in scalars, key
        assert scalars[f"streaming/fragment_{p}/bytes_sent"] == 0.0  # M = 1: no wire
        assert scalars[f"streaming/fragment_{p}/skipped"] == 0.0
    num, den = [0.0] * P, [0.0] * P
    for i, (_, fragment, _) in enumerate(layout):
        local, theta = sync.groups[i].read().double(), sync.theta_g[i].double()
        num[fragment] += float((local - theta).pow(2).sum())
        den[fragment] += float(theta.pow(2).sum())
    for p in range(P):
        assert num[p] > 0
        assert scalars[f"streaming/fragment_{p}/drift"] == pytest.approx(
            math.sqrt(num[p] / den[p]), rel=1e-5)  # accumulated in fp32
    assert scalars["streaming/drift"] == pytest.approx(math.sqrt(sum(num) / sum(den)), rel=1e-5)
    # The outer-gradient norm of a fragment covers all its shards (both param groups).
    for p in range(P):
        assert scalars[f"streaming/fragment_{p}/outer_grad_norm"] == pytest.approx(
            math.sqrt(ref.sent_sq[p]), rel=1e-6), p


def test_merge_at_load_does_what_the_merge_step_would_have_done():
    """A resume under another schedule merges the exchange in flight at once: a finite mean
    is the outer step and the merge of ``_apply``; a non-finite one is skipped as at the merge
    step (no outer step, the local parameters left alone)."""
    alpha = 0.5
    layout = _layout(2)
    tensors = _initial_tensors(layout)
    sync, _ = _build_sync(layout, tensors, SyncSchedule(4, 2, 1), alpha)
    g = _gen(3)
    theta, local, mean = (torch.randn(6, generator=g) for _ in range(3))
    momentum = torch.zeros(6)

    t, m, l_ = theta.clone(), momentum.clone(), local.clone()
    sync.merge_at_load(t, m, l_, mean, None, 2)
    want_m = mean.clone()  # first outer step: momentum = grad (Nesterov below)
    want_t = theta - LR * (mean + MU * want_m)
    assert torch.allclose(m, want_m) and torch.allclose(t, want_t)
    assert torch.allclose(l_, alpha * local + (1 - alpha) * want_t)

    t, m, l_ = theta.clone(), momentum.clone(), local.clone()
    sync.merge_at_load(t, m, l_, None, None, 2)  # some worker's outer gradient not finite
    assert torch.equal(t, theta) and torch.equal(m, momentum) and torch.equal(l_, local)


# ---- one worker's outer optimizer (--diloco-workers 1) ----------------------------------------

def _one_worker_sync(layout, tensors, schedule, outer, codec="none", error_feedback=False):
    from megatron_streaming.streaming.one_worker import OneWorkerExchange

    groups = [ShardGroup(i, pg, f, ts) for i, ((pg, f, _), ts) in enumerate(zip(layout, tensors))]
    sync = StreamingSync(groups, schedule, OneWorkerExchange(0, make_codec(codec), 30.0), outer,
                         0.0, error_feedback, False, lambda: None)
    sync.events = []
    return sync


@pytest.mark.parametrize("P,eager", [(1, False), (3, False), (2, True)])
def test_one_worker_plain_averaging_is_plain_training_bit_for_bit(P, eager):
    """Outer lr 1, no momentum, no codec, tau 0: at every sync the global parameters become
    the worker's own and the local ones stay as the inner steps left them, bit for bit. The
    outer step's own arithmetic, theta_g - (theta_g - local), rounds away from local wherever
    a value changed sign or by more than a factor of 2 since the last sync, as some do here."""
    H = 6
    layout = _layout(P)
    tensors = _initial_tensors(layout)
    plain = [[t.clone() for t in ts] for ts in tensors]
    sync = _one_worker_sync(layout, tensors, SyncSchedule(H, P, 0, eager=eager),
                            OuterOptimizer(1.0, 0.0, True))
    rounded = 0  # elements the arithmetic alone would have moved, over the run
    for s in range(1, 3 * H + 1):
        sent = {g.index: sync.theta_g[g.index].clone() for g in sync.groups
                if g.fragment in sync.schedule.sends_after(s)}
        _drive(sync, layout, [s])
        for pg in (0, 1):
            _inner_update(plain, layout, s, pg)
        for g, want in zip(sync.groups, plain):
            assert all(torch.equal(t, w) for t, w in zip(g.tensors, want)), (s, g.index)
        for i, theta_before in sent.items():
            local = sync.groups[i].read()
            assert torch.equal(sync.theta_g[i], local), (s, i)
            rounded += int((theta_before - (theta_before - local) != local).sum())
    assert sum(kind == "send" for _, kind, _, _ in sync.events) == 3 * len(layout)
    assert rounded > 0  # the data reach the case the exact copy is for


def test_one_worker_exchange_quantizes_as_the_wire_would_and_sends_nothing():
    """--diloco-quantize with one worker: the mean is decode(encode(x)) of its own outer
    gradient (through the error-feedback residual when asked), with its relative error, and no
    byte counted; without a codec it is the outer gradient itself."""
    from megatron_streaming.comm.codec import ErrorFeedback
    from megatron_streaming.streaming.one_worker import OneWorkerExchange

    n = 1000
    codec = make_codec("fp4", 128)
    exchange = OneWorkerExchange(0, codec, 30.0)
    x = torch.randn(n, generator=_gen(5))

    def send(feedback=None, value=x):
        buffer = exchange.buffer(n, "cpu")
        buffer[:n] = value
        (pending,) = exchange.all_reduce_mean_many([buffer], 4, ["fragment 0"], [feedback],
                                                   numels=[n])
        return buffer, pending.wait()

    buffer, result = send()
    want = codec.decode(codec.encode(buffer))[:n]
    assert torch.equal(result.mean, want) and not torch.equal(want, x)
    assert result.all_finite is True and result.bytes_sent == result.bytes_received == 0
    error = float((want - x).norm() / x.norm())
    assert result.quant_error == pytest.approx(error, rel=1e-5) and error > 0.05
    feedback = ErrorFeedback(codec, exchange.padded_numel(n), "cpu")
    _, first = send(feedback)
    _, second = send(feedback)  # carries the first send's error
    assert torch.equal(first.mean, want)
    residual = x - want
    assert torch.equal(second.mean, codec.decode(codec.encode(buffer + torch.cat(
        [residual, torch.zeros(exchange.padded_numel(n) - n)])))[:n])
    _, bad = send(value=torch.full((n,), float("nan")))
    assert bad.all_finite is False
    assert exchange.bytes_sent == exchange.bytes_received == 0
    exchange.close()

    exact = OneWorkerExchange(0, make_codec("none"), 30.0)
    buffer = exact.buffer(n, "cpu")
    buffer[:n] = x
    (pending,) = exact.all_reduce_mean_many([buffer], 4, ["fragment 0"], [None], numels=[n])
    result = pending.wait()
    assert result.mean.data_ptr() == buffer.data_ptr() and torch.equal(result.mean, x)
    assert result.quant_error == 0.0 and result.all_finite is True
    exact.close()


def test_one_worker_runs_its_outer_optimizer_only_when_asked():
    """--diloco-workers 1 alone is plain training (no sync, no outer state); a flag of the
    outer loop typed, or --diloco-sync, turns its outer optimizer on, unquantized unless
    --diloco-quantize is typed, and says so in one line at start."""
    from megatron_streaming.cli.arguments import parse_args, validate
    from megatron_streaming.errors import ConfigError
    from megatron_streaming.streaming.settings import enabled

    def cfg(*flags):
        return parse_args(["--mock-data", *flags])

    plain = cfg("--diloco-workers", "1")
    assert not enabled(plain) and plain.notes == []
    # Cross-worker flags ask for nothing, nor do the codec's own without --diloco-quantize.
    assert not enabled(cfg("--diloco-timeout", "30", "--diloco-weighting", "uniform",
                           "--diloco-control-lag", "2", "--eval-params", "local",
                           "--diloco-quant-block", "64", "--diloco-error-feedback"))
    asked = cfg("--diloco-inner-steps", "30", "--diloco-outer-lr", "0.7",
                "--diloco-outer-momentum", "0.9")
    assert enabled(asked) and asked.streaming.diloco_quantize == "none"
    assert asked.notes == [
        "--diloco-workers 1 with --diloco-inner-steps, --diloco-outer-lr, "
        "--diloco-outer-momentum (--no-diloco-sync: plain training): one worker's outer "
        "optimizer: every 30 steps, outer lr 0.7, momentum 0.9 (Nesterov), 1 fragment, no "
        "quantization",
        "--diloco-fragments, --diloco-overlap-steps not given: P=1, tau=0 for 20 steps of 2 "
        "layers (docs/DESIGN.md, \"Choosing the sync settings\": H=30 where a fragment still "
        "gets 40 outer steps, else train-iters / 40; P=3 where it divides the layers and H; "
        "tau=1 where H/P > 1)"]
    switch = cfg("--diloco-sync")  # 20 steps of 2 layers: H and P chosen, tau 0 (one worker)
    assert enabled(switch) and switch.notes[0].endswith(
        "every step, outer lr 1, no momentum, 1 fragment, no quantization (plain "
        "averaging: the same training as without it, bit for bit)")
    assert switch.notes[1].startswith("--diloco-inner-steps, --diloco-fragments, "
                                      "--diloco-overlap-steps not given: H=1, P=1, tau=0 for "
                                      "20 steps of 2 layers")
    assert enabled(cfg("--no-diloco-nesterov")) and enabled(cfg("--diloco-fragments", "2"))
    assert not enabled(cfg("--diloco-outer-lr", "0.7", "--no-diloco-sync"))
    quantized = cfg("--diloco-quantize", "int8", "--diloco-error-feedback")
    assert enabled(quantized) and quantized.streaming.diloco_quantize == "int8"
    assert "the outer gradient quantized locally as int8 with error feedback" in \
        quantized.notes[0]
    several = cfg("--diloco-workers", "2")  # as before: on, FP4 on the wire; H, P, tau said
    assert enabled(several) and several.streaming.diloco_quantize == "fp4-e2m1"
    assert [n[:n.index(" for ")] for n in several.notes] == [
        "--diloco-inner-steps, --diloco-fragments, --diloco-overlap-steps not given: H=1, P=1, "
        "tau=0"]
    off = cfg("--diloco-workers", "2", "--no-diloco-sync")
    assert not enabled(off) and off.notes == []
    with pytest.raises(ConfigError, match=r"^--diloco-min-workers 1: elastic workers need "
                       r"--diloco-workers above 1"):
        validate(cfg("--diloco-outer-lr", "0.7", "--diloco-min-workers", "1"), 1)
    # Warned at start: what the quality benchmark measured of one worker's outer momentum, and
    # the inner steps a merge tau steps after its send drops; plain averaging draws none.
    from megatron_streaming.streaming import rule

    papers = cfg("--diloco-outer-lr", "0.7", "--diloco-outer-momentum", "0.9",
                 "--diloco-fragments", "3", "--diloco-inner-steps", "6",
                 "--diloco-overlap-steps", "1").streaming
    momentum, overlap = rule.warnings(papers, 1e-3)
    assert momentum.startswith("--diloco-outer-lr 0.7 with --diloco-outer-momentum 0.9 on one "
                               "worker moves its parameters up to 7.0x")
    assert overlap.startswith("--diloco-overlap-steps 1 with one worker: there is no exchange")
    assert rule.warnings(switch.streaming, 1e-3) == rule.warnings(plain.streaming, 1e-3) == []

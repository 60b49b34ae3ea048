"""The outer optimizer (DiLoCo; CO2, arXiv 2401.16265) and the cross-worker transport.

The transport runs on small spawned gloo groups; its results are compared exactly with a
codec-level simulation of the quantized reduce-scatter + all-gather.
"""

import threading
import time

import pytest
import torch

from megatron_streaming.comm.codec import make_codec
from megatron_streaming.streaming.outer import OuterOptimizer, merge
from megatron_streaming.comm.transport import SyncTimeout, Transport

from conftest import spawn_gloo
from seams import abandoned, all_reduce_mean, count_collectives


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- outer.py ---------------------------------------------------------------------------------

def _grads(steps, seed=0):
    g = _gen(seed)
    return [torch.randn(257, generator=g) for _ in range(steps)]


def _run_outer(outer, theta0, grads):
    theta, momentum = theta0.clone(), torch.zeros_like(theta0)
    history = []
    for grad in grads:
        outer.step(theta, momentum, grad)
        history.append((theta.clone(), momentum.clone()))
    return history


def _run_torch_sgd(theta0, grads, **kw):
    param = torch.nn.Parameter(theta0.clone())
    opt = torch.optim.SGD([param], **kw)
    history = []
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
        history.append(param.detach().clone())
    return history


@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.9, False), (0.0, False),
                                               (0.5, True)])
def test_outer_optimizer_is_torch_sgd_exactly(momentum, nesterov):
    theta0 = torch.randn(257, generator=_gen(1))
    grads = _grads(10)
    ours = _run_outer(OuterOptimizer(0.7, momentum, nesterov), theta0, grads)
    torch_sgd = _run_torch_sgd(theta0, grads, lr=0.7, momentum=momentum, nesterov=nesterov)
    for step, ((theta, _), expected) in enumerate(zip(ours, torch_sgd)):
        assert torch.equal(theta, expected), step
    assert not torch.equal(ours[-1][0], theta0)


def test_gap_penalty_divides_the_outer_gradient():
    theta0 = torch.randn(257, generator=_gen(2))
    grads = _grads(10, seed=3)
    penalised = _run_outer(OuterOptimizer(0.7, 0.9, gap_penalty=2.0), theta0, grads)
    plain = _run_outer(OuterOptimizer(0.7, 0.9), theta0, [g / 2 for g in grads])
    for (a, ma), (b, mb) in zip(penalised, plain):
        assert torch.equal(a, b) and torch.equal(ma, mb)
    unpenalised = _run_outer(OuterOptimizer(0.7, 0.9), theta0, grads)
    assert not torch.equal(penalised[-1][0], unpenalised[-1][0])


def test_momentum_clip_is_applied_and_kept():
    phi, lr, mu = 0.5, 0.7, 0.9
    theta0 = torch.randn(257, generator=_gen(4))
    grads = _grads(10, seed=5)
    clipped = OuterOptimizer(lr, mu, True, clip_threshold=phi)
    theta, m = theta0.clone(), torch.zeros_like(theta0)
    ref_theta, ref_m = theta0.clone(), torch.zeros_like(theta0)
    for grad in grads:
        unclamped = ref_m * mu + grad
        clipped.step(theta, m, grad)
        # By hand: m <- clamp(mu m + g, -phi, phi); theta <- theta - lr (g + mu m).
        ref_m = unclamped.clamp(-phi, phi)
        ref_theta = ref_theta - lr * (grad + mu * ref_m)
        assert m.abs().max() <= phi
        assert torch.equal(m, ref_m)
        assert torch.allclose(theta, ref_theta, rtol=0, atol=1e-6)
        assert (unclamped.abs() > phi).any()  # the clamp had work to do
    unclipped = _run_outer(OuterOptimizer(lr, mu, True), theta0, grads)[-1][0]
    assert (theta - unclipped).abs().max() > 0.1  # the clamp changed the update, not just m
    huge = _run_outer(OuterOptimizer(lr, mu, True, clip_threshold=1e30), theta0, grads)[-1][0]
    assert torch.equal(huge, unclipped)


def test_outer_optimizer_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"--diloco-outer-momentum \(1.0\)"):
        OuterOptimizer(momentum=1.0)
    with pytest.raises(ValueError, match=r"--diloco-outer-lr \(-0.1\)"):
        OuterOptimizer(lr=-0.1)
    with pytest.raises(ValueError, match=r"--co2-gap-penalty \(0.0\)"):
        OuterOptimizer(gap_penalty=0.0)
    with pytest.raises(ValueError, match=r"--co2-clip-threshold \(-1.0\)"):
        OuterOptimizer(clip_threshold=-1.0)


def test_merge():
    g = _gen(6)
    theta_g = torch.randn(100, generator=g)
    local = torch.randn(100, generator=g)
    replaced = local.clone()
    replaced[3], replaced[7], replaced[9] = float("nan"), float("inf"), float("-inf")
    merge(replaced, theta_g, 0.0)
    assert torch.equal(replaced, theta_g)
    kept = local.clone()
    merge(kept, theta_g, 1.0)
    assert torch.equal(kept, local)
    half = local.clone()
    merge(half, theta_g, 0.5)
    assert torch.equal(half, (local + theta_g) / 2)
    quarter = local.clone()
    merge(quarter, theta_g, 0.25)
    assert torch.allclose(quarter, 0.25 * local + 0.75 * theta_g, rtol=0, atol=1e-6)


# ---- transport.py -----------------------------------------------------------------------------

TRANSPORT_N = 301  # not a multiple of the block, nor of M * block
MANY_N = (TRANSPORT_N, 77, 130)  # a fragment's shards of different sizes
TRANSPORT_BLOCK = 8
CODEC_NAMES = ("none", "bf16", "int8", "fp4")


def _worker_input(worker, n=TRANSPORT_N):
    g = _gen(1000 + worker)
    x = torch.randn(n, generator=g) * (worker + 1)
    x[torch.randint(0, n, (5,), generator=g)] *= 50  # outliers: blocks with different scales
    return x


class _GatedTransport(Transport):
    """While ``gate`` is clear, exchanges wait before touching the wire (a link that has not
    delivered yet), which shows the caller is not blocked meanwhile."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def _exchange_on_current_stream(self, xs, numels, feedbacks):
        self.gate.wait()
        return super()._exchange_on_current_stream(xs, numels, feedbacks)


def _transport_worker(rank, world, group):
    """Every exchange of the transport tests on one rank; returns what it observed."""
    ranks = list(range(world))
    out = {}
    for name in CODEC_NAMES:
        t = count_collectives(Transport(group, ranks, rank, make_codec(name, TRANSPORT_BLOCK),
                                        60.0))
        r = all_reduce_mean(t, _worker_input(rank), 1, name).wait()
        out[name] = {"mean": r.mean, "all_finite": r.all_finite,
                     "bytes": (r.bytes_sent, r.bytes_received),
                     "counters": (t.bytes_sent, t.bytes_received),
                     "quant_error": r.quant_error}
        all_reduce_mean(t, _worker_input(rank) * 2, 2, name).wait()
        out[name]["counters_after_two"] = (t.bytes_sent, t.bytes_received)
        out[name]["collectives_after_two"] = t.collectives
        t.close()
    # A NaN on rank 1 only.
    t = Transport(group, ranks, rank, make_codec("fp4", TRANSPORT_BLOCK), 60.0)
    x = _worker_input(rank)
    if rank == 1:
        x[17] = float("nan")
    r = all_reduce_mean(t, x, 3, "nan").wait()
    out["nonfinite"] = {"all_finite": r.all_finite, "mean_finite": bool(r.mean.isfinite().all())}
    t.close()
    # A fragment's shards on this rank (several param groups) in one exchange; a NaN in one
    # shard on rank 1 skips that shard only.
    t = count_collectives(Transport(group, ranks, rank, make_codec("fp4", TRANSPORT_BLOCK), 60.0))
    xs = [_worker_input(rank), _worker_input(rank, MANY_N[1]) * 3, _worker_input(rank, MANY_N[2])]
    if rank == 1:
        xs[1][5] = float("nan")
    rs = [p.wait() for p in t.all_reduce_mean_many(xs, 5, ["a", "b", "c"], [None] * 3)]
    out["many"] = {"means": [r.mean for r in rs], "finite": [r.all_finite for r in rs],
                   "bytes": [r.bytes_sent for r in rs], "collectives": t.collectives}
    t.close()
    # Asynchrony: while the link has not delivered, the caller goes on computing.
    t = _GatedTransport(group, ranks, rank, make_codec("none"), 60.0)
    pending = all_reduce_mean(t, _worker_input(rank), 4, "gated")
    done_at_once = pending.done()
    a = torch.randn(128, 128, generator=_gen(rank))
    computed = float((a @ a).trace())
    done_after_compute = pending.done()
    t.gate.set()
    r = pending.wait()
    out["gated"] = {"done": (done_at_once, done_after_compute), "computed": computed,
                    "mean": r.mean}
    t.close()
    # Let go (a membership change) while an exchange waits to reach the wire: it posts
    # nothing on the group and fails; the next transport on the same group pairs up exactly.
    t = _GatedTransport(group, ranks, rank, make_codec("none"), 60.0)
    pending = all_reduce_mean(t, _worker_input(rank), 6, "abandoned")
    out["abandoned"] = abandoned(t, pending)
    t = Transport(group, ranks, rank, make_codec("none"), 60.0)
    out["after_abandon"] = all_reduce_mean(t, _worker_input(rank) * 3, 7, "after").wait().mean
    t.close()
    # The wire over gloo: many point-to-point messages a peer (7 bytes each, the last one
    # short) carry exactly what gloo's all-to-all and all-gather carry.
    import torch.distributed as dist

    from megatron_streaming.comm import wire

    row = (torch.arange(world * 1000) % 251 + 3 * rank).to(torch.uint8)
    saved, wire.WIRE_CHUNK = wire.WIRE_CHUNK, 7
    try:
        post = wire.Poster(group)
        swapped, gathered = wire.all_to_all(row, post), wire.all_gather(row[:1000], post,
                                                                         world)
    finally:
        wire.WIRE_CHUNK = saved
    expected = torch.empty_like(row)
    dist.all_to_all_single(expected, row, group=group)
    expected_rows = [torch.empty(1000, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(expected_rows, row[:1000].clone(), group=group)
    out["wire"] = (torch.equal(swapped, expected),
                   all(torch.equal(a, b) for a, b in zip(gathered, expected_rows)))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["M2", "M3"])
def transport_run(request, tmp_path_factory):
    M = request.param
    results = spawn_gloo(_transport_worker, M, tmp_path_factory.mktemp(f"transport{M}"))
    return M, results


def _padded(n, M, block):
    return -(-n // (M * block)) * M * block


def _simulate_exchange(codec, xs):
    """The quantized reduce-scatter + all-gather, written out: each worker encodes its padded
    vector; chunk j is the sum (fp32, worker order) of the workers' decoded chunks j over M,
    re-encoded and decoded; the chunks concatenated and cut to n."""
    M, n = len(xs), xs[0].numel()
    padded = _padded(n, M, codec.block)
    chunk = padded // M
    decoded = []
    for x in xs:
        full = torch.zeros(padded)
        full[:n] = x
        decoded.append(codec.decode(codec.encode(full)))
    out = []
    for j in range(M):
        total = torch.zeros(chunk)
        for w in range(M):
            total += decoded[w][j * chunk:(j + 1) * chunk]
        out.append(codec.decode(codec.encode(total / M)))
    return torch.cat(out)[:n], chunk


@pytest.mark.timeout(120)
def test_chunked_wire_carries_what_the_collectives_carry(transport_run):
    M, results = transport_run
    assert [r["wire"] for r in results] == [(True, True)] * M


@pytest.mark.timeout(120)
def test_an_abandoned_transport_posts_nothing_on_its_group(transport_run):
    """A membership change lets go of the group (and then aborts it): an exchange that had
    not reached the wire yet fails with GroupReleased instead of posting on it (gloo crashes
    the process on a send posted to an aborted group), and the group is left as it was."""
    M, results = transport_run
    expected = sum(_worker_input(w) * 3 for w in range(M)) / M
    for w in range(M):
        assert "let go" in results[w]["abandoned"], results[w]["abandoned"]
        assert torch.allclose(results[w]["after_abandon"], expected, rtol=0, atol=1e-5), w


@pytest.mark.timeout(120)
def test_transport_fp32_mean_is_exact(transport_run):
    M, results = transport_run
    xs = [_worker_input(w) for w in range(M)]
    expected = xs[0].clone()
    for x in xs[1:]:
        expected = expected + x
    expected = expected / M
    for w in range(M):
        got = results[w]["none"]
        assert torch.equal(got["mean"], expected), w
        assert got["all_finite"] and got["quant_error"] == 0.0
    exact = torch.stack([x.double() for x in xs]).mean(0)
    assert torch.allclose(results[0]["none"]["mean"].double(), exact, rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["bf16", "int8", "fp4"])
def test_transport_quantized_mean_matches_codec_simulation(transport_run, name):
    M, results = transport_run
    codec = make_codec(name, TRANSPORT_BLOCK)
    xs = [_worker_input(w) for w in range(M)]
    expected, _ = _simulate_exchange(codec, xs)
    for w in range(M):
        assert torch.equal(results[w][name]["mean"], expected), (name, w)
        # Each rank's own quantization error, as the sync reports it: measured on the chunk
        # the rank reduces (its own codes for that chunk are decoded for the sum anyway).
        x = xs[w]
        full = torch.zeros(_padded(x.numel(), M, codec.block))
        full[:x.numel()] = x
        c = full.numel() // M
        own = codec.decode(codec.encode(full))[w * c:(w + 1) * c]
        ref = full[w * c:(w + 1) * c]
        assert results[w][name]["quant_error"] == pytest.approx(
            float((own - ref).norm() / ref.norm()), rel=1e-5)
        assert results[w][name]["quant_error"] > 0
    exact = torch.stack(xs).mean(0)
    # Sanity of the simulation itself: close to the true mean, but not equal to it.
    assert not torch.equal(expected, exact)
    assert float((expected - exact).norm() / exact.norm()) < 0.5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_transport_counts_the_bytes_it_moves(transport_run, name):
    M, results = transport_run
    codec = make_codec(name, TRANSPORT_BLOCK)
    chunk = _padded(TRANSPORT_N, M, codec.block) // M
    assert TRANSPORT_N % codec.block or codec.block == 1
    # All-to-all (M-1 of the M chunks out and in, each with the int32 finiteness flag),
    # all-gather (own mean chunk to M-1 peers, theirs in): two collectives per exchange.
    expected = 4 * (M - 1) + 2 * (M - 1) * codec.wire_bytes(chunk)
    for w in range(M):
        got = results[w][name]
        assert got["bytes"] == (expected, expected), (name, w)
        assert got["counters"] == (expected, expected)
        assert got["counters_after_two"] == (2 * expected, 2 * expected)
        assert got["collectives_after_two"] == 4


@pytest.mark.timeout(120)
def test_transport_sends_a_fragments_shards_in_one_exchange(transport_run):
    M, results = transport_run
    codec = make_codec("fp4", TRANSPORT_BLOCK)
    xs = [[_worker_input(w), _worker_input(w, MANY_N[1]) * 3, _worker_input(w, MANY_N[2])]
          for w in range(M)]
    for w in range(M):
        got = results[w]["many"]
        assert got["collectives"] == 2  # flags, scales and codes of all three: 2 collectives
        assert got["finite"] == [True, False, True]
        for i in (0, 2):
            expected, chunk = _simulate_exchange(codec, [x[i] for x in xs])
            assert torch.equal(got["means"][i], expected), (w, i)
            assert got["bytes"][i] == 4 * (M - 1) + 2 * (M - 1) * codec.wire_bytes(chunk)
        assert bool(got["means"][1].isfinite().all())


@pytest.mark.timeout(120)
def test_transport_non_finite_on_one_worker_skips_everywhere(transport_run):
    M, results = transport_run
    for w in range(M):
        assert results[w]["nonfinite"] == {"all_finite": False, "mean_finite": True}, w


@pytest.mark.timeout(120)
def test_transport_returns_before_the_exchange_completes(transport_run):
    M, results = transport_run
    xs = [_worker_input(w) for w in range(M)]
    for w in range(M):
        gated = results[w]["gated"]
        assert gated["done"] == (False, False), w
        a = torch.randn(128, 128, generator=_gen(w))
        assert gated["computed"] == float((a @ a).trace())
        assert torch.equal(gated["mean"], results[w]["none"]["mean"])
    assert torch.equal(results[0]["gated"]["mean"], sum(xs[1:], xs[0].clone()) / M)


def test_transport_single_worker_returns_its_input():
    t = Transport(None, [5], 5, make_codec("fp4", TRANSPORT_BLOCK), 10.0)
    x = _worker_input(0)
    original = x.clone()
    pending = all_reduce_mean(t, x, 1, "solo")
    x.add_(1.0)  # the caller trains on; the exchange has its own copy
    r = pending.wait()
    assert torch.equal(r.mean, original) and r.all_finite
    assert (r.bytes_sent, r.bytes_received, t.bytes_sent, t.bytes_received) == (0, 0, 0, 0)
    original[3] = float("nan")
    assert not all_reduce_mean(t, original, 2, "solo").wait().all_finite
    t.close()


TIMEOUT_S = 3.0
TIMEOUT_TAG = "fragment 1 (param group 1)"


def _timeout_worker(rank, world, group):
    if rank == 1:
        time.sleep(TIMEOUT_S + 2)  # alive but silent, then gone
        return None
    t = Transport(group, [0, 1], 0, make_codec("none"), TIMEOUT_S)
    pending = all_reduce_mean(t, torch.ones(10), 17, TIMEOUT_TAG)
    started = time.perf_counter()
    try:
        pending.wait()
    except SyncTimeout as e:
        return {"message": str(e), "seconds": time.perf_counter() - started}
    return {"message": None, "seconds": time.perf_counter() - started}


@pytest.mark.timeout(120)
def test_transport_times_out_naming_step_tag_and_peers(tmp_path):
    results = spawn_gloo(_timeout_worker, 2, tmp_path, group_timeout_s=TIMEOUT_S,
                         hard_exit=True)
    got = results[0]
    assert got["message"] is not None, "wait() returned although the peer never joined"
    assert got["seconds"] < TIMEOUT_S + 2.0, got
    for text in ("step 17", TIMEOUT_TAG, "peer group (global ranks) [0, 1]"):
        assert text in got["message"], got["message"]


def test_exchanges_run_in_order_on_a_daemon_thread_that_close_drains():
    """A daemon, so a collective stuck on a peer that never answers cannot keep a failed
    process from exiting; close() still waits for what was submitted (the peers run it too)."""
    import threading
    import time

    from megatron_streaming.comm.serial import SerialThread

    done, worker = [], SerialThread("cross-worker")
    names = []
    for i in range(5):
        worker.submit(lambda i=i: (time.sleep(0.01), done.append(i),
                                   names.append(threading.current_thread())))
    worker.shutdown()
    assert done == list(range(5))
    assert all(t.daemon and t.name == "cross-worker" for t in names)
    worker.shutdown()  # twice: nothing left to stop


class _RecordingCuda:
    """Stands in for ``torch.cuda`` where the transport touches it: records, per thread,
    which device was set and when a stream was entered, left or waited for."""

    def __init__(self):
        self.events = []  # (thread name, what, device or None)
        self.current = {}  # thread name -> device set on it

    def _me(self):
        return threading.current_thread().name

    def set_device(self, device):
        self.current[self._me()] = torch.device(device)
        self.events.append((self._me(), "set_device", torch.device(device)))

    def stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def entered():
            # torch's StreamContext asks for the current stream of the thread's current
            # device: where none was set, device 0 (and a CUDA context there).
            self.events.append((self._me(), "enter", self.current.get(self._me(), 0)))
            yield
        return entered()

    def make_stream(self, device=None):
        cuda = self

        class Stream:
            def __init__(self):
                self.device = device

            def synchronize(self):
                cuda.events.append((cuda._me(), "synchronize", None))

            def wait_stream(self, other):
                pass
        return Stream()


def test_the_exchange_thread_works_on_its_ranks_gpu_and_waits_for_its_stream_on_failure(
        monkeypatch):
    """A new thread starts on device 0: entering a stream there makes a CUDA context on GPU 0
    in every process of a node. The exchange's thread sets the rank's device first; and when
    an exchange fails, its side stream is waited for before the tensors it reads are freed."""
    cuda = _RecordingCuda()
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "Stream", cuda.make_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    t = Transport(None, [0], 0, make_codec("none"), 10.0, codec_device="cuda:3")
    assert t.cuda_device == torch.device("cuda", 3)
    # The codec device is a GPU this machine lacks: hand the thread CPU tensors directly.
    import concurrent.futures

    ok = concurrent.futures.Future()
    t._executor.submit(t._exchange, [torch.ones(4)], [4], [None], [ok])
    assert torch.equal(ok.result(10).mean, torch.ones(4))
    failed = concurrent.futures.Future()
    monkeypatch.setattr(t, "_exchange_on_current_stream",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("peer gone")))
    t._executor.submit(t._exchange, [torch.ones(4)], [4], [None], [failed])
    with pytest.raises(RuntimeError, match="peer gone"):
        failed.result(10)
    t.close()
    on_thread = [(what, device) for name, what, device in cuda.events
                 if name == "cross-worker"]
    assert on_thread == [("set_device", torch.device("cuda", 3)),
                         ("enter", torch.device("cuda", 3)), ("synchronize", None),
                         ("enter", torch.device("cuda", 3)), ("synchronize", None)], on_thread


# ---- NCCL's way: collectives from the caller's thread, nothing read on the host -----------

class _Recorder:
    """Wraps a transport's ``Poster``: notes the thread and the collective of every post, and
    (with ``watch`` on) every read of a tensor on the host by the caller's thread after the
    first post: a read there would wait for the collective, stalling the training loop (and,
    with a stuck peer, keeping the exchange's own deadline from firing)."""

    READS = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self, poster):
        self.poster, self.posts, self.reads, self.watch = poster, [], [], False
        self.group = poster.group

    @property
    def rank(self):
        return self.poster.rank

    def __call__(self, collective, *args, **kwargs):
        self.posts.append((threading.current_thread().name, collective.__name__))
        return self.poster(collective, *args, **kwargs)

    def release(self):
        self.poster.release()

    def install(self):
        for name in self.READS:
            real = getattr(torch.Tensor, name)

            def read(tensor, *args, _real=real, _name=name):
                if self.watch and self.posts and \
                        threading.current_thread() is threading.main_thread():
                    self.reads.append(_name)
                return _real(tensor, *args)

            setattr(torch.Tensor, name, read)


def _from_caller_worker(rank, world, group):
    """The same exchanges issued the gloo way (the exchange's thread) and NCCL's way (the
    caller's thread, ``from_caller``): a plain one, one with a NaN on rank 1, and two with
    error feedback (its residual carried from the first to the second)."""
    from megatron_streaming.comm.codec import ErrorFeedback

    ranks, out = list(range(world)), {}
    recorders = {}
    for way, from_caller in (("thread", False), ("caller", True)):
        codec = make_codec("fp4", TRANSPORT_BLOCK)
        t = Transport(group, ranks, rank, codec, 60.0, from_caller=from_caller)
        t.post = recorders[way] = _Recorder(t.post)
        if from_caller:
            t.post.install()
        nan = _worker_input(rank) * 2
        if rank == 1:
            nan[3] = float("nan")
        feedback = ErrorFeedback(codec, t.padded_numel(TRANSPORT_N), "cpu")
        got = []
        for step, (x, fb) in enumerate([(_worker_input(rank), None), (nan, None),
                                        (_worker_input(rank) * 3, feedback),
                                        (_worker_input(rank) * 4, feedback)]):
            t.post.watch = True
            pending = all_reduce_mean(t, x, step, f"case {step}", fb)
            t.post.watch = False
            r = pending.wait()
            got.append((r.mean, r.all_finite, r.quant_error, r.bytes_sent))
        out[way] = {"results": got, "residual": feedback.residual.clone(),
                    "posts": sorted(set(t.post.posts)), "reads": t.post.reads}
        t.close()
    return out


@pytest.mark.timeout(120)
def test_over_nccl_the_exchange_is_launched_from_the_callers_thread_without_host_reads(
        tmp_path):
    """NCCL deadlocks when two communicators of one GPU (the worker's, the cross-worker one)
    get their operations in different orders on different ranks, and must not be launched
    from several threads at once: over NCCL the exchange launches its collectives from the
    caller's thread (the training loop's, which launches the worker's collectives), and reads
    nothing on the host until waited for. Run here over gloo: the same results, bit for bit,
    as the exchange's own thread gives."""
    results = spawn_gloo(_from_caller_worker, 2, tmp_path)
    for rank, got in enumerate(results):
        assert {name for name, _ in got["thread"]["posts"]} == {"cross-worker"}
        assert {name for name, _ in got["caller"]["posts"]} == {"MainThread"}
        assert got["caller"]["reads"] == [], got["caller"]["reads"]
        for (a, b) in zip(got["thread"]["results"], got["caller"]["results"]):
            assert torch.equal(a[0], b[0]) and a[1:] == b[1:], rank
        assert [r[1] for r in got["caller"]["results"]] == [True, False, True, True]
        errors = [r[2] for r in got["caller"]["results"]]
        assert all(isinstance(e, float) for e in errors)
        # rank 1 sent zeros for its NaN: no error of its own
        assert [e > 0 for e in errors] == [True, rank == 0, True, True]
        assert torch.equal(got["thread"]["residual"], got["caller"]["residual"])
        assert got["caller"]["residual"].abs().sum() > 0


class _NeverDone:
    """A CUDA event of a collective whose peer never answers."""

    def query(self):
        return False


@pytest.mark.timeout(60)
def test_over_nccl_the_exchange_gives_up_at_its_deadline_from_launch_and_says_so(caplog):
    """NCCL's watchdog counts from a collective's launch and ends the process when its (longer)
    timeout runs out: the exchange's own deadline counts from the launch too, and its watcher
    says which step, fragment and peers at that moment, whether or not anyone waits."""
    import concurrent.futures
    import logging

    from megatron_streaming.comm.transport import ExchangeResult, Pending

    t = Transport(None, [0], 0, make_codec("none"), 0.2, from_caller=True)
    future = concurrent.futures.Future()
    pending = Pending(future, 17, TIMEOUT_TAG, [0, 4], 0.2, from_launch=True)
    with caplog.at_level(logging.ERROR, logger="megatron_streaming"):
        t._executor.submit(t._settle, _NeverDone(), [ExchangeResult(
            torch.zeros(4), torch.tensor(True), 0, 0, torch.tensor(0.0), 0.0)], [future],
            pending)
        with pytest.raises(SyncTimeout) as raised:
            pending.wait()
        t.close()
    for text in ("step 17", TIMEOUT_TAG, "--diloco-timeout 0.2 s",
                 "peer group (global ranks) [0, 4]"):
        assert text in str(raised.value)
    assert [r.getMessage() for r in caplog.records] == [str(raised.value)]
    # Launched long ago and still out: the wait gives up at once, not a timeout later.
    late = Pending(concurrent.futures.Future(), 18, TIMEOUT_TAG, [0, 4], 1000.0,
                   started=time.perf_counter() - 2000.0, from_launch=True)
    with pytest.raises(SyncTimeout, match="step 18"):
        late.wait()


def test_over_nccl_a_single_worker_returns_its_input_on_the_host():
    t = Transport(None, [5], 5, make_codec("fp4", TRANSPORT_BLOCK), 10.0, from_caller=True)
    x = _worker_input(0)
    r = all_reduce_mean(t, x, 1, "solo").wait()
    assert torch.equal(r.mean, x) and r.all_finite is True and r.quant_error == 0.0
    x[3] = float("nan")
    assert all_reduce_mean(t, x, 2, "solo").wait().all_finite is False
    t.close()

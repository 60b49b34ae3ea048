"""The sparse exchange (``comm/sparse_transport.py``): one all-gather of top-k payloads.

Spawned gloo groups of 2 and 3 workers (one launch each) run three rounds of a fragment of
three shards through ``SparseTransport``, each way it can be issued (the exchange's thread,
gloo's; the caller's thread, NCCL's). Their means are compared bit for bit with a
single-process reference that runs the same ``SparseErrorFeedback`` encodes for every
worker's inputs and sums the decodes in worker order; bytes with the closed form of the
module docstring, computed here from the formula, not from the codec.
"""

import math
import threading

import pytest
import torch

from megatron_streaming.comm.codec import make_codec
from megatron_streaming.comm.sparse import SparseCodec, SparseErrorFeedback
from megatron_streaming.comm.sparse_transport import SparseTransport

from conftest import spawn_gloo
from seams import abandoned, all_reduce_mean, count_collectives
from test_streaming_transport import _Recorder

# Chunk 12 (not a power of two: 4 index bits, positions 12-15 unused), k 3, 2-bit values.
CHUNK, K, VALUE_BITS, DECAY = 12, 3, 2, 0.75
# A short last chunk of 10, whole chunks, and a last chunk of 1 element (fewer than k).
SHARD_N = (70, 24, 25)
ROUNDS = 3
NAN_ROUND, NAN_SHARD, NAN_RANK = 1, 1, 1  # a NaN in one shard of one worker, one round


def _codec():
    return SparseCodec(chunk=CHUNK, k=K, value_bits=VALUE_BITS)


def _input(worker, rnd, shard):
    g = torch.Generator().manual_seed(100 * worker + 10 * rnd + shard)
    x = torch.randn(SHARD_N[shard], generator=g) * (worker + 1)
    x[torch.randint(0, x.numel(), (3,), generator=g)] *= 20  # chunks of different scales
    if (rnd, shard, worker) == (NAN_ROUND, NAN_SHARD, NAN_RANK):
        x[5] = float("nan")
    return x


def _closed_form(n, M):
    """Bytes each way of one shard of ``n`` elements (module docstring of sparse_transport)."""
    per_chunk = math.ceil(K * math.ceil(math.log2(CHUNK)) / 8) + math.ceil(K * VALUE_BITS / 8) + 4
    return (M - 1) * (math.ceil(n / CHUNK) * per_chunk + 4)


def _rounds(t, rank, handed_over, recorder=None):
    """The rounds on one transport with fresh accumulators; what each rank observed.
    ``recorder``: a ``_Recorder`` on its poster, watching host reads while the exchange is
    issued."""
    feedbacks = [SparseErrorFeedback(t.codec, t.padded_numel(n), "cpu", DECAY)
                 for n in SHARD_N]
    got = []
    for rnd in range(ROUNDS):
        xs = [_input(rank, rnd, i) for i in range(len(SHARD_N))]
        tags = [f"fragment 0 shard {i}" for i in range(len(SHARD_N))]
        if handed_over and rnd == ROUNDS - 1:  # buffers handed over, no copy
            bufs = [t.buffer(n, "cpu") for n in SHARD_N]
            for b, x in zip(bufs, xs):
                b[:x.numel()] = x
            pendings = t.all_reduce_mean_many(bufs, rnd, tags, feedbacks, list(SHARD_N))
        else:
            if recorder is not None:
                recorder.watch = True
            pendings = t.all_reduce_mean_many(xs, rnd, tags, feedbacks)
            if recorder is not None:
                recorder.watch = False
        results = [p.wait() for p in pendings]
        got.append({"means": [r.mean.clone() for r in results],
                    "finite": [r.all_finite for r in results],
                    "quant_error": [r.quant_error for r in results],
                    "bytes": [(r.bytes_sent, r.bytes_received) for r in results],
                    "counters": (t.bytes_sent, t.bytes_received),
                    "collectives": getattr(t, "collectives", None),
                    "residuals": [f.residual.clone() for f in feedbacks]})
    return got


class _GatedSparse(SparseTransport):
    """Exchanges wait at the wire, after encoding, until ``gate`` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def _all_gather(self, *args):
        self.gate.wait()
        return super()._all_gather(*args)


def _abandoned(rank, world, group):
    """A membership change lets go of the group while an exchange, encoded already, waits at
    the wire: it fails, its accumulator is the one before it, and the next exchange on the
    group pairs up exactly."""
    ranks, out = list(range(world)), {}
    feedback = SparseErrorFeedback(_codec(), SHARD_N[0], "cpu", DECAY)
    t = SparseTransport(group, ranks, rank, _codec(), 60.0)
    all_reduce_mean(t, _input(rank, 0, 0), 0, "first", feedback).wait()
    t.close()
    kept = feedback.residual.clone()
    t = _GatedSparse(group, ranks, rank, _codec(), 60.0)
    pending = all_reduce_mean(t, _input(rank, 1, 0), 1, "abandoned", feedback)
    out["abandoned"] = abandoned(t, pending)
    out["kept"] = torch.equal(feedback.residual, kept) and bool(kept.abs().sum() > 0)
    t = SparseTransport(group, ranks, rank, _codec(), 60.0)
    out["after"] = all_reduce_mean(t, _input(rank, 2, 0), 2, "after", feedback).wait().mean
    t.close()
    return out


def _sparse_worker(rank, world, group):
    ranks = list(range(world))
    t = count_collectives(SparseTransport(group, ranks, rank, _codec(), 60.0))
    out = {"thread": _rounds(t, rank, handed_over=True)}
    t.close()
    t = SparseTransport(group, ranks, rank, _codec(), 60.0, from_caller=True)
    t.post = recorder = _Recorder(t.post)
    recorder.install()
    out["caller"] = _rounds(t, rank, handed_over=False, recorder=recorder)
    out["caller_reads"], out["caller_posts"] = recorder.reads, sorted(set(recorder.posts))
    t.close()
    recorder.watch = False
    out.update(_abandoned(rank, world, group))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["M2", "M3"])
def sparse_run(request, tmp_path_factory):
    M = request.param
    return M, spawn_gloo(_sparse_worker, M, tmp_path_factory.mktemp(f"sparse{M}"))


def _reference(M):
    """The exchange in one process: per round and shard, each worker's SparseErrorFeedback
    encode of its input, the decodes summed in worker order, over M. A shard any worker has
    non-finite is skipped: no worker's accumulator changes. Per round: (means, skipped,
    each worker's own decoded send, each worker's accumulators after the round)."""
    codec = _codec()
    feedbacks = [[SparseErrorFeedback(codec, n, "cpu", DECAY) for n in SHARD_N]
                 for _ in range(M)]
    out = []
    for rnd in range(ROUNDS):
        means, skipped, own = [], [], [[None] * len(SHARD_N) for _ in range(M)]
        for i in range(len(SHARD_N)):
            xs = [_input(w, rnd, i) for w in range(M)]
            skip = not all(bool(x.isfinite().all()) for x in xs)
            skipped.append(skip)
            if skip:
                means.append(None)
                continue
            sent = [feedbacks[w][i].encode(xs[w]) for w in range(M)]
            for w in range(M):
                own[w][i] = codec.decode(sent[w])
            means.append(codec.sum_decoded(sent) / M)
        out.append((means, skipped, own,
                    [[f.residual.clone() for f in feedbacks[w]] for w in range(M)]))
    return out


def _bits(t):
    return t.view(torch.int32)


@pytest.mark.timeout(180)
def test_every_worker_gets_the_reference_mean_bit_for_bit(sparse_run):
    M, results = sparse_run
    reference = _reference(M)
    for way in ("thread", "caller"):
        for rnd, (means, skipped, _, residuals) in enumerate(reference):
            for w in range(M):
                got = results[w][way][rnd]
                for i, expected in enumerate(means):
                    if expected is None:
                        continue
                    assert torch.equal(_bits(got["means"][i]), _bits(expected)), (way, rnd, w, i)
                    # The same bytes on every worker, not only equal values.
                    assert torch.equal(_bits(got["means"][i]),
                                       _bits(results[0][way][rnd]["means"][i]))
                for i in range(len(SHARD_N)):
                    assert torch.equal(got["residuals"][i], residuals[w][i]), (way, rnd, w, i)
    # The reference is SparseLoCo's and not a dense mean: at most M k nonzeros a chunk, and
    # the accumulators hold what was not sent.
    means = reference[0][0]
    for i, n in enumerate(SHARD_N):
        nonzero = int((means[i] != 0).sum())
        assert 0 < nonzero <= M * K * math.ceil(n / CHUNK), (i, nonzero)
        assert all(float(reference[0][3][w][i].abs().sum()) > 0 for w in range(M))
    dense = sum(_input(w, 0, 0) for w in range(M)) / M
    assert not torch.equal(means[0], dense)


@pytest.mark.timeout(180)
def test_the_byte_counters_are_the_closed_form(sparse_run):
    M, results = sparse_run
    per_shard = [_closed_form(n, M) for n in SHARD_N]
    # Chunk 12, k 3, 2 bits: 2 + 1 + 4 bytes a chunk; shards of 6, 2 and 3 chunks.
    assert per_shard == [(M - 1) * b for b in (46, 18, 25)]
    assert per_shard == [(M - 1) * (4 + _codec().wire_bytes(n)) for n in SHARD_N]
    for w in range(M):
        for way in ("thread", "caller"):
            for rnd, got in enumerate(results[w][way]):
                # The skipped shard was sent all the same: it counts.
                assert got["bytes"] == [(b, b) for b in per_shard], (way, w, rnd)
                assert got["counters"] == ((rnd + 1) * sum(per_shard),) * 2


@pytest.mark.timeout(180)
def test_a_fragments_shards_cross_in_one_collective(sparse_run):
    M, results = sparse_run
    for w in range(M):
        assert [r["collectives"] for r in results[w]["thread"]] == [1, 2, 3]


@pytest.mark.timeout(180)
def test_a_non_finite_shard_is_skipped_everywhere_and_leaves_every_accumulator(sparse_run):
    """Rank 1's NaN in shard 1: every worker skips that shard only, and every worker's
    accumulator of it is the one before the round, the finite workers' too (the
    reference's next round, compared bit for bit above, starts from it)."""
    M, results = sparse_run
    for w in range(M):
        for way in ("thread", "caller"):
            rounds = results[w][way]
            got = rounds[NAN_ROUND]
            assert got["finite"] == [True, False, True], (way, w)
            assert bool(got["means"][NAN_SHARD].isfinite().all())
            assert torch.equal(got["residuals"][NAN_SHARD],
                               rounds[NAN_ROUND - 1]["residuals"][NAN_SHARD]), (way, w)
            assert bool(got["residuals"][NAN_SHARD].isfinite().all())
            # The next round is whole again.
            assert rounds[NAN_ROUND + 1]["finite"] == [True] * len(SHARD_N)
            # Rank 1 sent zeros for its NaN: no error of its own there.
            assert (got["quant_error"][NAN_SHARD] == 0.0) == (w == NAN_RANK)


@pytest.mark.timeout(180)
def test_the_quantization_error_is_the_own_send_against_the_input(sparse_run):
    M, results = sparse_run
    reference = _reference(M)
    for w in range(M):
        for rnd, (_, skipped, own, _) in enumerate(reference):
            for i in range(len(SHARD_N)):
                got = results[w]["thread"][rnd]["quant_error"][i]
                assert isinstance(got, float)
                if own[w][i] is None:
                    continue
                x = _input(w, rnd, i)
                expected = float((own[w][i] - x).norm() / x.norm())
                assert got == pytest.approx(expected, rel=1e-6), (w, rnd, i)
                assert 0.1 < got < 1.5  # much of each chunk is not sent this round


@pytest.mark.timeout(180)
def test_an_abandoned_exchange_fails_and_leaves_its_accumulator(sparse_run):
    M, results = sparse_run
    codec = _codec()
    sends = []
    for w in range(M):
        feedback = SparseErrorFeedback(codec, SHARD_N[0], "cpu", DECAY)
        feedback.encode(_input(w, 0, 0))
        sends.append(feedback.encode(_input(w, 2, 0)))  # round 1 never happened
    expected = codec.sum_decoded(sends) / M
    for w in range(M):
        assert "let go" in results[w]["abandoned"], results[w]["abandoned"]
        assert results[w]["kept"], w
        assert torch.equal(_bits(results[w]["after"]), _bits(expected)), w


@pytest.mark.timeout(180)
def test_over_nccl_the_sparse_exchange_reads_nothing_on_the_host(sparse_run):
    M, results = sparse_run
    for w in range(M):
        assert results[w]["caller_reads"] == []
        assert {name for name, _ in results[w]["caller_posts"]} == {"MainThread"}


def test_a_single_worker_gets_its_own_sparsified_send_and_sends_nothing():
    codec = _codec()
    t = count_collectives(SparseTransport(None, [5], 5, codec, 10.0))
    ours = [SparseErrorFeedback(codec, SHARD_N[0], "cpu", DECAY) for _ in range(2)]
    for rnd in range(2):
        x = _input(0, rnd, 0)
        r = all_reduce_mean(t, x, rnd, "solo", ours[0]).wait()
        expected = codec.decode(ours[1].encode(x))
        assert torch.equal(r.mean, expected) and r.all_finite
        assert torch.equal(ours[0].residual, ours[1].residual)
        assert r.quant_error == pytest.approx(float((expected - x).norm() / x.norm()), rel=1e-6)
        assert (r.bytes_sent, r.bytes_received, t.bytes_sent, t.bytes_received) == (0,) * 4
    assert t.collectives == 0
    before = ours[0].residual.clone()
    x = _input(0, 2, 0)
    x[3] = float("inf")
    r = all_reduce_mean(t, x, 2, "solo", ours[0]).wait()
    assert not r.all_finite and r.quant_error == 0.0
    assert torch.equal(ours[0].residual, before)
    t.close()


def test_the_sparse_exchange_refuses_what_it_cannot_run():
    codec = _codec()
    with pytest.raises(ValueError, match="needs a SparseCodec, got the 'fp4' codec"):
        SparseTransport(None, [0, 1], 0, make_codec("fp4", 8), 10.0)
    t = SparseTransport(None, [0, 1], 0, codec, 10.0)  # never reaches the wire below
    x = torch.ones(SHARD_N[0])
    with pytest.raises(ValueError, match="shard a: needs a SparseErrorFeedback.*got NoneType"):
        t.all_reduce_mean_many([x], 1, ["shard a"], [None])
    other = SparseErrorFeedback(SparseCodec(chunk=CHUNK, k=K + 1), SHARD_N[0], "cpu", DECAY)
    with pytest.raises(ValueError, match=r"chunk, k, value_bits \(12, 4, 2\).*\(12, 3, 2\)"):
        t.all_reduce_mean_many([x], 1, ["shard a"], [other])
    short = SparseErrorFeedback(codec, SHARD_N[0] - 1, "cpu", DECAY)
    with pytest.raises(ValueError, match="of 70 elements needs an accumulator of 70, got 69"):
        t.all_reduce_mean_many([x], 1, ["shard a"], [short])
    with pytest.raises(ValueError, match="1 shards, 1 tags, 2 feedbacks"):
        t.all_reduce_mean_many([x], 1, ["shard a"], [short, short])
    assert t.bytes_sent == 0 and t.padded_numel(SHARD_N[0]) == SHARD_N[0]
    t.close()


def test_padding_to_whole_chunks_would_leak_into_the_accumulator():
    """Why ``padded_numel`` pads nothing: with a last chunk of fewer than k elements, a
    padded accumulator gets the padding's zeros picked, sent as +s/2 and kept as -s/2 in
    the padding, where they compete with the real element: two rounds on, they set the
    chunk's scale and the real element is sent over 3x too large."""
    codec, n = _codec(), SHARD_N[2]  # last chunk: 1 element, k = 3
    padded = SparseErrorFeedback(codec, 3 * CHUNK, "cpu", DECAY)
    exact = SparseErrorFeedback(codec, n, "cpu", DECAY)
    sends = []
    for rnd in range(3):
        x = _input(0, rnd, 2)
        whole = torch.nn.functional.pad(x, (0, 3 * CHUNK - n))
        sends.append((codec.decode(padded.encode(whole))[:n], codec.decode(exact.encode(x))))
        if rnd == 0:
            assert float(padded.residual[n:].abs().sum()) > 0
    assert [torch.equal(a, b) for a, b in sends] == [True, True, False]
    assert float(sends[2][0][n - 1] / sends[2][1][n - 1]) > 3

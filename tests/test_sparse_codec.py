"""The sparse codec and its error feedback (``comm/sparse.py``): pure CPU, in-process.

Encodings are checked byte for byte on hand-built tensors, and decodes and sums against a
plain-Python reference of the format (sorting by magnitude then position, rounding by the
documented thresholds); every comparison is exact, since all values sent are the chunk scale
times a power of two.
"""

import math

import pytest
import torch

from megatron_streaming.comm.codec import make_codec
from megatron_streaming.comm.sparse import SparseCodec, SparseErrorFeedback


def _reference(x, chunk, k, value_bits):
    """Dense fp32 decode of the format, from Python lists (module docstring of sparse.py)."""
    values = x.tolist()
    out = [0.0] * len(values)
    levels = 2 ** (value_bits - 1)
    for start in range(0, len(values), chunk):
        part = values[start:start + chunk] + [0.0] * (chunk - len(values[start:start + chunk]))
        scale = max(abs(v) for v in part)
        chosen = sorted(range(chunk), key=lambda i: (-abs(part[i]), i))[:k]
        for i in chosen:
            m = sum(abs(part[i]) >= 0.75 * scale * 2.0 ** (j - levels + 1)
                    for j in range(1, levels))
            if start + i < len(values):
                out[start + i] = math.copysign(scale * 2.0 ** (m - levels + 1),
                                               -1.0 if part[i] < 0 else 1.0)
    return torch.tensor(out, dtype=torch.float32)


def _ties(n, seed):
    """Small integers times a power of two: many equal magnitudes in every chunk."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-6, 7, (n,), generator=g).float() * 0.125


def test_hand_built_bytes_positions_values_and_scales():
    codec = SparseCodec(chunk=8, k=3, value_bits=2)
    x = torch.tensor([0.1, -5, 2, 0, 3.9, -1, 0.2, 4.5,  # top 3: -5, 4.5, 3.9; s = 5
                      1, 1, -1, 1, 0.5, 0, 0, 0])  # four of magnitude 1: the lowest three
    e = codec.encode(x)
    positions, values = codec.unpack(e)
    assert positions.tolist() == [[1, 4, 7], [0, 1, 2]]
    # 3.9 and 4.5 are >= 0.75 * 5, so they are sent as s; -5 as -s
    assert values.tolist() == [[-5, 5, 5], [1, 1, -1]]
    assert e.scales.tolist() == [5, 1]
    # positions at 3 bits, least significant first: 1, 4, 7 -> 100 001 111 -> 225, 1;
    # 0, 1, 2 -> 000 100 010 -> 136, 0. Codes 3, 1, 1 (11 10 10) -> 23; 1, 1, 3 -> 53.
    assert e.payload.tolist() == [225, 1, 136, 0, 23, 53]
    assert e.nbytes() == codec.wire_bytes(16) == 2 * (2 + 1 + 4)
    assert codec.decode(e).tolist() == [0, -5, 0, 0, 5, 0, 0, 5, 1, 1, -1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("value_bits, x, expected", [
    # 2 bits: magnitudes s/2, s; threshold 0.75 s = 6 (ties to the larger); no zero
    (2, [8, 6, 5.99, 4, 1, -6, 0, -0.0], [8, 8, 4, 4, 4, -8, 4, 4]),
    # 3 bits: s/8, s/4, s/2, s; thresholds 1.5, 3, 6
    (3, [-8, 1.5, 1.49, 0.1, 3, 2.99, 6, -5.99], [-8, 2, 1, 1, 4, 2, 8, -4]),
    # 1 bit: the sign only
    (1, [-8, 0.5, -0.1, 3, 0, 7, 1, 2], [-8, 8, -8, 8, 8, 8, 8, 8]),
])
def test_value_levels(value_bits, x, expected):
    codec = SparseCodec(chunk=8, k=8, value_bits=value_bits)
    assert codec.decode(codec.encode(torch.tensor(x))).tolist() == expected


def test_all_zero_chunk_decodes_to_zeros():
    codec = SparseCodec(chunk=4, k=2)
    e = codec.encode(torch.tensor([0.0, 0, 0, 0, 0, 3, 0, 0]))
    assert e.scales.tolist() == [0, 3]
    assert codec.decode(e).tolist() == [0, 0, 0, 0, 1.5, 3, 0, 0]  # 0 at position 4: s/2


@pytest.mark.parametrize("numel, chunk, k, value_bits", [
    (11, 8, 3, 2),  # short last chunk of 3
    (10, 8, 3, 2),  # short last chunk of 2 < k: padding picked, then dropped
    (4096 + 100, 4096, 64, 2),
    (1000, 64, 5, 3),
    (257, 256, 256, 2),  # k = chunk: every element sent
])
def test_decode_matches_reference(numel, chunk, k, value_bits):
    codec = SparseCodec(chunk=chunk, k=k, value_bits=value_bits)
    for seed in range(3):
        x = _ties(numel, seed) if seed else torch.randn(numel, generator=torch.Generator()
                                                        .manual_seed(numel))
        e = codec.encode(x)
        assert e.payload.numel() + 4 * e.scales.numel() == e.nbytes() == \
            codec.wire_bytes(numel)
        assert torch.equal(codec.decode(e), _reference(x, chunk, k, value_bits))
        out = torch.full((numel,), 7.0)
        assert codec.decode(e, out=out) is out and torch.equal(out, codec.decode(e))


def test_sum_of_workers_matches_reference_in_order():
    codec = SparseCodec(chunk=16, k=4)
    g = torch.Generator().manual_seed(1)
    for workers in (2, 3):
        xs = [torch.randn(50, generator=g) * 10 ** w for w in range(workers)]
        expected = torch.zeros(50)
        for x in xs:  # fp32 sums in worker order, as every worker computes them
            expected = expected + _reference(x, 16, 4, 2)
        summed = codec.sum_decoded([codec.encode(x) for x in xs])
        assert torch.equal(summed, expected)
        assert (summed != 0).sum() >= 16  # 4 chunks, every worker's positions at least
    with pytest.raises(ValueError, match="cannot be summed"):
        codec.sum_decoded([codec.encode(torch.ones(16)), codec.encode(torch.ones(32))])


def test_ties_are_broken_by_position_and_deterministic():
    codec = SparseCodec(chunk=8, k=3)
    x = torch.tensor([-1.0, 1, 1, -1, 1, 1, 1, 1])
    e = codec.encode(x)
    assert codec.unpack(e)[0].tolist() == [[0, 1, 2]]
    assert codec.decode(e).tolist() == [-1, 1, 1, 0, 0, 0, 0, 0]
    x = _ties(5000, 7)
    first = codec.encode(x)
    for _ in range(3):
        again = codec.encode(x.clone())
        assert torch.equal(first.payload, again.payload)
        assert torch.equal(first.scales, again.scales)


def test_non_finite_input_is_refused():
    codec = SparseCodec(chunk=4, k=1)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.tensor([1.0, 2, 3, 4, 5, bad, 0, 0])
        with pytest.raises(ValueError, match="non-finite"):
            codec.encode(x)
        assert not bool(codec.encode_flagged(x)[1])
    assert bool(codec.encode_flagged(torch.ones(8))[1])


def test_invalid_parameters():
    for kwargs in ({"chunk": 8, "k": 9}, {"k": 0}, {"value_bits": 0}, {"value_bits": 5},
                   {"chunk": 1, "k": 1}, {"k": 2.0}):
        with pytest.raises(ValueError, match="SparseCodec"):
            SparseCodec(**kwargs)
    with pytest.raises(ValueError, match="decay 1.5"):
        SparseErrorFeedback(SparseCodec(), 8, "cpu", decay=1.5)
    with pytest.raises(ValueError, match="does not hold"):
        codec = SparseCodec(chunk=8, k=2)
        e = codec.encode(torch.ones(16))
        SparseCodec(chunk=8, k=3).decode(e)


def _two_rounds(feedback):
    sent = [feedback.codec.decode(feedback.encode(torch.tensor(d)))
            for d in ([1.0, -3, 0.5, 2], [0.75, 1, -1, 1.75])]
    return sent


def test_accumulator_two_rounds_by_hand():
    feedback = SparseErrorFeedback(SparseCodec(chunk=4, k=2), 4, "cpu", decay=0.5)
    sent = _two_rounds(feedback)
    # round 1: e = [1, -3, 0.5, 2]; top 2 are -3 and 2; s = 3, 2 < 2.25 -> s/2 = 1.5
    assert sent[0].tolist() == [0, -3, 0, 1.5]
    # e = [1, 0, 0.5, 0.5]; round 2: e = 0.5 e + delta = [1.25, 1, -0.75, 2];
    # top 2 are 2 and 1.25 (s = 2; 1.25 < 1.5 -> 1), so 0.25 stays at position 0
    assert sent[1].tolist() == [1, 0, 0, 2]
    assert feedback.residual.tolist() == [0.25, 1, -0.75, 0]
    # a non-finite round changes nothing, whichever way it is asked
    with pytest.raises(ValueError, match="non-finite"):
        feedback.encode(torch.tensor([0.0, float("nan"), 0, 0]))
    _, finite = feedback.encode_flagged(torch.tensor([0.0, float("inf"), 0, 0]))
    assert not bool(finite)
    assert feedback.residual.tolist() == [0.25, 1, -0.75, 0]
    # decay 1 is plain error feedback: e = [1, 0, 0.5, 0.5] + delta
    plain = SparseErrorFeedback(SparseCodec(chunk=4, k=2), 4, "cpu", decay=1)
    # -> [1.75, 1, -0.5, 2.25]: s = 2.25 and 1.75 >= 0.75 s, so both are sent as s
    assert _two_rounds(plain)[1].tolist() == [2.25, 0, 0, 2.25]
    assert plain.residual.tolist() == [-0.5, 1, -0.5, 0]


def test_accumulator_state_dict_round_trip_and_resize():
    codec = SparseCodec(chunk=4, k=2)
    feedback = SparseErrorFeedback(codec, 4, "cpu", decay=0.5)
    _two_rounds(feedback)
    restored = SparseErrorFeedback(codec, 4, "cpu", decay=0.5)
    restored.load_state_dict({k: v.clone() for k, v in feedback.state_dict().items()})
    delta = torch.tensor([0.5, -0.25, 2, 1])
    a, b = feedback.encode(delta), restored.encode(delta)
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
    assert torch.equal(feedback.residual, restored.residual)
    grown = feedback.resized(8, 4)
    assert isinstance(grown, SparseErrorFeedback) and grown.decay == 0.5
    assert grown.residual.tolist() == feedback.residual.tolist() + [0] * 4
    with pytest.raises(ValueError, match="checkpoint residual shape"):
        restored.load_state_dict({"residual": torch.zeros(5)})


def _ratio_to_data_parallel(wire_bytes, numel, steps, workers, all_gather):
    """Data parallel's bytes per worker over ``steps`` ring all-reduces of fp32 gradients,
    2 (M-1)/M * 4 n each, over one exchange's: the dense path's reduce-scatter and all-gather
    move 2 (M-1)/M * wire; the sparse all-gather (M-1) * wire."""
    dp = steps * 2 * (workers - 1) / workers * 4 * numel
    sent = (workers - 1) * wire_bytes if all_gather else 2 * (workers - 1) / workers * wire_bytes
    return dp / sent


def test_bytes_against_data_parallel_at_h30():
    n, h = 1_000_000, 30
    # the dense FP4 default reproduces the documented 226x
    fp4 = make_codec("fp4", 128).wire_bytes(n)
    assert fp4 == 500_000 + 4 * 7813
    assert round(_ratio_to_data_parallel(fp4, n, h, 2, all_gather=False), 1) == 225.9
    # 64 of 4,096 (1.56 %), 2-bit values: 245 chunks of 96 + 16 + 4 bytes
    dense_k = SparseCodec(chunk=4096, k=64, value_bits=2)
    assert dense_k.wire_bytes(n) == 245 * 116 == dense_k.encode(torch.randn(n)).nbytes()
    assert round(_ratio_to_data_parallel(dense_k.wire_bytes(n), n, h, 2, True)) == 4222
    assert round(_ratio_to_data_parallel(dense_k.wire_bytes(n), n, h, 4, True)) == 2111
    # 32 of 4,096 (0.78 %): 48 + 8 + 4 bytes per chunk, >= 4,000x for M = 2 and 4
    sparse_k = SparseCodec(chunk=4096, k=32, value_bits=2)
    assert sparse_k.wire_bytes(n) == 245 * 60
    assert round(_ratio_to_data_parallel(sparse_k.wire_bytes(n), n, h, 2, True)) == 8163
    assert round(_ratio_to_data_parallel(sparse_k.wire_bytes(n), n, h, 4, True)) == 4082

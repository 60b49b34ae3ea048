"""The outer-gradient codecs (DESIGN.md, "Quantized exchange"): pure CPU, in-process.

Every error bound below is the one the module docstring derives for the format, checked per
element in float64 (where the differences of fp32 values are exact), and every equality that
the arithmetic makes exact is checked with ``torch.equal``.
"""

import math

import pytest
import torch

from megatron_streaming.errors import UsageError
from megatron_streaming.comm.codec import (CODECS, Encoded, ErrorFeedback, chunk_bounds, is_finite,
                                           make_codec, pack_nibbles, unpack_nibbles)

BLOCKS = (128, 6)  # the default, and a small even block that leaves a short last block
FP32_EPS = 2.0 ** -24  # unit roundoff of fp32


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _data(kind, n, seed=0):
    g = _gen(seed)
    normal = torch.randn(n, generator=g)
    if kind == "normal":
        return normal
    if kind == "lognormal":  # magnitudes spread over ~7 decades
        return normal * torch.exp(2.0 * torch.randn(n, generator=g))
    if kind == "cauchy":  # ratio of normals: extreme outliers in most blocks
        return normal / torch.randn(n, generator=g)
    if kind == "midpoints":  # within 3 ulps of fp4 rounding midpoints s * 1.5 * 2^k
        return _near_midpoints(n, g)
    raise AssertionError(kind)


def _near_midpoints(n, g, block=32):
    """Blocks led by their scale s, then values within 3 ulps of s * 2^k or s * 1.5 * 2^k,
    where a decision on the rounded ratio fl(|x| / s) would pick the wrong neighbour."""
    scale = torch.exp(4 * torch.randn(-(-n // block), 1, generator=g))
    k = torch.randint(-7, 0, (scale.shape[0], block), generator=g).double()
    factor = 1 + 0.5 * torch.randint(0, 2, k.shape, generator=g)
    mid = (scale.double() * factor * torch.pow(2.0, k)).float()
    ulps = torch.randint(-3, 4, mid.shape, generator=g)
    for shift in range(1, 4):  # walk each value 0..3 ulps up or down
        mid = torch.where(ulps >= shift, torch.nextafter(mid, torch.full_like(mid, 1e38)), mid)
        mid = torch.where(-ulps >= shift, torch.nextafter(mid, torch.zeros_like(mid)), mid)
    mid[:, 0] = scale[:, 0]
    signs = torch.randint(0, 2, mid.shape, generator=g) * 2 - 1
    return (mid * signs).flatten()[:n].contiguous()


def _per_element_scale(codec, e):
    return e.scales.double().repeat_interleave(codec.block)[: e.numel]


def _error_bound(codec, x, e):
    """The format's per-element bound on |x - decode(encode(x))| (module docstring)."""
    mag = x.double().abs()
    if codec.name == "none":
        return torch.zeros_like(mag)
    if codec.name == "bf16":
        return mag * 2.0 ** -8
    scale = _per_element_scale(codec, e)
    if codec.name == "int8":
        # step/2 from rounding, plus fp32 rounding of x/step (|x/step| <= 128) and q*step.
        return scale * (0.5 + 2.0 ** -16)
    if codec.name == "fp4-e2m1":
        # Half the gap to the next magnitude: 1/5 of |x| from s/6 up, 1/3 from s/12, s/24
        # below; the decision is taken on |x| * 6 / s in fp32, so values within a few ulps
        # of a midpoint may round either way (slack 2^-20 |x|), and the decoded m/6 * s is
        # rounded once more.
        bound = torch.where(mag >= scale / 6, mag / 5,
                            torch.where(mag >= scale / 12, mag / 3, scale / 24))
        return bound + mag * 2.0 ** -20 + scale * 2.0 ** -23
    return torch.where(mag >= scale * 2.0 ** -6, mag / 3, scale * 2.0 ** -7)


def _roundtrip(codec, x):
    e = codec.encode(x)
    decoded = codec.decode(e)
    assert decoded.dtype == torch.float32 and decoded.shape == x.shape
    return e, decoded


def _assert_within_bound(codec, x):
    e, decoded = _roundtrip(codec, x)
    err = (x.double() - decoded.double()).abs()
    bound = _error_bound(codec, x, e)
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{codec.name}: element {worst} x={x[worst].item()!r} decoded={decoded[worst].item()!r}"
        f" err={err[worst].item()!r} > bound={bound[worst].item()!r}")
    return e, decoded


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("kind", ["normal", "lognormal", "cauchy"])
@pytest.mark.parametrize("name", CODECS)
def test_roundtrip_error_within_format_bound(name, kind, block):
    codec = make_codec(name, block)
    x = _data(kind, 10_001)  # not a multiple of either block
    e, _ = _assert_within_bound(codec, x)
    if name in ("int8", "fp4", "fp4-e2m1"):
        absmax = torch.nn.functional.pad(x, (0, -x.numel() % block)).abs().view(-1, block)
        expected = absmax.amax(dim=1) / (127 if name == "int8" else 1)
        assert torch.equal(e.scales, expected)


@pytest.mark.parametrize("kind", ["normal", "lognormal", "cauchy", "midpoints"])
def test_fp4_rounds_to_nearest_representable_value(kind):
    codec = make_codec("fp4", 32)
    x = _data(kind, 4_000, seed=1)
    e, decoded = _roundtrip(codec, x)
    scale = _per_element_scale(codec, e)
    mags = torch.tensor([0.0] + [2.0 ** k for k in range(-6, 1)], dtype=torch.float64)
    candidates = torch.sign(x.double())[:, None] * scale[:, None] * mags[None, :]
    nearest = (x.double()[:, None] - candidates).abs().amin(dim=1)
    assert torch.equal((x.double() - decoded.double()).abs(), nearest)


@pytest.mark.parametrize("kind", ["normal", "lognormal", "cauchy"])
def test_e2m1_rounds_to_nearest_representable_value(kind):
    """fp4-e2m1: the nearest of the eight magnitudes m / 6 * s (up to the fp32 decision's
    few ulps at a midpoint), and far less error than E3M0 on Gaussian data at the same
    bytes."""
    from megatron_streaming.comm.codec import E2M1_MAGNITUDES

    codec = make_codec("fp4-e2m1", 32)
    x = _data(kind, 4_000, seed=1)
    e, decoded = _roundtrip(codec, x)
    scale = _per_element_scale(codec, e)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64) / 6
    candidates = torch.sign(x.double())[:, None] * scale[:, None] * mags[None, :]
    nearest = (x.double()[:, None] - candidates).abs().amin(dim=1)
    err = (x.double() - decoded.double()).abs()
    assert bool((err <= nearest + x.double().abs() * 2.0 ** -20 + scale * 2.0 ** -23).all())
    if kind == "normal":
        e3m0 = make_codec("fp4", 32)
        relative = {c.name: float((c.decode(c.encode(x)) - x).norm() / x.norm())
                    for c in (codec, e3m0)}
        assert relative["fp4-e2m1"] < 0.65 * relative["fp4"], relative
        assert codec.wire_bytes(x.numel()) == e3m0.wire_bytes(x.numel())


def test_e2m1_every_code_roundtrips():
    canonical = [c for c in range(16) if c != 8]  # 8 (negative zero) is never emitted
    codes = torch.tensor([7] + canonical, dtype=torch.uint8)  # 7 = +s: fixes the absmax
    codec = make_codec("fp4-e2m1", codes.numel())
    for scale in (1.0, 3.7, 1e-3, 1e-30, 1e20):
        sent = Encoded(pack_nibbles(codes, codes.numel()), torch.tensor([scale]), codes.numel())
        decoded = codec.decode(sent)
        assert decoded[0] == torch.tensor(scale) and decoded[1].item() == 0.0
        again = codec.encode(decoded)
        assert torch.equal(again.payload, sent.payload)
        assert torch.equal(again.scales, sent.scales)


def test_fp4_rounding_boundaries_and_ties():
    # Scale 1 (the first element); ties go to the larger magnitude, also at 2^-7 (0 vs 2^-6).
    x = torch.tensor([1.0, 0.75, 0.7499999, 0.375, 0.3749999, 2.0 ** -7, 2.0 ** -7 * 0.9999,
                      -0.75, -(2.0 ** -7), 0.0, -0.0, 3 * 2.0 ** -8])
    expected = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.25, 2.0 ** -6, 0.0,
                             -1.0, -(2.0 ** -6), 0.0, 0.0, 2.0 ** -6])
    codec = make_codec("fp4", 12)
    assert torch.equal(codec.decode(codec.encode(x)), expected)


def test_pack_all_codes_in_every_position():
    # One block of 512 codes: byte i pairs code i (low nibble) with code i + 256 (high).
    low, high = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.cat((low.flatten(), high.flatten())).to(torch.uint8)
    packed = pack_nibbles(codes, 512)
    assert torch.equal(packed, (low.flatten() | high.flatten() << 4).to(torch.uint8))
    assert torch.equal(unpack_nibbles(packed, codes.numel(), 512), codes)
    swapped = torch.cat((codes[256:], codes[:256]))  # every code also in the other nibble
    assert torch.equal(unpack_nibbles(pack_nibbles(swapped, 512), 512, 512), swapped)


@pytest.mark.parametrize("n", range(0, 34))
def test_pack_odd_and_even_lengths(n):
    block = 8
    codes = torch.randint(0, 16, (n,), generator=_gen(n), dtype=torch.uint8)
    packed = pack_nibbles(codes, block)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 1) // 2
    assert torch.equal(unpack_nibbles(packed, n, block), codes)
    whole = n - n % block
    for b in range(whole // block):  # whole blocks pair i with i + block/2
        assert [int(v) for v in packed[4 * b:4 * b + 4]] == \
            [int(codes[8 * b + i]) | int(codes[8 * b + i + 4]) << 4 for i in range(4)]
    tail = n - whole  # the short last block pairs over its own (even) length
    half = (tail + 1) // 2
    for i in range(half):
        high = int(codes[whole + i + half]) if i + half < tail else 0  # padding code is zero
        assert int(packed[whole // 2 + i]) == int(codes[whole + i]) | high << 4


@pytest.mark.parametrize("scale", [1.0, 3.7, 1e-3, 1e-30, 1e20])
def test_fp4_every_code_roundtrips(scale):
    canonical = [c for c in range(16) if c != 8]  # 8 (negative zero) is never emitted
    codes = torch.tensor([7] + canonical, dtype=torch.uint8)  # 7 = +1: fixes the absmax
    codec = make_codec("fp4", codes.numel())
    sent = Encoded(pack_nibbles(codes, codes.numel()), torch.tensor([scale]), codes.numel())
    again = codec.encode(codec.decode(sent))
    assert torch.equal(again.payload, sent.payload)
    assert torch.equal(again.scales, sent.scales)
    negative_zero = Encoded(pack_nibbles(torch.tensor([7, 8], dtype=torch.uint8), 2),
                            torch.tensor([scale]), 2)
    assert codec.decode(negative_zero)[1].item() == 0.0


def test_int8_every_code_roundtrips():
    codes = torch.cat((torch.arange(-127, 128), torch.tensor([127]))).to(torch.int8)
    codec = make_codec("int8", codes.numel())
    for step in (1.0, 0.013, 7.5e-9, 3e15):
        sent = Encoded(codes, torch.tensor([step]), codes.numel())
        again = codec.encode(codec.decode(sent))
        assert torch.equal(again.payload, codes)
        # absmax = fl(127 * step) and step' = fl(absmax / 127): at most one ulp apart
        assert abs(again.scales.item() - step) <= 2 * FP32_EPS * step


def test_bf16_every_finite_value_roundtrips():
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16)
    values = values[torch.isfinite(values)]
    codec = make_codec("bf16")
    again = codec.encode(codec.decode(Encoded(values, None, values.numel())))
    assert torch.equal(again.payload.view(torch.int16), values.view(torch.int16))


@pytest.mark.parametrize("name", CODECS)
def test_zeros_and_all_zero_block(name):
    codec = make_codec(name, 8)
    e, decoded = _roundtrip(codec, torch.zeros(21))
    assert torch.equal(decoded, torch.zeros(21))
    if e.scales is not None:
        assert torch.equal(e.scales, torch.zeros(3))
    x = _data("normal", 24, seed=2)
    x[8:16] = 0
    e, decoded = _assert_within_bound(codec, x)
    assert torch.equal(decoded[8:16], torch.zeros(8))
    assert torch.equal(decoded[:8], codec.decode(codec.encode(x[:8])))  # blocks independent
    assert torch.equal(decoded[16:], codec.decode(codec.encode(x[16:])))


@pytest.mark.parametrize("name", CODECS)
def test_tiny_values(name):
    x = _data("normal", 1_000, seed=3) * 1e-30  # scales stay normal: s * 2^-7 >> 2^-126
    _, decoded = _assert_within_bound(make_codec(name, 128), x)
    assert not torch.equal(decoded, torch.zeros_like(decoded))


@pytest.mark.parametrize("name", CODECS)
def test_block_with_single_huge_outlier(name):
    codec = make_codec(name, 16)
    x = _data("normal", 32, seed=4)
    x[5] = 1e6
    _, decoded = _assert_within_bound(codec, x)
    assert torch.equal(decoded[16:], codec.decode(codec.encode(x[16:])))
    if name.startswith("fp4"):  # the outlier is the scale; the rest of its block is < s/24
        assert decoded[5].item() == 1e6
        assert torch.equal(decoded[:5], torch.zeros(5))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", CODECS)
def test_encode_rejects_non_finite(name, bad):
    x = _data("normal", 300, seed=5)
    x[297] = bad  # in the short last block
    assert not is_finite(x)
    with pytest.raises(ValueError, match="non-finite"):
        make_codec(name, 128).encode(x)
    ef = ErrorFeedback(make_codec(name, 128), 300, "cpu")
    ef.encode(_data("normal", 300, seed=6))
    before = ef.residual.clone()
    with pytest.raises(ValueError, match="non-finite"):
        ef.encode(x)
    assert torch.equal(ef.residual, before)  # a skipped fragment keeps its residual


def test_bf16_overflow_is_rejected_not_sent_as_inf():
    assert is_finite(torch.tensor([3.4e38]))
    with pytest.raises(ValueError, match="non-finite"):
        make_codec("bf16").encode(torch.tensor([1.0, 3.4e38]))


def test_encode_rejects_wrong_shape_or_dtype():
    with pytest.raises(ValueError, match="flat float32"):
        make_codec("fp4").encode(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="flat float32"):
        make_codec("int8").encode(torch.zeros(4, dtype=torch.float64))


def _power_of_two_blocks(n, block, seed):
    """Data whose fp4 decodes are powers of two in [2^-9, 2^3]: fp32 sums of three are exact."""
    x = _data("normal", n, seed=seed)
    blocks = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)
    exponents = torch.randint(-3, 4, (blocks.shape[0], 1), generator=_gen(seed + 100))
    blocks = blocks / blocks.abs().amax(dim=1, keepdim=True) * torch.pow(2.0, exponents)
    return blocks.flatten()[:n].contiguous()


def test_all_reduce_of_codes_equals_fp32_mean_of_decoded():
    workers, codec = 3, make_codec("fp4", 32)
    decoded = [codec.decode(codec.encode(_power_of_two_blocks(1_000, 32, seed=w)))
               for w in range(workers)]
    accumulated = torch.zeros(1_000)
    for d in decoded:  # what the transport does: decode, then accumulate in fp32
        accumulated += d
    accumulated /= workers
    # The fp32 sums are exact here, and float64-then-fp32 rounding of one division is the
    # correctly rounded fp32 quotient (53 >= 2*24 + 2), so this reference is the true mean.
    exact_mean = (torch.stack(decoded).double().sum(dim=0) / workers).float()
    assert torch.equal(accumulated, exact_mean)


def _simulate_reduce_scatter_all_gather(codec, inputs, parts):
    """Each chunk: every worker sends its codes, the owner averages in fp32, re-encodes the
    mean and all-gathers it; every rank then decodes."""
    out = torch.empty_like(inputs[0])
    for start, end in chunk_bounds(inputs[0].numel(), parts, codec.block):
        total = torch.zeros(end - start)
        for x in inputs:
            total += codec.decode(codec.encode(x[start:end]))
        out[start:end] = codec.decode(codec.encode(total / len(inputs)))
    return out


@pytest.mark.parametrize("numel,parts,block", [(1_000, 3, 32), (10, 5, 4), (257, 2, 128)])
@pytest.mark.parametrize("name", CODECS)
def test_chunked_reduce_scatter_equals_whole_tensor_reference(name, numel, parts, block):
    codec = make_codec(name, block)
    inputs = [_data("lognormal", numel, seed=w) for w in range(3)]
    total = torch.zeros(numel)
    for x in inputs:
        total += codec.decode(codec.encode(x))
    reference = codec.decode(codec.encode(total / len(inputs)))
    assert torch.equal(_simulate_reduce_scatter_all_gather(codec, inputs, parts), reference)


@pytest.mark.parametrize("name", ["int8", "fp4", "fp4-e2m1"])
def test_chunks_encode_to_slices_of_the_whole_encoding(name):
    codec, x = make_codec(name, 6), _data("cauchy", 101, seed=7)
    whole = codec.encode(x)
    pieces = [codec.encode(x[a:b]) for a, b in chunk_bounds(x.numel(), 4, codec.block)]
    assert torch.equal(torch.cat([p.payload for p in pieces]), whole.payload)
    assert torch.equal(torch.cat([p.scales for p in pieces]), whole.scales)


@pytest.mark.parametrize("numel,parts,block", [
    (0, 3, 4), (1, 1, 128), (10, 5, 4), (1_000, 3, 32), (1_024, 8, 128), (1_025, 8, 128)])
def test_chunk_bounds_are_block_aligned_and_balanced(numel, parts, block):
    bounds = chunk_bounds(numel, parts, block)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(start % block == 0 or start == numel for start, _ in bounds)
    blocks = [-(-(end - start) // block) for start, end in bounds]
    assert max(blocks) - min(blocks) <= 1
    with pytest.raises(ValueError):
        chunk_bounds(numel, 0, block)


def test_error_feedback_sum_sent_tracks_sum_true():
    n, steps, codec = 512, 200, make_codec("fp4", 32)
    drift = _data("lognormal", n, seed=8)  # a fixed component: plain fp4 error is biased
    ef = ErrorFeedback(codec, n, "cpu")
    sent_ef = torch.zeros(n, dtype=torch.float64)
    sent_plain, true = torch.zeros_like(sent_ef), torch.zeros_like(sent_ef)
    rounding = torch.zeros_like(sent_ef)  # bound on the fp32 rounding of x + r
    x_max, plain_error = 0.0, {}
    for step in range(1, steps + 1):
        x = drift + _data("normal", n, seed=1_000 + step)
        x_max = max(x_max, x.abs().max().item())
        rounding += (x + ef.residual).double().abs() * FP32_EPS
        sent_ef += codec.decode(ef.encode(x)).double()
        sent_plain += codec.decode(codec.encode(x)).double()
        true += x.double()
        # |r|_inf <= (X + |r|_inf) / 3 each step, so it never exceeds X / 2 (+ fp32 rounding).
        assert ef.residual.abs().max().item() <= x_max / 2 * (1 + 2.0 ** -20)
        plain_error[step] = (sent_plain - true).norm().item()
    # sum(sent) - sum(x) = -r exactly, but for the rounding of x + r and float64 summation.
    identity_gap = (sent_ef - true + ef.residual.double()).abs()
    assert bool((identity_gap <= rounding + steps * 2.0 ** -53 * true.abs().max()).all())
    ef_error = (sent_ef - true).norm().item()
    assert ef_error <= ef.residual.norm().item() * (1 + 2.0 ** -20)
    assert plain_error[200] > 1.8 * plain_error[100]  # grows linearly without feedback
    assert plain_error[200] > 20 * ef_error


def test_error_feedback_state_dict_roundtrip():
    codec = make_codec("fp4", 32)
    first, second = ErrorFeedback(codec, 100, "cpu"), ErrorFeedback(codec, 100, "cpu")
    first.encode(_data("normal", 100, seed=9))
    second.load_state_dict(first.state_dict())
    x = _data("normal", 100, seed=10)
    assert torch.equal(first.encode(x).payload, second.encode(x).payload)
    assert torch.equal(first.residual, second.residual)
    with pytest.raises(ValueError, match="shape"):
        ErrorFeedback(codec, 99, "cpu").load_state_dict(first.state_dict())


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("name", CODECS)
def test_wire_bytes_matches_encoded_size(name, block):
    codec = make_codec(name, block)
    for numel in (0, 1, 2, 7, 127, 128, 129, 1_000, 4_097):
        assert codec.wire_bytes(numel) == codec.encode(torch.randn(numel)).nbytes(), numel


def test_fp4_is_about_eight_times_smaller_than_fp32():
    numel, block = 2 ** 20 + 3, 128
    fp4 = make_codec("fp4", block).wire_bytes(numel)
    assert fp4 == math.ceil(numel / 2) + 4 * math.ceil(numel / block)
    assert 7.5 < make_codec("none").wire_bytes(numel) / fp4 < 8


@pytest.mark.parametrize("name,block,flag,value", [
    ("fp8", 128, "--diloco-quantize", "'fp8'"),
    ("int8", 0, "--diloco-quant-block", "0"),
    ("int8", -4, "--diloco-quant-block", "-4"),
    ("fp4", 127, "--diloco-quant-block", "127"),
    ("fp4", 2.5, "--diloco-quant-block", "2.5"),
])
def test_make_codec_errors_name_flag_and_value(name, block, flag, value):
    with pytest.raises(UsageError, match=f"{flag} {value}"):
        make_codec(name, block)
    assert issubclass(UsageError, ValueError)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["fp4", "fp4-e2m1", "int8", "bf16"])
def test_fused_kernels_equal_the_eager_ones_on_large_tensors(name, monkeypatch):
    """Tensors of COMPILE_MIN_NUMEL elements and more go through torch.compile'd kernels,
    compiled on the main thread (warm_up) and run on the transport's thread: same payload, same
    scales, same decoded values as the eager functions, also when decoding into a caller's
    buffer, including zero blocks, ties, values below the smallest magnitude and a short last
    block; and the main thread's random numbers drawn meanwhile are untouched."""
    import shutil
    import threading

    from megatron_streaming.comm import codec as codec_module

    codec = make_codec(name, 128)
    n = codec_module.COMPILE_MIN_NUMEL + 301  # a short last block of odd length
    torch.manual_seed(0)
    x = torch.randn(n) * torch.exp(2 * torch.randn(n))
    x[:128] = 0  # an all-zero block
    x[128:256] = torch.tensor([1.0, -1.5, 0.75, 2.0 ** -7, -(2.0 ** -7) * 0.999, 3.0 * 2.0 ** -8,
                               1.5 * 2.0 ** -3, 1e-30] * 16)  # ties, the zero threshold
    codec_module.warm_up(codec, n)
    out = torch.full((n,), float("nan"))
    fused = {}

    def run():
        encoded = codec.encode(x)
        fused.update(encoded=encoded, decoded=codec.decode(encoded),
                     into=codec.decode(encoded, out=out))

    torch.manual_seed(1)
    expected_draws = [torch.rand(4) for _ in range(50)]
    torch.manual_seed(1)
    thread = threading.Thread(target=run)
    thread.start()
    draws = [torch.rand(4) for _ in range(50)]
    thread.join()
    assert all(torch.equal(a, b) for a, b in zip(draws, expected_draws))
    monkeypatch.setattr(codec_module, "COMPILE_MIN_NUMEL", 1 << 62)  # everything eager
    eager = codec.encode(x)
    assert torch.equal(fused["encoded"].payload, eager.payload)
    if name != "bf16":
        assert torch.equal(fused["encoded"].scales, eager.scales)
    assert torch.equal(fused["decoded"], codec.decode(eager))
    assert fused["into"] is out and torch.equal(out, fused["decoded"])
    if name.startswith("fp4"):  # and both equal the per-element definition
        blocks = torch.nn.functional.pad(x, (0, -n % 128)).view(-1, 128)
        absmax = blocks.abs().amax(dim=1)
        codes = type(codec)._codes(blocks, absmax[:, None]).flatten()[:n]
        assert torch.equal(unpack_nibbles(eager.payload, n, 128), codes)
        assert torch.equal(eager.scales, absmax)
    if shutil.which("g++") or shutil.which("c++"):  # inductor's CPU backend can build here
        assert codec_module._compiled.get(f"{name} encode") is True
        if name != "bf16":  # bf16 decodes with one copy_
            assert codec_module._compiled.get(f"{name} decode") is True


def test_other_threads_never_compile(monkeypatch):
    """A kernel the main thread has not compiled runs eagerly elsewhere (compiling there would
    rewind the main thread's random numbers)."""
    import threading

    from megatron_streaming.comm import codec as codec_module

    monkeypatch.setattr(codec_module, "_compiled", {})
    codec = make_codec("int8", 128)
    x = torch.linspace(-1, 1, codec_module.COMPILE_MIN_NUMEL)
    result = {}
    thread = threading.Thread(target=lambda: result.update(e=codec.encode(x)))
    thread.start()
    thread.join()
    assert codec_module._compiled == {}
    monkeypatch.setattr(codec_module, "COMPILE_MIN_NUMEL", 1 << 62)
    assert torch.equal(result["e"].payload, codec.encode(x).payload)


def test_decode_into_checks_the_buffer():
    codec = make_codec("fp4", 8)
    e = codec.encode(torch.arange(10.0))
    with pytest.raises(ValueError, match="flat float32 of 10 elements"):
        codec.decode(e, out=torch.empty(9))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        codec.decode(e, out=torch.empty(10, dtype=torch.float64))

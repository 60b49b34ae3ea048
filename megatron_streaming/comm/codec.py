"""Codecs for the outer gradients that cross workers (DESIGN.md, "Quantized exchange").

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) sends outer gradients as FP4 E3M0 and
reports a negligible loss in quality. Data flow of one fragment on one rank:

    sync module: delta = theta_g - theta_local  (checks ``is_finite`` first, skips if not)
      -> Codec.encode (optionally through ErrorFeedback) -> transport (reduce-scatter of codes)
      -> Codec.decode -> fp32 sum / M -> encode the mean -> all-gather -> Codec.decode
      -> outer optimizer (Nesterov) on theta_g

Codecs, chosen by ``--diloco-quantize`` with block size ``--diloco-quant-block``:

* ``none``: fp32, 4 bytes per element.
* ``bf16``: round-to-nearest-even cast, 2 bytes per element, relative error <= 2^-8.
* ``int8``: per block, ``step = absmax / 127`` (the fp32 scale sent), ``q = round(x / step)``
  in [-127, 127]. Error <= step/2 exactly; with fp32 arithmetic <= step * (1/2 + 2^-16).
  CUDA divides by the constant 127 as a multiplication by its reciprocal, so a GPU's scales
  may differ from a CPU's in the last bit (and a code by one at a tie); the bound holds on
  both, and workers agree whatever their devices, since each decodes the bytes on the wire.
* ``fp4``: E3M0, one sign bit and three exponent bits, one fp32 scale ``s`` = block absmax.
  Exponent field -> magnitude / s (code = sign << 3 | field; sign 1 is negative):

      field      000  001   010   011   100  101  110  111
      |value|/s   0   2^-6  2^-5  2^-4  2^-3 2^-2 2^-1 2^0

  Field 000 is reserved for zero, so the block's largest element is exactly ``s``. Code 8
  (negative zero) is never emitted and decodes to 0. Rounding is to the nearest magnitude in
  linear space, ties to the larger one: for ``|x| >= 2^-6 s`` the relative error is <= 1/3
  (worst at 1.5 * 2^k * s). Below ``2^-6 s``, ``|x| < 2^-7 s`` becomes 0 and the rest 2^-6 s,
  so the absolute error is <= 2^-7 s. Both bounds hold exactly in fp32: every rounding
  decision is an exact comparison (see ``_fp4_codes``), provided ``s * 2^-7`` is a normal fp32
  (s >= 2^-119). Two codes per byte, paired within a block of b codes: byte i holds code i
  in its low nibble and code i + b/2 in its high one (``pack_nibbles``); a short last block
  pairs the same way over its own length, rounded up to even with a zero code.
* ``fp4-e2m1``: the same scale, packing and bytes as ``fp4``, the four bits as E2M1 (OCP FP4:
  one sign, two exponent bits and one mantissa bit). Magnitudes in units of s/6:

      index       000  001  010  011  100  101  110  111
      |value|*6/s  0   0.5   1   1.5   2    3    4    6

  Rounding to the nearest on ``|x| * 6 / s`` computed in fp32 (ties to the larger; a value
  within a few ulps of a midpoint may go either way). Error <= |x|/5 for ``|x| >= s/6``,
  <= |x|/3 for ``s/12 <= |x| < s/6``, <= s/24 below: coarser than E3M0 for the smallest
  elements of a block, finer for the rest (relative error over a Gaussian block of 128:
  0.11 against E3M0's 0.19).

Blocks are consecutive runs of ``block`` elements of the flat tensor; the last may be short.
An all-zero block has scale 0 and decodes to exact zeros. ``encode`` requires finite input and
raises ``ValueError`` otherwise, so an inf or NaN never reaches the wire as finite garbage.
``encode_flagged`` is the same encoding without the host's check: it returns the flag (a
tensor on the input's device) for a caller that must not wait for the device (the exchange
on NCCL, ``transport``), which then sends zeros and the flag instead.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_streaming.errors import UsageError

FP4_MIN_EXPONENT = -6  # smallest nonzero magnitude is 2^-6 of the block scale
INT8_MAX = 127


@dataclass(frozen=True, eq=False)
class Encoded:
    """What travels on the wire for one flat tensor (eq=False: tensors have no truth value)."""

    payload: torch.Tensor  # flat: uint8 nibble pairs (fp4), int8, bfloat16 or float32
    scales: Optional[torch.Tensor]  # flat fp32, one per block; None for none/bf16
    numel: int  # number of encoded elements

    def nbytes(self) -> int:
        """Exact bytes that cross the wire: payload plus scales."""
        total = self.payload.numel() * self.payload.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        return total


def is_finite(x: torch.Tensor) -> bool:
    """True when every element is finite (one reduction and one host sync)."""
    return bool(torch.isfinite(x).all())


class Codec(abc.ABC):
    """Encodes a flat fp32 tensor for the wire; decode returns a fresh flat fp32 tensor."""

    name: str
    block: int = 1  # chunk alignment for ``chunk_bounds``; 1 for element-wise codecs

    def encode(self, x: torch.Tensor) -> Encoded:
        """Encode a flat finite fp32 tensor; raises ValueError on inf or NaN (one host read
        of the flag ``encode_flagged`` returns)."""
        encoded, finite = self.encode_flagged(x)
        if not bool(finite):
            raise self._non_finite()
        return encoded

    @abc.abstractmethod
    def encode_flagged(self, x: torch.Tensor) -> Tuple[Encoded, torch.Tensor]:
        """Encode a flat fp32 tensor; also a 0-dim bool tensor on ``x``'s device: whether
        what was encoded is finite (an inf or NaN in ``x``, or a value the format cannot
        hold). Nothing is read on the host; where the flag is False the encoding is
        garbage and must not be decoded as values."""

    @abc.abstractmethod
    def decode(self, e: Encoded, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flat fp32 tensor of ``e.numel`` elements on the payload's device; written into
        ``out`` (flat fp32 of that size) when given, which saves allocating (and, for large
        tensors, faulting in) a fresh output on every call."""

    @abc.abstractmethod
    def wire_bytes(self, numel: int) -> int:
        """Size of ``encode(x).nbytes()`` for ``numel`` elements, without encoding."""

    def error_feedback(self, numel: int, device: torch.device | str) -> "ErrorFeedback":
        """The error-feedback state of one shard of ``numel`` (padded) elements."""
        return ErrorFeedback(self, numel, device)

    @staticmethod
    def _output(e: Encoded, out: Optional[torch.Tensor]) -> torch.Tensor:
        if out is None:
            return torch.empty(e.numel, dtype=torch.float32, device=e.payload.device)
        if out.shape != (e.numel,) or out.dtype != torch.float32:
            raise ValueError(f"decode: out must be flat float32 of {e.numel} elements, got "
                             f"shape {tuple(out.shape)} dtype {out.dtype}")
        return out

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 1 or x.dtype != torch.float32:
            raise ValueError(f"{self.name} codec: expected a flat float32 tensor, got "
                             f"shape {tuple(x.shape)} dtype {x.dtype}")

    def _non_finite(self) -> ValueError:
        return ValueError(f"{self.name} codec: input has non-finite values (inf or NaN); the "
                          "caller must check is_finite() and skip the fragment")


class Fp32Codec(Codec):
    """``none``: the exact fp32 values (copied, so later in-place updates cannot race a send)."""

    name = "none"

    def encode_flagged(self, x: torch.Tensor) -> Tuple[Encoded, torch.Tensor]:
        self._check_input(x)
        return Encoded(x.clone(), None, x.numel()), torch.isfinite(x).all()

    def decode(self, e: Encoded, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._output(e, out).copy_(e.payload)

    def wire_bytes(self, numel: int) -> int:
        return 4 * numel


def _bf16_rows(x: torch.Tensor):
    """(bf16 values, all finite): checked after the cast, which also catches finite values
    above the bf16 maximum; one fused pass under torch.compile."""
    payload = x.to(torch.bfloat16)
    return payload, torch.isfinite(payload).all()


class Bf16Codec(Codec):
    """``bf16``: round-to-nearest-even cast."""

    name = "bf16"

    def encode_flagged(self, x: torch.Tensor) -> Tuple[Encoded, torch.Tensor]:
        self._check_input(x)
        payload, finite = _kernel("bf16 encode", _bf16_rows, x.numel())(x)
        return Encoded(payload, None, x.numel()), finite

    def decode(self, e: Encoded, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._output(e, out).copy_(e.payload)

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# Tensors of 64k elements and more go through kernels fused by torch.compile (one or two passes
# over memory instead of one per operation: 8x faster at 256k elements, see
# benchmarks/micro.py); smaller ones, where the compiled call's fixed cost would dominate, and
# every tensor where compilation is unavailable, through the same functions eagerly. Both give
# identical results (tests/test_codec.py).
#
# Kernels are compiled on the main thread only (``warm_up``, at start-up): compiling saves the
# process's random-number state and restores it when done, so a compile on the transport's
# thread would rewind the dropout masks the main thread drew meanwhile (a resumed run would then
# differ from an uninterrupted one). Other threads run what the main thread compiled, in
# Dynamo's run-only mode (a guard miss runs eagerly instead of compiling).
COMPILE_MIN_NUMEL = 1 << 16
_compiled: Dict[str, bool] = {}  # kernel name -> compiled on the main thread (False: failed)
_wrappers: Dict[tuple, object] = {}  # (name, compiling) -> the callable (made once: ~0.5 ms)


def _kernel(name: str, fn, numel: int):
    if numel < COMPILE_MIN_NUMEL or _compiled.get(name) is False:
        return fn
    compiling = threading.current_thread() is threading.main_thread()
    if not (compiling or _compiled.get(name)):
        return fn
    if (name, compiling) not in _wrappers:
        _wrappers[name, compiling] = torch.compile(fn, dynamic=True) if compiling else \
            torch._dynamo.run(fn)
    kernel = _wrappers[name, compiling]

    def run(*args):
        try:
            result = kernel(*args)
        except Exception as e:  # e.g. no C++ compiler at the first call: stay eager
            import warnings

            warnings.warn(f"{name} codec: torch.compile failed ({type(e).__name__}: {e}); "
                          "using the eager kernels (identical results, slower)")
            _compiled[name] = False
            return fn(*args)
        _compiled.setdefault(name, True)
        return result

    return run


def warm_up(codec: "Codec", numel: int, device: torch.device | str = "cpu") -> None:
    """Compile ``codec``'s fused kernels for ``device`` now, on the main thread, if tensors of
    ``numel`` elements will use them: encode, and decode into slices of a buffer as the
    transport does (views at an offset), so its thread later finds them compiled. Draws no
    random numbers."""
    if numel < COMPILE_MIN_NUMEL or threading.current_thread() is not threading.main_thread():
        return
    n = 4 * max(COMPILE_MIN_NUMEL, codec.block)
    encoded = codec.encode(torch.linspace(-1.0, 1.0, n, device=device).pow(3))
    out = torch.empty(n, device=device)
    codec.decode(encoded, out=out)
    half = n // 2
    payload = encoded.payload.view(2, -1)
    scales = encoded.scales.view(2, -1) if encoded.scales is not None else [None, None]
    for w in range(2):  # chunk views in and out, as in the transport's exchange
        codec.decode(Encoded(payload[w], scales[w], half), out=out[w * half:(w + 1) * half])


class _BlockCodec(Codec):
    """A codec with one fp32 scale per block of ``block`` consecutive elements.

    Subclasses give row functions: ``_encode_rows(rows (nb, b)) -> (payload rows, scales (nb,))``
    and ``_decode_rows(payload rows, scales, out rows)``, with ``_codes_per_item`` codes in
    each payload element. Whole blocks go through them as one (nb, block) matrix (fused when
    large); the short last block, if any, as one more row of its own length, rounded up with
    zeros (which leave its absmax unchanged) to a whole number of payload elements.
    """

    _codes_per_item = 1

    def __init__(self, block: int):
        self.block = block

    def encode_flagged(self, x: torch.Tensor) -> Tuple[Encoded, torch.Tensor]:
        self._check_input(x)
        whole = x.numel() - x.numel() % self.block
        payload, scales = _kernel(f"{self.name} encode", self._encode_rows, whole)(
            x[:whole].view(-1, self.block))
        payload = payload.flatten()
        if whole < x.numel():
            tail = x[whole:]
            tail = torch.nn.functional.pad(tail, (0, -tail.numel() % self._codes_per_item))
            tail_payload, tail_scale = self._encode_rows(tail.view(1, -1))
            payload = torch.cat((payload, tail_payload.flatten()))
            scales = torch.cat((scales, tail_scale))
        # amax propagates NaN: one small check for the whole input
        return Encoded(payload, scales, x.numel()), torch.isfinite(scales).all()

    def decode(self, e: Encoded, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self._output(e, out)
        whole = e.numel - e.numel % self.block
        blocks = whole // self.block
        head = whole // self._codes_per_item
        _kernel(f"{self.name} decode", self._decode_rows, whole)(
            e.payload[:head].view(blocks, self.block // self._codes_per_item),
            e.scales[:blocks], out[:whole].view(-1, self.block))
        if whole < e.numel:
            tail = e.payload[head:]
            values = torch.empty(tail.numel() * self._codes_per_item, dtype=torch.float32,
                                 device=out.device)
            self._decode_rows(tail.view(1, -1), e.scales[blocks:], values.view(1, -1))
            out[whole:] = values[: e.numel - whole]
        return out


class Int8Codec(_BlockCodec):
    """``int8``: symmetric per-block absmax scaling, round to nearest (ties to even)."""

    name = "int8"

    @staticmethod
    def _encode_rows(rows: torch.Tensor):
        step = rows.abs().amax(dim=1) / INT8_MAX  # amax propagates NaN
        safe = torch.where(step > 0, step, torch.ones_like(step))  # all-zero block: no 0/0
        codes = torch.round(rows / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        return codes.to(torch.int8), step

    @staticmethod
    def _decode_rows(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(codes.float() * scales[:, None])

    def wire_bytes(self, numel: int) -> int:
        return numel + 4 * _ceil_div(numel, self.block)


def pack_nibbles(codes: torch.Tensor, block: int) -> torch.Tensor:
    """Pack 4-bit codes (uint8 < 16) two per byte, per block of ``block`` (even) codes: byte i
    of a block holds code i in its low nibble and code i + block/2 in its high one. A short
    last block is one block of its own length, rounded up to even with a zero code."""
    whole = codes.numel() - codes.numel() % block
    packed = [_pack_rows(codes[:whole].view(-1, block)).flatten()]
    if whole < codes.numel():
        tail = codes[whole:]
        packed.append(_pack_rows(torch.nn.functional.pad(tail, (0, tail.numel() % 2))[None]))
    return torch.cat([p.flatten() for p in packed])


def unpack_nibbles(packed: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: the ``numel`` codes."""
    whole = numel - numel % block
    head = packed[: whole // 2]
    codes = [_unpack_rows(head.view(-1, block // 2)).flatten()]
    if whole < numel:
        codes.append(_unpack_rows(packed[whole // 2:][None]).flatten()[: numel - whole])
    return torch.cat(codes)


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """(rows, b) codes -> (rows, b/2) bytes: the two halves of each row are contiguous, so the
    fused kernels load and store whole vectors (pairing neighbours instead is ~4x slower)."""
    half = codes.shape[1] // 2
    return codes[:, :half] | (codes[:, half:] << 4)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _fp4_codes(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest E3M0 codes (uint8) for ``blocks`` (nb, block) with per-block ``scale`` (nb, 1).

    The bracket 2^j <= |x|/s < 2^(j+1) comes from the exponent bits of the rounded ratio, but
    the decision is made on exact quantities: lo = s*2^j and hi = 2*lo are exact, and |x| - lo,
    hi - |x| are exact by Sterbenz's lemma (|x| lies within a factor 2 of both). If the rounded
    ratio lands on 2^(j+1) while the true one is just below, lo > |x| and the comparison still
    picks the right neighbour, so the documented error bounds need no fp32 slack. Integer and
    in-place operations only past the division: this is the codec's hot loop.
    """
    mag = blocks.abs()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block: no 0/0
    ratio = mag / safe  # in [0, 1]: the scale is the block's absmax
    # floor(log2(ratio)) from the fp32 exponent field; j below -8 only occurs for magnitudes
    # that become zero below, so clamp (this also keeps 2^j a normal number).
    j = (ratio.view(torch.int32) >> 23).sub_(127).clamp_(-8, 0)
    lo = ((j + 127) << 23).view(torch.float32).mul_(safe)  # s * 2^j, exact
    round_up = (mag - lo) >= (lo * 2 - mag)
    # The chosen magnitude is s * 2^(j + round_up): 2^-6 -> field 1, ..., 2^0 -> field 7.
    field = (j + round_up).add_(1 - FP4_MIN_EXPONENT).clamp_(1, 7)
    # Nearest of {0, 2^-6 s}: the midpoint 2^-7 s is exact, ties go to the larger magnitude.
    field.masked_fill_(mag < safe * 2.0 ** (FP4_MIN_EXPONENT - 1), 0)
    negative = (blocks < 0) & (field > 0)  # never emit code 8 (negative zero)
    return field.add_(negative.to(torch.int32) * 8).to(torch.uint8)


def _fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of codes for scale 1: the table in the module docstring computed from the
    bits (field f > 0 is 2^(f - 7), bit 3 the sign)."""
    codes = codes.to(torch.int32)
    field = codes & 7
    magnitude = ((field + (127 + FP4_MIN_EXPONENT - 1)) << 23).view(torch.float32)
    signed = torch.where(codes >= 8, -magnitude, magnitude)
    return torch.where(field > 0, signed, 0.0)


# E2M1 magnitudes (OCP FP4: one sign bit, two exponent bits, one mantissa bit), in units of
# 1/6 of the block scale, so that the block's largest element is exactly the scale.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))


def _e2m1_codes(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 codes (uint8) for ``blocks`` (nb, block) with per-block ``scale`` (nb, 1),
    the magnitudes ``E2M1_MAGNITUDES / 6 * scale``: |x| * 6 / s in fp32 against the midpoints,
    ties to the larger magnitude. Code = sign << 3 | index; negative zero is never emitted.
    Out-of-place int32 sums of comparisons: one fused pass when compiled (in-place updates or
    ``bucketize`` are not fused: 7x slower)."""
    mag = blocks.abs()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block: no 0/0
    ratio = mag / safe * 6.0
    index = (ratio >= _E2M1_MIDPOINTS[0]).to(torch.int32)
    for midpoint in _E2M1_MIDPOINTS[1:]:
        index = index + (ratio >= midpoint).to(torch.int32)
    negative = (blocks < 0) & (index > 0)
    return (index + negative.to(torch.int32) * 8).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes for scale 1 (index 7 is exactly 1): the fp32 bits of the
    magnitude m (index i >= 2: exponent i // 2 - 1, mantissa bit i % 2; index 1: 0.5) and
    the sign, then m / 6. Integer operations up to the one division (int-to-float
    conversions keep the compiled kernel from vectorising: 2x slower)."""
    c = codes.to(torch.int32)
    i = c & 7
    normal = ((i >> 1) + 126) << 23 | (i & 1) << 22
    bits = torch.where(i >= 2, normal, (i == 1).to(torch.int32) * (126 << 23))
    return (bits | (c >> 3) << 31).view(torch.float32) / 6.0


class Fp4Codec(_BlockCodec):
    """``fp4``: E3M0 with a per-block absmax scale (table in the module docstring).

    The block is even so that every block-aligned chunk is byte-aligned too: chunks encoded
    separately concatenate to exactly the whole tensor's encoding.
    """

    name = "fp4"
    _codes_per_item = 2  # two nibbles per byte
    _codes = staticmethod(_fp4_codes)
    _values = staticmethod(_fp4_values)

    @classmethod
    def _encode_rows(cls, rows: torch.Tensor):
        absmax = rows.abs().amax(dim=1)
        return _pack_rows(cls._codes(rows, absmax[:, None])), absmax

    @classmethod
    def _decode_rows(cls, packed: torch.Tensor, scales: torch.Tensor,
                     out: torch.Tensor) -> None:
        # Each half straight into its place: unpacking first (a cat) costs a temporary of a
        # byte per element, which for large tensors is mapped and faulted in on every call.
        half = packed.shape[1]
        out[:, :half].copy_(cls._values(packed & 0x0F) * scales[:, None])
        out[:, half:].copy_(cls._values(packed >> 4) * scales[:, None])

    def wire_bytes(self, numel: int) -> int:
        return _ceil_div(numel, 2) + 4 * _ceil_div(numel, self.block)


class Fp4E2M1Codec(Fp4Codec):
    """``fp4-e2m1``: E2M1 (OCP FP4) with the same per-block absmax scale and packing as
    ``fp4``, so the same bytes on the wire (module docstring)."""

    name = "fp4-e2m1"
    _codes = staticmethod(_e2m1_codes)
    _values = staticmethod(_e2m1_values)


_CLASSES = {c.name: c for c in (Fp32Codec, Bf16Codec, Int8Codec, Fp4Codec, Fp4E2M1Codec)}
CODECS = tuple(_CLASSES)  # the --diloco-quantize names


def make_codec(name: str, block: int = 128) -> Codec:
    """The codec for ``--diloco-quantize name`` and ``--diloco-quant-block block``."""
    if name not in _CLASSES:
        raise UsageError(f"--diloco-quantize {name!r}: expected one of {', '.join(CODECS)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise UsageError(f"--diloco-quant-block {block!r}: must be a positive integer")
    cls = _CLASSES[name]
    if not issubclass(cls, _BlockCodec):
        return cls()
    if block % cls._codes_per_item:
        raise UsageError(f"--diloco-quant-block {block}: {name} packs two codes per byte, so "
                         f"the block must be even (--diloco-quantize {name})")
    return cls(block)


def chunk_bounds(numel: int, parts: int, block: int) -> List[Tuple[int, int]]:
    """Split [0, numel) into ``parts`` contiguous (start, end) ranges of whole blocks.

    For the quantized reduce-scatter: rank i owns chunk i and every chunk is encoded on its
    own. Starts are multiples of ``block`` (ends too, but the last), so each chunk's blocks and
    scales are exactly those of the whole tensor. Chunk sizes differ by at most one block;
    with more parts than blocks the trailing chunks are empty.
    """
    if parts < 1 or block < 1 or numel < 0:
        raise ValueError(f"chunk_bounds: numel {numel}, parts {parts}, block {block}")
    base, extra = divmod(_ceil_div(numel, block), parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + (base + (part < extra)) * block
        bounds.append((min(start, numel), min(end, numel)))
        start = end
    return bounds


class ErrorFeedback:
    """Error feedback around a codec: send ``Q(x + r)``, keep ``r <- (x + r) - decode(...)``.

    Summed over steps, what was sent equals what should have been sent minus the current
    residual (up to fp32 rounding of ``x + r``), so quantization error does not accumulate.
    A non-finite input raises before the residual changes, so a skipped fragment leaves it
    intact. Only the sender's quantization is corrected, not the re-encoding of the mean.
    """

    def __init__(self, codec: Codec, numel: int, device: torch.device | str):
        self.codec = codec
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check(x)
        target = x + self.residual
        encoded = self.codec.encode(target)
        self.residual = target.sub_(self.codec.decode(encoded))
        return encoded

    def encode_flagged(self, x: torch.Tensor) -> Tuple[Encoded, torch.Tensor]:
        """``encode`` without the host's check (``Codec.encode_flagged``): where the flag is
        False the residual stays as it was, as ``encode`` leaves it when it raises."""
        self._check(x)
        target = x + self.residual
        encoded, finite = self.codec.encode_flagged(target)
        self.residual = torch.where(finite, target.sub_(self.codec.decode(encoded)),
                                    self.residual)
        return encoded, finite

    def _check(self, x: torch.Tensor) -> None:
        if x.shape != self.residual.shape:
            raise ValueError(f"ErrorFeedback: input shape {tuple(x.shape)} != residual shape "
                             f"{tuple(self.residual.shape)}")

    def resized(self, padded: int, numel: int) -> "ErrorFeedback":
        """A residual of ``padded`` elements whose first ``numel`` are this one's (the
        transport's padding follows the number of workers)."""
        fresh = ErrorFeedback(self.codec, padded, self.residual.device)
        fresh.residual[:numel] = self.residual[:numel]
        return fresh

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {"residual": self.residual}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        residual = state["residual"]
        if residual.shape != self.residual.shape:
            raise ValueError(f"ErrorFeedback: checkpoint residual shape {tuple(residual.shape)} "
                             f"!= {tuple(self.residual.shape)}")
        self.residual.copy_(residual)

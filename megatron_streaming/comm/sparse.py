"""Sparse outer gradients: top-k per chunk, 2-bit values, error feedback with decay.

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, arXiv 2508.15706) sends, per chunk of the outer
gradient, only its k largest-magnitude entries, quantized to 2 bits, and keeps everything else
in a per-worker accumulator that decays (and so stands in for DiLoCo's outer momentum):

    e <- decay * e + delta;   sent = Q(top-k(e));   e <- e - decode(sent)

Data flow of one fragment on one worker (once wired; nothing calls this module yet):

    delta -> SparseErrorFeedback.encode -> all-gather of every worker's fixed-size payload
      -> SparseCodec.sum_decoded (every worker's payload, in worker order) -> outer step

Each worker's top-k set differs, so the dense path's reduce-scatter of codes does not apply;
a fixed k per chunk makes every payload the same size, so one all-gather moves them.

Format, per chunk of ``chunk`` consecutive elements of the flat tensor (the last chunk may be
short: it is padded with zeros, which are picked last, and positions past the end are dropped
on decode):

* the k entries of largest magnitude; among equal magnitudes the lower index wins, so the
  choice is the same on every device. Their in-chunk positions, ascending, at
  ``index_bits = ceil(log2 chunk)`` bits each (12 for 4,096).
* one fp32 scale ``s``, the chunk's absmax (so the largest entry is sent exactly).
* each entry as ``value_bits`` bits: the top bit the sign (1 negative), the rest a magnitude
  index m in [0, L), L = 2^(value_bits - 1), for the magnitude ``s * 2^(m - L + 1)``. With
  2 bits: codes 0, 1, 2, 3 are +s/2, +s, -s/2, -s. Rounding is to the nearest magnitude in
  linear space, ties to the larger, at the thresholds ``s * (0.75 * 2^(j - L + 1))`` computed
  in fp32 (``0.75 s`` rounds for most s, by half an ulp at most: an entry that close to a
  midpoint may take either neighbour, the same one on every device, since the comparison is
  the same fp32 arithmetic). Relative error <= 1/3 from the smallest magnitude up; there is
  no zero, so an entry below it is sent as it (error <= s * 2^(1 - L)), zeros included: a
  chunk with fewer than k nonzero entries sends some of its zeros as +s/2, which the
  accumulator then takes back (-s/2 kept there); what was not sent exactly stays in the
  accumulator. An all-zero chunk decodes to zeros.

Bytes are packed least significant bit first: code i of a chunk occupies bits
[i * bits, (i + 1) * bits) of that chunk's byte run, rounded up to whole bytes per chunk.
``Encoded.payload`` holds every chunk's index bytes, then every chunk's value bytes (uint8);
``Encoded.scales`` the fp32 scales. Bytes for n elements (``wire_bytes``):

    ceil(n / chunk) * (ceil(k * index_bits / 8) + ceil(k * value_bits / 8) + 4)

Everything is made with tensor operations on the input's device (no loop over elements, no
host read); ``encode`` reads one finiteness flag on the host, as the other codecs do.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .codec import Codec, Encoded, ErrorFeedback, _ceil_div

SCALE_BYTES = 4  # one fp32 scale per chunk


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, n) non-negative integer codes below 2^bits -> (rows, ceil(n * bits / 8)) uint8,
    least significant bit first (module docstring)."""
    rows, n = codes.shape
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((codes.to(torch.int32)[..., None] >> shifts) & 1).to(torch.uint8)
    stream = torch.nn.functional.pad(stream.view(rows, n * bits), (0, -(n * bits) % 8))
    weights = torch.arange(8, device=codes.device, dtype=torch.uint8)
    return (stream.view(rows, _ceil_div(n * bits, 8), 8) << weights).sum(dim=2, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of ``_pack_bits``: (rows, bytes) uint8 -> (rows, n) int64 codes."""
    rows, size = packed.shape
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed[..., None] >> shifts) & 1).view(rows, size * 8)[:, : n * bits]
    weights = torch.arange(bits, device=packed.device, dtype=torch.int64)
    return (stream.view(rows, n, bits).to(torch.int64) << weights).sum(dim=2)


class SparseCodec(Codec):
    """Top-``k`` of every chunk of ``chunk`` elements, values at ``value_bits`` bits with a
    per-chunk fp32 scale (module docstring). Payloads have a fixed size for a given numel."""

    name = "sparse"

    def __init__(self, chunk: int = 4096, k: int = 64, value_bits: int = 2,
                 decay: float = 0.95):
        for what, value, low, high in (("chunk", chunk, 2, 1 << 24), ("k", k, 1, chunk),
                                       ("value_bits", value_bits, 1, 4)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"SparseCodec: {what} {value!r} must be an integer in "
                                 f"[{low}, {high}] (chunk {chunk!r}, k {k!r})")
        self.block = chunk  # chunk_bounds aligns shards to whole chunks
        self.chunk, self.k, self.value_bits = chunk, k, value_bits
        self.index_bits = (chunk - 1).bit_length()
        self.index_bytes = _ceil_div(k * self.index_bits, 8)  # per chunk
        self.value_bytes = _ceil_div(k * value_bits, 8)  # per chunk
        self.decay = decay  # of each shard's accumulator (``error_feedback``)

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def wire_bytes(self, numel: int) -> int:
        return _ceil_div(numel, self.chunk) * (self.index_bytes + self.value_bytes + SCALE_BYTES)

    def error_feedback(self, numel: int, device: torch.device | str) -> "SparseErrorFeedback":
        return SparseErrorFeedback(self, numel, device, self.decay)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as (chunks, chunk) rows, the short last chunk padded with zeros (a view when
        there is none)."""
        short = -x.numel() % self.chunk
        padded = torch.nn.functional.pad(x, (0, short)) if short else x
        return padded.view(padded.numel() // self.chunk, self.chunk)

    def select(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(positions (chunks, k) int64 ascending within each chunk, their values (chunks, k)):
        the k largest magnitudes of each chunk, ties to the lower position."""
        rows = self._rows(x)
        return self._select(rows, rows.abs())

    def _select(self, rows: torch.Tensor, mag: torch.Tensor):
        # The k-th largest magnitude is a value, the same whatever order topk breaks ties
        # in; the tied ones are then taken in position order (a full stable sort instead is
        # 7x slower at 4,096 per chunk). Counts in int32: a bool's sum or cumsum in torch's
        # default int64 took most of the encode on a CPU.
        i32 = torch.int32
        kth = torch.topk(mag, self.k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        above, tied = mag > kth, mag == kth
        room = self.k - above.to(i32).sum(dim=1, keepdim=True, dtype=i32)
        take = above | (tied & (tied.to(i32).cumsum(dim=1, dtype=i32) <= room))
        # Exactly k taken per chunk (fewer only with NaN, flagged): the j-th taken is where
        # the running count of taken ones first reaches j (a search per chunk, no host read;
        # a scatter of every position, most onto one spare column, was slower on a CPU).
        counts = take.to(i32).cumsum(dim=1, dtype=i32)
        want = torch.arange(1, self.k + 1, dtype=i32, device=rows.device)
        positions = torch.searchsorted(counts, want.expand(rows.shape[0], -1).contiguous())
        positions = positions.clamp_(max=self.chunk - 1)
        return positions, rows.gather(1, positions)

    def _codes(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Nearest value codes (int32) for ``values`` (chunks, k) with ``scale`` (chunks, 1)."""
        levels = 1 << (self.value_bits - 1)
        mag = values.abs()
        m = torch.zeros_like(values, dtype=torch.int32)
        for j in range(1, levels):  # thresholds between magnitudes j - 1 and j
            m = m + (mag >= scale * (0.75 * 2.0 ** (j - levels + 1))).to(torch.int32)
        return m + (values < 0).to(torch.int32) * levels

    def _values(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """fp32 values of ``codes`` (chunks, k) for ``scale`` (chunks, 1): the power of two
        built from its bits (exact), times the scale."""
        levels = 1 << (self.value_bits - 1)
        codes = codes.to(torch.int32)
        power = (((codes & (levels - 1)) + (128 - levels)) << 23).view(torch.float32)
        return torch.where(codes >= levels, -power, power) * scale

    def encode_flagged(self, x: torch.Tensor) -> Tuple[Encoded, torch.Tensor]:
        self._check_input(x)
        rows = self._rows(x)
        mag = rows.abs()
        positions, values = self._select(rows, mag)
        scales = mag.amax(dim=1)  # amax propagates NaN: the finiteness flag
        codes = self._codes(values, scales[:, None])
        payload = torch.cat((_pack_bits(positions, self.index_bits).flatten(),
                             _pack_bits(codes, self.value_bits).flatten()))
        return Encoded(payload, scales, x.numel()), torch.isfinite(scales).all()

    def unpack(self, e: Encoded) -> Tuple[torch.Tensor, torch.Tensor]:
        """(positions (chunks, k) int64, fp32 values (chunks, k)) of an encoding."""
        chunks = _ceil_div(e.numel, self.chunk)
        if e.payload.numel() != chunks * (self.index_bytes + self.value_bytes) or \
                e.scales is None or e.scales.numel() != chunks:
            raise ValueError(f"sparse codec: payload of {e.payload.numel()} bytes does not "
                             f"hold {e.numel} elements at chunk {self.chunk}, k {self.k}, "
                             f"value_bits {self.value_bits}")
        split = chunks * self.index_bytes
        positions = _unpack_bits(e.payload[:split].view(chunks, self.index_bytes), self.k,
                                 self.index_bits)
        codes = _unpack_bits(e.payload[split:].view(chunks, self.value_bytes), self.k,
                             self.value_bits)
        return positions, self._values(codes, e.scales[:, None])

    def decode(self, e: Encoded, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.sum_decoded([e], out)

    def sum_decoded(self, encoded: Sequence[Encoded],
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of the decoded encodings (every worker's payload after the all-gather), in
        their order: each position's sum is ((0 + v_0) + v_1) + ..., the same on every worker.
        Positions within one payload are distinct, so each scatter adds once per element."""
        if not encoded:
            raise ValueError("sparse codec: sum_decoded needs at least one encoding")
        numel = encoded[0].numel
        if any(e.numel != numel for e in encoded):
            raise ValueError(f"sparse codec: encodings of {[e.numel for e in encoded]} "
                             "elements cannot be summed")
        out = self._output(encoded[0], out)
        padded = numel % self.chunk != 0
        chunks = _ceil_div(numel, self.chunk)
        rows = out.new_zeros(chunks, self.chunk) if padded else \
            out.zero_().view(chunks, self.chunk)
        for e in encoded:
            positions, values = self.unpack(e)
            rows.scatter_add_(1, positions, values)
        if padded:
            out.copy_(rows.view(-1)[:numel])
        return out


class SparseErrorFeedback(ErrorFeedback):
    """The per-worker accumulator ``e`` of SparseLoCo: ``e <- decay * e + x``, send the
    codec's top-k of ``e``, keep ``e <- e - decode(sent)``. With decay 1 this is plain error
    feedback. Saved as ``residual``, like ``ErrorFeedback``; a non-finite input leaves it as
    it was (``encode`` raises, ``encode_flagged`` returns the False flag)."""

    def __init__(self, codec: SparseCodec, numel: int, device: torch.device | str,
                 decay: float):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or \
                not 0.0 <= decay <= 1.0:
            raise ValueError(f"SparseErrorFeedback: decay {decay!r} must be in [0, 1]")
        super().__init__(codec, numel, device)
        self.decay = float(decay)

    def encode(self, x: torch.Tensor) -> Encoded:
        encoded, finite = self.encode_flagged(x)
        if not bool(finite):
            raise self.codec._non_finite()
        return encoded

    def encode_flagged(self, x: torch.Tensor) -> Tuple[Encoded, torch.Tensor]:
        self._check(x)
        target = self.residual.mul(self.decay).add_(x)
        encoded, finite = self.codec.encode_flagged(target)
        self.residual = torch.where(finite, target.sub_(self.codec.decode(encoded)),
                                    self.residual)
        return encoded, finite

    def resized(self, padded: int, numel: int) -> "SparseErrorFeedback":
        fresh = SparseErrorFeedback(self.codec, padded, self.residual.device, self.decay)
        fresh.residual[:numel] = self.residual[:numel]
        return fresh

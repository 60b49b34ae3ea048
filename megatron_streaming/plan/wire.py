"""The outer gradients' format on the link, as the planner and the simulator count its bytes.

Two exchanges cross workers (docs/streaming.md):

* dense (``--diloco-quantize fp4-e2m1``, the planner's default, and the other dense codecs):
  a reduce-scatter and an all-gather of codes (``comm.transport``), each rank moving
  ``2 (M-1)/M`` of its shard at ``bits`` per value each way, two collectives;
* sparse (``--diloco-quantize sparse``, SparseLoCo, arXiv 2508.15706): one all-gather of
  every worker's fixed-size top-k payload (``comm.sparse_transport``): each rank sends its
  row to the M-1 others, ``(M-1) x (SparseCodec.wire_bytes(n) + FLAG_BYTES)`` for a shard of
  n elements, one collective. It grows with M-1 where the dense one stays under 2x.

Where the planner sees a fragment, the transport sees lanes: the fragment cut in ``lanes``
nearly equal pieces (``streaming.canonical.lane_bounds``), one shard each; the sparse bytes
are counted per lane (a short last chunk costs a whole one). The codec's formula is used, not
restated: ``SparseCodec.wire_bytes`` (importing it brings torch, so only a sparse wire does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

FP4_BITS = 4 + 32 / 128  # per value on the wire: the code and one fp32 scale per 128
DENSE_COLLECTIVES = 2  # a reduce-scatter and an all-gather
SPARSE_COLLECTIVES = 1  # one all-gather of payloads


@dataclass(frozen=True)
class Wire:
    """One exchange's format: dense at ``bits`` per value, or sparse (``k`` of every
    ``chunk`` elements at ``value_bits``, as ``--diloco-sparse-*`` say)."""

    quantize: str = "fp4-e2m1"
    """The ``--diloco-quantize`` value the plan's flags carry."""
    bits: float = FP4_BITS
    """Dense: bits per value, scales included."""
    chunk: int = 4096
    """Sparse: elements per chunk (``--diloco-sparse-chunk``)."""
    k: int = 64
    """Sparse: entries sent per chunk (``--diloco-sparse-k``)."""
    value_bits: int = 2
    """Sparse: bits per value sent (``--diloco-sparse-value-bits``)."""

    @property
    def sparse(self) -> bool:
        return self.quantize == "sparse"

    @property
    def collectives(self) -> int:
        """Collectives per exchange, each a round trip on the link."""
        return SPARSE_COLLECTIVES if self.sparse else DENSE_COLLECTIVES

    @classmethod
    def from_streaming(cls, s) -> "Wire":
        """The wire a run's ``StreamingConfig`` asks for: sparse with its ``--diloco-sparse-*``
        values, else the dense FP4 the planner chooses (``rule.advise``)."""
        if s.diloco_quantize == "sparse":
            return cls("sparse", chunk=s.diloco_sparse_chunk, k=s.diloco_sparse_k,
                       value_bits=s.diloco_sparse_value_bits)
        return cls()

    def codec(self):
        """The ``SparseCodec`` whose bytes a sparse wire counts."""
        from ..comm.sparse import SparseCodec

        return SparseCodec(chunk=self.chunk, k=self.k, value_bits=self.value_bits)

    def bytes_sent(self, values: float, workers: int, lanes: int = 1) -> float:
        """Bytes one worker sends (and receives) in one exchange of ``values`` elements over
        ``lanes`` lanes (module docstring). Nothing with one worker."""
        if workers < 2:
            return 0.0
        if not self.sparse:
            return values * self.bits * (2 * (workers - 1) / workers) / 8
        from ..comm.sparse_transport import FLAG_BYTES

        codec, n = self.codec(), math.ceil(values)
        bounds = [lane * n // lanes for lane in range(lanes + 1)]
        per_peer = sum(codec.wire_bytes(b - a) + FLAG_BYTES for a, b in zip(bounds, bounds[1:]))
        return float((workers - 1) * per_peer)

    def fewer_than_data_parallel(self, inner_steps: int, values: float, workers: int,
                                 lanes: int = 1) -> float:
        """How many times fewer bytes than data parallel's bf16 gradients all-reduced every
        step (ring: ``2 (M-1)/M`` of them) over H steps."""
        if not self.sparse:
            return inner_steps * 16 / self.bits
        data_parallel = values * 16 * (2 * (workers - 1) / workers) / 8
        return inner_steps * data_parallel / self.bytes_sent(values, workers, lanes)

    def describe(self) -> str:
        if not self.sparse:
            return f"--diloco-quantize {self.quantize} ({self.bits:g} bits a value)"
        return (f"--diloco-quantize sparse ({self.k} of every {self.chunk} elements at "
                f"{self.value_bits} bits, positions at {(self.chunk - 1).bit_length()} bits, "
                "one fp32 scale a chunk; one all-gather)")


DENSE_FP4 = Wire()


def as_wire(bits: Union[float, Wire]) -> Wire:
    """``bits`` as a ``Wire``: a dense one at that many bits per value, or itself."""
    return bits if isinstance(bits, Wire) else Wire("dense", bits=float(bits))


__all__ = ["DENSE_FP4", "FP4_BITS", "Wire", "as_wire"]

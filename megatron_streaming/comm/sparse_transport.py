"""The sparse exchange: one all-gather of every worker's top-k payload, summed by each worker.

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, arXiv 2508.15706) sends, per chunk of a
worker's error-feedback accumulator, only the k entries of largest magnitude at 2 bits
(``comm.sparse``). Each worker's top-k set differs, so the dense path's reduce-scatter of
codes (``transport``) does not apply; a fixed k per chunk makes every payload the same size,
so one all-gather moves them all, and every worker decodes and sums them itself.

Data flow of one fragment on one rank (its shards of several param groups, one exchange):

    shard x -> SparseErrorFeedback.encode_flagged  (e <- decay e + x; send top-k of e;
               e <- e - decode(sent))
      -> one byte row: every shard's int32 finiteness flag, then every shard's per-chunk fp32
         scales, then every shard's packed positions and values (``wire.pack``)
      -> all-gather of the rows (one collective; over gloo chunked point-to-point, ``wire``)
      -> per shard, every worker's payload decoded and summed in worker order
         (``SparseCodec.sum_decoded``), divided by M: the fp32 mean, the same bits on every
         worker, on the codec's device

Bytes, per shard of n elements, chunk C, k entries per chunk, b value bits, M workers: a rank
sends its row to M-1 peers and receives theirs, so sent = received =

    (M-1) x (ceil(n/C) x (ceil(k ceil(log2 C) / 8) + ceil(k b / 8) + 4) + 4)

(4 per chunk: its fp32 scale; the last 4: the shard's int32 finiteness flag). At C = 4,096,
k = 64, b = 2 a chunk costs 96 + 16 + 4 = 116 bytes, 0.23 bits per element per peer. Unlike
the dense path's ``2 (M-1)/M`` the traffic per rank grows with M-1: every row goes to every
peer.

Choices, and why:

* Error feedback is required (``feedbacks``: one ``SparseErrorFeedback`` per shard, of this
  transport's format). The plain codec would drop the 98 % of each chunk it does not send,
  round after round; the accumulator is what keeps them (and stands in for outer momentum).
* No padding (``padded_numel(n) == n``). The codec pads a short last chunk itself and drops
  what it picks there on decode. Padding the shard to whole chunks instead would make the
  padding part of the accumulator: where the last chunk holds fewer than k elements, zeros of
  the padding are picked, sent as +s/2 (the format has no zero), and the accumulator keeps
  -s/2 there, which then competes for the chunk's k places round after round.
* One worker: the sparsified value, ``decode(top-k(e))`` through the accumulator, with no
  wire and no bytes. Sparsification with error feedback is part of the optimizer, not only of
  the wire; returning the outer gradient itself would leave the accumulator unused and make
  M = 1 another algorithm.
* A shard any worker flagged non-finite (or whose mean overflows) is skipped everywhere, as in
  the dense path, and every worker's accumulator of that shard is left as it was before the
  exchange (the dense path keeps only the non-finite worker's): a round nobody applies did
  not happen, so accumulators of finite workers do not lose the top-k entries they sent.
* ``quant_error``: ``||decode(sent) - x|| / ||x||`` of this rank's own send against its input
  x, as the dense path measures its own (with error feedback, against the input too). Here it
  includes the sparsification (close to 1 at 1-3 % density in a single round): what this
  round applies of this worker's outer gradient, before error feedback returns the rest.

Nothing is read on the host during the exchange: flags and errors stay tensors on the codec's
device until the result is waited for (``ExchangeResult.on_host``), as in the dense path.
Threads, streams and the caller's-thread launch for NCCL are ``Transport``'s.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .codec import Encoded, ErrorFeedback
from .sparse import SparseCodec, SparseErrorFeedback
from .transport import ExchangeResult, Transport, _all_finite, _relative_error
from .wire import all_gather, pack, unpack

FLAG_BYTES = 4  # one int32 finiteness flag per shard


class SparseTransport(Transport):
    """``Transport`` whose exchange is SparseLoCo's: top-k payloads, one all-gather, a local
    sum (module docstring). Same constructor and results; ``codec`` must be a
    ``SparseCodec``."""

    def __init__(self, group, group_ranks: List[int], rank: int, codec: SparseCodec,
                 timeout: float, wire_device: str = "cpu", use_cuda_stream: bool = False,
                 codec_device: Optional[str] = None, from_caller: Optional[bool] = None):
        if not isinstance(codec, SparseCodec):  # before the exchange's thread starts
            raise ValueError(f"SparseTransport needs a SparseCodec, got the "
                             f"{getattr(codec, 'name', type(codec).__name__)!r} codec")
        super().__init__(group, group_ranks, rank, codec, timeout, wire_device,
                         use_cuda_stream, codec_device, from_caller)

    def padded_numel(self, numel: int) -> int:
        """No padding: the codec handles a short last chunk (module docstring, "Choices")."""
        return numel

    def all_reduce_mean_many(self, xs: List[torch.Tensor], step: int, tags: List[str],
                             feedbacks: List[Optional[ErrorFeedback]],
                             numels: Optional[List[int]] = None):
        """``Transport.all_reduce_mean_many``, one collective whatever the number of shards;
        each shard needs its ``SparseErrorFeedback`` (checked here, before anything is
        sent, so a wrong call fails on the caller's thread)."""
        if not len(xs) == len(tags) == len(feedbacks) or \
                (numels is not None and len(numels) != len(xs)):
            raise ValueError(f"sparse exchange: {len(xs)} shards, {len(tags)} tags, "
                             f"{len(feedbacks)} feedbacks"
                             + ("" if numels is None else f", {len(numels)} numels"))
        for i, (x, tag, feedback) in enumerate(zip(xs, tags, feedbacks)):
            self._check_feedback(feedback, x.numel() if numels is None else numels[i], tag)
        return super().all_reduce_mean_many(xs, step, tags, feedbacks, numels)

    def _check_feedback(self, feedback, numel: int, tag: str) -> None:
        codec = self.codec
        if not isinstance(feedback, SparseErrorFeedback):
            raise ValueError(
                f"sparse exchange of {tag}: needs a SparseErrorFeedback (the accumulator of "
                f"SparseLoCo, which keeps what is not sent), got {type(feedback).__name__}")
        theirs = (feedback.codec.chunk, feedback.codec.k, feedback.codec.value_bits)
        if not isinstance(feedback.codec, SparseCodec) or \
                theirs != (codec.chunk, codec.k, codec.value_bits):
            raise ValueError(f"sparse exchange of {tag}: the feedback encodes chunk, k, "
                             f"value_bits {theirs}, the transport decodes "
                             f"{(codec.chunk, codec.k, codec.value_bits)}")
        if feedback.residual.numel() != numel:
            raise ValueError(f"sparse exchange of {tag}: a shard of {numel} elements needs an "
                             f"accumulator of {numel}, got {feedback.residual.numel()}")

    # ---- the exchange ---------------------------------------------------------------------
    def _exchange_on_current_stream(self, xs, numels, feedbacks) -> List[ExchangeResult]:
        """``xs``: shards of ``numels`` elements (no padding). Nothing is read on the host."""
        # ``encode_flagged`` replaces an accumulator with a new tensor and never writes the
        # old one, kept here to restore a skipped shard's (tested).
        before = [feedback.residual for feedback in feedbacks]
        try:
            return self._sparse_exchange(xs, feedbacks, before)
        except BaseException:
            # An exchange that fails here (its group let go, a peer gone) is applied by
            # nobody on this rank: its accumulators go back to before it, as a skipped
            # shard's do. (Over NCCL a failure found only when waited for is not undone.)
            for feedback, old in zip(feedbacks, before):
                feedback.residual = old
            raise

    def _sparse_exchange(self, xs, feedbacks, before) -> List[ExchangeResult]:
        """Encode every shard, gather every worker's row, sum the decodes in worker order;
        a shard skipped anywhere gets its accumulator from ``before`` back."""
        M = self.workers
        sent, flags = [], []
        for x, feedback in zip(xs, feedbacks):
            encoded, encodable = feedback.encode_flagged(x)
            # A non-finite shard travels as zeros (positions 0, scales 0: it decodes to 0);
            # its flag tells every worker to skip it.
            ok = _all_finite(x) & encodable
            encoded.scales.masked_fill_(~ok, 0)
            encoded.payload.masked_fill_(~ok, 0)
            sent.append(encoded)
            flags.append(ok)
        if M == 1:  # nothing crosses a wire: the mean is this worker's sparsified send
            flags_of = [torch.stack(flags).to(torch.int32)]
            received, sizes = [sent], [0] * len(sent)
        else:
            flags_of, received, sizes = self._all_gather(flags, sent)
        with self._lock:
            self.bytes_sent += sum(sizes)
            self.bytes_received += sum(sizes)
        everywhere = torch.stack(flags_of).min(dim=0).values > 0  # per shard, over workers
        results = []
        for i, (x, feedback, own, ok) in enumerate(zip(xs, feedbacks, sent, flags)):
            # Fixed worker order: every worker adds the same values in the same order.
            mean = self.codec.sum_decoded([received[w][i] for w in range(M)]).div_(M)
            all_finite = everywhere[i] & _all_finite(mean)
            feedback.residual = torch.where(all_finite, feedback.residual, before[i])
            quant_error = torch.where(ok, _relative_error(self.codec.decode(own), x), 0.0)
            results.append(ExchangeResult(mean, all_finite, sizes[i], sizes[i], quant_error,
                                          0.0))
        return results

    def _all_gather(self, flags: List[torch.Tensor], sent: List[Encoded]):
        """The one collective (it replaces the dense path's two: ``tests/seams.py`` counts it
        under this name): every worker's row of flags, scales and payloads to every worker.
        Returns per worker its flags (int32, one per shard) and its ``Encoded`` per shard, in
        worker order, on the codec's device; and the bytes each way per shard."""
        M, shards = self.workers, len(sent)
        # Flags, then scales, then payloads: the int32 and fp32 parts start aligned, so
        # ``unpack`` hands out views without copies.
        layout = [torch.stack(flags).to(torch.int32).view(1, -1)]
        layout += [e.scales.view(1, -1) for e in sent]
        layout += [e.payload.view(1, -1) for e in sent]
        row = pack(layout).view(-1)
        rows = [r.to(row.device, non_blocking=True)
                for r in all_gather(self._to_wire(row), self.post, M)]
        flags_of, received = [], []
        for r in rows:
            parts = unpack(r, layout)
            flags_of.append(parts[0])
            received.append([Encoded(payload, scales, e.numel) for e, scales, payload
                             in zip(sent, parts[1:1 + shards], parts[1 + shards:])])
        return flags_of, received, [(FLAG_BYTES + e.nbytes()) * (M - 1) for e in sent]

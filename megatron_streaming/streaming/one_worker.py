"""The exchange of a job of one worker: the mean over one worker is its own outer gradient.

Where it sits: the sync hands each fragment's outer gradient to its transport (``sync``);
with ``--diloco-workers 1`` (``settings.enabled``: the outer loop asked for) that transport is
this one. Nothing crosses a wire and nothing is counted. Without ``--diloco-quantize`` (the
parser resolves it to ``none`` for one worker: the default FP4 is for the wire) the mean is
the outer gradient itself, bit for bit. With it, the outer gradient goes through the codec as
it would on its way to the wire, ``decode(encode(x))`` (through the error-feedback residual
with ``--diloco-error-feedback``), so that a one-worker run measures what the codec costs in
loss with nothing else changed. Several workers quantize twice (the send and the mean);
a second pass over values already on the codec's grid changes little, so one stands for both.

It runs where the multi-worker exchange runs (the transport's thread, off the training
thread), so ``--diloco-overlap-steps`` and the checkpoint of an exchange in flight behave as
with several workers.
"""

from __future__ import annotations

from typing import List

import torch

from ..comm.codec import Codec
from ..comm.transport import ExchangeResult, Transport


class OneWorkerExchange(Transport):
    """``Transport`` over no group: this rank is the only member of its exchanges."""

    def __init__(self, rank: int, codec: Codec, timeout: float, codec_device=None):
        super().__init__(None, [rank], rank, codec, timeout, codec_device=codec_device)

    def _exchange_on_current_stream(self, xs, numels, feedbacks) -> List[ExchangeResult]:
        out = []
        for x, n, feedback in zip(xs, numels, feedbacks):
            finite = torch.isfinite(x.sum())  # a 0-dim tensor: read once the exchange is done
            if self.codec.name == "none":
                out.append(ExchangeResult(x[:n], finite, 0, 0, 0.0, 0.0))
                continue
            encoded, encodable = feedback.encode_flagged(x) if feedback is not None \
                else self.codec.encode_flagged(x)
            mean = self.codec.decode(encoded)
            norm = x.norm()
            error = torch.where(norm > 0, (mean - x).norm() / norm, 0.0)
            out.append(ExchangeResult(mean[:n], finite & encodable, 0, 0,
                                      torch.where(finite, error, 0.0), 0.0))
        return out

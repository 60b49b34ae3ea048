"""The one door through which bytes cross workers.

Data flow: the sync module hands over one rank's shard of an outer gradient; this module
quantizes it, runs a quantized reduce-scatter (an all-to-all of codes, decoded and summed in
fp32) and a quantized all-gather of the averaged chunks over the rank's cross-worker group,
and hands back the fp32 mean. Each rank moves about ``2 (M-1)/M x n x bits`` and every byte
it puts on the wire is counted here.

The exchange runs asynchronously: on a background thread for gloo (collectives on the
cross-worker group are issued only from that thread, one at a time, in submission order, so
all workers pair their collectives up identically), and additionally on a side CUDA stream
for NCCL, so the inner steps in between really overlap it. ``Pending.wait`` fails with a
message naming the step, the fragment and the peer group when the peers do not answer in time.

This is also the seam for tests and for slow-link emulation.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from ..errors import JobFailure
from .codec import Codec, Encoded, ErrorFeedback, is_finite


class SyncTimeout(JobFailure):
    """A cross-worker exchange did not complete in time."""


@dataclass
class ExchangeResult:
    mean: torch.Tensor       # fp32, the mean over workers of their (quantized) outer gradients
    all_finite: bool         # False if any worker's outer gradient had an inf or NaN
    bytes_sent: int
    bytes_received: int
    quant_error: float       # ||decode(encode(x)) - x|| / ||x|| of this rank's own send
    seconds: float           # wall time of the exchange itself


@dataclass
class Pending:
    """An exchange in flight (or already completed, e.g. restored from a checkpoint)."""

    future: concurrent.futures.Future
    step: int
    tag: str
    group_ranks: List[int]
    timeout: float
    started: float = field(default_factory=time.perf_counter)

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> ExchangeResult:
        try:
            return self.future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise SyncTimeout(
                f"cross-worker exchange of {self.tag} sent after step {self.step} got no answer "
                f"within --diloco-timeout {self.timeout:g} s from peer group (global ranks) "
                f"{self.group_ranks}") from None
        except Exception as e:  # the collective itself failed (e.g. gloo's own timeout)
            raise SyncTimeout(
                f"cross-worker exchange of {self.tag} sent after step {self.step} failed in "
                f"peer group (global ranks) {self.group_ranks}: {e}") from e

    @classmethod
    def completed(cls, result: ExchangeResult, step: int, tag: str) -> "Pending":
        future = concurrent.futures.Future()
        future.set_result(result)
        return cls(future, step, tag, [], 0.0)


class Transport:
    """Quantized, asynchronous all-reduce-mean over one cross-worker group."""

    def __init__(self, group, group_ranks: List[int], rank: int, codec: Codec,
                 timeout: float, wire_device: str = "cpu", use_cuda_stream: bool = False):
        self.group, self.group_ranks = group, list(group_ranks)
        self.workers = len(group_ranks)
        self.index = self.group_ranks.index(rank)
        self.codec, self.timeout = codec, timeout
        self.wire_device = torch.device(wire_device)  # gloo moves CPU tensors, NCCL CUDA ones
        self.bytes_sent = 0
        self.bytes_received = 0
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cross-worker")
        self._stream = torch.cuda.Stream() if use_cuda_stream else None
        # Test seam: while this event is clear, exchanges wait before touching the wire (a
        # link that has not delivered yet), which shows the caller is not blocked meanwhile.
        self.gate: Optional[threading.Event] = None

    def padded_numel(self, numel: int) -> int:
        """Shards are padded so that each worker's chunk is a whole number of blocks."""
        multiple = self.workers * self.codec.block
        return -(-numel // multiple) * multiple

    def all_reduce_mean(self, x: torch.Tensor, step: int, tag: str,
                        feedback: Optional[ErrorFeedback] = None) -> Pending:
        """Start averaging ``x`` (flat fp32) over the workers; returns at once."""
        # A copy: the caller keeps training on the original while this one travels.
        x = x.detach().to(self.wire_device, copy=True)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
        future = self._executor.submit(self._exchange, x, feedback)
        return Pending(future, step, tag, self.group_ranks, self.timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    # ---- the exchange, on the background thread ----------------------------------------
    def _exchange(self, x: torch.Tensor, feedback: Optional[ErrorFeedback]) -> ExchangeResult:
        if self._stream is None:
            return self._exchange_on_current_stream(x, feedback)
        with torch.cuda.stream(self._stream):
            result = self._exchange_on_current_stream(x, feedback)
            self._stream.synchronize()
            return result

    def _exchange_on_current_stream(self, x, feedback) -> ExchangeResult:
        started = time.perf_counter()
        if self.gate is not None:
            self.gate.wait()
        finite = is_finite(x)
        if self.workers == 1:  # nothing crosses a wire: the mean is the value itself
            return ExchangeResult(x, finite, 0, 0, 0.0, time.perf_counter() - started)
        n = x.numel()
        padded = torch.zeros(self.padded_numel(n), dtype=torch.float32, device=x.device)
        # A non-finite gradient is replaced by zeros on the wire; the flag tells every worker
        # to skip this fragment's outer step, so it never reaches the global parameters.
        if finite:
            padded[:n] = x
        encoded = feedback.encode(padded) if (feedback is not None and finite) else \
            self.codec.encode(padded)
        quant_error = _relative_error(self.codec.decode(encoded)[:n], padded[:n])
        sent = received = 0
        all_finite, b = self._all_finite(finite)
        sent, received = sent + b, received + b
        chunk_mean, b_s, b_r = self._reduce_scatter(encoded, padded.numel())
        sent, received = sent + b_s, received + b_r
        mean, b_s, b_r = self._all_gather(self.codec.encode(chunk_mean))
        sent, received = sent + b_s, received + b_r
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received
        return ExchangeResult(mean[:n], all_finite, sent, received, quant_error,
                              time.perf_counter() - started)

    def _all_finite(self, finite: bool):
        flag = torch.tensor([1 if finite else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item()), 4 * (self.workers - 1)

    def _reduce_scatter(self, encoded: Encoded, numel: int):
        """All-to-all of codes: worker j receives every worker's j-th chunk, sums in fp32."""
        M = self.workers
        chunk = numel // M
        parts = [encoded.payload.view(M, -1)]
        if encoded.scales is not None:
            parts.append(encoded.scales.view(M, -1))
        received = [_all_to_all(p.contiguous(), self.group) for p in parts]
        def chunk_of(w):
            return Encoded(received[0][w], received[1][w] if len(received) > 1 else None, chunk)

        total = self.codec.decode(chunk_of(0))
        part = torch.empty_like(total)
        for w in range(1, M):  # fixed order: the sum is the same on every run
            total += self.codec.decode(chunk_of(w), out=part)
        per_chunk = encoded.nbytes() // M
        return total / M, per_chunk * (M - 1), per_chunk * (M - 1)

    def _all_gather(self, encoded: Encoded):
        """Every worker's averaged chunk to every worker; decoded and concatenated."""
        M = self.workers
        payloads = _all_gather(encoded.payload, self.group, M)
        scales = _all_gather(encoded.scales, self.group, M) if encoded.scales is not None \
            else [None] * M
        n = encoded.numel
        mean = torch.empty(M * n, dtype=torch.float32, device=encoded.payload.device)
        for w in range(M):
            self.codec.decode(Encoded(payloads[w], scales[w], n), out=mean[w * n:(w + 1) * n])
        size = encoded.nbytes()
        return mean, size * (M - 1), size * (M - 1)


def _all_to_all(t: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group)
    return out


def _all_gather(t: torch.Tensor, group, parts: int) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(parts)]
    dist.all_gather(out, t, group=group)
    return out


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    norm = exact.norm().item()
    return (approx - exact).norm().item() / norm if norm > 0 else 0.0

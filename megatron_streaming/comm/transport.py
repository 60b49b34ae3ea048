"""The one door through which bytes cross workers.

Data flow: the sync module hands over one rank's shard of an outer gradient; this module
quantizes it, runs a quantized reduce-scatter (an all-to-all of codes, decoded and summed in
fp32) and a quantized all-gather of the averaged chunks over the rank's cross-worker group,
and hands back the fp32 mean. Two collectives per exchange, whatever the link's round trip
costs: the finiteness flag, the scales and the codes travel packed in one byte row per peer
(over gloo as chunked point-to-point messages, all in flight at once: ``wire.swap``).
Each rank moves about ``2 (M-1)/M x n x bits`` and every byte it puts on the wire is counted
here.

The exchange runs asynchronously. Over gloo its collectives are issued from a background
thread (one at a time, in submission order, so all workers pair their collectives up
identically), and additionally on a side CUDA stream where it touches the GPU (the codec on a
GPU job: then only the packed codes cross to host memory), so the inner steps in between
really overlap it. Over NCCL they are issued from the caller's thread (the training loop's,
at the step that sends the fragment), on the side stream: the GPU runs them while the next
steps train, and the host reads nothing until the result is waited for. NCCL can deadlock
when operations of two communicators of one device (the worker's and the cross-worker one)
are launched in different orders on different ranks, and it is not safe to launch them from
several threads at once (NCCL user guide, "Using multiple NCCL communicators concurrently"
and "Thread Safety"); from the one thread that launches the worker's collectives, every rank
launches both in its program's order, which NCCL then follows on the device
(``NCCL_LAUNCH_ORDER_IMPLICIT``, ``parallel.distributed.order_nccl_launches``).

``Pending.wait`` fails with a message naming the step, the fragment and the peer group when
the peers do not answer in time. Over NCCL that time counts from the launch, as NCCL's own
watchdog counts it, and a watcher thread says so at that moment even when nobody waits: the
NCCL group's own timeout is longer (``parallel.topology.cross_worker_group_timeout``), so
this message comes before NCCL's watchdog ends the process.

Tests and slow-link emulation subclass it (``tests/``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..errors import JobFailure
from .serial import SerialThread
from .codec import Codec, Encoded, ErrorFeedback
# GroupReleased: what an exchange fails with once its group was let go (raised by ``wire``)
from .wire import GroupReleased, Poster, all_gather, all_to_all, pack, unpack  # noqa: F401

log = logging.getLogger("megatron_streaming")

# How often the watcher of an exchange launched from the caller's thread asks the GPU whether
# it is done (a CUDA event's query: no NCCL call, no wait).
POLL_SECONDS = 0.01


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

    def on_host(self, seconds: float) -> "ExchangeResult":
        """The result as the caller reads it: the flag and the error, which the exchange keeps
        as tensors on its device until it is done, as Python values."""
        return dataclasses.replace(self, all_finite=bool(self.all_finite),
                                   quant_error=float(self.quant_error), seconds=seconds)


@dataclass
class Pending:
    """An exchange in flight (or already completed, e.g. restored from a checkpoint)."""

    future: concurrent.futures.Future
    step: int
    tag: str
    group_ranks: List[int]
    timeout: float
    started: float = field(default_factory=time.perf_counter)
    # The timeout counts from ``started`` (the launch: NCCL's watchdog counts from there),
    # else from the call to ``wait``.
    from_launch: bool = False

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> ExchangeResult:
        timeout = self.timeout
        if self.from_launch:
            timeout = max(0.0, self.started + self.timeout - time.perf_counter())
        try:
            result = self.future.result(timeout=timeout)
            if result.mean.is_cuda:  # made on the side stream, now read on this one: the
                # allocator must not hand its memory to the next exchange before that
                result.mean.record_stream(torch.cuda.current_stream())
            return result
        except concurrent.futures.TimeoutError:
            raise SyncTimeout(self.timeout_message()) from None
        except SyncTimeout:  # the watcher's (``Transport._settle``)
            raise
        except Exception as e:  # the collective itself failed (e.g. gloo's own timeout)
            raise SyncTimeout(
                f"cross-worker exchange of {self.tag} sent after step {self.step} failed in "
                f"peer group (global ranks) {self.group_ranks}: {e}") from e

    def timeout_message(self) -> str:
        return (f"cross-worker exchange of {self.tag} sent after step {self.step} got no "
                f"answer within --diloco-timeout {self.timeout:g} s from peer group (global "
                f"ranks) {self.group_ranks}")

    @classmethod
    def completed(cls, result: ExchangeResult, step: int, tag: str) -> "Pending":
        future = concurrent.futures.Future()
        future.set_result(result)
        return cls(future, step, tag, [], 0.0)


class Transport:
    """Quantized, asynchronous all-reduce-mean over one cross-worker group."""

    def __init__(self, group, group_ranks: List[int], rank: int, codec: Codec,
                 timeout: float, wire_device: str = "cpu", use_cuda_stream: bool = False,
                 codec_device: Optional[str] = None, from_caller: Optional[bool] = None):
        self.post = Poster(group)  # every collective on the group goes through it
        self.group_ranks = list(group_ranks)
        self.workers = len(group_ranks)
        self.index = self.group_ranks.index(rank)
        self.codec, self.timeout = codec, timeout
        self.wire_device = torch.device(wire_device)  # gloo moves CPU tensors, NCCL CUDA ones
        # Where the codec runs (default: the wire's). On a GPU job with gloo across workers,
        # the GPU: the packed codes cross to the host, 8x fewer bytes than the fp32 outer
        # gradient, and the GPU codes a fragment in well under a millisecond where one CPU
        # thread takes tens (docs/RESULTS.md, "On a GPU").
        self.codec_device = torch.device(codec_device) if codec_device is not None \
            else self.wire_device
        use_cuda_stream = use_cuda_stream or self.codec_device.type == "cuda"
        # The GPU this rank's exchange touches (None: none). A new thread starts on device 0:
        # entering a stream there would create a CUDA context on GPU 0 in every process of
        # the node (hundreds of MB each; an error in exclusive-process mode), so the
        # exchange's thread sets this device before anything else.
        self.cuda_device = _cuda_device(self.codec_device, self.wire_device) \
            if use_cuda_stream else None
        # Whose thread issues the collectives: the caller's for NCCL (default: a wire on the
        # GPU), which orders them with the worker's own NCCL collectives (module docstring);
        # else the exchange's thread. That thread then only watches the GPU finish them.
        self.from_caller = self.wire_device.type == "cuda" if from_caller is None \
            else from_caller
        self.bytes_sent = 0
        self.bytes_received = 0
        self._lock = threading.Lock()
        self._executor = SerialThread("cross-worker", initializer=self._set_device)
        self._stream = torch.cuda.Stream(self.cuda_device) if use_cuda_stream else None

    def padded_numel(self, numel: int) -> int:
        """Shards are padded so that each worker's chunk is a whole number of blocks."""
        multiple = self.workers * self.codec.block
        return -(-numel // multiple) * multiple

    def buffer(self, numel: int, device) -> torch.Tensor:
        """A zeroed fp32 buffer of ``padded_numel(numel)`` elements on ``device`` (the codec's),
        to hand a shard over without a copy: write it into the first ``numel`` elements and
        pass the buffer with ``numels`` to ``all_reduce_mean_many``."""
        return torch.zeros(self.padded_numel(numel), dtype=torch.float32, device=device)

    def all_reduce_mean_many(self, xs: List[torch.Tensor], step: int, tags: List[str],
                             feedbacks: List[Optional[ErrorFeedback]],
                             numels: Optional[List[int]] = None) -> List[Pending]:
        """Start averaging several flat fp32 tensors (a fragment's shards on this rank) in one
        exchange: two collectives whatever their number. One ``Pending`` per tensor.

        Without ``numels`` the caller keeps its tensors (and may train on): a padded copy of
        each travels. With ``numels`` the caller hands over buffers from ``buffer`` holding a
        shard of that many elements each, and reads them, never writes them, from now on:
        they travel as they are, with no copy."""
        if numels is None:
            numels = [x.numel() for x in xs]
            xs = [self._padded_copy(x) for x in xs]
        else:
            for x, n in zip(xs, numels):
                if x.numel() != self.padded_numel(n) or x.device != self.codec_device:
                    raise ValueError(f"a handed-over shard of {n} elements needs a buffer of "
                                     f"{self.padded_numel(n)} on {self.codec_device}, got "
                                     f"{x.numel()} on {x.device} (Transport.buffer)")
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
        futures = [concurrent.futures.Future() for _ in xs]
        pendings = [Pending(f, step, tag, self.group_ranks, self.timeout,
                            from_launch=self.from_caller) for f, tag in zip(futures, tags)]
        if self.from_caller:
            self._launch(xs, numels, feedbacks, futures, pendings[0])
        else:
            self._executor.submit(self._exchange, xs, numels, feedbacks, futures)
        return pendings

    def _padded_copy(self, x: torch.Tensor) -> torch.Tensor:
        padded = self.buffer(x.numel(), self.codec_device)
        padded[:x.numel()].copy_(x.detach().view(-1))
        return padded

    def close(self) -> None:
        """Wait for the exchanges submitted so far (their peers run them too), then stop."""
        self._executor.shutdown()

    def abandon(self) -> None:
        """Stop without waiting and let go of the group (a membership change: call it before
        the group is aborted; what still runs on it fails at once, and nobody waits for
        it)."""
        self.post.release()
        self._executor.shutdown(wait=False)

    # ---- the exchange ---------------------------------------------------------------------
    def _set_device(self) -> None:
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else \
            contextlib.nullcontext()

    def _exchange(self, xs, numels, feedbacks, futures) -> None:
        """One exchange, on the exchange's thread, waited for there."""
        started = time.perf_counter()
        try:
            try:
                with self._on_stream():
                    flagged = self._exchange_on_current_stream(xs, numels, feedbacks)
            finally:
                if self._stream is not None:
                    # Also when it failed: ``xs`` were made on the training stream and are
                    # freed with this frame; the allocator may hand their memory back to
                    # that stream only once this one has stopped reading them.
                    self._stream.synchronize()
            results = [r.on_host(time.perf_counter() - started) for r in flagged]
        except BaseException as e:  # every waiter hears of it
            for f in futures:
                f.set_exception(e)
            return
        for f, r in zip(futures, results):
            f.set_result(r)

    def _launch(self, xs, numels, feedbacks, futures, pending: Pending) -> None:
        """One exchange issued from the caller's thread, on the side stream; nothing is read
        on the host. The exchange's thread then watches the GPU finish it (``_settle``)."""
        try:
            with self._on_stream():
                flagged = self._exchange_on_current_stream(xs, numels, feedbacks)
                done = None
                if self._stream is not None:
                    for x in xs:  # made on the training stream, freed by the caller while
                        x.record_stream(self._stream)  # this stream may still read them
                    done = torch.cuda.Event()
                    done.record(self._stream)
        except BaseException as e:  # every waiter hears of it
            for f in futures:
                f.set_exception(e)
            return
        self._executor.submit(self._settle, done, flagged, futures, pending)

    def _settle(self, done, flagged, futures, pending: Pending) -> None:
        """On the exchange's thread: wait for ``done`` (None: done already) until the
        exchange's deadline from its launch, then hand over its results, or say that its
        peers did not answer (now, whether or not anyone waits: NCCL's watchdog ends the
        process a little later)."""
        while done is not None and not done.query():
            if time.perf_counter() >= pending.started + pending.timeout:
                error = SyncTimeout(pending.timeout_message())
                log.error("%s", error)
                for f in futures:
                    f.set_exception(error)
                return
            time.sleep(POLL_SECONDS)
        try:
            results = [r.on_host(time.perf_counter() - pending.started) for r in flagged]
        except BaseException as e:
            for f in futures:
                f.set_exception(e)
            return
        for f, r in zip(futures, results):
            f.set_result(r)

    def _exchange_on_current_stream(self, xs, numels, feedbacks) -> List[ExchangeResult]:
        """``xs``: padded shards (``buffer``), ``numels`` of their elements each. Nothing is
        read on the host here: the results' finiteness flags and quantization errors are
        tensors on the codec's device (``ExchangeResult.on_host``)."""
        finite = [_all_finite(x) for x in xs]
        if self.workers == 1:  # nothing crosses a wire: the mean is the value itself
            return [ExchangeResult(x[:n], f, 0, 0, 0.0, 0.0)
                    for x, n, f in zip(xs, numels, finite)]
        shards, sent_finite = [], []
        for padded, ok, feedback in zip(xs, finite, feedbacks):
            encoded, encodable = feedback.encode_flagged(padded) if feedback is not None \
                else self.codec.encode_flagged(padded)
            # A non-finite gradient (or one the format cannot hold) travels as zeros; its
            # flag tells every worker to skip this shard's outer step, so it never reaches
            # the global parameters. (The caller's buffer is read, never written; the
            # residual of error feedback stays as it was.)
            ok = ok & encodable
            (encoded.scales if encoded.scales is not None else encoded.payload) \
                .masked_fill_(~ok, 0)
            shards.append((padded, encoded))
            sent_finite.append(ok)
        reduced, b1 = self._reduce_scatter(sent_finite, shards)
        means, b2 = self._all_gather([self.codec.encode_flagged(chunk_mean)[0]
                                      for _, chunk_mean, _ in reduced])
        with self._lock:
            self.bytes_sent += sum(b1) + sum(b2)
            self.bytes_received += sum(b1) + sum(b2)
        # A mean the format could not hold (a sum beyond its range) is skipped everywhere
        # too: every worker decodes the same bytes into it.
        return [ExchangeResult(mean[:n], all_finite & _all_finite(mean), s1 + s2,
                               s1 + s2, quant_error, 0.0)
                for n, mean, (all_finite, _, quant_error), s1, s2
                in zip(numels, means, reduced, b1, b2)]

    def _to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the wire's device. From a GPU to gloo's host memory through a pinned
        buffer (a pageable copy would stage through a driver buffer at a fraction of the
        rate), complete before the wire reads it; what comes back lands in pinned buffers
        too (``wire.all_to_all``, ``wire.all_gather``), so the copies back run
        asynchronously on this stream, ordered before the decoding that reads them."""
        if t.device == self.wire_device:
            return t
        if t.is_cuda and self.wire_device.type == "cpu":
            return pinned_host_copy(t)
        return t.to(self.wire_device)

    def _reduce_scatter(self, finite: List[bool], shards):
        """One all-to-all: worker j receives every worker's j-th chunk of each shard (codes,
        scales and a finiteness flag), packed in one byte row per destination; decodes and
        sums in fp32. Per shard: (all finite, the mean of chunk j, this rank's quantization
        error measured on chunk j); and the bytes each way per shard. The error needs no
        decode of its own: chunk j's own codes are decoded for the sum anyway."""
        M, me = self.workers, self.index
        flags = torch.stack(finite).to(torch.int32).view(1, -1).expand(M, -1)
        layout = [flags]
        for _, encoded in shards:
            if encoded.scales is not None:
                layout.append(encoded.scales.view(M, -1))
            layout.append(encoded.payload.view(M, -1))
        rows = pack(layout)
        received = all_to_all(self._to_wire(rows.view(-1)), self.post)
        received = received.to(rows.device, non_blocking=True).view(M, -1)
        flags_of, parts_of = [], []  # per worker: its flags; its (scales, codes) per shard
        for w in range(M):
            flags_w, *rest = unpack(received[w], layout)
            flags_of.append(flags_w)
            parts_of.append(_per_shard(rest, [e for _, e in shards]))
        out, sizes = [], []
        for i, (padded, encoded) in enumerate(shards):
            chunk = padded.numel() // M
            total, part, quant_error = None, None, None
            for w in range(M):  # fixed order: the sum is the same on every run
                scales, codes = parts_of[w][i]
                decoded = self.codec.decode(Encoded(codes, scales, chunk),
                                            out=None if total is None else part)
                if w == me:  # this rank's own send (0 where it sent zeros)
                    quant_error = torch.where(finite[i], _relative_error(
                        decoded, padded[me * chunk:(me + 1) * chunk]), 0.0)
                if total is None:
                    total, part = decoded.clone(), torch.empty_like(decoded)
                else:
                    total += decoded
            all_finite = torch.stack([flags_of[w][i] for w in range(M)]).min() > 0
            out.append((all_finite, total / M, quant_error))
            sizes.append((4 + encoded.nbytes() // M) * (M - 1))
        return out, sizes

    def _all_gather(self, encoded: List[Encoded]):
        """One all-gather: every worker's averaged chunk of each shard (scales and codes, one
        byte row) to every worker; decoded and concatenated per shard."""
        M = self.workers
        layout = []
        for e in encoded:
            if e.scales is not None:
                layout.append(e.scales.view(1, -1))
            layout.append(e.payload.view(1, -1))
        row = pack(layout).view(-1)
        rows = [r.to(row.device, non_blocking=True)
                for r in all_gather(self._to_wire(row), self.post, M)]
        means = [torch.empty(M * e.numel, dtype=torch.float32, device=row.device)
                 for e in encoded]
        for w in range(M):
            for e, mean, (scales, codes) in zip(encoded, means,
                                                _per_shard(unpack(rows[w], layout), encoded)):
                self.codec.decode(Encoded(codes, scales, e.numel),
                                  out=mean[w * e.numel:(w + 1) * e.numel])
        return means, [e.nbytes() * (M - 1) for e in encoded]


def pinned_host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of GPU tensor ``t``, complete on return, made through pinned memory: a
    pageable copy stages through a driver buffer at a fraction of the rate."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return host


def _cuda_device(*devices: torch.device) -> torch.device:
    """The first CUDA device among ``devices``, with its index (the current one if unset)."""
    device = next(d for d in devices if d.type == "cuda")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None
                        else device.index)


def _per_shard(parts: List[torch.Tensor], encoded: List[Encoded]) -> List[tuple]:
    """Unpacked parts, laid out as [scales,] codes per shard, as (scales or None, codes)."""
    it, out = iter(parts), []
    for e in encoded:
        scales = next(it) if e.scales is not None else None
        out.append((scales, next(it)))
    return out


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a 0-dim bool tensor on its device: its
    sum is (an inf or NaN anywhere makes it inf or NaN), and the sum holds no temporary of
    ``t``'s size. (A sum beyond fp32's range reads as not finite: an outer gradient is
    orders of magnitude from it.)"""
    return torch.isfinite(t.sum())


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """||approx - exact|| / ||exact|| (0 where ``exact`` is 0), a 0-dim tensor on their
    device (read on the host once the exchange is done)."""
    norm = exact.norm()
    return torch.where(norm > 0, (approx - exact).norm() / norm, 0.0)

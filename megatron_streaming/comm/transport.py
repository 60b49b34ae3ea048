"""The one door through which bytes cross workers.

Data flow: the sync module hands over one rank's shard of an outer gradient; this module
quantizes it, runs a quantized reduce-scatter (an all-to-all of codes, decoded and summed in
fp32) and a quantized all-gather of the averaged chunks over the rank's cross-worker group,
and hands back the fp32 mean. Two collectives per exchange, whatever the link's round trip
costs: the finiteness flag, the scales and the codes travel packed in one byte row per peer
(over gloo as chunked point-to-point messages, all in flight at once: ``_swap``).
Each rank moves about ``2 (M-1)/M x n x bits`` and every byte it puts on the wire is counted
here.

The exchange runs asynchronously: on a background thread for gloo (collectives on the
cross-worker group are issued only from that thread, one at a time, in submission order, so
all workers pair their collectives up identically), and additionally on a side CUDA stream
where it touches the GPU (NCCL, or the codec on a GPU job with gloo across workers: then only
the packed codes cross to host memory), so the inner steps in between really overlap it.
``Pending.wait`` fails with a message naming the step, the fragment and the peer group when
the peers do not answer in time.

Tests and slow-link emulation subclass it (``tests/``).
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
from .serial import SerialThread
from .codec import Codec, Encoded, ErrorFeedback, is_finite


class SyncTimeout(JobFailure):
    """A cross-worker exchange did not complete in time."""


class GroupReleased(RuntimeError):
    """The exchange's group was let go (a membership change) before it posted this."""


class Poster:
    """Posts collectives on one group until the group is let go (``release``). Posting and
    letting go exclude each other, so a group that a membership change aborts and destroys
    (``elastic``) is never handed a new collective by the exchange's thread: gloo does not fail
    a send posted on an aborted group, it crashes the process. A post after the release raises
    ``GroupReleased``; waits already posted are woken by the abort. The group stays referenced
    (by the frames still using it) until they are done."""

    def __init__(self, group):
        self.group = group
        self._open = True
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def __call__(self, collective, *args, **kwargs):
        with self._lock:
            if not self._open:
                raise GroupReleased("the cross-worker group was let go (membership change)")
            return collective(*args, group=self.group, **kwargs)

    def release(self) -> None:
        """No collective is posted from now on; returns once none is being posted."""
        with self._lock:
            self._open = False


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
            result = self.future.result(timeout=self.timeout)
            if result.mean.is_cuda:  # made on the side stream, now read on this one: the
                # allocator must not hand its memory to the next exchange before that
                result.mean.record_stream(torch.cuda.current_stream())
            return result
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
                 timeout: float, wire_device: str = "cpu", use_cuda_stream: bool = False,
                 codec_device: Optional[str] = None):
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
        self._executor.submit(self._exchange, xs, numels, feedbacks, futures)
        return [Pending(f, step, tag, self.group_ranks, self.timeout)
                for f, tag in zip(futures, tags)]

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

    # ---- the exchange, on the background thread ----------------------------------------
    def _set_device(self) -> None:
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)

    def _exchange(self, xs, numels, feedbacks, futures) -> None:
        try:
            if self._stream is None:
                results = self._exchange_on_current_stream(xs, numels, feedbacks)
            else:
                try:
                    with torch.cuda.stream(self._stream):
                        results = self._exchange_on_current_stream(xs, numels, feedbacks)
                finally:
                    # Also when it failed: ``xs`` were made on the training stream and are
                    # freed with this frame; the allocator may hand their memory back to that
                    # stream only once this one has stopped reading them.
                    self._stream.synchronize()
        except BaseException as e:  # every waiter hears of it
            for f in futures:
                f.set_exception(e)
            return
        for f, r in zip(futures, results):
            f.set_result(r)

    def _exchange_on_current_stream(self, xs, numels, feedbacks) -> List[ExchangeResult]:
        """``xs``: padded shards (``buffer``), ``numels`` of their elements each."""
        started = time.perf_counter()
        finite = [is_finite(x) for x in xs]
        if self.workers == 1:  # nothing crosses a wire: the mean is the value itself
            return [ExchangeResult(x[:n], f, 0, 0, 0.0, time.perf_counter() - started)
                    for x, n, f in zip(xs, numels, finite)]
        shards = []
        for padded, ok, feedback in zip(xs, finite, feedbacks):
            # A non-finite gradient is replaced by zeros on the wire; its flag tells every
            # worker to skip this shard's outer step, so it never reaches the global
            # parameters. (The caller's buffer is read, never written.)
            if not ok:
                padded = torch.zeros_like(padded)
            encoded = feedback.encode(padded) if (feedback is not None and ok) else \
                self.codec.encode(padded)
            shards.append((padded, encoded))
        reduced, b1 = self._reduce_scatter(finite, shards)
        means, b2 = self._all_gather([self.codec.encode(chunk_mean)
                                      for _, chunk_mean, _ in reduced])
        with self._lock:
            self.bytes_sent += sum(b1) + sum(b2)
            self.bytes_received += sum(b1) + sum(b2)
        seconds = time.perf_counter() - started
        return [ExchangeResult(mean[:n], all_finite, s1 + s2, s1 + s2, quant_error, seconds)
                for n, mean, (all_finite, _, quant_error), s1, s2
                in zip(numels, means, reduced, b1, b2)]

    def _to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the wire's device. From a GPU to gloo's host memory through a pinned
        buffer (a pageable copy would stage through a driver buffer at a fraction of the
        rate), complete before the wire reads it; what comes back lands in pinned buffers
        too (``_all_to_all``, ``_all_gather``), so the copies back run asynchronously on
        this stream, ordered before the decoding that reads them."""
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
        device = shards[0][0].device
        flags = torch.tensor([[1 if f else 0 for f in finite]] * M, dtype=torch.int32,
                             device=device)
        layout = [flags]
        for _, encoded in shards:
            if encoded.scales is not None:
                layout.append(encoded.scales.view(M, -1))
            layout.append(encoded.payload.view(M, -1))
        rows = _pack(layout)
        received = _all_to_all(self._to_wire(rows.view(-1)), self.post)
        received = received.to(device, non_blocking=True).view(M, -1)
        flags_of, parts_of = [], []  # per worker: its flags; its (scales, codes) per shard
        for w in range(M):
            flags_w, *rest = _unpack(received[w], layout)
            flags_of.append(flags_w)
            parts_of.append(_per_shard(rest, [e for _, e in shards]))
        out, sizes = [], []
        for i, (padded, encoded) in enumerate(shards):
            chunk = padded.numel() // M
            all_finite, total, part, quant_error = True, None, None, 0.0
            for w in range(M):  # fixed order: the sum is the same on every run
                all_finite = all_finite and bool(flags_of[w][i].item())
                scales, codes = parts_of[w][i]
                decoded = self.codec.decode(Encoded(codes, scales, chunk),
                                            out=None if total is None else part)
                if w == me:
                    quant_error = _relative_error(decoded, padded[me * chunk:(me + 1) * chunk])
                if total is None:
                    total, part = decoded.clone(), torch.empty_like(decoded)
                else:
                    total += decoded
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
        row = _pack(layout).view(-1)
        rows = [r.to(row.device, non_blocking=True)
                for r in _all_gather(self._to_wire(row), self.post, M)]
        means = [torch.empty(M * e.numel, dtype=torch.float32, device=row.device)
                 for e in encoded]
        for w in range(M):
            for e, mean, (scales, codes) in zip(encoded, means,
                                                _per_shard(_unpack(rows[w], layout), encoded)):
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


def _pack(parts: List[torch.Tensor]) -> torch.Tensor:
    """Rows of several tensors (each [rows, k], any dtype) side by side as one uint8 [rows, B]
    tensor: what one collective carries."""
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)


def _unpack(row: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
    """One packed row back into flat tensors with the dtypes and row widths of ``like``:
    views into ``row``, copied only where a piece does not start on its dtype's alignment."""
    out, offset = [], 0
    for p in like:
        width = p.shape[1] * p.element_size()
        piece = row[offset:offset + width]
        if piece.storage_offset() % p.element_size():
            piece = piece.clone()
        out.append(piece.view(p.dtype))
        offset += width
    return out


# gloo moves one large message each way over a pair's TCP connection; with both directions
# busy and no round trip to pace them the two take turns (all-to-all of 25 MB each way over
# a 100 Mbit/s harness link: 48 % of the rate each way, its all-gather 63 %), where several
# messages in flight each way keep both directions full (90 %, 91 %; its chunked ring
# all-reduce does the same; benchmarks/wire_directions.py). So on gloo both collectives go
# as tagged point-to-point messages of at most WIRE_CHUNK bytes, all posted at once. NCCL
# keeps its own collectives.
WIRE_CHUNK = 1 << 18


def _swap(sends: List[torch.Tensor], recvs: List[torch.Tensor], post: Poster) -> None:
    """Every peer ``j`` gets ``sends[j]`` into its ``recvs[me]``, in chunks, both ways at
    once (``sends[me]`` is copied locally)."""
    me = post.rank
    recvs[me].copy_(sends[me])
    works = []
    for peer in range(len(sends)):
        if peer == me:
            continue
        out, inp = recvs[peer].view(-1), sends[peer].view(-1)
        step = max(1, WIRE_CHUNK // inp.element_size())
        for tag, start in enumerate(range(0, inp.numel(), step)):
            works.append(post(dist.isend, inp[start:start + step], group_dst=peer, tag=tag))
            works.append(post(dist.irecv, out[start:start + step], group_src=peer, tag=tag))
    for work in works:
        work.wait()


def _like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``t``, pinned where ``t`` is (a receive buffer for staged rows)."""
    if t.device.type == "cpu" and t.is_pinned():
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return torch.empty_like(t)


def _all_to_all(t: torch.Tensor, post: Poster) -> torch.Tensor:
    out = _like(t)
    if t.device.type != "cpu":
        post(dist.all_to_all_single, out, t)
        return out
    parts = dist.get_world_size(post.group)
    _swap(list(t.view(parts, -1)), list(out.view(parts, -1)), post)
    return out


def _all_gather(t: torch.Tensor, post: Poster, parts: int) -> List[torch.Tensor]:
    out = [_like(t) for _ in range(parts)]
    if t.device.type != "cpu":
        post(dist.all_gather, out, t)
        return out
    _swap([t] * parts, out, post)
    return out


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    norm = exact.norm().item()
    return (approx - exact).norm().item() / norm if norm > 0 else 0.0

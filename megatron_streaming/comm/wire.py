"""The packed rows of one exchange on the wire: the group's poster, and the two collectives.

``transport`` packs each collective's flags, scales and codes into one byte row per peer
(``pack``) and moves the rows with ``all_to_all`` and ``all_gather``: over gloo as chunked
point-to-point messages, all in flight at once (``swap``), over NCCL as NCCL's own
collectives. Every post on the cross-worker group goes through a ``Poster``.
"""

from __future__ import annotations

import threading
from typing import List

import torch
import torch.distributed as dist


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


def pack(parts: List[torch.Tensor]) -> torch.Tensor:
    """Rows of several tensors (each [rows, k], any dtype) side by side as one uint8 [rows, B]
    tensor: what one collective carries."""
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)


def unpack(row: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
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


def swap(sends: List[torch.Tensor], recvs: List[torch.Tensor], post: Poster) -> None:
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


def all_to_all(t: torch.Tensor, post: Poster) -> torch.Tensor:
    out = _like(t)
    if t.device.type != "cpu":
        post(dist.all_to_all_single, out, t)
        return out
    parts = dist.get_world_size(post.group)
    swap(list(t.view(parts, -1)), list(out.view(parts, -1)), post)
    return out


def all_gather(t: torch.Tensor, post: Poster, parts: int) -> List[torch.Tensor]:
    out = [_like(t) for _ in range(parts)]
    if t.device.type != "cpu":
        post(dist.all_gather, out, t)
        return out
    swap([t] * parts, out, post)
    return out

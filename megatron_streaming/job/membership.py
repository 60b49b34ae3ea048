"""Membership epochs: which workers form the job now, as recorded in the rendezvous store.

Epoch 0 is every configured worker (``--diloco-workers``); it has no record. A change of
membership (a worker lost, a worker back) writes the next epoch's record once:
``megatron_streaming/membership/<e>`` = ``{"members": [...], "step": s, "reason": "..."}``,
with the store's compare-and-set, so the first proposer wins and every other proposer of the
same epoch reads the winner's record instead of writing its own. The store is the job's
standalone rendezvous (``python -m megatron_streaming.job.rendezvous``): no worker hosts it, so
any live worker can write and read the record.

The rule against split brain: a record lets its members go on only if they are a strict
majority of the configured workers (more than M/2) and at least ``--diloco-min-workers``. A
proposer that sees fewer workers alive proposes a *stopping* record instead (``stopping``:
its members save a checkpoint and stop). Either way the first proposal of the epoch wins, so
of two sides of a partitioned link at most one goes on (with M even, a half is not a
majority: both halves stop), and a side that lost the race reads that it is not a member and
stops. Each epoch's cross-worker groups are made by its members alone under the epoch's own
prefix of the store (``Topology.add_cross_worker_groups``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Tuple

PREFIX = "megatron_streaming/membership/"


@dataclass(frozen=True)
class Record:
    epoch: int
    members: Tuple[int, ...]
    step: int = 0
    reason: str = ""
    stopping: bool = False  # too few alive: the members save a checkpoint and stop

    def encode(self) -> bytes:
        d = {"members": list(self.members), "step": self.step, "reason": self.reason}
        return json.dumps({**d, "stopping": True} if self.stopping else d).encode()

    @classmethod
    def decode(cls, epoch: int, raw: bytes) -> "Record":
        d = json.loads(raw)
        return cls(epoch, tuple(d["members"]), int(d["step"]), d.get("reason", ""),
                   bool(d.get("stopping", False)))


def quorum_problem(members, configured: int, min_workers: int) -> Optional[str]:
    """Why ``members`` may not go on (None: they may)."""
    n = len(set(members))
    if 2 * n <= configured:
        return (f"{n} of {configured} workers alive is not a majority of --diloco-workers "
                f"{configured}: the other side of a partition may be the one that goes on")
    if n < min_workers:
        return f"{n} workers alive, fewer than --diloco-min-workers {min_workers}"
    return None


class Membership:
    """The membership records of one job in ``store`` (a TCPStore client)."""

    def __init__(self, store, configured: int, min_workers: Optional[int] = None):
        self.store, self.configured = store, configured
        self.min_workers = configured if min_workers is None else min_workers
        self.bytes = 0  # through the store, for the cross-worker control count

    def record(self, epoch: int) -> Optional[Record]:
        """Epoch ``epoch``'s record, None if not written (yet)."""
        if epoch == 0:
            return Record(0, tuple(range(self.configured)))
        key = f"{PREFIX}{epoch}"
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        self.bytes += len(key) + len(raw)
        return Record.decode(epoch, raw)

    def latest(self) -> Record:
        """The newest record (epochs are written in order, each once)."""
        newest = self.record(0)
        while True:
            following = self.record(newest.epoch + 1)
            if following is None:
                return newest
            newest = following

    def propose(self, after: Record, alive: List[int], step: int, reason: str) -> Record:
        """The record that follows ``after``: ``alive`` (this proposer's view) if it is the
        first proposal, else the one already written. When ``alive`` may not go on, the
        proposal is a stopping record, its reason saying why."""
        problem = quorum_problem(alive, self.configured, self.min_workers)
        if problem:
            reason = (f"{reason}; {problem} (membership epoch {after.epoch} was workers "
                      f"{list(after.members)})")
        mine = Record(after.epoch + 1, tuple(sorted(set(alive))), step, reason,
                      stopping=bool(problem))
        key = f"{PREFIX}{mine.epoch}"
        held = self.store.compare_set(key, "", mine.encode())
        self.bytes += len(key) + 2 * len(mine.encode())
        return Record.decode(mine.epoch, held)

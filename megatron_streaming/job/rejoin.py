"""Admission of a restarted worker: is this launch a worker coming back into a running elastic
job (``elastic.Elastic.join`` then takes it in), or a first launch? And what such a worker is
told when the job ends before it is admitted.

The job ends with its last step; its leading rank then records the end in the rendezvous store
(``record_end``: the iteration, the membership) and, where the store goes with its process,
waits a few seconds until every worker asking in (``JOIN``) has read it. A worker asking in
reads it while it waits (``ended``) and exits with one line. Where the store goes without that
record (its host died, or the job stopped early on a signal), the store's errors become one
line too (``store_may_go``)."""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from typing import List, Optional

import torch.distributed as dist

from ..errors import JobFailure, first_line
from .door import PREFIX
from .membership import Membership

JOIN = "megatron_streaming/join/"  # + worker index: a restarted worker asks to rejoin
ENDED = "megatron_streaming/ended"  # the job's last step is done: its iteration, membership
# How long the leading rank, hosting the store, waits for a worker asking in to read the end
# (it reads every half second while it waits).
READ_END_SECONDS = 10.0
# What a store client raises when its server is gone (or unreachable).
STORE_ERRORS = (dist.DistError, ConnectionError, TimeoutError)


def running_job(cfg, store, worker: int, local: int, ranks: int):
    """The membership record of a running elastic job that this worker is outside of (a
    restarted worker rejoins it), else None. A launch whose index is still taken waits
    until the others have noticed its predecessor is gone.

    The launch's first rank decides and the others take its decision: another rank
    would see the claim its own first rank has just made as a predecessor's. They find
    it by the launch's number among the launches of this worker with as many ranks,
    counted by every rank's arrival (a restart arrives after its predecessor's ranks)."""
    s, p = cfg.streaming, cfg.parallel
    if s.diloco_min_workers is None or s.diloco_min_workers >= s.diloco_workers:
        return None
    membership = Membership(store, s.diloco_workers, s.diloco_min_workers)
    base = f"megatron_streaming/launch/worker{worker}/ranks{ranks}/"
    decided = f"{base}{(store.add(base + 'arrivals', 1) - 1) // ranks}"
    if local != 0:
        store.wait([decided], datetime.timedelta(minutes=p.distributed_timeout_minutes))
        decision = json.loads(store.get(decided))
        if decision.get("failed"):
            raise JobFailure(decision["failed"])
        epoch = decision["rejoin"]
        return None if epoch is None else membership.record(epoch)
    try:
        latest = _decide(cfg, store, worker, membership)
    except JobFailure as e:
        store.set(decided, json.dumps({"failed": str(e)}))
        raise
    store.set(decided, json.dumps({"rejoin": None if latest is None else latest.epoch}))
    return latest


def _decide(cfg, store, worker: int, membership):
    deadline = time.monotonic() + 60.0 * cfg.parallel.distributed_timeout_minutes
    while True:
        latest = membership.latest()
        if latest.stopping:
            raise JobFailure(f"the job this rendezvous serves has stopped: "
                             f"{latest.reason} (membership epoch {latest.epoch}); "
                             "restart the rendezvous and every worker (with --load) for "
                             "a new run")
        if worker not in latest.members:
            end = ended(store)
            if end is not None:
                raise JobFailure(end_message(worker, end))
            return latest
        if not store.check([f"{PREFIX}worker{worker}"]) or time.monotonic() > deadline:
            return None  # a first launch (or a duplicate one: the door refuses it)
        time.sleep(1.0)


def record_end(store, iteration: int, record, workers: int, wait_s: float) -> List[int]:
    """On the job's leading rank after its last step: record that the job ended at
    ``iteration`` in membership ``record`` (``membership.Record``), then wait up to ``wait_s``
    until every worker outside ``record`` asking in has read it (it withdraws its request).
    Returns the workers that read it."""
    store.set(ENDED, json.dumps({"iteration": iteration, "epoch": record.epoch,
                                 "members": list(record.members)}))
    asking = [w for w in range(workers) if w not in record.members
              and store.check([f"{JOIN}{w}"])]
    deadline = time.monotonic() + wait_s
    waiting = list(asking)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.1)
        waiting = [w for w in waiting if store.check([f"{JOIN}{w}"])]
    return [w for w in asking if w not in waiting]


def ended(store) -> Optional[dict]:
    """The job's end as its leading rank recorded it (``record_end``), or None."""
    if not store.check([ENDED]):
        return None
    return json.loads(store.get(ENDED))


def end_message(worker: int, end: dict) -> str:
    """What worker ``worker``, asking in, says of the job's end (``ended``)."""
    return (f"worker {worker} asked to rejoin, but the job ended at iteration "
            f"{end['iteration']} (membership epoch {end['epoch']}: workers {end['members']}): "
            "nothing to rejoin")


@contextlib.contextmanager
def store_may_go(worker: int, address):
    """While worker ``worker`` asks to rejoin: the rendezvous store (at ``address``, a
    ``distributed.StoreAddress``) going away becomes one line (``JobFailure``)."""
    try:
        yield
    except STORE_ERRORS as e:
        host = {"external": "the standalone rendezvous", "agent": "worker 0's launcher"}.get(
            address.hosted_by, "worker 0's first rank")
        raise JobFailure(f"worker {worker} asked to rejoin, but the rendezvous store {address} "
                         f"went away before it was admitted (its host, {host}, has exited: "
                         f"the job ended, or it died): {first_line(e)}") from None

"""Admission of a restarted worker: is this launch a worker coming back into a running elastic
job (``elastic.Elastic.join`` then takes it in), or a first launch?"""

from __future__ import annotations

import datetime
import json
import time

from ..errors import JobFailure
from .door import PREFIX
from .membership import Membership


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
            return latest
        if not store.check([f"{PREFIX}worker{worker}"]) or time.monotonic() > deadline:
            return None  # a first launch (or a duplicate one: the door refuses it)
        time.sleep(1.0)

"""Elastic workers: with ``--diloco-min-workers K`` below ``--diloco-workers M``, the workers
that survive a lost one go on training, over new cross-worker groups (DESIGN.md, "Membership
epochs").

* Noticing: a cross-worker collective that fails (an exchange the sync waits for, the
  lagged reduction of the stop flag) is noted (``note``) instead of raised. Exchanges that
  fail are skipped, as a non-finite one is: no outer step, no merge.
* Agreeing inside the worker: right after each training step every rank of the worker
  reduces its notes (``end_of_step``, one small in-worker reduction per step), so a worker
  acts on a loss as one, after the same step.
* Recovering: the old cross-worker groups are aborted; the heartbeats tell which workers are
  alive; the next membership record is proposed (``membership.Membership``: the first
  proposal of an epoch wins, and it needs a strict majority of the configured workers and at
  least K of them, so of two sides of a partition at most one goes on); the members make the
  epoch's groups on the rendezvous store; a new transport averages over them. Exchanges not
  merged by then are dropped on every survivor. The survivors then agree on the step to go
  on from (the latest any of them reached): one that noticed a step earlier trains up to it
  without the sync. At that step every survivor takes theta_g and the outer momentum from the
  lowest member (one uncompressed broadcast per loss), so exchanges that completed on one
  survivor and failed on another cannot leave their global copies apart. The stop agreement
  starts afresh on the new control group.

* Rejoining: a restarted worker (the same launch command) finds itself outside the latest
  membership at the door, asks in the rendezvous store (``JOIN``) and waits. The job's leading
  rank sees the request at its next heartbeat and raises a bit of the stop flag, so every live
  worker reads it after the same step; there they merge the exchanges in flight at once (as
  at the end of training), write the next membership with the newcomer, make the epoch's
  groups with it and send it theta_g and the outer momentum (from the lowest live worker)
  and the step. The newcomer sets its weights to theta_g, starts a fresh inner optimizer,
  and goes on from that step's data and learning rate, in lockstep from then on. It never
  brings weights of its own into the shared state. A job that ends before it is admitted
  records its end (``rejoin.record_end``, after the last step): the newcomer exits saying so.

The rendezvous store must outlive the lost worker: with the default store (hosted by global
rank 0), losing worker 0 ends the job; ``--rendezvous-external`` keeps it elsewhere.
"""

from __future__ import annotations

import datetime
import gc
import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import JobFailure, first_line
from .lifecycle import STORE_CALL_SECONDS
from .rejoin import JOIN, READ_END_SECONDS, STORE_ERRORS, end_message, ended, record_end, \
    store_may_go
from ..parallel.topology import device_of

log = logging.getLogger("megatron_streaming")


class Elastic:
    """This rank's part of the job's membership; built by the run after the sync, from what it
    acts on: the topology and its communicator (which records a failed collective: ``lost``),
    the sync, the stop agreement and request, the heartbeats, every worker's shape (``job``),
    the job's rendezvous store (``rendezvous``, a ``distributed.StoreAddress``),
    ``report_from_here(bool)``, called when this rank starts or stops reporting, and
    ``collect()``, a full garbage collection (the run's collector: it also frees what training
    froze out of the collector's walks)."""

    def __init__(self, cfg, topology, sync, stop, stop_request, liveness, job, rendezvous,
                 report_from_here, collect=None):
        s = cfg.streaming
        self.cfg, self.topology, self.sync, self.job = cfg, topology, sync, job
        self.stop, self.stop_request, self.liveness = stop, stop_request, liveness
        self.rendezvous, self.report_from_here = rendezvous, report_from_here
        self.collect = collect or gc.collect
        topo = topology
        self.min_workers = s.diloco_min_workers or s.diloco_workers
        self.enabled = sync.enabled and self.min_workers < topo.layout.workers
        self.timeout = datetime.timedelta(seconds=s.diloco_timeout)
        self.resync_at: Optional[int] = None  # the step after which the survivors resync
        # Why the job stops (too few workers alive), once the survivors have resynced.
        self.stopping: Optional[str] = None
        self.history = []  # the membership records this rank moved to, in order
        self.ended_at: Optional[int] = None  # the step after which ``end`` recorded the end
        if self.enabled:
            from .membership import Membership

            self.membership = Membership(topo.store, topo.layout.workers, self.min_workers)
            self.record = self.membership.record(0)
            topo.cross.tolerates_loss = True  # a lost worker is recorded there, not raised
            stop.carries_join = True
            liveness.watch = self._watch

    @property
    def catching_up(self) -> bool:
        """Training without the sync up to the step the survivors go on from."""
        return self.resync_at is not None

    def end_of_step(self, iteration: int) -> None:
        """After each training step, on every rank: act on a loss noticed by any rank of the
        worker; at the agreed step, take the global state from the lowest member."""
        if not self.enabled:
            return
        flag = torch.tensor([int(self.topology.cross.lost is not None)], dtype=torch.int32,
                            device=device_of(self.topology.groups["worker"]))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.topology.groups["worker"])
        if flag.item():
            self._recover(iteration)
        if self.resync_at == iteration:
            self._resync(iteration)

    def after_stop_flag(self, iteration: int) -> None:
        """After the step's stop flag was read (every live rank alike): admit the workers
        that asked to rejoin, if the flag says one did; after the last step, tell them the
        job ended instead."""
        if not self.enabled:
            return
        if iteration >= self.cfg.training.train_iters:
            self.end(iteration)
        elif self.stop.join_agreed:
            self._admit(iteration)

    def end(self, iteration: int) -> None:
        """After the job's last step (``iteration``), on its leading rank: record the end for
        the workers asking to rejoin (``rejoin.record_end``). Where the store goes with this
        process, wait (bounded) until they have read it, so they can say where the job ended.
        Once per run; every rank may call it."""
        topo = self.topology
        if not (self.enabled and topo.leads_job()) or self.ended_at is not None:
            return
        self.ended_at = iteration
        wait = 0.0 if self.rendezvous.hosted_by == "external" else READ_END_SECONDS
        try:
            store = _connect(self.rendezvous, topo.store, STORE_CALL_SECONDS)
            told = record_end(store, iteration, self.record, topo.layout.workers, wait)
        except STORE_ERRORS as e:  # nobody to tell, then: a newcomer finds the store gone
            log.debug("the job's end not recorded in the rendezvous store: %s", first_line(e))
            return
        if told:
            log.warning("worker(s) %s asked to rejoin as the job ended after step %d: told "
                        "there is nothing to rejoin", told, iteration)

    def _watch(self, store) -> None:
        """At each heartbeat (its thread), on the job's leading rank: a worker asking in?"""
        topo = self.topology
        if not topo.leads_job():
            return
        outside = [w for w in range(topo.layout.workers) if w not in topo.members]
        if any(store.check([f"{JOIN}{w}"]) for w in outside):
            self.stop_request.join_pending = True

    # ---- recovery ------------------------------------------------------------------------
    def _recover(self, iteration: int) -> None:
        topo = self.topology
        cause = topo.cross.take_lost()
        self.sync.abandon()  # first: the failed exchanges' errors hold their groups
        self._release_groups()
        try:  # a new connection: the standalone rendezvous may have been restarted since
            _answers(self.rendezvous, STORE_CALL_SECONDS)
            self.membership.store = _connect(self.rendezvous, topo.store, STORE_CALL_SECONDS)
            survey = self.liveness.survey(self.membership.store)
        except Exception as e:  # cut off from the rendezvous (and so from the job)
            raise OutsideTheJob(f"worker {topo.worker} lost the job after step {iteration} "
                                f"({cause}) and cannot reach the rendezvous store: "
                                f"{first_line(e)}") from None
        gone = {topo.layout.coords(r)["worker"] for r in survey["lost"] + survey["exiting"]}
        gone &= set(self.record.members)  # those lost earlier are not news
        alive = [w for w in self.record.members if w not in gone]
        reason = f"lost worker(s) {sorted(gone)} after step {iteration}" if gone else \
            f"a cross-worker collective failed after step {iteration} ({cause})"
        record = self.membership.propose(self.record, alive, iteration, reason)
        if topo.worker not in record.members:
            if record.stopping:
                raise JobFailure(f"the job stops: {record.reason} (membership epoch "
                                 f"{record.epoch})")
            raise OutsideTheJob(f"the other workers went on without worker {topo.worker} "
                                f"(membership epoch {record.epoch}: workers "
                                f"{list(record.members)}, {record.reason})")
        self._new_epoch(record)
        # The step to go on from: the latest any survivor reached.
        steps = torch.tensor([iteration], dtype=torch.int64)
        _, steps = topo.cross.all_reduce_control(steps, dist.ReduceOp.MAX)
        target = int(steps.item())
        if record.stopping:  # at that step, with the same global state: save and stop
            self.stopping = f"{record.reason}; stopping after step {target}"
        log.warning("membership epoch %d: workers %s (%s)%s; exchanges in flight were "
                    "dropped%s", record.epoch, list(record.members), record.reason,
                    "" if record.stopping else
                    f"; the outer mean is over {len(record.members)} workers from now on",
                    f"; training without the sync up to step {target}" if target > iteration
                    else "")
        self.resync_at = target
        self.sync.paused = target > iteration

    def _resync(self, iteration: int) -> None:
        """Every member takes theta_g and the outer momentum of the lowest member."""
        self._share_global_state(0)
        self.sync.paused = False
        self.resync_at = None
        log.info("step %d: global parameters and outer momentum taken from worker %d",
                 iteration, self.record.members[0])

    def _share_global_state(self, src: int) -> None:
        """theta_g and the outer momentum of the member at index ``src`` of the epoch, to
        every member (collective over the cross-worker data groups)."""
        self.sync.share_global_state(src, self.topology.cross)

    def _release_groups(self) -> None:
        """Let go of the epoch's cross-worker groups, so that they are destroyed and their
        connections closed: a peer still blocked in a collective on them (it has not noticed
        the loss yet) fails at once instead of after --diloco-timeout. (Aborting a gloo group
        does not wake a blocked collective; closing its connections does.)"""
        from patches.torch_process_group import drop

        topo = self.topology
        # First: no new collective from the exchange's thread on a group being aborted.
        self.sync.transport.abandon()
        for group in [topo.groups.pop(name, None)
                      for name in ("cross_worker", "cross_worker_control")] + topo.proxy_groups:
            if group is not None:
                drop(group)
        topo.proxy_groups = []
        topo.cross.data_group = topo.cross.control_group = None
        topo.cross.proxy_groups = []
        self.stop.release()
        self.collect()

    def _new_epoch(self, record) -> None:
        """Make ``record``'s groups (this rank's coordinate) and move everything onto them."""
        topo = self.topology
        self.record = record
        self.history.append(record)
        topo.add_cross_worker_groups(self.membership.store, record.epoch,
                                     list(record.members), self.timeout)
        topo.members = record.members
        self.report_from_here(topo.is_logging_rank())  # the lowest live worker reports
        topo.cross.regroup(topo)
        self.sync.regroup(topo.cross)
        from ..streaming.builder import token_share

        self.sync.share = token_share(self.cfg, self.job, topo)  # over the members
        self.stop.regroup()

    # ---- rejoining -----------------------------------------------------------------------
    def _admit(self, iteration: int) -> None:
        """On every live rank, after the same step: let the workers that asked in join."""
        topo = self.topology
        store = self.membership.store = _connect(self.rendezvous, topo.store)
        asking = [w for w in range(topo.layout.workers) if w not in self.record.members
                  and store.check([f"{JOIN}{w}"])]
        self.stop_request.join_pending = False
        if not asking:
            return
        merged = self.sync.finish()  # in flight: merged now, the newcomer starts after them
        before = self.record
        record = self.membership.propose(
            before, [*before.members, *asking], iteration,
            f"worker(s) {asking} rejoined after step {iteration}")
        self._release_groups()
        self._new_epoch(record)
        self._share_global_state(record.members.index(min(before.members)))
        if topo.leads_job():
            for w in asking:
                store.delete_key(f"{JOIN}{w}")
        log.warning("membership epoch %d: workers %s (%s; %d exchange(s) in flight merged "
                    "first); the outer mean is over %d workers from now on", record.epoch,
                    list(record.members), record.reason, merged, len(record.members))

    def join(self, since: int) -> int:
        """On a restarted worker (outside membership epoch ``since``): ask in, wait until
        the live workers admit it, take the global state; returns the step to go on from."""
        topo = self.topology
        store = self.membership.store
        with store_may_go(topo.worker, self.rendezvous):  # the job may end meanwhile
            if topo.coords["local"] == 0:
                store.set(f"{JOIN}{topo.worker}", str(since))
            log.warning("worker %d asks to rejoin the running job (membership epoch %d: "
                        "workers %s)", topo.worker, since,
                        list(self.membership.record(since).members) if since
                        else list(range(topo.layout.workers)))
            epoch = self._wait_for_admission(store, since)
            record, before = self.membership.record(epoch), self.membership.record(epoch - 1)
        self._new_epoch(record)
        self._share_global_state(record.members.index(min(before.members)))
        sync = self.sync
        for g, theta in zip(sync.groups, sync.theta_g):  # the newcomer's weights: theta_g
            g.write(theta.to(g.read().device))
        sync.push_to_model()
        sync.step = sync.finished_step = record.step  # the exchanges then in flight are
        sync.mark_merged(sync.schedule.in_flight_after(record.step))  # merged already
        log.warning("worker %d rejoined after step %d (membership epoch %d: workers %s): "
                    "weights set to the global parameters, fresh inner optimizer",
                    topo.worker, record.step, record.epoch, list(record.members))
        return record.step

    def _wait_for_admission(self, store, since: int) -> int:
        """Until a membership epoch after ``since`` holds this worker (returns it); raises
        ``JobFailure`` when the job stops, ends (its leading rank recorded it: this worker's
        request is withdrawn, which tells the leading rank it was read) or the wait times
        out."""
        import time

        topo = self.topology
        deadline = time.monotonic() + 60.0 * self.cfg.parallel.distributed_timeout_minutes
        epoch = since
        while True:
            following = self.membership.record(epoch + 1)
            if following is not None:
                epoch += 1
                if following.stopping:
                    raise JobFailure(f"worker {topo.worker} asked to rejoin, but the job "
                                     f"stopped: {following.reason}")
                if topo.worker in following.members:
                    return epoch
                continue
            end = ended(store)
            if end is not None:
                if topo.coords["local"] == 0:
                    store.delete_key(f"{JOIN}{topo.worker}")
                raise JobFailure(end_message(topo.worker, end))
            if time.monotonic() > deadline:
                raise JobFailure(f"worker {topo.worker} asked to rejoin but was not admitted "
                                 "within --distributed-timeout-minutes (are the other workers "
                                 "running, with --diloco-min-workers?)")
            time.sleep(0.5)


class OutsideTheJob(JobFailure):
    """This worker is no longer a member (cut off, or the others went on without it).
    ``rejoin_when_reachable`` turns it into a restart of the worker's process, which rejoins
    as any restarted worker does; else it ends the run as a ``JobFailure``."""


def rejoin_when_reachable(outside: OutsideTheJob, timeout_s: float, hosts_store: bool,
                          address, environment: dict) -> None:
    """Wait (up to ``timeout_s``) until the rendezvous store (at ``address``, a
    ``distributed.StoreAddress``) answers, then restart this process with its own command
    line (same pid, environment and launcher), so that it comes back through the door as a
    restarted worker: a cut link heals by itself (``environment``: the process's own, as its
    launcher gave it). Raises a ``JobFailure``
    with ``outside``'s message when it cannot: this rank hosts the store (a restart would
    take the store with it), or the store stays away."""
    import os
    import sys
    import time

    if hosts_store:
        raise JobFailure(f"{outside}; stopping (this rank hosts the rendezvous store, so it "
                         "cannot restart to rejoin)")
    log.warning("%s; rejoining as a restarted worker once the rendezvous store answers "
                "(waiting up to %g s, --distributed-timeout-minutes)", outside, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _answers(address, 5.0)
            _connect(address, None, 5.0).check(["megatron_streaming/door/"])
            break
        except Exception as e:
            if time.monotonic() > deadline:
                raise JobFailure(f"{outside}; the rendezvous store stayed unreachable for "
                                 f"{timeout_s:g} s (--distributed-timeout-minutes): "
                                 f"{first_line(e)}") from None
            time.sleep(2.0)
    log.warning("the rendezvous store answers again: restarting this rank to rejoin")
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)


def _answers(address, seconds: float) -> None:
    """Raise unless the rendezvous store's port takes a connection within ``seconds`` (where
    the launcher named one)."""
    if address.known:
        address.answers(seconds)


def _connect(address, fallback, seconds: float = 60.0):
    """A fresh client of the job's rendezvous store (``fallback`` without a launcher)."""
    return address.client(seconds) if address.known else fallback

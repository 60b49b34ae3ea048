"""Stopping and failing cleanly: SIGTERM, lost ranks, and what the user is told.

* ``StopRequest`` turns SIGTERM (what SLURM sends at the time limit, or ``scancel``) into a
  flag; the training loop never dies inside a step.
* ``StopAgreement`` makes every rank of every worker stop after the *same* iteration, so the
  checkpoint written on the way out is one consistent job-wide checkpoint. A signal may reach
  only one cluster (one job per cluster), and ranks see it at different moments, so the flag is
  reduced every step: MAX over the worker (in-worker traffic, posted asynchronously and read
  on the host a step later, so the host never waits for the GPU to finish the step it just
  queued), then MAX over the rank's cross-worker control group, issued asynchronously and
  read ``--diloco-control-lag`` steps later (default 1; more when the link's latency, or a
  fragment queued ahead on it, exceeds a step), so no step waits for a round trip over the
  slow link. Every rank reads the same reduced value at the same iteration, hence the same
  decision. The same exchange notices a dead peer within a step.
* ``Liveness`` keeps a heartbeat (and the current iteration) per rank in the job's rendezvous
  store, on a background thread. When a collective fails, it tells a dead rank (heartbeat
  frozen, no exit note) from a live but stuck one, so the error names the lost rank. The same
  thread keeps a rank from training on as an orphan: when its launcher is gone (torchrun and
  the deepspeed launcher start ranks in sessions of their own, so a SIGKILL of the launcher
  leaves them running) or the rendezvous store has been unreachable for longer than
  ``--distributed-timeout-minutes``, it asks for a stop, which ``StopAgreement`` turns into a
  job-wide stop after the same iteration, with a checkpoint when ``--save`` is set.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm.crossworker import byte_count
from ..comm.serial import BoundedCalls
from ..errors import first_line
from ..parallel.topology import device_of

log = logging.getLogger("megatron_streaming")

HEARTBEAT_SECONDS = 1.0
# The longest any one call to the rendezvous store may take before the store counts as
# unreachable (a call over a link that went down blocks instead of failing).
STORE_CALL_SECONDS = 10.0
# Stop reasons that are not signals, above every signal number, so the MAX reduction of the
# stop flag carries them like one: --exit-duration-in-mins ran out; the rank's launcher is
# gone; the rendezvous store is unreachable.
EXIT_DURATION = 1000
LAUNCHER_GONE = 1001
RENDEZVOUS_GONE = 1002
_REASONS = {EXIT_DURATION: "exit-duration-in-mins", LAUNCHER_GONE: "launcher-gone",
            RENDEZVOUS_GONE: "rendezvous-unreachable"}


class StopRequest:
    """Records SIGTERM instead of dying; the loop checks ``received`` between steps."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.received: Optional[int] = None  # the signal's number
        # Elastic runs: a restarted worker asks to rejoin (seen by the job's leading rank in
        # the rendezvous store); carried by the stop flag so every live worker admits it
        # after the same step.
        self.join_pending = False
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.request(signum)

    def request(self, reason: int) -> None:
        """Ask to stop for ``reason`` (a signal number or ``EXIT_DURATION``); the first wins."""
        if self.received is None:
            self.received = int(reason)


class StopAgreement:
    """Decides, identically on every rank, after which iteration to stop."""

    def __init__(self, topology, request: StopRequest, lag: int = 1):
        self.request = request
        self.lag = lag
        self.worker_group = topology.groups["worker"]
        self.workers = topology.layout.workers
        self.cross = topology.cross
        self.device = device_of(self.worker_group)
        self._pending = collections.deque()  # (work, tensor) of the last ``lag`` steps
        self._in_worker: Optional[_HostRead] = None  # the worker's MAX posted a step ago
        self._outgoing = _PinnedFlags(self.device)  # where the flag leaves the host from
        self.carries_join = False  # elastic runs: the flag also says "a worker asks to join"
        self.join_agreed = False  # the flag just read asks every live worker to admit one
        # --async-save: the flag also carries the checkpoint being committed's progress on
        # this rank (``saves``: ``Checkpointer.progress``, four iterations), the first two
        # negated (so MAX is the minimum); ``saves_everywhere`` is what every rank of every
        # worker reported, as of the flag just read: every rank reads the same after the same
        # step (``Checkpointer.advance``).
        self.saves: Optional[Callable[[], Sequence[int]]] = None
        self.saves_everywhere = (0, 0, 0, 0)

    def release(self) -> None:
        """Drop the reductions posted on the control group of the epoch that ends."""
        self._pending.clear()

    def regroup(self) -> None:
        """Start afresh on a new membership's control group (every member does it after the
        same step); the reductions posted on the old one are dropped."""
        self.workers = self.cross.workers
        self.release()

    def should_stop(self) -> Optional[str]:
        """The name of the signal that stops every rank after this iteration, or None.

        Collective over the worker and (asynchronously) across workers; call once per step
        on every rank."""
        values = [self.request.received or 0]
        if self.carries_join:
            values.append(int(self.request.join_pending))
        if self.saves is not None:
            written, finalised, committed, failed = self.saves()
            values += [-written, -finalised, committed, failed]
        flag = self._outgoing.to_device(values)
        posted = _HostRead(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.worker_group,
                                           async_op=True), flag)
        self.join_agreed = False
        previous, self._in_worker = self._in_worker, posted
        # Every call posts one reduction across workers (their counts pair up), the first
        # one with nothing asked: nothing was posted a step before it.
        flag = previous.read() if previous is not None else torch.zeros_like(flag, device="cpu")
        if self.workers == 1:
            self._read_saves(flag)
            return _signal_name(int(flag[0]))
        try:
            work, posted = self.cross.all_reduce_control(flag, dist.ReduceOp.MAX,
                                                         async_op=True)
        except Exception as e:  # an elastic run goes on: no stop request from it
            self.cross.failed(e)
            return None
        self._pending.append((work, posted))
        if len(self._pending) <= self.lag:
            return None
        return self._finish_oldest()

    def _finish_oldest(self) -> Optional[str]:
        work, posted = self._pending.popleft()
        try:
            work.wait()
        except Exception as e:  # an elastic run goes on: no stop request from it
            self.cross.failed(e)
            return None
        self.join_agreed = self.carries_join and bool(posted[1].item())
        self._read_saves(posted)
        return _signal_name(int(posted[0].item()))

    def _read_saves(self, flag: torch.Tensor) -> None:
        if self.saves is not None:
            written, finalised, committed, failed = (int(v) for v in flag[-4:].tolist())
            self.saves_everywhere = (-written, -finalised, committed, failed)

    def close(self) -> None:
        """Completes the reductions still in flight (every rank issued the same ones)."""
        if self._in_worker is not None:
            self._in_worker.read()
            self._in_worker = None
        while self._pending:
            self._finish_oldest()


class _PinnedFlags:
    """The stop flag on its way to the device. On a GPU it is copied from pinned host memory
    allocated once: a copy from pageable memory would make the host wait for the device to
    finish the work queued before it (the step just queued). Two buffers per length, used in
    turn: a buffer is refilled two calls after its copy was queued, and in between the host
    waited for the in-worker reduction queued behind that copy (``_HostRead.read``), so the
    copy has finished. Elsewhere (gloo inside the worker) the flag is a fresh host tensor:
    the reduction posted with it may still be reading it when the next call comes."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: Dict[int, List[torch.Tensor]] = {}  # by the flag's length
        self._calls = 0

    def to_device(self, values: List[int]) -> torch.Tensor:
        flag = torch.tensor(values, dtype=torch.int32)
        if self.device.type != "cuda":
            return flag
        pair = self._buffers.get(len(values))
        if pair is None:
            pair = self._buffers[len(values)] = [
                torch.empty(len(values), dtype=torch.int32, pin_memory=True) for _ in range(2)]
        staged = pair[self._calls % 2]
        self._calls += 1
        staged.copy_(flag)
        return staged.to(self.device, non_blocking=True)


class _HostRead:
    """An in-worker reduction posted asynchronously, read on the host later. On a GPU its
    result is copied to pinned host memory right behind it on the stream and an event marks
    the copy, so reading it waits for that step's work only, not for the steps queued since."""

    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor, self.event = work, tensor, None
        if tensor.is_cuda:
            work.wait()  # NCCL: the stream waits for the reduction, the host does not
            self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.tensor.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        else:
            self.work.wait()
        return self.tensor


def beating(store, rank: int, seconds: float = 2.5 * HEARTBEAT_SECONDS) -> bool:
    """Whether ``rank``'s heartbeat (``Liveness``, this launch's restart count) moves in
    ``store`` within ``seconds``."""
    key = f"{Liveness.launch_prefix()}/beat/{rank}"
    before = store.add(key, 0)
    time.sleep(seconds)
    return store.add(key, 0) != before


class Liveness:
    """Per-rank heartbeat and progress in the rendezvous store (a few bytes a second)."""

    PREFIX = "megatron_streaming/liveness"

    def __init__(self, topology, address, interval: float = HEARTBEAT_SECONDS,
                 stop: Optional[StopRequest] = None, store_timeout: float = 600.0,
                 saves: bool = False):
        """``address``: the job's rendezvous store (``distributed.StoreAddress``)."""
        self.topology = topology
        # Where an orphaned rank asks to stop; whether that stop writes a checkpoint (--save).
        self.stop_request, self.store_timeout, self.saves = stop, store_timeout, saves
        # The launcher that started this rank, if one did (a lone process is left alone: its
        # parent is a shell, and a shell may go while the job goes on).
        launched = "LOCAL_RANK" in os.environ and (
            "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_SIZE" in os.environ)
        self.launcher = os.getppid() if launched and os.getppid() != 1 else None
        self._unreachable_since: Optional[float] = None
        self._retry_at = 0.0
        self.rank = topology.rank
        self.world = topology.layout.world_size
        self.interval = interval
        self.iteration = 0  # written by the training loop, published by the heartbeat
        self.address = address
        self.prefix = self.launch_prefix()
        self._calls = BoundedCalls("rendezvous-store")
        self.watch = None  # called with the store at every beat (``elastic``)
        self.store = self._connect()
        # The store lives with global rank 0: another worker's beats cross the link.
        self._cross = topology.cross if topology.worker != 0 else None
        self._stop = threading.Event()
        self._calls(self._beat, STORE_CALL_SECONDS)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _connect(self, seconds: float = 10.0):
        return self.address.client(seconds)

    @classmethod
    def launch_prefix(cls) -> str:
        """Where this launch's ranks keep their keys (a torchrun restart starts afresh)."""
        return f"{cls.PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _beat(self) -> None:
        beat, it, value = self._key("beat", self.rank), self._key("iteration", self.rank), \
            str(self.iteration)
        self.store.add(beat, 1)
        self.store.set(it, value)
        if self.watch is not None:  # elastic runs: the leader looks for workers asking in
            self.watch(self.store)
        if self._cross is not None:
            self._cross.count_control(byte_count(beat, it, value) + 16)  # + the counter

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.check_orphaned():
                return  # the store went with the launcher (torchrun's agent hosts it)
            now = time.monotonic()
            if self._unreachable_since is not None:
                if now - self._unreachable_since > self.store_timeout:
                    self._ask_stop(RENDEZVOUS_GONE, f"the rendezvous store {self.address} has "
                                   f"been unreachable for {self.store_timeout:g} s "
                                   "(--distributed-timeout-minutes)")
                    return
                if now < self._retry_at:
                    continue
            try:
                if self._unreachable_since is not None:  # it may be back (restarted)
                    self.store = self._calls(lambda: self._connect(
                        min(10.0, max(1.0, self.store_timeout / 10))), STORE_CALL_SECONDS)
                self._calls(self._beat, STORE_CALL_SECONDS)
                self._unreachable_since = None
            except Exception:  # the store is gone (or the link to it): stop if it stays so;
                # retry less and less often meanwhile (each failure logs a c10d warning)
                self._unreachable_since = self._unreachable_since or now
                self._retry_at = now + min(30.0, 2 * (now - self._unreachable_since)
                                           + self.interval)

    def check_orphaned(self) -> bool:
        """Ask for a stop if this rank's launcher is gone (the rank was re-parented)."""
        if self.launcher is None or os.getppid() == self.launcher:
            return False
        self._ask_stop(LAUNCHER_GONE, f"the launcher that started this rank (pid "
                       f"{self.launcher}) is gone")
        return True

    def _ask_stop(self, reason: int, why: str) -> None:
        if self.stop_request is None or self.stop_request.received is not None:
            return
        log.warning("rank %d: %s: stopping after the current iteration%s", self.rank, why,
                    ", with a checkpoint" if self.saves else "")
        self.stop_request.request(reason)

    def close(self) -> None:
        """Stop the heartbeat before the store's host may exit (end of a run)."""
        self._stop.set()
        self._thread.join(timeout=10)

    def mark_exiting(self, reason: str) -> None:
        """Tell the others this rank leaves on purpose (after an error it reported)."""
        try:
            self._calls(lambda: self.store.set(self._key("exiting", self.rank), reason[:200]),
                        2.0)
        except Exception:
            pass

    def survey(self, store=None) -> Dict[str, List[int]]:
        """Which ranks are dead (heartbeat frozen over a few periods, no exit note),
        which left after reporting an error, and each live rank's iteration. ``store``: a
        client of the rendezvous store to read through (default: the heartbeat's).

        Raises ``ConnectionError`` when the store itself cannot be reached (also when it does
        not answer within ``STORE_CALL_SECONDS``: a link that went down)."""
        store = store or self.store
        try:
            before = self._calls(lambda: self._read_beats(store), STORE_CALL_SECONDS)
            time.sleep(2.5 * self.interval)
            after = self._calls(lambda: self._read_beats(store), STORE_CALL_SECONDS)
            exiting, iterations = self._calls(lambda: self._read_notes(store),
                                              STORE_CALL_SECONDS)
        except Exception as e:
            raise ConnectionError(f"rendezvous store {self.address} unreachable: {e}") from None
        frozen = [r for r in range(self.world) if before[r] == after[r] and r != self.rank]
        return {"lost": [r for r in frozen if r not in exiting], "exiting": exiting,
                "iterations": iterations}

    def _read_beats(self, store) -> List[int]:
        return [store.add(self._key("beat", r), 0) for r in range(self.world)]

    def _read_notes(self, store):
        exiting = [r for r in range(self.world) if store.check([self._key("exiting", r)])]
        iterations = {r: int(store.get(self._key("iteration", r)))
                      for r in range(self.world) if store.check([self._key("iteration", r)])}
        return exiting, iterations

    def hosts_store(self) -> bool:
        """Global rank 0 hosts the store unless an agent (torchrun) or a standalone
        rendezvous (``--rendezvous-external``) does."""
        return self.rank == 0 and self.address.hosted_by == "rank0"

    def linger(self, lost: List[int], seconds: float = 8.0) -> None:
        """On the store's host: wait (bounded) until every rank that is not lost has left a
        note, so their diagnosis can still read the store. Bounded, because a peer blocked
        in a collective with this rank is only released when this process exits."""
        if not self.hosts_store():
            return
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                waiting = [r for r in range(self.world) if r not in lost and r != self.rank
                           and not self.store.check([self._key("exiting", r)])]
            except Exception:
                return
            if not waiting:
                return
            time.sleep(0.2)


def describe_rank(layout, rank: int) -> str:
    c = layout.coords(rank)
    axes = ", ".join(f"{a} {c[a]}" for a in ("tp", "sp", "dp", "pp")
                     if layout.axis_sizes()[a] > 1)
    return f"rank {rank} (worker {c['worker']}{', ' + axes if axes else ''})"


def failure_message(error: BaseException, layout, rank: int, iteration: int,
                    survey: Optional[dict], survey_error: Optional[str],
                    checkpoint: str, store_hosted_by: str) -> str:
    """One paragraph: what was lost, where this rank was, the last good checkpoint.
    ``store_hosted_by``: who hosts the rendezvous store (``StoreAddress.hosted_by``)."""
    # gloo appends advice to its errors ("This is typically caused by ..."): keep the fact.
    fact = first_line(error).split(". This is typically")[0]
    if survey_error:
        host = ("the standalone rendezvous" if store_hosted_by == "external"
                else describe_rank(layout, 0))
        who = (f"cannot tell which rank was lost: {survey_error} (its host, {host}, has "
               "exited or died, or the link to it is down; see its error)")
    elif survey["lost"]:
        who = "lost " + ", ".join(describe_rank(layout, r) for r in survey["lost"])
    else:
        behind = sorted((it, r) for r, it in survey["iterations"].items()
                        if r not in survey["exiting"] and it < iteration)
        who = "no rank died"
        if behind:
            who += "; stuck: " + ", ".join(f"{describe_rank(layout, r)} at iteration {it}"
                                           for it, r in behind[:8])
    return (f"{who}. {describe_rank(layout, rank)} stopped at iteration {iteration}: "
            f"{fact}. {checkpoint}")


def checkpoint_advice(save: Optional[str]) -> str:
    from ..checkpoint import CheckpointError, find_checkpoint

    if not save:
        return "No checkpoint: --save was not given."
    try:
        directory, meta = find_checkpoint(save)
    except CheckpointError:
        return f"No checkpoint was completed under --save {save}."
    return (f"Last good checkpoint: {directory} (iteration {meta['iteration']}); resume with "
            f"--load {save}.")


def _signal_name(number: int) -> Optional[str]:
    if number in _REASONS:
        return _REASONS[number]
    return signal.Signals(number).name if number else None



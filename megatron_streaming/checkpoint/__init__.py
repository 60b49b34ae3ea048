"""Checkpoints keyed by global parameter names, resumable under any layout.

Format: megatron-core's ``dist_checkpointing`` (Megatron-LM's ``torch_dist``, i.e.
``torch.distributed.checkpoint`` files): every rank writes its own tensor slices in parallel,
and a load under another TP / PP / SP / DP / ZeRO layout reads the boxes it needs from them.
What is stored (``job``, under the names of ``keys``), the JSON that describes it (``meta``),
how a resume under other flags is decided (``resume``), the directory and its checks
(``store``). ``python -m megatron_streaming.checkpoint`` inspects,
exports to and imports from Hugging Face and Megatron-LM. A checkpoint written by Megatron-LM
itself gives its weights to start from (``megatron_lm``).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Callable, List, Optional, Sequence

from ..errors import JobFailure, first_line
from .background import (COMMITTING, DONE, FINALISING, WRITING, FileWrite, PendingSave,
                         Runner, Staging, Task, in_place, read_json, shared_files, write_json)
from .meta import document
from .resume import FORMAT_VERSION, CheckpointError
from .store import (TRACKER, check_files, check_safe, check_writable, commit, file_table,
                    find_checkpoint, has_checkpoint, iteration_dir, prune, share, worker_part)

from . import megatron_lm

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpointer", "FORMAT_VERSION",
           "TRACKER", "check_loadable", "check_writable", "find_checkpoint", "has_checkpoint",
           "iteration_dir", "megatron_lm"]


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


# torch's checkpoint reader and writer report failures as a CheckpointException, which is a
# BaseException: caught alongside ordinary ones.
_ERRORS = (Exception, _checkpoint_exception())


class CheckpointWriteError(JobFailure):
    """A checkpoint that could not be written; the message names --save, the path and the
    checkpoint that is still the latest."""


class Checkpointer:
    """Saves and loads this rank's part of a job-wide checkpoint: each worker writes its own
    part (``store``), in its own world; the job's leading rank (``leads``) commits the whole.

    ``state`` objects (``job.JobState``) give ``sharded_state_dict()``, ``rank_info()`` and
    ``describe()``; ``failed_ranks(flag)`` is a collective over every rank of every worker that
    returns the ranks whose flag is set (``CrossWorker.ranks_reporting``); ``gather(obj)`` every
    rank of this worker's object, in rank order; ``gather_workers(obj)`` every worker's, in
    worker order (a collective of every rank; each worker's first rank's object counts);
    ``members()`` the job's workers now (their indices)."""

    def __init__(self, rank: int, failed_ranks: Callable[[bool], List[int]],
                 gather: Callable[[object], list], world: int = 1, worker: int = 0,
                 gather_workers: Callable[[object], list] = lambda obj: [obj],
                 leads: Optional[Callable[[], bool]] = None, local: Optional[int] = None,
                 members: Optional[Callable[[], Sequence[int]]] = None):
        from patches.megatron_save_plan import SavePlans

        self.rank = rank  # global
        self.world = world  # ranks per worker (this worker's)
        self.local = rank % world if local is None else local  # rank within the worker
        self.worker = worker
        self.failed_ranks = failed_ranks
        self.gather = gather
        self.gather_workers = gather_workers
        # Whether this rank commits for the job: global rank 0, or the first rank of the
        # lowest live worker once workers were lost (``elastic``).
        self.leads = leads or (lambda: rank == 0)
        self.members = members or (lambda: (worker,))
        self.staging = Staging()  # --async-save's copy of the tensors, kept between saves
        self.runner = Runner()  # --async-save's thread: the writes, the commits' stages
        self.plans = SavePlans()  # the latest save's plan, for the next of its structure

    def reserve_staging(self, state) -> int:
        """--async-save: make the host buffer the saves copy into now, beside training,
        instead of in the first save, start the thread they write on, and plan the saves
        (``plan_ahead``); returns the buffer's bytes. Collective within the worker, as
        ``state.sharded_state_dict`` is."""
        sharded = state.sharded_state_dict()
        self.runner.start()
        staged = self.staging.reserve(sharded)
        self.plan_ahead(sharded)
        return staged

    def plan_ahead(self, sharded: dict) -> None:
        """Plan a save of ``sharded`` now (megatron-core's validation and global metadata:
        collective within the worker), so that the saves of its structure plan on each rank
        alone. The planner makes a directory: a temporary one, made first, every rank of the
        worker learning whether each could (else nothing is planned)."""
        import tempfile

        try:
            directory = tempfile.mkdtemp(prefix="megatron-streaming-plan-")
        except OSError:
            directory = None
        try:
            if all(made is not None for made in self.gather(directory)):
                self.plans.plan_ahead(sharded, directory)
        finally:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def save(self, root: str, iteration: int, state, run_state: dict,
             keep_last: int = 0) -> str:
        """Write the checkpoint, then commit on the leading rank. A write that fails on any
        rank (disk full, read-only, no permission) fails the save on every rank with
        ``CheckpointWriteError``; the previous checkpoint stays the latest."""
        return self.finish_save(self.start_save(root, iteration, state, run_state),
                                keep_last)

    def start_save(self, root: str, iteration: int, state, run_state: dict,
                   background: bool = False) -> PendingSave:
        """Everything of a save that needs the step loop: this rank's tensors collected (and
        copied out when ``background``), the write planned; then its files written at once,
        or on a thread (``background``: ``PendingSave.written`` tells when).

        A save that plans afresh (the first, or one whose structure changed) plans with
        every rank of the worker (megatron-core's validation and global metadata), once the
        worker's first rank has checked the free space and told the others; one of the
        structure of the kept plan (``SavePlans``; ``plan_ahead``) plans, checks the space
        and writes on each rank alone (in the background all three on the write's thread,
        after the copy). Either way a failure is learnt by every rank at the
        commit; nothing here crosses between workers."""
        final = iteration_dir(root, iteration)
        partial = final + ".partial"
        part = f"worker{self.worker}"
        mine = os.path.join(partial, part)

        # No collective across workers here: each worker's ranks make their part of the
        # partial directory themselves, and what a crash mid-save left in it is removed at
        # the commit (``store.commit``: what the checkpoint does not list).
        t0 = time.perf_counter()
        sharded = state.sharded_state_dict()
        same = self.plans.matches(sharded)
        sharded = self.staging.snapshot(sharded) if background else in_place(sharded)
        t1 = time.perf_counter()
        gathered = self.gather(({**state.rank_info(), "keys": sorted(sharded)},
                                same))
        infos = [info for info, _ in gathered]
        need = sum(i.get("bytes", 0) for i in infos)
        reuse = all(same for _, same in gathered)  # the same on every rank of the worker
        request = []

        def make_part():  # a worker without the shared filesystem makes its own partial
            os.makedirs(mine, exist_ok=True)
            _check_space(mine, need)

        def plan():
            request.append(self.plans.request(sharded, mine, reuse))

        def part_and_plan():
            make_part()
            return self.plans.request(sharded, mine, True)

        if reuse and background:
            # The rest is this rank's alone, its tensors copied out: on the write's thread
            # (a failure there is flagged, as a failed write is).
            error, t2 = None, time.perf_counter()
            request.append(part_and_plan)
        elif reuse:  # this rank's own plan: no collective until the commit
            error = _attempt(make_part)
            t2 = time.perf_counter()
            error = error or _attempt(plan)
        else:
            # Inside the planner's collectives (within the worker) a failure on one rank
            # only would leave the others waiting: a disk that cannot take the save stops
            # every rank of the worker before them (its first rank checks).
            error = _attempt(make_part) if self.local == 0 else None
            t2 = time.perf_counter()
            if all(text is None for text in self.gather(_text(error))):
                error = _attempt(plan)
        # Any failure so far is learnt by every rank at the commit: a worker that plans
        # afresh and one that does not run the same collectives across workers.
        # On a GPU a synchronous save's device tensors are copied to host memory by its
        # write, in the step loop; a background save's were copied out above.
        report = _report(partial, part, self.local) if background and error is None else None
        write = FileWrite(request[0] if request else None, mine, report)
        t3 = time.perf_counter()
        pending = PendingSave(root, iteration, partial, final, part, infos, write,
                              {"collect": t1 - t0,
                               "describe": t2 - t1, "plan": t3 - t2},
                              run_state, state.describe, error)
        if background and error is None:
            write.start(self.runner)
        else:
            write.run()
        return pending

    # ---- the commit ----------------------------------------------------------------------
    # A save's commit has three stages after its start: every rank's files written, each
    # worker's part finalised by its first rank (torch's index and megatron-core's
    # metadata.json, from every rank's write results), the job's checkpoint committed by the
    # leading rank. ``finish_save`` runs them at once, with a collective between stages;
    # ``advance`` (--async-save) one at a time, on threads, each begun once every rank's flags
    # (``progress``, read by every rank after the same step: ``StopAgreement.saves``) say the
    # one before is done everywhere, the write results and each part's files going from
    # rank to rank through the partial directory (``.commit/``). The step loop then never
    # waits for another worker, nor for another rank of its own.

    def progress(self, pending: PendingSave) -> List[int]:
        """This rank's flags for ``pending``: the iteration (else 0) where its files are
        written, where its part of the worker's finalisation is done, where the job's commit
        is done (the leading rank), and where it failed (a rank that failed learns the rest
        at ``advance``). The first two count as their minimum over the job, the others as
        their maximum."""
        p, it = pending, pending.iteration
        if _own_error(p) is not None:
            return [0, 0, 0, it]
        ran = p.task is not None and p.task.done()
        written = it if p.write.done() else 0
        finalised = written if self.local != 0 else \
            it if p.stage in (COMMITTING, DONE) or (p.stage == FINALISING and ran) else 0
        committed = it if p.stage == COMMITTING and ran else 0
        return [written, finalised, committed, 0]

    def advance(self, pending: PendingSave, everywhere: Sequence[int],
                keep_last: int = 0) -> Optional[str]:
        """The next stage of ``pending``'s commit once ``everywhere`` (every rank's
        ``progress``, reduced over the job, the same on every rank) says the one before is done;
        returns the committed checkpoint's path when it is. Call it on every rank after the
        same steps. A failure on any rank fails the save on every rank, as ``finish_save``
        does (collective then)."""
        p, it = pending, pending.iteration
        t0 = time.perf_counter()
        try:
            written, finalised, committed, failed = everywhere
            if failed >= it:
                self._fail(p)
            if p.stage == WRITING and written >= it:
                p.stage = FINALISING
                if self.local == 0:
                    p.task = Task(lambda: _attempt(lambda: self._finalise_from_reports(p)),
                                  self.runner)
            elif p.stage == FINALISING and finalised >= it:
                p.stage, p.task = COMMITTING, None
                if self.leads():
                    p.task = Task(lambda: _attempt(lambda: self._commit_from_parts(
                        p, keep_last)), self.runner)
            elif p.stage == COMMITTING and committed >= it:
                p.stage = DONE
                self.timings = {**p.timings, "write": p.write.seconds["write"]}
                return p.final
            return None
        finally:
            p.timings["advance"] = p.timings.get("advance", 0.0) + time.perf_counter() - t0

    def finish_save(self, pending: PendingSave, keep_last: int = 0) -> str:
        """Wait for this rank's files of ``pending``, learn whether every rank's were written,
        finalise, and commit on the leading rank (every rank of every worker takes part),
        from whatever stage ``advance`` left it in; with ``keep_last`` the leading rank then
        deletes the older checkpoints beyond it. A failure on any rank (of the write, its
        plan, the finalisation or the commit) fails the save on every rank with
        ``CheckpointWriteError``; the previous checkpoint stays the latest."""
        p, write = pending, pending.write
        t0 = time.perf_counter()
        table = write.wait()
        t1 = time.perf_counter()
        if p.stage == WRITING:
            error = _own_error(p)
            # Over the worker: every rank's failure (None, or its text), files and results.
            reports = self.gather((self.rank, _text(error), table, write.results))
            failures = [(rank, text) for rank, text, _, _ in reports if text is not None]
            error = None
            if not failures and self.local == 0:
                error = _attempt(lambda: self._finalise(p, [(t, r) for _, _, t, r in reports]))
            p.stage = FINALISING
        else:
            failures = []
            error = p.task.wait() if p.task is not None else None
        finalized = time.perf_counter()
        if p.stage == FINALISING:
            if not failures:  # the worker's first rank's finalisation: every rank learns it
                failures = [(rank, text) for rank, text in self.gather((self.rank, _text(
                    error))) if text is not None]
            # Across workers: every worker's part (from its first rank) and failures (the
            # same on every rank of a worker).
            gathered = self.gather_workers((p.summary if self.local == 0 else None,
                                            failures))
            failures = _merged(fs for _, fs in gathered)
            if failures:
                self._failed(p.root, p.iteration, p.partial, [rank for rank, _ in failures],
                             failures[0][1])
            parts = [x for x, _ in gathered if x is not None]
            t2 = time.perf_counter()
            self._agree(p.root, p.iteration, p.partial,
                        (lambda: self._commit(p, parts, keep_last)) if self.leads() else None)
        else:  # the leading rank's commit began in ``advance``: every rank learns how it went
            t2 = time.perf_counter()
            self._fail_together(p.root, p.iteration, p.partial, error)
        p.stage = DONE
        # In the step loop's time: collect, describe, plan, waited (for this rank's files:
        # all of a synchronous write), finalize (every rank's files and results over the
        # worker, torch's index), gather (every worker's part, across workers: where the
        # worker ahead waits for the others) and commit.
        self.timings = {**p.timings, "write": write.seconds["write"],
                        "waited": t1 - t0, "finalize": finalized - t1,
                        "gather": t2 - finalized, "commit": time.perf_counter() - t2}
        return p.final

    def _finalise(self, p: PendingSave, reports: list) -> dict:
        """The worker's first rank: its part finalised from every rank's (table, write
        results), in rank order (``SavePlans.finish``); returns the part, its ranks' facts
        and its files, kept in ``p.summary``."""
        self.plans.finish([results for _, results in reports])
        mine = os.path.join(p.partial, p.part)
        tables = [table for table, _ in reports]
        tables[0] = {**tables[0], **file_table(mine, shared_files(mine))}  # the worker's
        p.summary = {"infos": p.infos,
                     "files": {f"{p.part}/{k}": v for t in tables for k, v in sorted(t.items())}}
        return p.summary

    def _finalise_from_reports(self, p: PendingSave) -> None:
        """``_finalise`` from the reports each rank wrote beside its files, then the part
        written for the leading rank (``advance``)."""
        from patches.megatron_checkpoint_writer import results_from_json

        reports = [(p.write.table, p.write.results)]
        for local in range(1, self.world):
            report = read_json(_report(p.partial, p.part, local))
            reports.append((report["table"], results_from_json(report["results"])))
        write_json(_report(p.partial, p.part), self._finalise(p, reports))

    def _commit_from_parts(self, p: PendingSave, keep_last: int) -> None:
        """The leading rank: the commit of every member worker's part (``advance``)."""
        self._commit(p, [read_json(_report(p.partial, f"worker{w}"))
                         for w in self.members()], keep_last)

    def _commit(self, p: PendingSave, parts: list, keep_last: int) -> None:
        every_rank = [i for x in parts for i in x["infos"]]
        meta = document(p.iteration, p.run_state, p.describe(every_rank),
                        {k: v for x in parts for k, v in sorted(x["files"].items())})
        commit(p.root, p.partial, p.final, meta)
        if keep_last:
            prune(p.root, keep_last)

    def _fail(self, p: PendingSave) -> None:
        """A save that failed on some rank (``advance``): every rank learns where and why,
        and raises ``CheckpointWriteError`` (collective)."""
        p.write.wait()
        if p.task is not None:
            p.task.wait()  # (what it raised, anything but an OSError, is raised here)
        error = _own_error(p)
        mine = [(rank, text) for rank, text in self.gather((self.rank, _text(error)))
                if text is not None]
        failures = _merged(self.gather_workers(mine))
        p.stage = DONE
        self._failed(p.root, p.iteration, p.partial, [rank for rank, _ in failures],
                     failures[0][1] if failures else None)

    def _fail_together(self, root: str, iteration: int, partial: str, error) -> None:
        """Every rank learns whether ``error`` (an OSError or None) happened on any rank;
        then every rank raises ``CheckpointWriteError`` or none does (collective)."""
        failed = self.failed_ranks(error is not None)
        if failed:
            self._failed(root, iteration, partial, failed, error)

    def _failed(self, root: str, iteration: int, partial: str, ranks: list, error) -> None:
        """The save failed on ``ranks`` (``error``: the first one's, or this rank's): the
        leading rank gives back the space it took; every rank raises the same way."""
        if self.leads():
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(_write_error_message(root, iteration, ranks, error))

    def _agree(self, root: str, iteration: int, partial: str, action) -> None:
        """Run ``action`` (None: nothing) and learn whether it failed on any rank; the
        collective doubles as the barrier between the phases of a save."""
        error = None
        if action is not None:
            try:
                action()
            except _ERRORS as e:  # OSError, or the writer's report of one
                error = _os_error(e)
                if error is None:
                    raise
        self._fail_together(root, iteration, partial, error)

    def verify(self, root: str, part: str) -> None:
        """Every file of the checkpoint's part ``part`` (``store.worker_part``), its SHA-256
        checked, each rank of the worker checking its share in parallel, and the pickled
        files' safety (the worker's first rank); every rank learns the verdict (collective)."""
        error = None
        directory, meta = find_checkpoint(root)
        try:
            files = sorted(f for f in meta["files"] if not part or f.startswith(part + "/"))
            check_files(root, directory, meta, hashes=set(share(files, self.local,
                                                                self.world)), part=part)
            if self.local == 0:
                check_safe(root, directory, (part,))
        except CheckpointError as e:
            error = e
        failed = self.failed_ranks(error is not None)
        if failed:
            if error is None:
                error = CheckpointError(f"--load {root}: a file of {directory} was altered "
                                        f"after it was written (see the message of rank "
                                        f"{failed[0]})")
            raise error

    def load(self, root: str, state, plan) -> dict:
        """Restore everything; returns the run state saved with it (iteration, ...)."""
        directory, meta = find_checkpoint(root)
        part = worker_part(meta, plan.part_worker)
        started = time.perf_counter()
        self.verify(root, part)
        self.timings = {"verify": time.perf_counter() - started}
        try:
            self.timings.update(state.load(directory, meta, plan, part) or {})
        except CheckpointError:
            raise
        except _ERRORS as e:
            if _is_read_error(e):
                raise CheckpointError(f"--load {root}: cannot read "
                                      f"{os.path.join(directory, part)}: "
                                      f"{first_line(e)}") from None
            raise
        return meta["run"]


def _attempt(action) -> Optional[OSError]:
    """Run ``action``; the OSError it raised (or the one behind the writer's report), or None.
    Anything else is raised."""
    try:
        action()
    except _ERRORS as e:
        error = _os_error(e)
        if error is None:
            raise
        return error
    return None


def _report(partial: str, part: str, local: Optional[int] = None) -> str:
    """Where a rank's write report (``local``), or a worker's finalised part, waits for the
    rank that reads it (``Checkpointer.advance``); the commit removes them (unlisted)."""
    name = part if local is None else f"{part}.rank{local}"
    return os.path.join(partial, ".commit", name + ".json")


def _own_error(p: PendingSave) -> Optional[OSError]:
    """This rank's failure of ``p`` so far: before its write (the plan, the free space), of
    its write, or of its stage's task (waiting for none of them); anything but an OSError is
    raised."""
    if p.error is not None:
        return p.error
    if p.write.done() and p.write.error is not None:
        error = _os_error(p.write.error)
        if error is None:
            raise p.write.error
        return error
    if p.task is not None and p.task.done():
        return p.task.wait()
    return None


def _merged(failure_lists) -> list:
    """(rank, text) of every failure in ``failure_lists`` (each a list of them), once per
    rank, in rank order."""
    every = {}
    for failures in failure_lists:
        for rank, text in failures:
            every.setdefault(rank, text)
    return sorted(every.items())


def _text(error: Optional[OSError]) -> Optional[str]:
    return None if error is None else str(error)


def _check_space(directory: str, tensor_bytes: int) -> None:
    import errno

    need = int(tensor_bytes * 1.02) + (1 << 20)  # torch's per-tensor headers, the metadata
    free = shutil.disk_usage(directory).free
    if need > free:
        raise OSError(errno.ENOSPC, f"No space left on device for the checkpoint "
                                    f"({need / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB "
                                    "free)")


def _os_error(e: BaseException):
    """The OSError behind ``e``, or None. torch's checkpoint writer reports a failed write
    (disk full) as a CheckpointException carrying each rank's failure as text."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            for failure in e.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure  # (exc, trace)
                found = _os_error(inner) if isinstance(inner, BaseException) else None
                text = first_line(inner).replace("Worker failure: ", "")
                return found or OSError(text)
            # No failure of its own: the writer failed on another rank, which reports it.
            return OSError("the checkpoint writer failed on another rank")
        e = e.__cause__ or e.__context__
    return None


def _is_read_error(e: BaseException) -> bool:
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(e, (OSError, pickle.UnpicklingError, EOFError, CheckpointException))


def _write_error_message(root: str, iteration: int, failed, error) -> str:
    mine = f": {error}" if error is not None else ""
    try:
        directory, _ = find_checkpoint(root)
        previous = f"the latest checkpoint is still {directory}"
    except CheckpointError:
        previous = "no earlier checkpoint exists there"
    return (f"--save {root}: writing the checkpoint of iteration {iteration} failed on "
            f"rank(s) {failed}{mine}; {previous}")


def check_loadable(root: str, cfg, layout, vocab_size=None):
    """The latest checkpoint's (directory, JSON), after checking that it fits this run and
    that its files are all there at their written sizes. Needs no process group, so a wrong
    --load fails before any collective."""
    from .resume import check_compatible

    directory, meta = find_checkpoint(root)
    check_files(root, directory, meta, hashes=False)
    check_compatible(root, meta, cfg, vocab_size)
    return directory, meta

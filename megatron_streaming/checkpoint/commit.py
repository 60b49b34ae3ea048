"""A save's commit: its three stages after the start of the save (``save_load``), on every
rank of every worker.

A save's commit has three stages after its start: every rank's files written, each worker's
part finalised by its first rank (torch's index and megatron-core's metadata.json, from every
rank's write results), the job's checkpoint committed by the leading rank. ``finish_save``
runs them at once, with a collective between stages; ``advance`` (--async-save) one at a time,
on threads, each begun once every rank's flags (``progress``, read by every rank after the same
step: ``StopAgreement.saves``) say the one before is done everywhere, the write results and
each part's files going from rank to rank through the partial directory (``.commit/``). The
step loop then never waits for another worker, nor for another rank of its own.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import List, Optional, Sequence

from .background import (COMMITTING, DONE, FINALISING, WRITING, PendingSave, Task, read_json,
                         shared_files, write_json)
from .failures import (ERRORS, CheckpointWriteError, attempt, merged, os_error, text_of,
                       write_error_message)
from .meta import document
from .store import commit, file_table, prune


class Commit:
    """The commit of a save that ``Checkpointer.start_save`` began; ``Checkpointer`` is one.
    It reads the checkpointer's rank (``rank``, ``local``, ``world``), collectives
    (``gather``, ``gather_workers``, ``failed_ranks``), ``leads``, ``members``, its thread
    (``runner``) and plans (``plans``), and leaves the latest save's ``timings``."""

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
                    p.task = Task(lambda: attempt(lambda: self._finalise_from_reports(p)),
                                  self.runner)
            elif p.stage == FINALISING and finalised >= it:
                p.stage, p.task = COMMITTING, None
                if self.leads():
                    p.task = Task(lambda: attempt(lambda: self._commit_from_parts(
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
            reports = self.gather((self.rank, text_of(error), table, write.results))
            failures = [(rank, text) for rank, text, _, _ in reports if text is not None]
            error = None
            if not failures and self.local == 0:
                error = attempt(lambda: self._finalise(p, [(t, r) for _, _, t, r in reports]))
            p.stage = FINALISING
        else:
            failures = []
            error = p.task.wait() if p.task is not None else None
        finalized = time.perf_counter()
        if p.stage == FINALISING:
            if not failures:  # the worker's first rank's finalisation: every rank learns it
                failures = [(rank, text) for rank, text in self.gather((self.rank, text_of(
                    error))) if text is not None]
            # Across workers: every worker's part (from its first rank) and failures (the
            # same on every rank of a worker).
            gathered = self.gather_workers((p.summary if self.local == 0 else None,
                                            failures))
            failures = merged(fs for _, fs in gathered)
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
            report = read_json(report_path(p.partial, p.part, local))
            reports.append((report["table"], results_from_json(report["results"])))
        write_json(report_path(p.partial, p.part), self._finalise(p, reports))

    def _commit_from_parts(self, p: PendingSave, keep_last: int) -> None:
        """The leading rank: the commit of every member worker's part (``advance``)."""
        self._commit(p, [read_json(report_path(p.partial, f"worker{w}"))
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
        mine = [(rank, text) for rank, text in self.gather((self.rank, text_of(error)))
                if text is not None]
        failures = merged(self.gather_workers(mine))
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
        raise CheckpointWriteError(write_error_message(root, iteration, ranks, error))

    def _agree(self, root: str, iteration: int, partial: str, action) -> None:
        """Run ``action`` (None: nothing) and learn whether it failed on any rank; the
        collective doubles as the barrier between the phases of a save."""
        error = None
        if action is not None:
            try:
                action()
            except ERRORS as e:  # OSError, or the writer's report of one
                error = os_error(e)
                if error is None:
                    raise
        self._fail_together(root, iteration, partial, error)


def report_path(partial: str, part: str, local: Optional[int] = None) -> str:
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
        error = os_error(p.write.error)
        if error is None:
            raise p.write.error
        return error
    if p.task is not None and p.task.done():
        return p.task.wait()
    return None

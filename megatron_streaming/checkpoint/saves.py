"""The run's checkpoints, one save at a time, from its start to its commit or its abandonment,
with their log lines (torchtitan's ``CheckpointManager`` holds its async staging the same way).

The step loop says "save now" (``start``), "advance the save" (``advance``, after each stop
flag), "finish it" (``finish``), and "drop it" when a worker is lost while one is written in the
background (``abandon``); the stop flag carries this rank's progress (``progress``). What a save
writes, and the stages of its commit, are the ``Checkpointer``'s (``save_load``, ``commit``).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

from .background import COMMITTING, PendingSave

log = logging.getLogger("megatron_streaming")


class Saves:
    """This rank's saves of a run: ``checkpointer`` (``save_load.Checkpointer``) writes
    ``state`` (``job.JobState``) as ``cfg`` (the checkpoint section: --save, --async-save,
    --keep-last) asks; ``failed(error)`` is told of a save that failed on the way
    (``CrossWorker.failed``: an elastic run goes on without the lost worker, anything else is
    raised there). Each method is called by every rank after the same step."""

    def __init__(self, checkpointer, state, cfg, failed: Callable[[Exception], None]):
        self.checkpointer, self.state, self.cfg, self.failed = checkpointer, state, cfg, failed
        self.pending: Optional[PendingSave] = None  # --async-save: the one being written
        self.last_saved: Optional[int] = None  # iteration of the latest checkpoint committed
        # --async-save's host buffer is sized after the first step, once the optimizer has
        # made its state (DeepSpeed makes the Adam moments at the first step).
        self.staging_due = bool(cfg.async_save and cfg.save)
        # --log-progress's file (``run.progress_log.ProgressLog``): a line per save started
        # in the background and per save committed; None: no lines.
        self.progress_log = None

    def reserve_staging(self) -> None:
        """--async-save, after the run's first step: the host buffer the saves copy into,
        their thread and their plan (``Checkpointer.reserve_staging``); once."""
        if not self.staging_due:
            return
        self.staging_due = False
        staged = self.checkpointer.reserve_staging(self.state)
        log.info("--async-save: %.2f GiB of host memory on this rank for the copies of the "
                 "checkpoints written in the background, made beside the next steps; the "
                 "saves' plan made now", staged / 2**30)

    def start(self, iteration: int, run_state: dict, wait: bool = False) -> None:
        """Checkpoint ``iteration`` (``run_state``: the run's position, kept in the JSON); with
        --async-save (unless ``wait``) the files are written in the background and committed
        by ``advance`` or ``finish``. A save in flight is committed first: one at a time."""
        self.finish(iteration, "the next checkpoint is due")
        background = self.cfg.async_save and not wait
        try:
            pending = self.checkpointer.start_save(self.cfg.save, iteration, self.state,
                                                   run_state, background=background)
        except Exception as e:
            self._failed(e, iteration)
            return
        t = pending.timings
        if background:
            self.pending = pending
            if self.progress_log is not None:
                self.progress_log.saving_in_background(iteration)
            log.info("checkpoint of iteration %d: writing in the background (the step loop "
                     "waited %.2f s: collect and copy out %.2f s, plan %.2f s)",
                     iteration, sum(t.values()), t["collect"] + t["describe"], t["plan"])
            return
        self._commit(pending, iteration)

    def progress(self) -> list:
        """The checkpoint being written's progress on this rank, for the stop flag
        (``StopAgreement.saves``)."""
        if self.pending is None:
            return [0, 0, 0, 0]
        return self.checkpointer.progress(self.pending)

    def advance(self, iteration: int, everywhere: Sequence[int]) -> None:
        """The commit of the checkpoint being written, if any, a stage further where every
        rank's flags say so (``everywhere``: ``StopAgreement.saves_everywhere``;
        ``Checkpointer.advance``): no wait for another rank."""
        pending = self.pending
        if pending is None:
            return
        try:
            path = self.checkpointer.advance(pending, everywhere, self.cfg.keep_last)
        except Exception as e:
            self.pending = None
            self._failed(e, pending.iteration)
            return
        if path is not None:
            self.pending = None
            self.last_saved = pending.iteration
            if self.progress_log is not None:
                self.progress_log.saved(pending.iteration, background=True)
            t = self.checkpointer.timings
            log.info("saved checkpoint %s at iteration %d (written and hashed in the "
                     "background in %.2f s, committed in the background, %d steps after "
                     "the save; the step loop waited %.2f s at the start and %.2f s since)",
                     path, iteration, t["write"], iteration - pending.iteration,
                     t["collect"] + t["describe"] + t["plan"], t["advance"])

    def finish(self, iteration: int, why: Optional[str] = None) -> None:
        """Commit the checkpoint being written, if any (waiting for its files; ``why``: the
        reason to wait, logged). Collective: every rank calls it after the same step."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if why and not pending.written():
            log.info("waiting for the checkpoint of iteration %d to be written (%s)",
                     pending.iteration, why)
        self._commit(pending, iteration)

    def _commit(self, pending: PendingSave, iteration: int) -> None:
        try:
            path = self.checkpointer.finish_save(pending, self.cfg.keep_last)
        except Exception as e:
            self._failed(e, pending.iteration)
            return
        self.last_saved = pending.iteration
        if self.progress_log is not None:
            self.progress_log.saved(pending.iteration,
                                    background=pending.write.is_background())
        t = self.checkpointer.timings
        if pending.write.is_background():
            log.info("saved checkpoint %s at iteration %d (written and hashed in the "
                     "background in %.2f s; the step loop waited %.2f s at the start and "
                     "%.2f s at the commit, %.2f s of it in the gather across workers)", path,
                     iteration, t["write"], t["collect"] + t["describe"] + t["plan"],
                     t["waited"] + t["finalize"] + t["gather"] + t["commit"], t["gather"])
        else:
            log.info("saved checkpoint %s in %.2f s (gather %.2f s, write and hash %.2f s)",
                     path, sum(t.values()), t["collect"] + t["describe"],
                     t["plan"] + t["write"])

    def abandon(self) -> None:
        """A worker was lost while a checkpoint was being written in the background: not
        committed, as a synchronous save that loses a worker is not (its part and the
        exchanges in flight went with it); training goes on. This rank's files and its
        stage of the commit are let finish first; the partial directory stays, as after a
        synchronous save's loss. A commit already begun (every part finalised) goes on."""
        pending = self.pending
        if pending is None or pending.stage == COMMITTING:
            return
        self.pending = None
        pending.write.wait()
        if pending.task is not None:
            pending.task.wait()
        log.warning("the checkpoint of iteration %d was not written: a worker was lost while "
                    "it was being written in the background; training goes on",
                    pending.iteration)

    def _failed(self, error: Exception, iteration: int) -> None:
        # A worker lost during the save: not committed; elastic runs go on (anything else,
        # or a run that tolerates no loss, raises here).
        self.failed(error)
        log.warning("the checkpoint of iteration %d was not written: a cross-worker "
                    "collective failed during it (a lost worker); training goes on", iteration)

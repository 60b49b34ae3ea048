"""The run: set-up, the training loop, evaluation, checkpoints and the summary.

``pretrain(cfg)`` is what ``pretrain_gpt.py`` calls. Order matters: everything that can be
checked without other processes (flags, files, tokenizer) is checked before the first
collective, so a bad flag fails fast on every rank with the same message.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from ..config import Config

log = logging.getLogger("megatron_streaming")


class Run:
    """The objects of one rank's run, built once by ``setup``; a context manager:

        with Run(cfg) as run:      # setup(); the sync is hooked into the inner optimizer
            run.train()
                                   # close(): hooks detached, TensorBoard flushed, heartbeat
                                   # stopped; also when the block raises, and when setup
                                   # itself fails (a bad --load, say)
    """

    def __init__(self, cfg: Config, extensions=()):
        self.cfg = cfg
        # Callables run -> step hook (an object with before_step(step) and after_step()),
        # appended to the engine's after the sync's: drills and tests inject faults this way.
        self.extensions = list(extensions)
        self.start_time = time.perf_counter()
        self.rejoin = None  # the membership record of a running job this worker rejoins
        self.launch_environment = dict(os.environ)  # as launched: a restart to rejoin uses it
        self.collector = None  # Python's garbage collector in training (``collector``)

    def setup(self) -> "Run":
        """Everything a rank needs, built in dependency order."""
        from ..checkpoint.saves import Saves
        from ..job.elastic import Elastic
        from ..job.lifecycle import Liveness, StopAgreement, StopRequest
        from . import build
        from .collector import GarbageCollection
        from .metrics import setup_logging
        from .report import RunReport
        from .start import say_at_start, start_processes

        cfg, p = self.cfg, self.cfg.parallel
        self.stop_request = StopRequest()  # first: a SIGTERM during set-up is kept, too
        self.stopped_by = None  # the signal that ended training early
        started = start_processes(cfg)
        self.topology, self.tokenizer, self.job = started.topology, started.tokenizer, \
            started.job
        self.resume, self.resume_plan, self.rejoin = started.resume, started.resume_plan, \
            started.rejoin
        self.own_processes, self.patches = started.own_processes, started.patches
        self.rendezvous = started.rendezvous
        self._closed = False  # from here on there is something for ``close`` to stop
        self.liveness = Liveness(self.topology, self.rendezvous, stop=self.stop_request,
                                 store_timeout=60.0 * p.distributed_timeout_minutes,
                                 saves=bool(cfg.checkpoint.save))
        self.stop = StopAgreement(self.topology, self.stop_request,
                                  cfg.streaming.diloco_control_lag)
        self.reports = self.topology.is_logging_rank()  # progress lines, the writers
        setup_logging(self.reports)
        say_at_start(cfg, started)
        # A worker rejoining a running job takes its state from a live worker instead.
        self.weights_from = None if self.rejoin else started.weights_from
        self.model = build.build_model(cfg, self.topology, self.tokenizer.vocab_size,
                                       self.reports, self.weights_from)
        self.engine, self.sync = build.build_engine_and_sync(cfg, self.topology, self.model,
                                                             self.job)
        self.checkpointer, self.job_state = build.build_checkpointing(
            cfg, self.topology, self.model, self.engine, self.sync, self.tokenizer.vocab_size)
        self.saves = Saves(self.checkpointer, self.job_state, cfg.checkpoint,
                           self.topology.cross.failed)  # from start to commit, one at a time
        if cfg.checkpoint.async_save:
            self.stop.saves = self.saves.progress
        self.sync.attach(self.engine.inner_optimizer, self.engine.step_hooks)
        self.report = RunReport(cfg, self.topology, self.model, self.engine, self.sync)
        self.collector = GarbageCollection.from_config(cfg.training)
        self.writer = None  # made below, once the data is known (a rejoining worker: joined)
        self.elastic = Elastic(cfg, self.topology, self.sync, self.stop, self.stop_request,
                               self.liveness, self.job, self.rendezvous, self.report_from_here,
                               self.collector.collect_everything)
        for make in self.extensions:
            self.engine.step_hooks.append(make(self))
        self.iteration = 0
        self.last_valid = (None, None)  # (iteration, loss) of the latest evaluation
        self.step_seconds = []
        self._throughput = None  # made by ``train``: evaluations are taken out of its times
        run_state = self._take_state()
        from ..data.inputs import RunData
        from .metrics import make_writer

        self.data = RunData(self.cfg, self.topology, self.tokenizer, self.job)
        self._check_data_position(run_state)
        self.writer = make_writer(self.cfg.logging, self.reports, self.cfg)
        from .progress_log import ProgressLog

        self.progress = ProgressLog.of(self)  # --log-progress: progress.txt in --save
        self.progress.job_started()
        self.saves.progress_log = self.progress  # a line per save started and committed
        return self

    @property
    def last_saved(self) -> Optional[int]:
        """The iteration of the latest checkpoint this run wrote (None: none yet)."""
        return self.saves.last_saved

    def _take_state(self) -> Optional[dict]:
        """The state to start from: a live worker's (a restarted worker rejoining), the
        checkpoint's (``--load``; its run state is returned), or the initial one."""
        if self.rejoin is not None:  # the state from a live worker, not from --load
            self.resume = None
            self.iteration = self.elastic.join(self.rejoin.epoch)
        if self.weights_from is not None:
            return self._from_megatron_lm(self.weights_from)
        if not self.resume:
            return None
        started = time.perf_counter()
        run_state = self.checkpointer.load(self.resume, self.job_state, self.resume_plan)
        self.iteration = run_state["iteration"]
        t = self.checkpointer.timings
        log.info("resumed from %s at iteration %d (loaded in %.2f s: verify %.2f s, read "
                 "%.2f s, restore %.2f s)", self.resume, self.iteration,
                 time.perf_counter() - started, t["verify"], t.get("read", 0.0),
                 t.get("restore", 0.0))
        for note in self.resume_plan.notes:
            log.warning("%s", note)
        return run_state

    def _from_megatron_lm(self, source) -> dict:
        """A Megatron-LM checkpoint's weights are in the model already (``build``): the run
        goes on from its iteration (0 with --finetune), everything else fresh."""
        finetune = self.cfg.checkpoint.finetune
        self.iteration = 0 if finetune else source.iteration
        if self.reports:
            for note in source.notes:
                log.warning("%s", note)
        log.info("started from the weights of the Megatron-LM checkpoint %s at iteration %d%s; "
                 "its optimizer, RNG and data-iterator states are not read: the inner "
                 "optimizer and the sync start fresh from these weights", source.directory,
                 self.iteration, " (--finetune)" if finetune else "")
        return {"iteration": self.iteration,
                "consumed_samples": None if finetune else source.consumed_samples}

    def report_from_here(self, reports: bool) -> None:
        """This rank starts or stops reporting for the job (the lowest live worker's ranks
        report: ``elastic`` moves it when the membership changes)."""
        from .metrics import make_writer, setup_logging

        if reports == self.reports:
            return
        setup_logging(reports)
        self.reports = reports
        if self.writer is not None:
            self.writer.close()
            self.writer = make_writer(self.cfg.logging, reports, self.cfg)

    def __enter__(self) -> "Run":
        try:
            return self.setup()
        except BaseException:  # ``with`` calls no __exit__ then: stop what setup started
            self.close()  # (a heartbeat left in a store call aborts the interpreter's exit)
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Release what ``setup`` hooked in or started, without any collective (so also
        after a failure: exchanges still in flight are left to the process's end, as a peer
        may never answer them). Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for part, release in (("sync", "detach"), ("writer", "close"), ("liveness", "close"),
                              ("collector", "stop")):
            made = getattr(self, part, None)  # a failed setup may not have made it
            if made is not None:
                getattr(made, release)()

    # ---- evaluation ----------------------------------------------------------------------
    def evaluate(self, split: str) -> Optional[float]:
        """Mean loss over ``--eval-iters`` fixed batches (on the last stage; else None), with
        the global parameters when the sync is on (``--eval-params global``)."""
        import contextlib

        iterator = self.data.eval_iterator(split)
        if iterator is None:
            return None
        use_global = self.cfg.streaming.eval_params == "global"
        with self.sync.global_parameters() if use_global else contextlib.nullcontext():
            losses = [self.engine.eval_step(iterator)
                      for _ in range(self.cfg.training.eval_iters)]
        return None if losses[0] is None else sum(losses) / len(losses)

    def _report_eval(self, split: str) -> Optional[float]:
        started = time.perf_counter()
        self.collector.before_eval()
        loss = self.evaluate(split)
        self.collector.after_eval()
        if self._throughput is not None:  # not in Megatron-LM's iteration-time either
            self._throughput.exclude(time.perf_counter() - started)
        if loss is not None and self.topology.is_logging_rank():
            log.info("%s loss at iteration %d: %.6f", split, self.iteration, loss)
            self.writer.scalars(self.iteration, eval_scalars(split, loss, self.cfg.logging),
                                samples=self.data.samples_through(self.iteration),
                                legacy={f"{split}/loss": loss})
        return loss

    # ---- training -----------------------------------------------------------------------
    def train(self) -> Optional[float]:
        from .metrics import Throughput

        cfg, t = self.cfg, self.cfg.training
        throughput = self._throughput = Throughput(self.data.tokens_through, self.iteration)
        iterator = self.data.train_iterator(self.iteration)
        # The latest step's report: its loss is read on the host (a wait for the device) at
        # log steps only, and once at the end.
        result = None
        self.collector.start()  # the set-up's objects out of every later collection's walk
        while self.iteration < t.train_iters:
            started = time.perf_counter()
            result = self.engine.train_step(iterator, self.iteration)
            self.step_seconds.append(time.perf_counter() - started)
            self.engine.timers.add("diloco-sync", self.sync.take_hook_seconds())
            self.iteration += 1
            self.liveness.iteration = self.iteration
            self.saves.reserve_staging()  # after the first step (--async-save)
            if self.iteration == t.train_iters:
                merged = self.sync.finish()
                if merged:
                    log.info("merged %d fragment exchange(s) still in flight after the last "
                             "step", merged)
            members = self.topology.members
            self.elastic.end_of_step(self.iteration)  # a lost worker: the others go on
            if set(self.topology.members) < set(members):
                self.saves.abandon()  # a save in the background: dropped
            if self.elastic.catching_up:  # up to the step the other survivors reached: no
                continue  # save, no stop flag (they are past this step's)
            if self.elastic.stopping:  # too few workers alive: a checkpoint, then out
                self.stopped_by = "too-few-workers"
                break
            if self.report.due(self.iteration):
                self.report.log_step(self.iteration, result, throughput, self.data,
                                     self.writer, self.step_seconds[-1])
            if t.eval_interval and self.iteration % t.eval_interval == 0:
                self.last_valid = (self.iteration, self._report_eval("valid"))
            interval = cfg.checkpoint.save_interval
            if interval and self.iteration % interval == 0:
                self.save()
            self.collector.after_step(self.iteration)
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                log.info("exiting at iteration %d (--exit-interval %d)", self.iteration,
                         t.exit_interval)
                break
            self._check_duration()
            self.stopped_by = self.stop.should_stop()
            self.saves.advance(self.iteration, self.stop.saves_everywhere)  # where due
            if self.stopped_by:
                log.info("stopping after iteration %d: %s", self.iteration, self.stopped_by)
                break
            if self.stop.join_agreed:  # a save in flight is committed before a worker joins
                self.finish_saving("a worker joins")  # (it has no part in it)
            self.elastic.after_stop_flag(self.iteration)  # a restarted worker comes in
        return None if result is None else result.loss

    def _check_duration(self) -> None:
        """--exit-duration-in-mins: past it, this rank asks to stop; the stop agreement then
        stops every rank of every worker after the same iteration, as SIGTERM does."""
        limit = self.cfg.training.exit_duration_in_mins
        if limit and time.perf_counter() - self.start_time > 60.0 * limit:
            from ..job.lifecycle import EXIT_DURATION

            self.stop_request.request(EXIT_DURATION)

    def _check_data_position(self, run_state: Optional[dict]) -> None:
        """The checkpoint's consumed samples against the batch schedule's: they differ only
        when the batch flags changed since it was written (the data position follows the
        flags)."""
        saved = (run_state or {}).get("consumed_samples")
        if saved is not None and saved != self.data.samples_through(self.iteration):
            log.warning("the checkpoint had consumed %d training samples by iteration %d; "
                        "with these batch flags it is %d, and the data continues from there",
                        saved, self.iteration, self.data.samples_through(self.iteration))

    def save(self, wait: bool = False) -> None:
        """Checkpoint this iteration (``Saves.start``: in the background with --async-save,
        unless ``wait``)."""
        run_state = {"iteration": self.iteration,
                     "consumed_samples": self.data.samples_through(self.iteration),
                     "tokens": self.data.tokens_through(self.iteration)}
        self.saves.start(self.iteration, run_state, wait)

    def finish_saving(self, why: Optional[str] = None) -> None:
        """Commit the checkpoint being written, if any (``Saves.finish``). Collective."""
        self.saves.finish(self.iteration, why)


def eval_scalars(split: str, loss: float, logging_cfg) -> dict:
    """An evaluation's scalars as Megatron-LM's ``evaluate_and_print_results`` names them:
    ``lm loss validation`` and, with --log-validation-ppl-to-tensorboard, ``lm loss
    validation ppl`` = exp(min(20, loss)). The test split is ``lm loss test`` (Megatron-LM
    writes its test loss as a second ``lm loss validation`` point at the last iteration,
    which no dashboard can tell from the validation one)."""
    import math

    name = "lm loss validation" if split == "valid" else f"lm loss {split}"
    out = {name: loss}
    if logging_cfg.log_validation_ppl_to_tensorboard:
        out[f"{name} ppl"] = math.exp(min(20.0, loss))
    return out


def pretrain(cfg: Config, extensions=()) -> Optional[dict]:
    """Train (unless --skip-train), evaluate, save; returns the summary on the logging rank.
    ``extensions``: see ``Run``.

    A communication failure (a lost or stuck peer) ends in ``JobFailure`` naming the lost
    rank and the last good checkpoint; SIGTERM ends in a checkpoint and a normal return."""
    from ..job.elastic import OutsideTheJob, rejoin_when_reachable

    with Run(cfg, extensions) as run:
        try:
            return _train_and_report(run)
        except OutsideTheJob as e:  # cut off or left behind: rejoin, after Run.close
            if not run.own_processes:  # embedded: the caller's process is not ours to restart
                raise
            outside, hosts_store = e, run.liveness.hosts_store()
        except Exception as e:
            raise _failure(run, e)
    rejoin_when_reachable(outside, 60.0 * cfg.parallel.distributed_timeout_minutes,
                          hosts_store, run.rendezvous, run.launch_environment)


def _failure(run: Run, error: Exception) -> Exception:
    """What ``pretrain`` raises for ``error`` from ``run``: a communication failure becomes a
    ``JobFailure`` naming the lost (or stuck) ranks and the last good checkpoint; anything
    else (a bug, bad input) is returned unchanged."""
    from ..comm.failures import is_communication_error
    from ..errors import JobFailure, UsageError
    from ..job import lifecycle

    if isinstance(error, UsageError) or not is_communication_error(error):
        return error
    survey, survey_error = None, None
    try:
        survey = run.liveness.survey()
    except ConnectionError as e:
        survey_error = str(e)
    message = lifecycle.failure_message(
        error, run.topology.layout, run.topology.rank, run.iteration, survey,
        survey_error, lifecycle.checkpoint_advice(run.cfg.checkpoint.save),
        run.rendezvous.hosted_by)
    run.liveness.mark_exiting(message)
    run.liveness.linger(survey["lost"] if survey else [])
    failure = JobFailure(message)
    failure.__cause__ = error
    return failure


def _train_and_report(run: Run) -> Optional[dict]:
    from .metrics import write_summary

    cfg = run.cfg
    train_loss = None
    if not cfg.training.skip_train:
        train_loss = run.train()
        if cfg.checkpoint.save:
            run.finish_saving("training ends" if run.stopped_by is None else run.stopped_by)
            if run.last_saved != run.iteration:
                run.save(wait=True)
        if run.elastic.stopping:
            from ..errors import JobFailure
            from ..job.lifecycle import checkpoint_advice

            raise JobFailure(f"{run.elastic.stopping}. "
                             f"{checkpoint_advice(cfg.checkpoint.save)}")
    evaluated_at, valid_loss = run.last_valid
    test_loss = None
    if run.stopped_by is None:  # a stop request leaves at once: no extra evaluation
        if evaluated_at != run.iteration:
            valid_loss = run._report_eval("valid")
        test_loss = run._report_eval("test")
    run.stop.close()
    run.sync.close()  # finishes exchanges still in flight, so the byte count is final
    peak = run.report.peak_memory_mib()
    sync_bytes = run.report.cross_worker_bytes()
    control_bytes = run.topology.cross.total_control_bytes()
    parameters = run.report.parameter_count()
    summary = None
    if run.topology.is_logging_rank():
        summary = run.report.summary(run, train_loss, valid_loss, test_loss, peak, sync_bytes,
                                     parameters, control_bytes)
        if run.sync.enabled:  # the job-wide count, the summary's: one source for both
            run.writer.scalars(run.iteration,
                               {"streaming/cross_worker_control_bytes": control_bytes})
        if cfg.logging.summary_json:
            write_summary(cfg.logging.summary_json, summary)
        log.info("done: %s", summary)
    run.close()
    run.topology.cross.job_barrier()
    return summary

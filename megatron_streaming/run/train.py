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

from ..cli.arguments import validate, world_size_from_env
from ..config import Config

log = logging.getLogger("megatron_streaming")


class Run:
    """The objects of one rank's run, built once by ``setup``; a context manager:

        with Run(cfg) as run:      # setup(); the sync is hooked into the inner optimizer
            run.train()
                                   # close(): hooks detached, TensorBoard flushed, heartbeat
                                   # stopped; also when the block raises
    """

    def __init__(self, cfg: Config, extensions=()):
        self.cfg = cfg
        # Callables run -> step hook (an object with before_step(step) and after_step()),
        # appended to the engine's after the sync's: drills and tests inject faults this way.
        self.extensions = list(extensions)
        self.start_time = time.perf_counter()
        self.rejoin = None  # the membership record of a running job this worker rejoins
        self.launch_environment = dict(os.environ)  # as launched: a restart to rejoin uses it

    def setup(self) -> "Run":
        """Everything a rank needs, built in dependency order."""
        from ..job.lifecycle import StopRequest

        self.stop_request = StopRequest()  # first: a SIGTERM during set-up is kept, too
        self.stopped_by = None  # the signal that ended training early
        self._start_processes()
        self._build_model()
        self._build_engine_and_sync()
        self.sync.attach(self.engine.inner_optimizer, self.engine.step_hooks)
        self.writer = None  # made below, once the data is known (a rejoining worker: joined)
        from ..job.elastic import Elastic

        self.elastic = Elastic(self)
        for make in self.extensions:
            self.engine.step_hooks.append(make(self))
        self.iteration = 0
        self.last_valid = (None, None)  # (iteration, loss) of the latest evaluation
        self.last_saved = None  # iteration of the latest checkpoint this run wrote
        self.step_seconds = []
        run_state = None
        if self.rejoin is not None:  # the state from a live worker, not from --load
            self.resume = None
            self.iteration = self.elastic.join(self.rejoin.epoch)
        if self.resume:
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
        from ..data.inputs import RunData
        from .metrics import make_writer

        self.data = RunData(self.cfg, self.topology, self.tokenizer, self.job)
        self._check_data_position(run_state)
        self.writer = make_writer(self.cfg.logging, self.reports, self.cfg)
        self._closed = False
        return self

    def report_from_here(self, reports: bool) -> None:
        """This rank starts or stops reporting for the job (the lowest live worker's ranks
        report: ``elastic`` moves it when the membership changes)."""
        from .metrics import make_writer, setup_logging

        setup_logging(reports)
        self.reports = reports
        if self.writer is not None:
            self.writer.close()
            self.writer = make_writer(self.cfg.logging, reports, self.cfg)

    def __enter__(self) -> "Run":
        return self.setup()

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
        self.sync.detach()
        self.writer.close()
        self.liveness.close()

    def _start_processes(self) -> None:
        """Check what can be checked alone, then join the process groups."""
        import datetime
        import os

        import patches

        from ..parallel import distributed, slurm
        from ..data.inputs import load_run_tokenizer
        from .metrics import setup_logging
        from ..parallel.topology import RankLayout, Topology

        cfg, p, s = self.cfg, self.cfg.parallel, self.cfg.streaming
        launched_by = None if distributed.is_initialized() else \
            slurm.task_environment(os.environ)  # a bare srun: its tasks as the job's ranks
        own_host = distributed.join_worker_launch(os.environ, s.diloco_workers,
                                                  s.diloco_worker_index, p.master_addr,
                                                  p.master_port)
        world = world_size_from_env()
        validate(cfg, world)
        layout = RankLayout(world, s.diloco_workers, p.tensor_model_parallel_size,
                            p.pipeline_model_parallel_size, p.ds_sequence_parallel_size)
        if cfg.checkpoint.save:
            from ..checkpoint import check_writable

            check_writable(cfg.checkpoint.save, int(os.environ.get("RANK", "0")))
        self.tokenizer = load_run_tokenizer(cfg)
        self.resume = self._resume_source(layout)
        self.patches = patches.apply()
        door = store = world_store = None
        crossed = 0  # bytes through the job's store to find this worker's own
        from ..job.workers import JobShape, WorkerShape, check, from_records

        shape = WorkerShape.of(cfg, layout)
        self.job = JobShape.uniform(shape, layout.workers)  # every worker's, from the door
        self.own_processes = not distributed.is_initialized()  # else embedded: the world
        if self.own_processes:  # exists already
            from ..job.door import Door, fingerprint

            store, self.rendezvous = distributed.rendezvous_store(
                p.distributed_timeout_minutes, p.rendezvous_external)
            rank = int(os.environ["RANK"])
            coords = layout.coords(rank)
            door = Door(store, coords["worker"], layout.workers, coords["local"],
                        datetime.timedelta(minutes=p.distributed_timeout_minutes))
            self.rejoin = self._running_job(store, coords["worker"], coords["local"],
                                            layout.ranks_per_worker)
            if self.rejoin is None:
                shapes = door.agree(fingerprint(cfg, layout, self.tokenizer), shape.settings())
            else:
                from ..job.lifecycle import beating

                first = door.first_rank(coords["worker"])  # it claims for the worker
                shapes = door.rejoin(fingerprint(cfg, layout, self.tokenizer),
                                     self.rejoin.epoch, self.rejoin.members,
                                     lambda: not beating(store, first), shape.settings())
            self.job = from_records(shapes)
            check(self.job, cfg)
            sizes = tuple(w.ranks for w in self.job.workers)
            if len(set(sizes)) > 1:  # workers of their own sizes: number the job's ranks
                layout = RankLayout(sum(sizes), layout.workers, layout.tp, layout.pp,
                                    layout.sp, sizes=sizes, worker=coords["worker"])
                distributed.renumber(os.environ, layout, coords["worker"], coords["local"])
            world_store, crossed = distributed.worker_world_store(
                store, layout, int(os.environ["RANK"]),
                self.rejoin.epoch if self.rejoin else 0, p.distributed_timeout_minutes,
                own_host)
        else:  # the job's store is the one its caller's launcher named
            self.rendezvous = distributed.StoreAddress.of_launcher(os.environ)
        # Each worker is its own world, on its own store (distributed.init_distributed).
        rank, _ = distributed.init_distributed(
            p.distributed_backend, p.distributed_timeout_minutes, world_store, layout=layout)
        distributed.cpu_threads()
        self.topology = Topology.create(
            layout, rank, timeout=datetime.timedelta(minutes=p.distributed_timeout_minutes),
            cross_worker_backend="nccl" if s.diloco_backend == "nccl" else "gloo",
            cross_worker_timeout=datetime.timedelta(seconds=s.diloco_timeout),
            backend=distributed.backend_for(p.distributed_backend), store=store,
            cross_members=[] if self.rejoin else None)  # a newcomer's come when admitted
        self.topology.install_into_megatron()
        from ..comm.crossworker import CrossWorker

        self.topology.cross = CrossWorker(self.topology)
        if door is not None and self.topology.worker != 0:  # worker 0 hosts the store
            self.topology.cross.count_control(door.bytes + crossed)
        from ..job.lifecycle import Liveness, StopAgreement

        self.liveness = Liveness(self.topology, self.rendezvous, stop=self.stop_request,
                                 store_timeout=60.0 * p.distributed_timeout_minutes,
                                 saves=bool(cfg.checkpoint.save))
        self.stop = StopAgreement(self.topology, self.stop_request, s.diloco_control_lag)
        self.reports = self.topology.is_logging_rank()  # progress lines, the writers
        setup_logging(self.reports)
        if launched_by:
            log.info("launch: %s", launched_by)
        for note in cfg.notes:
            log.info("flag %s", note)
        if self.topology.is_logging_rank():  # the same on every rank: said once per job
            for line in (*cfg.adjustments, *cfg.warnings):
                log.warning("%s", line)
        log.info("layout: %s; patches: %s", self.topology.describe(),
                 ", ".join(self.patches) or "none")

    def _running_job(self, store, worker: int, local: int, ranks: int):
        """The membership record of a running elastic job that this worker is outside of (a
        restarted worker rejoins it), else None. A launch whose index is still taken waits
        until the others have noticed its predecessor is gone.

        The launch's first rank decides and the others take its decision: another rank
        would see the claim its own first rank has just made as a predecessor's. They find
        it by the launch's number among the launches of this worker with as many ranks,
        counted by every rank's arrival (a restart arrives after its predecessor's ranks)."""
        import datetime
        import json

        from ..errors import JobFailure
        from ..job.membership import Membership

        s, p = self.cfg.streaming, self.cfg.parallel
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
            latest = self._decide_rejoin(store, worker, membership)
        except JobFailure as e:
            store.set(decided, json.dumps({"failed": str(e)}))
            raise
        store.set(decided, json.dumps({"rejoin": None if latest is None else latest.epoch}))
        return latest

    def _decide_rejoin(self, store, worker: int, membership):
        import time

        from ..job.door import PREFIX
        from ..errors import JobFailure

        deadline = time.monotonic() + 60.0 * self.cfg.parallel.distributed_timeout_minutes
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

    def _build_model(self) -> None:
        from ..parallel import distributed
        from ..worker import weights
        from ..worker.model import build_model, describe_attention, transformer_impl_note

        cfg, topo = self.cfg, self.topology
        if self.reports:  # which layers and attention run, and why, once per job; a path
            # this project's tests have not run is a warning
            tried = cfg.model.transformer_impl != "transformer_engine"
            (log.info if tried else log.warning)("%s", transformer_impl_note(
                cfg.model.transformer_impl))
            log.info("core attention: %s", describe_attention(cfg.model, topo.layout.sp))
        distributed.seed_everything(cfg.training.seed, topo.tp_rank)
        self.model = build_model(cfg.model, cfg.parallel, topo, self.tokenizer.vocab_size,
                                 cfg.te, cfg.precision)
        tied = not cfg.model.untie_embeddings_and_output_weights
        weights.initialize_weights(
            self.model, seed=cfg.training.seed, std=cfg.model.init_method_std,
            num_layers=cfg.model.num_layers,
            layer_offset=topo.first_layer(cfg.model.num_layers),
            tp_rank=topo.tp_rank, tp_size=topo.layout.tp,
            tied_output_name="embedding.word_embeddings.weight" if tied else None,
            gated_mlp=cfg.model.swiglu, zero_centered_norms=cfg.model.apply_layernorm_1p)

    def _build_engine_and_sync(self) -> None:
        from ..checkpoint import Checkpointer
        from ..checkpoint.job import JobState
        from ..worker.engine import WorkerEngine
        from ..streaming import builder

        self.engine = WorkerEngine(self.cfg, self.topology, self.model)
        self.sync = builder.build_sync(self.cfg, self.topology, self.engine, self.job)
        if self.job.workers and not (self.job.same_layout and self.job.same_batches):
            routes = getattr(self.sync, "routes", None)
            log.info("workers of their own layouts or batches: %s; the outer mean weighs %s; "
                     "exchange %s", "; ".join(self.job.describe()),
                     "each worker by its tokens" if self.cfg.streaming.diloco_weighting ==
                     "tokens" else "the workers alike",
                     "shard by shard" if routes is None else
                     f"by {self.topology.layout.lanes} layout-free lane(s) per "
                     f"fragment (set-up moved {self.sync.in_worker_bytes} bytes within this "
                     "rank's worker)")
        topo = self.topology
        self.checkpointer = Checkpointer(
            topo.rank, topo.ranks_reporting, lambda obj: _gather_objects(obj, topo),
            topo.layout.ranks_per_worker, topo.worker, topo.cross.gather_control,
            topo.leads_job, local=topo.coords["local"])
        self.job_state = JobState(self.cfg, self.topology, self.model, self.engine, self.sync,
                                  self.tokenizer.vocab_size)

    def _resume_source(self, layout) -> Optional[str]:
        """The directory to resume from, checked before any process group exists.

        ``--load`` equal to ``--save`` with nothing saved yet is the first launch of a job
        that requeues itself: it starts from scratch. Any other missing checkpoint is an error.
        """
        import os

        from ..checkpoint import check_loadable, has_checkpoint
        from ..checkpoint.resume import plan

        c = self.cfg.checkpoint
        if not c.load:
            return None
        if c.save and os.path.abspath(c.load) == os.path.abspath(c.save) and \
                not has_checkpoint(c.load):
            return None
        _, meta = check_loadable(c.load, self.cfg, layout, self.tokenizer.vocab_size)
        self.resume_plan = plan(meta, self.cfg, layout, int(os.environ.get("RANK", "0")),
                                self.cfg.streaming.diloco_new_worker_optimizer)
        return c.load

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
        loss = self.evaluate(split)
        if loss is not None and self.topology.is_logging_rank():
            log.info("%s loss at iteration %d: %.6f", split, self.iteration, loss)
            self.writer.scalars(self.iteration, {f"{split}/loss": loss})
        return loss

    # ---- training -----------------------------------------------------------------------
    def train(self) -> Optional[float]:
        from .metrics import Throughput, progress_line

        cfg, t = self.cfg, self.cfg.training
        throughput = Throughput(self.data.tokens_through, self.iteration)
        iterator = self.data.train_iterator(self.iteration)
        loss = None
        while self.iteration < t.train_iters:
            started = time.perf_counter()
            result = self.engine.train_step(iterator, self.iteration)
            self.step_seconds.append(time.perf_counter() - started)
            self.engine.timers.add("diloco-sync", self.sync.take_hook_seconds())
            self.iteration += 1
            self.liveness.iteration = self.iteration
            loss = result.loss
            if self.iteration == t.train_iters:
                merged = self.sync.finish()
                if merged:
                    log.info("merged %d fragment exchange(s) still in flight after the last "
                             "step", merged)
            self.elastic.end_of_step(self.iteration)  # a lost worker: the others go on
            if self.elastic.catching_up:  # up to the step the other survivors reached: no
                continue  # save, no stop flag (they are past this step's)
            if self.elastic.stopping:  # too few workers alive: a checkpoint, then out
                self.stopped_by = "too-few-workers"
                break
            if self.iteration % cfg.logging.log_interval == 0 or self.iteration == t.train_iters:
                self._log_step(result, throughput, progress_line)
            if t.eval_interval and self.iteration % t.eval_interval == 0:
                self.last_valid = (self.iteration, self._report_eval("valid"))
            interval = cfg.checkpoint.save_interval
            if interval and self.iteration % interval == 0:
                self.save()
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                log.info("exiting at iteration %d (--exit-interval %d)", self.iteration,
                         t.exit_interval)
                break
            self._check_duration()
            self.stopped_by = self.stop.should_stop()
            if self.stopped_by:
                log.info("stopping after iteration %d: %s", self.iteration, self.stopped_by)
                break
            self.elastic.after_stop_flag(self.iteration)  # a restarted worker comes in
        return loss

    def _log_step(self, result, throughput, progress_line) -> None:
        """Called on every rank: the sync's scalars and the timers are reduced over the worker
        first."""
        from ..worker import timers
        from ..streaming import report

        scalars = report.worker_scalars(self.sync, self.topology.groups["worker"],
                                        self.topology.cross.control_bytes)
        report.reset_interval_stats(self.sync)
        times = self.engine.timers.report(self.topology.groups["worker"])
        if not self.sync.enabled and self.topology.layout.workers == 1:
            step_bytes = self._data_parallel_step_bytes()
            if step_bytes:
                scalars = {"traffic/data_parallel_bytes": self.iteration * step_bytes}
        if not self.topology.is_logging_rank():
            return
        rate = throughput.rate(self.iteration)
        extra = ""
        if self.sync.enabled:
            extra = (f" | sync bytes {scalars['streaming/worker_bytes_sent']:,.0f} | drift "
                     f"{scalars['streaming/drift']:.4f}")
        if result.decoupled_lr is not None:  # as Megatron-LM logged it
            extra += f" | decoupled lr {result.decoupled_lr:.3e}"
            scalars["train/decoupled_lr"] = result.decoupled_lr
        if result.loss_scale is not None:  # --fp16, as Megatron reports it (this worker's)
            skipped = self.engine.skipped_iterations
            extra += f" | loss scale {result.loss_scale:g} | skipped iterations {skipped}"
            scalars.update({"train/loss_scale": result.loss_scale,
                            "train/skipped_iterations": skipped})
        log.info(progress_line(self.iteration, self.cfg.training.train_iters, result.loss,
                               result.lr, result.grad_norm, rate, throughput.elapsed(), extra))
        if times:
            log.info(timers.format_report(times, self.engine.timers.option))
            scalars.update(timers.scalars(times))
        self.writer.scalars(self.iteration, {
            "train/loss": result.loss, "train/lr": result.lr,
            "train/grad_norm": result.grad_norm, "train/tokens_per_s": rate,
            "train/step_seconds": self.step_seconds[-1],
            "train/tokens": self.data.tokens_through(self.iteration),
            "train/global_batch_size": self.data.batches.global_batch(self.iteration - 1),
            **scalars})

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

    def _data_parallel_step_bytes(self) -> int:
        """What one step's gradient all-reduce over the data-parallel ranks moves (ring, fp32):
        the traffic a streaming run is compared against. Counted once, on the first call
        (collective over TP x PP, like every ``_log_step``)."""
        if not hasattr(self, "_dp_step_bytes"):
            from ..comm.traffic import ring_all_reduce_bytes

            layout = self.topology.layout
            # Under Ulysses the gradients are averaged over the sequence and data axes together.
            ranks = layout.sp * layout.dp
            self._dp_step_bytes = ring_all_reduce_bytes(self.parameter_count(), ranks) \
                if ranks > 1 else 0
        return self._dp_step_bytes

    def save(self) -> None:
        from ..comm.failures import hand_over

        try:
            path = self.checkpointer.save(
                self.cfg.checkpoint.save, self.iteration, self.job_state,
                {"iteration": self.iteration,
                 "consumed_samples": self.data.samples_through(self.iteration),
                 "tokens": self.data.tokens_through(self.iteration)})
        except Exception as e:  # a worker lost during the save: not committed; elastic runs
            hand_over(self.elastic.note if self.elastic.enabled else None, e)  # go on
            log.warning("the checkpoint of iteration %d was not written: a cross-worker "
                        "collective failed during it (a lost worker); training goes on",
                        self.iteration)
            return
        self.last_saved = self.iteration
        t = self.checkpointer.timings
        log.info("saved checkpoint %s in %.2f s (gather %.2f s, write %.2f s, hash %.2f s)",
                 path, sum(t.values()), t["collect"] + t["describe"], t["write"], t["hash"])

    def failure(self, error: Exception) -> Exception:
        """What to raise for ``error``: a communication failure becomes a ``JobFailure``
        naming the lost (or stuck) ranks and the last good checkpoint; anything else (a bug,
        bad input) is returned unchanged."""
        from ..comm.failures import is_communication_error
        from ..errors import JobFailure, UsageError
        from ..job import lifecycle

        if isinstance(error, UsageError) or not is_communication_error(error):
            return error
        survey, survey_error = None, None
        try:
            survey = self.liveness.survey()
        except ConnectionError as e:
            survey_error = str(e)
        message = lifecycle.failure_message(
            error, self.topology.layout, self.topology.rank, self.iteration, survey,
            survey_error, lifecycle.checkpoint_advice(self.cfg.checkpoint.save),
            self.rendezvous.hosted_by)
        self.liveness.mark_exiting(message)
        self.liveness.linger(survey["lost"] if survey else [])
        failure = JobFailure(message)
        failure.__cause__ = error
        return failure

    def peak_memory_mib(self) -> dict:
        """Peak memory of every rank of this worker, in-worker rank order (collective over
        the worker): ``rss`` the resident peak of the process; on a GPU also ``device`` the
        caching allocator's allocated peak (Megatron's "max allocated") and
        ``device_reserved`` what it held from the driver at most (the CUDA context not
        counted in either)."""
        import resource

        import torch
        import torch.distributed as dist

        from ..parallel.topology import device_of

        group = self.topology.groups["worker"]
        device = device_of(group)
        mine = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0]
        keys = ["rss"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mine += [torch.cuda.max_memory_allocated() / 2**20,
                     torch.cuda.max_memory_reserved() / 2**20]
            keys += ["device", "device_reserved"]
        mine = torch.tensor(mine, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        return {key: [round(float(x[i]), 1) for x in gathered] for i, key in enumerate(keys)}

    def parameter_count(self) -> int:
        """Parameters of the whole model, each counted once (collective over TP x PP)."""
        import torch
        import torch.distributed as dist

        from ..worker.grads import tied_embedding_weight

        replica = tied_embedding_weight(self.model, self.topology)
        skip = replica if (replica is not None and not self.topology.is_first_stage) else None
        count = sum(p.numel() for p in self.model.parameters() if p is not skip and (
            getattr(p, "tensor_model_parallel", False) or self.topology.tp_rank == 0))
        from ..parallel.topology import device_of

        group = self.topology.groups["mp"]
        total = torch.tensor([count], dtype=torch.float64, device=device_of(group))
        dist.all_reduce(total, group=group)
        return int(total.item())

    def cross_worker_bytes(self) -> int:
        """Collective over the worker; 0 without the sync."""
        from ..streaming import report

        return report.total_bytes_sent(self.sync, self.topology.groups["worker"],
                                       self.topology.layout.workers)

    def summary(self, train_loss, valid_loss, test_loss, peak, sync_bytes,
                parameters, control_bytes) -> dict:
        steady = self.step_seconds[1:] or self.step_seconds
        return {
            "iteration": self.iteration,
            "train_loss": train_loss,
            "valid_loss": valid_loss,
            "test_loss": test_loss,
            "tokens": self.data.tokens_through(self.iteration),  # all workers
            "samples": self.data.samples_through(self.iteration),
            "cross_worker_bytes": sync_bytes,
            # Everything else that crossed workers (crossworker.CrossWorker): the stop flag,
            # checkpoint agreement, the door, heartbeats of the workers without the store.
            "cross_worker_control_bytes": control_bytes,
            "parameters": parameters,
            "wall_seconds": time.perf_counter() - self.start_time,
            "workers": self.topology.layout.workers,
            "world_size": self.topology.layout.world_size,
            # Mean step time after the first step (which pays one-off set-up costs).
            "seconds_per_iteration": sum(steady) / len(steady) if steady else None,
            "peak_rss_mib_per_rank": peak["rss"],  # ranks of worker 0, in-worker rank order
            # On a GPU: the allocator's allocated and reserved peaks, same order (else absent).
            **{f"peak_{key}_mib_per_rank": peak[key] for key in ("device", "device_reserved")
               if key in peak},
            "stopped_by": self.stopped_by,  # a signal that ended training early, or None
            "checkpoint_iteration": self.last_saved,
        }


def _gather_objects(obj, topology) -> list:
    """Every rank of the worker's ``obj``, in rank order (the checkpoint's per-rank facts)."""
    import torch.distributed as dist

    group = topology.groups["worker"]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
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
            raise run.failure(e)
    rejoin_when_reachable(outside, 60.0 * cfg.parallel.distributed_timeout_minutes,
                          hosts_store, run.rendezvous, run.launch_environment)


def _train_and_report(run: Run) -> Optional[dict]:
    from .metrics import write_summary

    cfg = run.cfg
    train_loss = None
    if not cfg.training.skip_train:
        train_loss = run.train()
        if cfg.checkpoint.save and run.last_saved != run.iteration:
            run.save()
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
    peak = run.peak_memory_mib()
    sync_bytes = run.cross_worker_bytes()
    control_bytes = run.topology.cross.total_control_bytes(run.topology.groups["worker"])
    parameters = run.parameter_count()
    summary = None
    if run.topology.is_logging_rank():
        summary = run.summary(train_loss, valid_loss, test_loss, peak, sync_bytes,
                              parameters, control_bytes)
        if cfg.logging.summary_json:
            write_summary(cfg.logging.summary_json, summary)
        log.info("done: %s", summary)
    run.close()
    run.topology.barrier()
    return summary

"""Start-up of one rank: what can be checked alone first (flags, files, tokenizer, the
checkpoint to resume from), then the door where the workers meet, the process groups and the
communicator across workers. A bad flag fails here, before the first collective, on every rank
with the same message."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

from ..cli.arguments import validate, world_size_from_env
from ..config import Config

log = logging.getLogger("megatron_streaming")


@dataclass
class Started:
    """What start-up made for the run."""

    topology: object  # parallel.topology.Topology, its communicator set (``topology.cross``)
    tokenizer: object
    job: object  # job.workers.JobShape: every worker's shape, as agreed at the door
    resume: Optional[str]  # the checkpoint directory to resume from
    resume_plan: object  # checkpoint.resume.ResumePlan (when ``resume``)
    rejoin: object  # the membership record of a running job this worker rejoins, or None
    own_processes: bool  # False: embedded in a world its caller made
    patches: list  # the upstream patches applied
    launched_by: Optional[str]  # a bare srun read as a launcher, said at start
    rendezvous: object  # parallel.distributed.StoreAddress: the job's rendezvous store
    # checkpoint.megatron_lm.MegatronCheckpoint: a Megatron-LM checkpoint to take the model's
    # weights from (``--load`` of one; ``resume`` is None then)
    weights_from: object = None


def start_processes(cfg: Config) -> Started:
    """Check what can be checked alone, then join the process groups."""
    import patches as upstream_patches

    from ..data.inputs import load_run_tokenizer
    from ..job.workers import JobShape, WorkerShape, check, from_records
    from ..parallel import distributed, slurm
    from ..parallel.topology import RankLayout, Topology

    p, s = cfg.parallel, cfg.streaming
    launched_by = None if distributed.is_initialized() else \
        slurm.task_environment(os.environ)  # a bare srun: its tasks as the job's ranks
    own_host = distributed.join_worker_launch(os.environ, s.diloco_workers,
                                              s.diloco_worker_index, p.master_addr,
                                              p.master_port)
    if not distributed.is_initialized():  # its GPU before anything may import Transformer
        distributed.claim_device(os.environ, s.diloco_workers)  # Engine (patches, tokenizer)
    world = world_size_from_env()
    validate(cfg, world)
    if s.diloco_backend == "nccl":  # NCCL reads its settings once, at its first use
        distributed.order_nccl_launches(os.environ)
    layout = RankLayout.of(cfg, world)
    if cfg.checkpoint.save:
        from ..checkpoint import check_writable

        check_writable(cfg.checkpoint.save, int(os.environ.get("RANK", "0")))
    tokenizer = load_run_tokenizer(cfg)
    resume, resume_plan, weights_from = resume_source(cfg, layout, tokenizer.vocab_size)
    applied = upstream_patches.apply()
    door = store = world_store = rejoin = None
    crossed = 0  # bytes through the job's store to find this worker's own
    shape = WorkerShape.of(cfg, layout)
    job = JobShape.uniform(shape, layout.workers)  # every worker's, from the door
    own_processes = not distributed.is_initialized()  # else embedded: the world exists
    if own_processes:
        from ..job.door import Door, fingerprint
        from ..job.rejoin import running_job, store_may_go

        store, rendezvous = distributed.rendezvous_store(p.distributed_timeout_minutes,
                                                         p.rendezvous_external)
        rank = int(os.environ["RANK"])
        coords = layout.coords(rank)
        door = Door(store, coords["worker"], layout.workers, coords["local"],
                    datetime.timedelta(minutes=p.distributed_timeout_minutes))
        rejoin = running_job(cfg, store, coords["worker"], coords["local"],
                             layout.ranks_per_worker)
        if rejoin is None:
            shapes = door.agree(fingerprint(cfg, layout, tokenizer), shape.settings())
        else:
            from ..job.lifecycle import beating

            with store_may_go(coords["worker"], rendezvous):  # the job may end meanwhile
                first = door.first_rank(coords["worker"])  # it claims for the worker
                shapes = door.rejoin(fingerprint(cfg, layout, tokenizer), rejoin.epoch,
                                     rejoin.members, lambda: not beating(store, first),
                                     shape.settings())
        job = from_records(shapes)
        check(job, cfg)
        sizes = tuple(w.ranks for w in job.workers)
        if len(set(sizes)) > 1:  # workers of their own sizes: number the job's ranks
            layout = dataclasses.replace(layout, world_size=sum(sizes), sizes=sizes,
                                         worker=coords["worker"])
            distributed.renumber(os.environ, layout, coords["worker"], coords["local"])
        world_store, crossed = distributed.worker_world_store(
            store, layout, int(os.environ["RANK"]), rejoin.epoch if rejoin else 0,
            p.distributed_timeout_minutes, own_host)
    else:  # the job's store is the one its caller's launcher named
        rendezvous = distributed.StoreAddress.of_launcher(os.environ)
    # Each worker is its own world, on its own store (distributed.init_distributed).
    rank, _ = distributed.init_distributed(
        p.distributed_backend, p.distributed_timeout_minutes, world_store, layout=layout)
    distributed.cpu_threads()
    topology = Topology.create(
        layout, rank, timeout=datetime.timedelta(minutes=p.distributed_timeout_minutes),
        cross_worker_backend="nccl" if s.diloco_backend == "nccl" else "gloo",
        cross_worker_timeout=datetime.timedelta(seconds=s.diloco_timeout),
        backend=distributed.backend_for(p.distributed_backend), store=store,
        cross_members=[] if rejoin else None)  # a newcomer's come when admitted
    topology.install_into_megatron()
    from ..comm.crossworker import CrossWorker

    topology.cross = CrossWorker(topology)
    if door is not None and topology.worker != 0:  # worker 0 hosts the store
        topology.cross.count_control(door.bytes + crossed)
    return Started(topology, tokenizer, job, resume, resume_plan, rejoin, own_processes,
                   applied, launched_by, rendezvous, weights_from)


def resume_source(cfg: Config, layout, vocab_size: int):
    """The directory to resume from, its plan, and a Megatron-LM checkpoint to take the
    weights from instead (``checkpoint.megatron_lm``); checked before any process group
    exists.

    ``--load`` equal to ``--save`` with nothing saved yet is the first launch of a job
    that requeues itself: it starts from scratch. Any other missing checkpoint is an error.
    """
    from ..checkpoint import CheckpointError, check_loadable, has_checkpoint, megatron_lm
    from ..checkpoint.resume import plan

    c = cfg.checkpoint
    if not c.load:
        return None, None, None
    if c.save and os.path.abspath(c.load) == os.path.abspath(c.save) and \
            not has_checkpoint(c.load):
        from ..checkpoint.checkpoint_args import missing_lines

        cfg.warnings.extend(missing_lines(c.load))  # Megatron-LM's words, said once at start
        return None, None, None
    if megatron_lm.is_megatron_lm(c.load):
        if c.save and os.path.abspath(c.load) == os.path.abspath(c.save):
            raise CheckpointError(f"--save {c.save}: the same directory as --load, which holds "
                                  "a Megatron-LM checkpoint; a save would replace its iter_N "
                                  "directories and tracker: --save to another directory")
        source = megatron_lm.open_checkpoint(c.load)
        source.notes = megatron_lm.check_compatible(source, cfg, vocab_size)
        return None, None, source
    if c.finetune:
        raise CheckpointError(f"--finetune: --load {c.load} is a checkpoint of this package, "
                              "which resumes in full (optimizer, outer state, iteration); "
                              "--finetune applies to a Megatron-LM checkpoint: drop it")
    _, meta = check_loadable(c.load, cfg, layout, vocab_size)
    return c.load, plan(meta, cfg, layout, int(os.environ.get("RANK", "0")),
                        cfg.streaming.diloco_new_worker_optimizer), None


def say_at_start(cfg: Config, started: Started) -> None:
    """What this job runs with, once per job (on its logging rank)."""
    topology = started.topology
    if started.launched_by:
        log.info("launch: %s", started.launched_by)
    for note in cfg.notes:
        log.info("flag %s", note)
    if topology.is_logging_rank():  # the same on every rank: said once per job
        for line in (*cfg.adjustments, *cfg.warnings):
            log.warning("%s", line)
    log.info("layout: %s; patches: %s", topology.describe(),
             ", ".join(started.patches) or "none")

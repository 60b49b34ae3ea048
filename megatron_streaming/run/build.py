"""The objects one rank trains with, built on its topology: the model slice with its
deterministic weights, the engine (megatron-core's schedule inside DeepSpeed ZeRO), the sync
hooked into it, and what saves and restores the rank's state."""

from __future__ import annotations

import logging

from ..config import Config

log = logging.getLogger("megatron_streaming")


def build_model(cfg: Config, topology, vocab_size: int, reports: bool, weights_from=None):
    """This rank's slice of the GPT, initialised the same on every layout; then holding the
    weights of ``weights_from`` (a Megatron-LM checkpoint, ``checkpoint.megatron_lm``) if
    given, before the engine and the sync copy them."""
    from ..parallel import distributed
    from ..worker import weights
    from ..worker.model import build_model as build, describe_attention, transformer_impl_note
    from ..worker.moe import expert_offset

    if reports:  # which layers and attention run, and why, once per job; a path this
        # project's tests have not run is a warning
        tried = cfg.model.transformer_impl != "transformer_engine"
        (log.info if tried else log.warning)("%s", transformer_impl_note(
            cfg.model.transformer_impl))
        log.info("core attention: %s", describe_attention(cfg.model, topology.layout.sp))
    distributed.seed_everything(cfg.training.seed, topology.tp_rank)
    model = build(cfg.model, cfg.parallel, topology, vocab_size, cfg.te, cfg.precision)
    if reports:  # torch's math kernel holds the whole score matrix: said, once
        from ..worker.attention import kernel_note

        note = kernel_note(model)
        if note:
            log.warning("%s", note)
    tied = not cfg.model.untie_embeddings_and_output_weights
    weights.initialize_weights(
        model, seed=cfg.training.seed, std=cfg.model.init_method_std,
        num_layers=cfg.model.num_layers,
        layer_offset=topology.first_layer(cfg.model.num_layers),
        tp_rank=topology.tp_rank, tp_size=topology.layout.tp,
        tied_output_name="embedding.word_embeddings.weight" if tied else None,
        gated_mlp=cfg.model.swiglu, zero_centered_norms=cfg.model.apply_layernorm_1p,
        expert_offset=expert_offset(cfg.model, topology))
    if weights_from is not None:
        from ..checkpoint import megatron_lm

        for note in megatron_lm.load_weights(model, weights_from):
            if reports:
                log.warning("--load %s: %s", weights_from.root, note)
    return model


def build_engine_and_sync(cfg: Config, topology, model, job):
    """The engine, and the sync (``attach`` hooks it into the inner optimizer)."""
    from ..streaming import builder
    from ..worker.engine import WorkerEngine

    engine = WorkerEngine(cfg, topology, model)
    sync = builder.build_sync(cfg, topology, engine, job)
    if job.workers and not (job.same_layout and job.same_batches):
        routes = sync.routes
        log.info("workers of their own layouts or batches: %s; the outer mean weighs %s; "
                 "exchange %s", "; ".join(job.describe()),
                 "each worker by its tokens" if cfg.streaming.diloco_weighting ==
                 "tokens" else "the workers alike",
                 "shard by shard" if routes is None else
                 f"by {topology.layout.lanes} layout-free lane(s) per "
                 f"fragment (set-up moved {sync.in_worker_bytes} bytes within this "
                 "rank's worker)")
    return engine, sync


def build_checkpointing(cfg: Config, topology, model, engine, sync, vocab_size: int):
    """The checkpointer (the collectives a save and a load need) and this rank's state."""
    from ..checkpoint import Checkpointer
    from ..checkpoint.job import JobState

    checkpointer = Checkpointer(
        topology.rank, topology.cross.ranks_reporting, lambda obj: _gather_objects(obj, topology),
        topology.layout.ranks_per_worker, topology.worker, topology.cross.gather_control,
        topology.leads_job, local=topology.coords["local"], members=lambda: topology.members)
    return checkpointer, JobState(cfg, topology, model, engine, sync, vocab_size)


def _gather_objects(obj, topology) -> list:
    """Every rank of the worker's ``obj``, in rank order (the checkpoint's per-rank facts)."""
    import torch.distributed as dist

    group = topology.groups["worker"]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out

"""Builds the streaming sync of one rank from the config, the topology and the engine."""

from __future__ import annotations

from typing import Callable, Union

from ..config import Config
from ..topology import Topology
from ..weights import global_name, local_spec_name
from .codec import make_codec, warm_up
from .fragments import FragmentPlan
from .outer import OuterOptimizer
from .schedule import SyncSchedule
from .sync import NoSync, ShardGroup, StreamingSync


def enabled(cfg: Config) -> bool:
    s = cfg.streaming
    return s.diloco_sync and s.diloco_workers > 1


def num_fragments(cfg: Config) -> int:
    s = cfg.streaming
    if s.diloco_fragment_layers:
        return cfg.model.num_layers // s.diloco_fragment_layers
    return s.diloco_fragments


def fragment_plan(cfg: Config) -> FragmentPlan:
    return FragmentPlan(cfg.model.num_layers, num_fragments(cfg),
                        cfg.streaming.diloco_fragment_pattern)


def sync_schedule(cfg: Config, dp: int = 1) -> SyncSchedule:
    """The schedule of the flags (``dp``: a worker's data-parallel size, for a batch ramp's
    effect on the learning rate under ``--diloco-sync-spacing lr|decay``)."""
    s = cfg.streaming
    schedule = SyncSchedule(s.diloco_inner_steps, num_fragments(cfg), s.diloco_overlap_steps,
                            eager=s.diloco_eager)
    if s.diloco_sync_spacing != "steps" and cfg.training.train_iters:
        from ..schedules import BatchSchedule, LrSchedule
        from .schedule import spaced_sends, sync_weights

        lr = LrSchedule(cfg, BatchSchedule(cfg.training, cfg.model.seq_length, dp))
        lrs = [lr(i) for i in range(cfg.training.train_iters)]
        schedule = SyncSchedule(s.diloco_inner_steps, num_fragments(cfg),
                                s.diloco_overlap_steps,
                                spaced_sends(sync_weights(s.diloco_sync_spacing, lrs),
                                             schedule.interval, s.diloco_overlap_steps),
                                s.diloco_eager)
    return schedule


def outer_optimizer(cfg: Config) -> OuterOptimizer:
    s = cfg.streaming
    return OuterOptimizer(s.diloco_outer_lr, s.diloco_outer_momentum, s.diloco_nesterov,
                          s.co2_gap_penalty, s.co2_clip_threshold)


def model_name_function(cfg: Config, topology: Topology) -> Callable[[str], str]:
    """Local parameter name on this rank -> its name in the whole model, the same on every
    layout: global layer index, megatron-core's local-spec name (``weights.local_spec_name``)
    and, on a last stage holding the tied output layer, the embedding it copies."""
    offset = topology.pp_rank * (cfg.model.num_layers // topology.layout.pp)
    tied = not cfg.model.untie_embeddings_and_output_weights

    def model_name(name: str) -> str:
        if tied and name == "output_layer.weight":
            return "embedding.word_embeddings.weight"
        return local_spec_name(global_name(name, offset))

    return model_name


def fragment_function(cfg: Config, topology: Topology) -> Callable[[str], int]:
    """Local parameter name on this rank -> fragment."""
    plan, model_name = fragment_plan(cfg), model_name_function(cfg, topology)
    return lambda name: plan.fragment_of(model_name(name))


def shard_groups(engine, fragment_of: Callable[[str], int]):
    """One ShardGroup per (param group, fragment) present on this rank, in a fixed order, so
    ranks at the same coordinate of different workers submit identical exchanges."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    groups = []
    for param_group, slices in enumerate(engine.master_slices()):
        by_fragment = {}
        for param, view, first in slices:
            name = names[id(param)]
            views, sources = by_fragment.setdefault(fragment_of(name), ([], []))
            views.append(view)
            sources.append((name, param, first))
        for fragment in sorted(by_fragment):
            views, sources = by_fragment[fragment]
            groups.append(ShardGroup(len(groups), param_group, fragment, views, sources))
    return groups


def canonical_routes(cfg: Config, topology: Topology, groups):
    """Every fragment's route to the lanes (``canonical``; collective over the worker)."""
    from ..topology import device_of
    from .canonical import build_routes

    plan = fragment_plan(cfg)
    group = topology.groups["worker"]
    return build_routes(
        groups, [g.sources for g in groups], group, device_of(group),
        topology.coords["local"], topology.layout.lanes, plan.fragment_of,
        model_name_function(cfg, topology), tp_rank=topology.tp_rank,
        tp_size=topology.layout.tp, gated=cfg.model.swiglu)


def build_sync(cfg: Config, topology: Topology, engine,
               job=None) -> Union[StreamingSync, NoSync]:
    """The sync module (``NoSync`` when the sync is off); ``attach`` hooks it into the
    engine. ``job``: every worker's shape (``workers.JobShape``); workers of different
    layouts exchange by lanes (``canonical.CanonicalSync``)."""
    if not enabled(cfg):
        return NoSync()
    s = cfg.streaming
    groups = shard_groups(engine, fragment_function(cfg, topology))
    # The codec runs where the outer state lives (the GPU, unless it is offloaded): only the
    # codes go to the wire's device.
    codec_device = "cpu" if s.diloco_offload_outer_state or not groups else \
        groups[0].read().device
    transport = topology.cross.make_transport(
        make_codec(s.diloco_quantize, s.diloco_quant_block), s.diloco_timeout, codec_device)
    args = (sync_schedule(cfg, topology.layout.dp), transport, outer_optimizer(cfg),
            s.diloco_alpha, s.diloco_error_feedback, s.diloco_offload_outer_state,
            engine.push_to_model)
    if job is not None and not job.same_layout:
        from .canonical import CanonicalSync

        routes = canonical_routes(cfg, topology, groups)
        sizes = [r.lane_numel for r in routes.values()]
        sync = CanonicalSync(groups, routes, *args)
    else:
        sizes = [g.numel for g in groups]
        sync = StreamingSync(groups, *args)
    warm_up(transport.codec, max((transport.padded_numel(n) for n in sizes), default=0),
            transport.codec_device)
    sync.workers = topology.cross.workers or transport.workers  # (a newcomer: none yet)
    if job is not None:
        sync.share = token_share(cfg, job, topology)
    return sync


def token_share(cfg: Config, job, topology: Topology) -> float:
    """This worker's factor on its outer gradients for the current members
    (``workers.JobShape.share``)."""
    members = topology.members or range(len(job.workers))
    return job.share(topology.worker, members, cfg.streaming.diloco_weighting)

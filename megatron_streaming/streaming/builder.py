"""Builds the streaming sync of one rank from the config, the topology and the engine (what
the flags mean on their own is ``settings``)."""

from __future__ import annotations

from typing import Callable, Union

from ..comm.codec import warm_up
from ..config import Config
from ..parallel.topology import Topology
from ..worker.moe import expert_offset
from ..worker.weights import global_name, local_spec_name
from . import settings
from .settings import enabled, fragment_plan, outer_optimizer, sync_schedule
from .sync import NoSync, ShardGroup, StreamingSync


def model_name_function(cfg: Config, topology: Topology) -> Callable[[str], str]:
    """Local parameter name on this rank -> its name in the whole model, the same on every
    layout: global layer index, megatron-core's local-spec name (``weights.local_spec_name``)
    and, on a last stage holding the tied output layer, the embedding it copies."""
    offset = topology.first_layer(cfg.model.num_layers)
    experts = expert_offset(cfg.model, topology)
    tied = not cfg.model.untie_embeddings_and_output_weights

    def model_name(name: str) -> str:
        if tied and name == "output_layer.weight":
            return "embedding.word_embeddings.weight"
        return local_spec_name(global_name(name, offset, experts))

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
    from ..parallel.topology import device_of
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
    layouts exchange by lanes (``canonical.CanonicalSync``); one worker with nobody
    (``one_worker``)."""
    if not enabled(cfg):
        return NoSync()
    s = cfg.streaming
    groups = shard_groups(engine, fragment_function(cfg, topology))
    # The codec runs where the outer state lives (the GPU, unless it is offloaded): only the
    # codes go to the wire's device.
    codec_device = "cpu" if s.diloco_offload_outer_state or not groups else \
        groups[0].read().device
    codec = settings.codec(cfg)
    if topology.layout.workers == 1 and s.diloco_quantize == "sparse":
        from ..comm.sparse_transport import SparseTransport  # its own send, no wire

        transport = SparseTransport(None, [topology.rank], topology.rank, codec,
                                    s.diloco_timeout, codec_device=codec_device)
    elif topology.layout.workers == 1:  # the mean over one worker: its own, no wire
        from .one_worker import OneWorkerExchange

        transport = OneWorkerExchange(topology.rank, codec, s.diloco_timeout, codec_device)
    else:
        transport = topology.cross.make_transport(codec, s.diloco_timeout, codec_device)
    args = (sync_schedule(cfg, topology.layout.dp), transport, outer_optimizer(cfg),
            s.diloco_alpha, settings.error_feedback(cfg), s.diloco_offload_outer_state,
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
    sync.cross = topology.cross
    sync.workers = topology.cross.workers or transport.workers  # (a newcomer: none yet)
    if job is not None:
        sync.share = token_share(cfg, job, topology)
    return sync


def token_share(cfg: Config, job, topology: Topology) -> float:
    """This worker's factor on its outer gradients for the current members
    (``workers.JobShape.share``)."""
    members = topology.members or range(len(job.workers))
    return job.share(topology.worker, members, cfg.streaming.diloco_weighting)

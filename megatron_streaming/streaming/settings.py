"""What the streaming flags mean, from the config alone: whether the sync runs, the fragment
plan, the sync schedule and the outer optimizer. Flag validation and resume decisions read these
without building a sync (``builder`` assembles the running one)."""

from __future__ import annotations

from ..config import Config
from .fragments import FragmentPlan
from .outer import OuterOptimizer
from .schedule import SyncSchedule


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
        from ..config.schedules import BatchSchedule, LrSchedule
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

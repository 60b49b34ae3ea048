"""What the streaming flags mean, from the config alone: whether the sync runs, the fragment
plan, the sync schedule and the outer optimizer. Flag validation and resume decisions read these
without building a sync (``builder`` assembles the running one).

One worker (``--diloco-workers 1``) runs the outer optimizer too when it is asked for, with no
traffic: the papers' M=1 row (DiLoCo scaling laws, arXiv 2503.09799, Table 4) and SNOO's outer
Nesterov on a single worker. The parser decides from the flags typed (``cli.arguments``): any
of ``OUTER_LOOP_FIELDS``' flags, or ``--diloco-sync``, turns it on; without them it stays plain
training with no outer state."""

from __future__ import annotations

from ..config import Config
from .fragments import FragmentPlan
from .outer import OuterOptimizer
from .schedule import SyncSchedule


# The flags of the outer loop's math. Given with one worker, any of them turns its outer
# optimizer on. The cross-worker ones (timeout, backend, weighting, elastic workers, the stop
# flag's lag) do not, as they mean nothing without a second worker; nor do the codec's own
# (--diloco-quant-block, --diloco-error-feedback), which one worker uses only with
# --diloco-quantize typed.
OUTER_LOOP_FIELDS = (
    "diloco_inner_steps", "diloco_fragments", "diloco_fragment_layers",
    "diloco_fragment_pattern", "diloco_sync_spacing", "diloco_overlap_steps", "diloco_eager",
    "diloco_alpha", "diloco_outer_lr", "diloco_outer_momentum", "diloco_nesterov",
    "diloco_quantize", "diloco_offload_outer_state", "co2_gap_penalty", "co2_clip_threshold")


def enabled(cfg: Config) -> bool:
    """Whether the sync runs. Several workers: unless ``--no-diloco-sync``. One worker: the
    parser leaves ``diloco_sync`` on only where the outer loop was asked for (``cli.arguments``
    resolves it from the flags typed), so a plain single-worker run holds no outer state."""
    return cfg.streaming.diloco_sync


def describe_one_worker(cfg: Config) -> str:
    """The one line a one-worker run with its outer optimizer says at start (from the flags
    as typed: made before validation, it computes nothing that a bad value would break)."""
    s = cfg.streaming
    mu, layers = s.diloco_outer_momentum, s.diloco_fragment_layers
    every = "every step" if s.diloco_inner_steps == 1 else f"every {s.diloco_inner_steps} steps"
    parts = [every, f"outer lr {s.diloco_outer_lr:g}, " + (
        f"momentum {mu:g} ({'Nesterov' if s.diloco_nesterov else 'heavy ball'})" if mu > 0
        else "no momentum"),
        f"fragments of {layers} layers" if layers else
        f"{s.diloco_fragments} fragment{'s' if s.diloco_fragments > 1 else ''}"]
    if s.diloco_sync_spacing != "steps":
        parts.append(f"syncs spaced by --diloco-sync-spacing {s.diloco_sync_spacing}")
    if s.diloco_overlap_steps:
        parts.append(f"tau {s.diloco_overlap_steps}")
    if s.diloco_eager:
        parts.append("eager")
    if s.diloco_alpha:
        parts.append(f"alpha {s.diloco_alpha:g}")
    if s.diloco_quantize == "none":
        parts.append("no quantization")
    else:
        parts.append(f"the outer gradient quantized locally as {s.diloco_quantize}"
                     + (" with error feedback" if s.diloco_error_feedback else ""))
    if s.diloco_offload_outer_state:
        parts.append("outer state in CPU memory")
    line = "one worker's outer optimizer: " + ", ".join(parts)
    plain = s.diloco_outer_lr == 1 and mu == 0 and s.co2_gap_penalty == 1 and \
        (s.diloco_nesterov or s.co2_clip_threshold == 0)  # ``OuterOptimizer.averages``
    if plain and s.diloco_quantize == "none" and \
            not (s.diloco_overlap_steps or s.diloco_eager or s.diloco_alpha):
        line += " (plain averaging: the same training as without it, bit for bit)"
    return line


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


def codec(cfg: Config):
    """The codec of ``--diloco-quantize`` (``sparse``: ``comm.sparse.SparseCodec`` of the
    ``--diloco-sparse-*`` flags, its accumulator's decay with it)."""
    s = cfg.streaming
    if s.diloco_quantize == "sparse":
        from ..comm.sparse import SparseCodec

        return SparseCodec(s.diloco_sparse_chunk, s.diloco_sparse_k,
                           s.diloco_sparse_value_bits, s.diloco_sparse_decay)
    from ..comm.codec import make_codec

    return make_codec(s.diloco_quantize, s.diloco_quant_block)


def error_feedback(cfg: Config) -> bool:
    """Whether each shard keeps an error-feedback state: asked for, or the sparse exchange's
    accumulator, which is its method."""
    s = cfg.streaming
    return s.diloco_error_feedback or s.diloco_quantize == "sparse"


def outer_optimizer(cfg: Config) -> OuterOptimizer:
    s = cfg.streaming
    return OuterOptimizer(s.diloco_outer_lr, s.diloco_outer_momentum, s.diloco_nesterov,
                          s.co2_gap_penalty, s.co2_clip_threshold)

"""What a checkpoint may resume into, and how: decided from its JSON and this run's flags
alone, before any process group exists, so a change that cannot be honoured fails fast on
every rank with the flag, the old and the new value.

Honoured: any TP / PP / Ulysses SP / DP size and ZeRO stage (the checkpoint is keyed by global
parameter names); precision (weights come from the fp32 masters when there are any); another
sync schedule (``--diloco-fragments``, ``--diloco-fragment-pattern``, ``--diloco-inner-steps``,
``--diloco-overlap-steps``, ``--diloco-eager``: an exchange in flight is merged at load, since
the new schedule never sent it; with eager updates, less the worker's own share of it, applied
at its send; also when the number of workers changes, since that share is over M) or wire format (``--diloco-quantize``: the error-feedback residual is carried
over); another number of workers (new workers start from the global parameters, with the
inner optimizer state of worker 0 or a fresh one, ``--diloco-new-worker-optimizer``; fewer
workers keep the first ones).

Refused: another architecture or vocabulary, another inner optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import keys
from ..errors import UsageError

FORMAT_VERSION = 3  # 3: a part per worker (checkpoint/store.py); 2: one for the job
READABLE_VERSIONS = (2, 3)


class CheckpointError(UsageError):
    """A checkpoint directory that cannot be used; the message names the flag and the path."""


# Model flags whose value the stored tensors depend on: (flag, how to read it from a config).
ARCHITECTURE = (
    ("--num-layers", lambda m: m.num_layers),
    ("--hidden-size", lambda m: m.hidden_size),
    ("--num-attention-heads", lambda m: m.num_attention_heads),
    ("--num-query-groups", lambda m: m.query_groups()),
    ("--kv-channels", lambda m: m.kv_channels or m.hidden_size // m.num_attention_heads),
    ("--ffn-hidden-size", lambda m: m.ffn_size()),
    ("--swiglu", lambda m: m.swiglu),
    ("--normalization", lambda m: m.normalization),
    ("--position-embedding-type", lambda m: m.position_embedding_type),
    ("--max-position-embeddings",
     lambda m: (m.max_position_embeddings or m.seq_length)
     if m.position_embedding_type == "learned_absolute" else None),
    ("--untie-embeddings-and-output-weights", lambda m: m.untie_embeddings_and_output_weights),
    ("--disable-bias-linear", lambda m: m.disable_bias_linear),
    ("--apply-layernorm-1p", lambda m: m.apply_layernorm_1p),
    # Mixture of experts (absent from checkpoints written before it: not compared there).
    ("--num-experts", lambda m: m.num_experts if m.moe else None),
    ("--moe-layer-freq", lambda m: [int(x) for x in m.moe_layers()] if m.moe else None),
    ("--moe-ffn-hidden-size", lambda m: (m.moe_ffn_hidden_size or m.ffn_size())
     if m.moe else None),
    ("--moe-shared-expert-intermediate-size",
     lambda m: m.moe_shared_expert_intermediate_size if m.moe else None),
)

SCHEDULE = (
    ("--diloco-fragments", "fragments"),
    ("--diloco-fragment-pattern", "pattern"),
    ("--diloco-inner-steps", "inner_steps"),
    ("--diloco-overlap-steps", "overlap_steps"),
    ("--diloco-eager", "eager"),
)


def architecture(model_cfg) -> Dict[str, object]:
    return {flag: get(model_cfg) for flag, get in ARCHITECTURE}


def streaming_description(cfg) -> dict:
    from ..streaming import settings

    s = cfg.streaming
    return {"enabled": settings.enabled(cfg), "workers": s.diloco_workers,
            "fragments": settings.num_fragments(cfg), "pattern": s.diloco_fragment_pattern,
            "inner_steps": s.diloco_inner_steps, "overlap_steps": s.diloco_overlap_steps,
            "eager": s.diloco_eager,
            "quantize": s.diloco_quantize, "error_feedback": s.diloco_error_feedback,
            "outer_lr": s.diloco_outer_lr, "outer_momentum": s.diloco_outer_momentum,
            "alpha": s.diloco_alpha}


def layout_description(layout, zero_stage: int) -> dict:
    out = {"world_size": layout.world_size, "workers": layout.workers, "tp": layout.tp,
           "pp": layout.pp, "dp": layout.dp, "sp": layout.sp, "zero_stage": zero_stage}
    if layout.ep > 1:  # expert parallel (absent at 1, as in checkpoints written before it)
        out["ep"] = layout.ep
    return out


def check_compatible(root: str, meta: dict, cfg, vocab_size: Optional[int]) -> None:
    """Raise CheckpointError for anything this run cannot take from the checkpoint."""
    saved = meta["model"]["architecture"]
    for flag, value in architecture(cfg.model).items():
        if flag in saved and saved[flag] != value:
            raise CheckpointError(f"--load {root}: the checkpoint's model has {flag} "
                                  f"{saved[flag]}, this run {value}; the architecture cannot "
                                  "change on resume")
    old_vocab = meta["model"].get("vocab_size")
    if vocab_size is not None and old_vocab is not None and old_vocab != vocab_size:
        raise CheckpointError(f"--load {root}: the checkpoint's vocabulary has {old_vocab} "
                              f"tokens, this run's tokenizer {vocab_size} (--tokenizer-type / "
                              "--tokenizer-model / --vocab-file)")
    old_opt = meta["optimizer"]["name"]  # None: weights only (an imported model)
    if old_opt is not None and old_opt != cfg.optimizer.optimizer:
        raise CheckpointError(f"--load {root}: the checkpoint was trained with --optimizer "
                              f"{old_opt}, this run has --optimizer {cfg.optimizer.optimizer}; "
                              "the inner optimizer state cannot be carried over")


def schedule_changes(meta: dict, cfg) -> List[Tuple[str, object, object]]:
    """(flag, old, new) of every sync-schedule flag that differs (empty: same schedule)."""
    old, new = meta["streaming"], streaming_description(cfg)
    # Checkpoints from before a flag existed hold its default.
    return [(flag, old.get(key, False), new[key]) for flag, key in SCHEDULE
            if old.get(key, False) != new[key]]


@dataclass
class ResumePlan:
    weights_worker: Optional[int]       # whose weights this worker takes (None: theta_g)
    optimizer_worker: Optional[int]     # whose inner optimizer state (None: fresh)
    optimizer_keys: List[str]
    optimizer_steps: List[Optional[float]]
    residuals: bool                     # this worker has an error-feedback residual saved
    merge_pending_now: bool             # another schedule: merge the exchange in flight
    pending_finite: bool                # the exchange in flight had a finite mean
    eager_saved: bool                   # saved under --diloco-eager: per-worker outer state
    saved_workers: int                  # the checkpoint's number of workers
    pending: Dict[int, dict]            # fragment -> {"step", "all_finite"} to keep in flight
    pending_stats: Dict[int, dict]      # shard index -> byte counts (same layout only)
    nothing_in_flight: List[int]        # fragments whose next merge has nothing to merge
    bytes: Tuple[int, int]              # this rank's transport byte counters
    restore_rng: bool
    loss_scaler: dict = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    @property
    def part_worker(self) -> Optional[int]:
        """Whose part of the checkpoint this worker reads (``store.worker_part``): the worker
        whose weights or inner optimizer it takes; None (a new worker starting from theta_g
        with a fresh optimizer): the lowest worker that saved, as every part holds theta_g."""
        return self.weights_worker if self.weights_worker is not None else \
            self.optimizer_worker


def plan(meta: dict, cfg, layout, rank: int, new_worker_optimizer: str) -> ResumePlan:
    """How this rank resumes from ``meta`` (the checkpoint's JSON)."""
    from ..streaming import settings

    old_layout = meta["layout"]
    same_layout = old_layout == layout_description(layout, cfg.parallel.zero_stage)
    worker = layout.coords(rank)["worker"]
    old_workers = old_layout["workers"]
    ranks = {r["rank"]: r for r in meta["ranks"]}
    notes = []
    # New: beyond the checkpoint's workers, or one it has no part of (lost before the save).
    new_worker = worker >= old_workers or str(worker) not in meta["workers"]
    lowest = min(int(w) for w in meta["workers"])
    if new_worker and keys.outer(keys.THETA_G) not in meta["kinds"]["prefixes"]:
        weights_worker = lowest  # a run without the sync: worker 0's weights are the model
    else:
        weights_worker = None if new_worker else worker
    if new_worker:
        optimizer_worker = lowest if new_worker_optimizer == "copy" else None
        had = f"{old_workers} worker(s)" if worker >= old_workers else \
            f"no part of it: workers {sorted(int(w) for w in meta['workers'])} saved"
        notes.append(f"worker {worker} is new (the checkpoint has {had}): "
                     "it starts from the global parameters with "
                     + (f"worker {optimizer_worker}'s inner optimizer state"
                        if optimizer_worker is not None else "a fresh inner optimizer")
                     + " (--diloco-new-worker-optimizer)")
    else:
        optimizer_worker = worker
    source = meta["workers"][str(optimizer_worker)] if optimizer_worker is not None else None
    optimizer_keys = source["optimizer_keys"] if source else []
    optimizer_steps = source["optimizer_steps"] if source else []

    changes = schedule_changes(meta, cfg) if settings.enabled(cfg) else []
    old_pending = meta.get("pending", [])
    # Without the sync on resume, the worker simply goes on from its own weights.
    eager_saved = bool(meta["streaming"].get("eager"))
    # Eager exchanges carry each worker's share over M: with another M they merge at load.
    eager_regroup = (eager_saved or cfg.streaming.diloco_eager) and \
        old_workers != cfg.streaming.diloco_workers
    merge_now = bool(old_pending) and (bool(changes) or eager_regroup)
    iteration = meta["iteration"]
    pending, nothing = {}, []
    if settings.enabled(cfg):
        if old_pending and not merge_now:
            pending = {p["fragment"]: {"step": p["step"], "all_finite": p["all_finite"]}
                       for p in old_pending}
        elif meta.get("merged_early") and not changes:
            nothing = list(meta["merged_early"])
        if changes or eager_regroup or not meta["streaming"]["enabled"]:
            # The new schedule's exchanges that would be in flight now were never sent.
            nothing = settings.sync_schedule(cfg).in_flight_after(iteration)
    if changes:
        notes.append("sync schedule changed on resume (" + ", ".join(
            f"{flag} {old} -> {new}" for flag, old, new in changes) + ")"
            + ("; the exchange in flight was merged at load" if merge_now else ""))
    elif merge_now:
        notes.append(f"--diloco-workers {old_workers} -> {cfg.streaming.diloco_workers} "
                     "with eager updates: the exchanges in flight were merged at load")
    outer = [(flag, meta["streaming"].get(key), new) for flag, key, new in (
        ("--diloco-outer-lr", "outer_lr", cfg.streaming.diloco_outer_lr),
        ("--diloco-outer-momentum", "outer_momentum", cfg.streaming.diloco_outer_momentum),
        ("--diloco-alpha", "alpha", cfg.streaming.diloco_alpha))]
    outer = [c for c in outer if c[1] is not None and c[1] != c[2]]
    if outer and settings.enabled(cfg):
        # Typed on purpose, or a changed default (earlier checkpoints: 0.7 / 0.9): say so.
        notes.append("outer optimizer changed on resume (" + ", ".join(
            f"{flag} {old} -> {new}" for flag, old, new in outer) + "); the outer momentum "
            "buffer carries over; pass the checkpoint's values to keep them")
    mine = ranks.get(rank) if same_layout else None
    pending_stats = {int(k): v for k, v in (mine or {}).get("pending", {}).items()}
    if mine is not None:
        counters = (mine.get("bytes_sent", 0), mine.get("bytes_received", 0))
    else:  # another layout: the worker's bytes go to its first rank
        is_first = all(c == 0 for a, c in layout.coords(rank).items() if a != "worker")
        totals = [sum(r.get(k, 0) for r in meta["ranks"] if r["worker"] == worker)
                  for k in ("bytes_sent", "bytes_received")]
        counters = tuple(totals) if is_first and not new_worker else (0, 0)
    residuals = bool(meta["workers"].get(str(worker), {}).get("residuals"))
    scaler = (mine or {}).get("loss_scaler") or \
        meta["workers"].get(str(weights_worker if weights_worker is not None else 0),
                            {}).get("loss_scaler", {})
    if not same_layout:
        new_layout = layout_description(layout, cfg.parallel.zero_stage)
        notes.append("layout changed on resume: " + ", ".join(
            f"{k} {old_layout.get(k, 1)} -> {new_layout.get(k, 1)}"
            for k in [*new_layout, *(k for k in old_layout if k not in new_layout)]
            if old_layout.get(k) != new_layout.get(k)) + "; RNG states start from --seed")
    old_pending_finite = all(p["all_finite"] for p in old_pending)
    restore_rng = same_layout and bool((mine or {}).get("rng"))
    return ResumePlan(weights_worker, optimizer_worker, optimizer_keys, optimizer_steps,
                      residuals and not new_worker, merge_now, old_pending_finite,
                      eager_saved, old_workers, pending,
                      pending_stats, nothing, counters, restore_rng, scaler or {}, notes)

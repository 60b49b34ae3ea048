"""Flags generated from the config dataclasses, and the one place that validates them.

Validation runs before any process-group work, from the launcher's environment
(``WORLD_SIZE``), so a bad layout fails at once with the flag and the value in the message
instead of hanging in a collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import List, Optional, Sequence

from ..config import Config, flag_name
from ..errors import ConfigError


def _base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return _base_type(args[0]) if args else tp


def _add_field(group, f: dataclasses.Field, hints) -> None:
    meta = dict(f.metadata)
    help_text = meta.pop("help")
    flags = [meta.pop("flag", flag_name(f.name)), *meta.pop("aliases", [])]
    tp = _base_type(hints[f.name])
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if tp is bool:
        if default:
            # The help once, on the positive form (the help text says what is on); the
            # positive form changes no value, but a flag typed can mean something
            # (``_apply_one_worker``: --diloco-sync asks one worker for its outer optimizer).
            group.add_argument(*["--no-" + flag[2:] for flag in flags], dest=f.name,
                               action="store_false", help=f"Turns {flags[0]} off.")
            group.add_argument(*flags, dest=f.name, action="store_true", default=True,
                               help=f"(on by default) {help_text}")
        else:
            group.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
        return
    if typing.get_origin(hints[f.name]) in (list, List):
        tp = str
    if default not in (None, []):
        help_text += f" (default {default})"
    group.add_argument(*flags, dest=f.name, **{"type": tp, "default": default,
                                                "help": help_text, **meta})


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (a ConfigError), never the usage dump."""

    def error(self, message):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    from . import megatron_flags

    parser = _Parser(
        prog="pretrain_gpt.py",
        description="Train a GPT with Megatron-core inside DeepSpeed ZeRO, as one or more "
        "DiLoCo workers.", allow_abbrev=False)
    # Launchers pass this; LOCAL_RANK in the environment is what we use.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    for section_name, section in Config().sections():
        cls = type(section)
        group = parser.add_argument_group(section_name, cls.__doc__)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, f, hints)
    megatron_flags.add_to_parser(parser)
    return parser


def config_from_namespace(ns: argparse.Namespace) -> Config:
    cfg = Config()
    for _, section in cfg.sections():
        for f in dataclasses.fields(section):
            setattr(section, f.name, getattr(ns, f.name))
    return cfg


def parse_args(argv: Optional[Sequence[str]] = None) -> Config:
    """Flags -> Config. Megatron-LM / Megatron-DeepSpeed flags that are not ours are mapped,
    accepted or refused (``megatron_flags``); an unknown flag is refused by name. Every
    problem is one line of the ConfigError; notes on accepted flags go to ``cfg.notes``."""
    from . import megatron_flags

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    problems = _unknown_lines(argv, unknown, parser)
    cfg = config_from_namespace(namespace)
    given = megatron_flags.given_flags(argv)
    try:
        cfg.notes = megatron_flags.apply(cfg, namespace, given)
    except megatron_flags.Refusal as e:
        problems.extend(str(e).splitlines())
    problems.extend(_apply_schedule_flags(cfg, given))
    if problems:
        raise ConfigError("\n".join(problems))
    from ..streaming import rule

    chosen = rule.choose_unset(cfg)  # before the one-worker line, which names H and P
    _apply_one_worker(cfg, given, parser)
    cfg.notes += [chosen] if chosen and cfg.streaming.diloco_sync else []
    sparse = rule.choose_sparse_outer_lr(cfg, given)
    cfg.notes += [sparse] if sparse else []
    past = rule.past_measured(cfg.streaming, cfg.training.train_iters)
    cfg.notes += [past] if past else []  # where validate's warning on outer momentum is not
    return cfg


def _apply_one_worker(cfg: Config, given: set, parser: argparse.ArgumentParser) -> None:
    """One worker (``--diloco-workers 1``) runs its outer optimizer only when the outer loop
    is asked for: a flag of its math typed (``settings.OUTER_LOOP_FIELDS``: --diloco-inner-steps,
    --diloco-outer-lr, ...) or --diloco-sync; else it is plain training with no outer state, as
    launch lines that give only --diloco-workers 1 expect. Asked for, it quantizes only with
    --diloco-quantize typed (the default FP4 is the wire's format, and there is no wire), and
    says so in one line at start."""
    from ..streaming import settings

    s = cfg.streaming
    if s.diloco_workers != 1 or not s.diloco_sync:  # several workers, or --no-diloco-sync
        return
    outer_flags = {flag for action in parser._actions if action.dest in
                   settings.OUTER_LOOP_FIELDS for flag in action.option_strings}
    asked = sorted(given & outer_flags) + (["--diloco-sync"] if "--diloco-sync" in given
                                           else [])
    if not asked:
        s.diloco_sync = False
        return
    if "--diloco-quantize" not in given:
        s.diloco_quantize = "none"
    cfg.notes.append(f"--diloco-workers 1 with {', '.join(asked)} (--no-diloco-sync: plain "
                     f"training): {settings.describe_one_worker(cfg)}")


def _apply_schedule_flags(cfg: Config, given: set) -> List[str]:
    """Rules that need to know which flags were typed: training length, and the keys of a
    --deepspeed_config JSON that set flags not given. Returns one line per problem."""
    from ..config import ds_config, schedules

    problems = schedules.apply_given(cfg, given)
    notes, json_problems = ds_config.apply_user_config(cfg, given)
    cfg.notes.extend(notes)
    return problems + json_problems


def _unknown_lines(argv: Sequence[str], unknown: Sequence[str],
                   parser: argparse.ArgumentParser) -> List[str]:
    """One line per flag nothing takes (the values right after it need no line of their
    own) and per stray value."""
    from collections import Counter

    left, lines, in_unknown_flag = Counter(unknown), [], False
    for token in argv:
        if not left[token]:
            in_unknown_flag = False
            continue
        left[token] -= 1
        if token.startswith("-"):
            lines.append(_unknown_flag(token, parser))
            in_unknown_flag = True
        elif not in_unknown_flag:
            lines.append(f"unexpected value {token!r} (no flag before it takes a value)")
    return lines


def _unknown_flag(token: str, parser: argparse.ArgumentParser) -> str:
    """One line for a flag nothing takes, with the nearest known flag if one is close."""
    import difflib

    flag = token.split("=", 1)[0]
    close = difflib.get_close_matches(flag, list(parser._option_string_actions), n=1,
                                      cutoff=0.8)
    hint = f"; did you mean {close[0]}?" if close else \
        "; see the table of Megatron flags in docs/megatron.md and `pretrain_gpt.py --help`"
    return f"unrecognized argument {flag}: not a flag of this pretrain_gpt.py nor a known " \
           f"Megatron-LM / Megatron-DeepSpeed flag{hint}"


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: Config, world_size: int) -> None:
    """Check every flag against the others and the world size; raise ConfigError."""
    from ..parallel.topology import RankLayout

    m, p, o, d = cfg.model, cfg.parallel, cfg.optimizer, cfg.data
    cfg.warnings = []  # the checks below add theirs
    try:
        layout = RankLayout.of(cfg, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(m, name)
        _require(value > 0, f"{flag_name(name)} must be > 0, got {value}")
    _require(m.hidden_size % m.num_attention_heads == 0,
             f"--hidden-size ({m.hidden_size}) is not divisible by --num-attention-heads "
             f"({m.num_attention_heads})")
    _require(m.num_attention_heads % tp == 0,
             f"--num-attention-heads ({m.num_attention_heads}) is not divisible by "
             f"--tensor-model-parallel-size ({tp})")
    _require(m.num_layers % pp == 0,
             f"--num-layers ({m.num_layers}) is not divisible by "
             f"--pipeline-model-parallel-size ({pp})")
    ffn = m.ffn_size()
    _require(ffn % tp == 0, f"--ffn-hidden-size ({ffn}) is not divisible by "
             f"--tensor-model-parallel-size ({tp})")
    _validate_attention(m, tp)
    _validate_recompute(m)
    if p.sequence_parallel and tp == 1:  # Megatron-LM does the same
        p.sequence_parallel = False
        cfg.adjustments.append("--sequence-parallel switched off: it needs "
                               "--tensor-model-parallel-size > 1")
    if p.sequence_parallel:
        _require(m.seq_length % tp == 0,
                 f"--seq-length ({m.seq_length}) is not divisible by "
                 f"--tensor-model-parallel-size ({tp}) as --sequence-parallel needs")
    max_pos = m.max_position_embeddings or m.seq_length
    _require(m.position_embedding_type != "learned_absolute" or max_pos >= m.seq_length,
             f"--max-position-embeddings ({max_pos}) is smaller than --seq-length "
             f"({m.seq_length})")
    _validate_layer_kinds(cfg)
    _validate_moe(cfg, layout)
    _validate_gpu_features(cfg)
    _validate_streaming(cfg)
    _validate_zero(cfg, pp)
    _validate_precision(cfg)
    _validate_schedules(cfg, dp)
    from ..streaming import rule

    cfg.warnings += rule.warnings(cfg.streaming, cfg.optimizer.lr, cfg.training.train_iters)
    _validate_batches(cfg, dp)
    _require(o.lr >= 0 and o.min_lr >= 0, f"--lr ({o.lr}) and --min-lr ({o.min_lr}) must be "
             ">= 0")
    _require(o.clip_grad >= 0, f"--clip-grad must be >= 0, got {o.clip_grad}")
    _require(o.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {o.lr_warmup_iters}")
    _require(cfg.logging.log_interval > 0,
             f"--log-interval must be > 0, got {cfg.logging.log_interval}")
    interval = cfg.logging.tensorboard_log_interval
    _require(interval is None or interval > 0,
             f"--tensorboard-log-interval must be > 0, got {interval}")
    # TensorBoard reads a queue size of 0 as "unbounded": nothing would reach the disk
    # until the writer's timer or the end.
    _require(cfg.logging.tensorboard_queue_size > 0,
             f"--tensorboard-queue-size must be > 0, got {cfg.logging.tensorboard_queue_size}")
    _require(not cfg.logging.log_optimizer_states_to_tensorboard or o.optimizer == "adam",
             f"--log-optimizer-states-to-tensorboard writes Adam's moments; --optimizer "
             f"{o.optimizer} keeps none")
    _require(not cfg.logging.wandb_project or cfg.logging.wandb_exp_name,
             f"--wandb-project {cfg.logging.wandb_project} needs --wandb-exp-name (the run's "
             "name, as in Megatron-LM)")
    _validate_data(d)
    _validate_checkpoint(cfg)


def _validate_attention(m, tp: int) -> None:
    """Grouped-query attention, head size and RoPE: checked before megatron asserts."""
    groups = m.query_groups()
    _require(groups > 0, f"--num-query-groups must be > 0, got {groups}")
    _require(m.num_attention_heads % groups == 0,
             f"--num-attention-heads ({m.num_attention_heads}) is not divisible by "
             f"--num-query-groups ({groups})")
    # megatron-core also handles fewer groups than TP ranks by replicating key/value heads;
    # that layout is not layout-free here (each rank would hold a copy), so it is refused.
    _require(groups % tp == 0,
             f"--num-query-groups ({groups}) is not divisible by --tensor-model-parallel-size "
             f"({tp})")
    _require(m.kv_channels is None or m.kv_channels > 0,
             f"--kv-channels must be > 0, got {m.kv_channels}")
    _require(0.0 < m.rotary_percent <= 1.0,
             f"--rotary-percent must be in (0, 1], got {m.rotary_percent}")
    _require(m.rotary_base > 0, f"--rotary-base must be > 0, got {m.rotary_base}")


def _validate_recompute(m) -> None:
    """Megatron-LM's rules, checked before megatron-core's config asserts."""
    if m.recompute_granularity is None:
        _require(m.recompute_method is None and m.recompute_num_layers is None,
                 "--recompute-method / --recompute-num-layers need --recompute-granularity")
        return
    if m.recompute_granularity == "selective":
        _require(m.recompute_method is None and m.recompute_num_layers is None,
                 "--recompute-granularity selective takes no --recompute-method or "
                 "--recompute-num-layers (they choose layers for full recompute)")
        allowed = {"core_attn", "mlp", "layernorm"}
        bad = sorted(set(m.recompute_modules or []) - allowed)
        _require(not bad, f"--recompute-modules {' '.join(bad)}: choose from "
                 f"{', '.join(sorted(allowed))}")
        from patches.optional import have_te
        import torch

        # megatron-core 0.16.1 recomputes layernorm through Transformer Engine only, and its
        # MLP recompute never returns from the backward on CPU (a reentrant checkpoint).
        gpu_only = sorted(set(m.recompute_modules or []) & {"mlp", "layernorm"})
        _require(not gpu_only or (torch.cuda.is_available() and have_te()),
                 f"--recompute-modules {' '.join(gpu_only)}: needs a GPU with Transformer "
                 "Engine here; use core_attn (the default)")
        return
    _require(m.recompute_method is not None,
             "--recompute-granularity full needs --recompute-method uniform or block")
    _require(m.recompute_num_layers is None or m.recompute_num_layers > 0,
             f"--recompute-num-layers must be > 0, got {m.recompute_num_layers}")
    _require(not (m.ladder_residual or m.ladder_layers),
             "--recompute-granularity full is not supported with --ladder-residual / "
             "--ladder-layers; use --recompute-granularity selective")


def _validate_layer_kinds(cfg: Config) -> None:
    """Ulysses and Ladder residual: checked up front (an uneven Ulysses split hangs gloo)."""
    m, p = cfg.model, cfg.parallel
    try:
        if p.ds_sequence_parallel_size > 1:
            from ..worker.ulysses import check_ulysses

            check_ulysses(m.num_attention_heads, m.query_groups(), p.tensor_model_parallel_size,
                          p.ds_sequence_parallel_size, m.seq_length, p.sequence_parallel)
        if m.ladder_residual or m.ladder_layers:
            from ..worker.ladder import ladder_layer_set

            ladder_layer_set(m.ladder_residual, m.ladder_layers, m.num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ladder = m.ladder_residual or m.ladder_layers
    _require(not (ladder and p.sequence_parallel),
             "--ladder-residual / --ladder-layers do not support --sequence-parallel yet")
    _require(not (ladder and m.transformer_impl == "transformer_engine"),
             "--ladder-residual / --ladder-layers need --transformer-impl local (or auto)")
    _require(not (p.ds_sequence_parallel_size > 1 and m.transformer_impl == "transformer_engine"),
             "--ds-sequence-parallel-size > 1 needs --transformer-impl local (or auto)")
    _require(not (m.attention_backend == "local" and m.transformer_impl == "transformer_engine"),
             "--attention-backend local is megatron-core's own attention on its local layers: "
             "use --transformer-impl local (or auto), as Megatron-LM's --spec local")


def _validate_moe(cfg: Config, layout) -> None:
    """Mixture of experts: Megatron-LM's rules, and what does not run here, by flag."""
    from ..config.schema import moe_layer_pattern

    m, p = cfg.model, cfg.parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    _require(m.num_experts is None or m.num_experts >= 1,
             f"--num-experts must be >= 1, got {m.num_experts}")
    if not m.moe:
        _require(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts above 1")
        return
    e = m.num_experts
    _require(e % ep == 0, f"--num-experts ({e}) is not divisible by "
             f"--expert-model-parallel-size ({ep})")
    _require(1 <= m.moe_router_topk <= e,
             f"--moe-router-topk must be in [1, --num-experts ({e})], got {m.moe_router_topk}")
    _require(m.moe_router_topk > 1 or m.moe_router_pre_softmax,
             "--moe-router-topk 1 needs --moe-router-pre-softmax (a softmax over the one "
             "chosen expert has no gradient), as in Megatron-LM")
    try:
        pattern = moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pp = p.pipeline_model_parallel_size
    per_stage = m.num_layers // pp
    empty = [s for s in range(pp) if not any(pattern[s * per_stage:(s + 1) * per_stage])]
    # At EP > 1 the experts are optimizer groups of their own, which every stage must have
    # (DeepSpeed reduces each group's gradient norm over the pipeline stages together).
    _require(ep == 1 or not empty,
             f"--moe-layer-freq {m.moe_layer_freq} leaves pipeline stage "
             f"{empty[0] if empty else 0} without an MoE layer, which "
             f"--expert-model-parallel-size {ep} needs on every stage; change the frequency or "
             "the pipeline size")
    _require(etp is None or etp == p.tensor_model_parallel_size,
             f"--expert-tensor-parallel-size {etp}: only the tensor-parallel size "
             f"({p.tensor_model_parallel_size}, the default) is supported")
    # megatron-core 0.16.1 takes expert biases only at expert TP 1 (at EP 1 through
    # patches.megatron_moe.unshared_expert_outputs).
    _require(m.disable_bias_linear or p.tensor_model_parallel_size == 1,
             "--num-experts with --tensor-model-parallel-size > 1: megatron-core's experts take "
             "linear biases only at expert tensor-parallel size 1; add --disable-bias-linear")
    _require(not (p.tensor_model_parallel_size > 1 and not p.sequence_parallel),
             "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel, as "
             "megatron-core requires")
    # DeepSpeed's stage-0 clipping averages each rank's own norm over the data-parallel
    # ranks, which hold different experts: the norm would not be the model's.
    _require(not (ep > 1 and p.zero_stage == 0 and cfg.optimizer.clip_grad > 0),
             f"--zero-stage 0 with --expert-model-parallel-size {ep}: DeepSpeed's stage-0 "
             "gradient clipping averages per-rank norms, which differ with experts spread "
             "over the ranks; use --zero-stage 1 or 2 (or --clip-grad 0)")
    width = m.moe_ffn_hidden_size or m.ffn_size()
    _require(width > 0 and width % (etp or p.tensor_model_parallel_size) == 0,
             f"--moe-ffn-hidden-size ({width}) is not divisible by the expert tensor-parallel "
             f"size ({etp or p.tensor_model_parallel_size})")
    shared = m.moe_shared_expert_intermediate_size
    _require(shared is None or shared > 0,
             f"--moe-shared-expert-intermediate-size must be > 0, got {shared}")
    _require(shared is None or m.disable_bias_linear,
             "--moe-shared-expert-intermediate-size needs --disable-bias-linear: megatron-core's "
             "shared experts take no biases")
    capacity = m.moe_expert_capacity_factor
    _require(capacity is None or capacity > 0,
             f"--moe-expert-capacity-factor must be > 0, got {capacity}")
    if m.moe_min_capacity is not None and capacity is not None:
        # the tokens one router call sees: a micro-batch, less what SP splits off
        tokens = cfg.training.micro_batch_size * m.seq_length // (
            p.ds_sequence_parallel_size *
            (p.tensor_model_parallel_size if p.sequence_parallel else 1))
        import math

        least = math.ceil(tokens * m.moe_router_topk / e * capacity)
        _require(least >= m.moe_min_capacity,
                 f"--moe-min-capacity {m.moe_min_capacity}: megatron-core's capacity has no "
                 f"minimum, and here it is {least} (--moe-expert-capacity-factor {capacity:g} "
                 f"x {tokens} tokens x top-{m.moe_router_topk} / {e} experts), below it: "
                 "drop the flag or raise the capacity factor")
    _require(not m.moe_pad_expert_input_to_capacity or capacity is not None,
             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    _require(not (m.ladder_residual or m.ladder_layers),
             "--num-experts does not go with --ladder-residual / --ladder-layers (the ladder "
             "block's MLP is dense)")
    import torch

    _require(not m.moe_grouped_gemm or torch.cuda.is_available(),
             "--moe-grouped-gemm: the grouped GEMM is a GPU kernel and this machine has no "
             "GPU; drop it (the experts then run one after another: the same math)")
    if m.moe_grouped_gemm:
        cfg.warnings.append("--moe-grouped-gemm: megatron-core's grouped GEMM experts have not "
                            "run in this project's tests (docs/limits.md, Mixture of experts)")


def _validate_gpu_features(cfg: Config) -> None:
    """FP8 exists only in Transformer Engine's layers on a GPU: one line per flag where it
    cannot run."""
    flags = cfg.te.gpu_only_flags()
    if not flags:
        return
    from ..worker.model import have_transformer_engine

    import torch

    if not (torch.cuda.is_available() and have_transformer_engine()):
        raise ConfigError("\n".join(
            f"{flag}: needs Transformer Engine on a GPU, which this machine lacks; drop it "
            "(training then runs in the precision of --bf16/--fp16)"
            for flag in flags))
    m, p = cfg.model, cfg.parallel
    local_only = [name for name, on in (
        (f"--transformer-impl {m.transformer_impl}", m.transformer_impl != "transformer_engine"),
        ("--attention-backend local", m.attention_backend == "local"),
        ("--ladder-residual / --ladder-layers", m.ladder_residual or m.ladder_layers),
        ("--ds-sequence-parallel-size > 1", p.ds_sequence_parallel_size > 1)) if on]
    _require(not local_only, f"{', '.join(flags)} need Transformer Engine's layers, which "
             f"{local_only[0] if local_only else ''} replaces with megatron-core's local ones")


def _check_cross_worker_nccl(cfg: Config, have_cuda: bool) -> None:
    """NCCL across workers is opt-in: refuse what cannot work with it, say once that it has
    not run here. A stuck or lost peer of an NCCL group blocks the GPU stream (and a host
    that reads a result) until NCCL's watchdog ends the process: the survivors cannot go on
    without the lost worker, and only a cross-worker timeout below the in-worker one lets the
    job's own error (and its checkpoint on the way out) come first."""
    s, p = cfg.streaming, cfg.parallel
    if s.diloco_backend != "nccl":
        return
    _require(have_cuda, "--diloco-backend nccl needs CUDA, and this machine has no GPU")
    _require(s.diloco_min_workers is None or s.diloco_min_workers >= s.diloco_workers,
             f"--diloco-min-workers {s.diloco_min_workers} needs --diloco-backend gloo: a lost "
             "worker's NCCL peers block until NCCL's watchdog ends their process, so the "
             "survivors cannot go on without it")
    in_worker = 60.0 * p.distributed_timeout_minutes
    _require(s.diloco_timeout < in_worker,
             f"--diloco-backend nccl: --diloco-timeout {s.diloco_timeout:g} s must be below "
             f"--distributed-timeout-minutes {p.distributed_timeout_minutes:g} "
             f"({in_worker:g} s), or the in-worker watchdog ends the process before the "
             "cross-worker exchange reports its stuck peer")
    cfg.warnings.append(
        "--diloco-backend nccl: NCCL across workers has not run in this project's tests; it "
        "needs a network both clusters' NCCL can use (docs/gpu_clusters.md), and a lost "
        "worker ends the job")


def _validate_streaming(cfg: Config) -> None:
    """The sync's own checks (schedule, fragments, outer optimizer, codec), as flag errors."""
    from ..streaming import settings

    s, layers = cfg.streaming, cfg.model.num_layers
    if s.diloco_fragment_layers is not None:
        _require(s.diloco_fragment_layers > 0 and layers % s.diloco_fragment_layers == 0,
                 f"--diloco-fragment-layers ({s.diloco_fragment_layers}) must divide "
                 f"--num-layers ({layers})")
    _require(0.0 <= s.diloco_alpha <= 1.0,
             f"--diloco-alpha must be in [0, 1], got {s.diloco_alpha}")
    _require(s.diloco_timeout > 0, f"--diloco-timeout must be > 0, got {s.diloco_timeout}")
    if s.diloco_min_workers is not None:
        _require(s.diloco_workers > 1,
                 f"--diloco-min-workers {s.diloco_min_workers}: elastic workers need "
                 "--diloco-workers above 1 (one worker has no other to go on without); drop it")
        _require(1 <= s.diloco_min_workers <= s.diloco_workers,
                 f"--diloco-min-workers must be in [1, --diloco-workers ({s.diloco_workers})], "
                 f"got {s.diloco_min_workers}")
        _require(not (s.diloco_eager and s.diloco_min_workers < s.diloco_workers),
                 "--diloco-min-workers below --diloco-workers does not go with --diloco-eager "
                 "(each worker's own global copy cannot be taken from another)")
    _require(s.diloco_control_lag >= 1,
             f"--diloco-control-lag must be >= 1, got {s.diloco_control_lag}")
    if s.diloco_quantize == "sparse":
        _require(2 <= s.diloco_sparse_chunk <= 1 << 24, "--diloco-sparse-chunk must be in "
                 f"[2, 16777216], got {s.diloco_sparse_chunk}")
        _require(1 <= s.diloco_sparse_k <= s.diloco_sparse_chunk, "--diloco-sparse-k must be "
                 f"in [1, --diloco-sparse-chunk ({s.diloco_sparse_chunk})], got "
                 f"{s.diloco_sparse_k}")
        _require(0.0 <= s.diloco_sparse_decay <= 1.0,
                 f"--diloco-sparse-decay must be in [0, 1], got {s.diloco_sparse_decay}")
    import torch

    _check_cross_worker_nccl(cfg, torch.cuda.is_available())
    if cfg.parallel.distributed_backend == "nccl" and not torch.cuda.is_available():
        # Megatron launch scripts pass it as a matter of course; on CPU gloo is the only one.
        cfg.parallel.distributed_backend = "gloo"
        cfg.adjustments.append("--distributed-backend nccl: this machine has no GPU; "
                               "using gloo")
    try:
        settings.fragment_plan(cfg)
        settings.sync_schedule(cfg)
        settings.outer_optimizer(cfg)
        settings.codec(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_zero(cfg: Config, pp: int) -> None:
    stage = cfg.parallel.zero_stage
    # ZeRO-2 reduces each gradient as soon as backward produces it and keeps per-backward
    # bookkeeping that assumes forward and backward alternate; the 1F1B pipeline schedule
    # runs several forwards before their backwards. DeepSpeed's own pipeline engine refuses
    # the same combination.
    _require(not (stage == 2 and pp > 1),
             f"--zero-stage 2 cannot be combined with --pipeline-model-parallel-size {pp}; "
             "use --zero-stage 1 with pipeline parallelism")
    if cfg.parallel.overlap_grad_reduce and stage < 2:
        # The schedule owns the micro-batch loop, so DeepSpeed reduces below stage 2 once, in
        # engine.step() after the last backward (and refuses overlap_comm there).
        cfg.parallel.overlap_grad_reduce = False
        cfg.adjustments.append(
            f"--overlap-grad-reduce at --zero-stage {stage} (--use-distributed-optimizer is "
            "stage 1): the gradients are reduced once, in the optimizer step after the last "
            "backward, so there is nothing to overlap; running without DeepSpeed's "
            "overlap_comm (--zero-stage 2 reduces during each backward and overlaps)")


def _validate_precision(cfg: Config) -> None:
    """Megatron's loss-scaling flags, in the forms DeepSpeed's fp16 section can take."""
    p = cfg.precision
    _require(not (p.fp16 and p.bf16), "--fp16 and --bf16 are mutually exclusive; choose one")
    if p.bf16 and cfg.parallel.zero_stage == 0 and not p.grad_reduce_in_bf16:
        # DeepSpeed has no fp32 accumulation of bf16 gradients without ZeRO (it raises), and
        # Megatron-DeepSpeed's own bf16 ZeRO-0 runs accumulate in bf16: said, not refused.
        cfg.adjustments.append(
            "--bf16 at --zero-stage 0: gradients accumulate over micro-batches in bf16 "
            "(DeepSpeed accumulates bf16 gradients in fp32, as Megatron-LM does, only under "
            "ZeRO); --zero-stage 1 or 2 accumulates them in fp32")
    if not p.fp16:
        return  # Megatron ignores the loss-scaling flags without --fp16, and so do we
    if p.loss_scale is not None:
        _require(p.loss_scale > 0, f"--loss-scale must be > 0, got {p.loss_scale}")
        return
    import math

    initial = p.initial_loss_scale
    # DeepSpeed takes the initial dynamic scale as a power of two (fp16.initial_scale_power).
    _require(initial > 0 and math.log2(initial).is_integer(),
             f"--initial-loss-scale {initial:g}: DeepSpeed's dynamic loss scale starts at a "
             "power of two (e.g. 65536 = 2**16)")
    for flag, value in (("--min-loss-scale", p.min_loss_scale),
                        ("--loss-scale-window", p.loss_scale_window)):
        _require(value >= 1 and float(value).is_integer(),
                 f"{flag} {value:g}: DeepSpeed's loss scaler takes a whole number >= 1")
    _require(p.min_loss_scale <= initial,
             f"--min-loss-scale ({p.min_loss_scale:g}) is larger than --initial-loss-scale "
             f"({initial:g})")
    _require(p.hysteresis >= 1, f"--hysteresis must be >= 1, got {p.hysteresis}")
    if cfg.parallel.zero_stage == 0 and p.hysteresis > 1:
        cfg.adjustments.append(
            f"--hysteresis {p.hysteresis}: without ZeRO (--zero-stage 0) DeepSpeed's fp16 "
            "optimizer halves the loss scale at every overflow (hysteresis 1)")


def _validate_schedules(cfg: Config, dp: int) -> None:
    """Iterations, batch ramp-up and learning-rate flags (Megatron's rules; resolves the
    iteration count of --train-samples / --train-tokens), and the --deepspeed_config JSON
    against the generated DeepSpeed config."""
    from ..config import ds_config, schedules
    from ..worker.engine import deepspeed_config

    try:
        batches = schedules.check_and_resolve(cfg, dp)
        if cfg.training.deepspeed_config:
            ds_config.check_accumulation(cfg, batches.final_micro_batches, dp)
            deepspeed_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_batches(cfg: Config, dp: int) -> None:
    t = cfg.training
    _require(t.micro_batch_size > 0, f"--micro-batch-size must be > 0, got {t.micro_batch_size}")
    gbs = t.global_batch_size or t.micro_batch_size * dp
    _require(gbs > 0 and gbs % (t.micro_batch_size * dp) == 0,
             f"--global-batch-size ({gbs}) is not divisible by --micro-batch-size "
             f"({t.micro_batch_size}) x data-parallel size ({dp})")
    _require(t.skip_train or t.train_iters > 0,
             f"--train-iters must be > 0, got {t.train_iters}")
    _require(t.eval_interval >= 0, f"--eval-interval must be >= 0, got {t.eval_interval}")
    _require(t.exit_interval >= 0, f"--exit-interval must be >= 0, got {t.exit_interval}")
    _require(t.eval_iters >= 0, f"--eval-iters must be >= 0, got {t.eval_iters}")
    _require(t.manual_gc_interval >= 0,
             f"--manual-gc-interval must be >= 0, got {t.manual_gc_interval}")


def _validate_data(d) -> None:
    sources = [bool(d.data_path), bool(d.train_data_path or d.valid_data_path
                                        or d.test_data_path), d.mock_data]
    _require(sum(sources) == 1,
             "give exactly one data source: --data-path, --train-data-path (with "
             "--valid-data-path/--test-data-path), or --mock-data")
    from ..data.tokenizers import TokenizerSpec, problems

    if d.mock_data and d.tokenizer_type is None:
        _require(d.vocab_size is None or d.vocab_size > 1,
                 f"--vocab-size must be > 1, got {d.vocab_size}")
        return
    if not d.mock_data:
        _require(d.tokenizer_model is not None or d.tokenizer_type is not None
                 or (d.vocab_file and d.merge_file),
                 "--tokenizer-model (or --tokenizer-type with its files) is required with "
                 "--data-path / --train-data-path")
    found = problems(TokenizerSpec.of(d))
    _require(not found, "\n".join(found))
    if d.mock_data:
        return
    for flag, prefixes in (("--data-path", d.data_path), ("--train-data-path",
                           d.train_data_path), ("--valid-data-path", d.valid_data_path),
                           ("--test-data-path", d.test_data_path)):
        for prefix in prefixes:
            if _is_number(prefix):
                continue
            for suffix in (".bin", ".idx"):
                _require(os.path.isfile(prefix + suffix),
                         f"{flag} {prefix}: {prefix + suffix} does not exist")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _validate_checkpoint(cfg: Config) -> None:
    import torch

    c, t = cfg.checkpoint, cfg.training
    _require(c.save_interval >= 0, f"--save-interval must be >= 0, got {c.save_interval}")
    if c.save_interval and not c.save:  # Megatron-LM saves only `if args.save and ...`
        cfg.adjustments.append(f"--save-interval {c.save_interval} without --save: nothing "
                               "is saved")
        c.save_interval = 0  # said once, however often the config is validated
    _require(c.keep_last >= 0, f"--keep-last must be >= 0, got {c.keep_last}")
    _require(not c.keep_last or c.save, f"--keep-last {c.keep_last} needs --save DIR")
    _require(not c.async_save or c.save, "--async-save needs --save DIR")
    if c.async_save and torch.cuda.is_available():
        cfg.warnings.append("--async-save: the copy of device tensors into pinned host memory "
                            "before the background write has not run in this project's tests "
                            "(docs/limits.md, Checkpoints)")
    if c.load is not None and c.load != c.save:
        _require(os.path.isdir(c.load), f"--load {c.load}: no such directory")
    _require(not t.skip_train or c.load is not None or t.eval_iters > 0,
             "--skip-train with no --load and --eval-iters 0 does nothing")

"""Flags generated from the config dataclasses, and the one place that validates them.

Validation runs before any process-group work, from the launcher's environment
(``WORLD_SIZE``), so a bad layout fails at once with the flag and the value in the message
instead of hanging in a collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import List, Optional, Sequence

from .config import Config
from .errors import UsageError


class ConfigError(UsageError):
    """A flag value that cannot work; the message names the flag and the value."""


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return _base_type(args[0]) if args else tp


def _add_field(group, f: dataclasses.Field, hints) -> None:
    meta = dict(f.metadata)
    help_text = meta.pop("help")
    flag = meta.pop("flag", flag_name(f.name))
    tp = _base_type(hints[f.name])
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if tp is bool:
        if default:
            group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false",
                               help=f"Turn off: {help_text}")
        else:
            group.add_argument(flag, dest=f.name, action="store_true", help=help_text)
        return
    if typing.get_origin(hints[f.name]) in (list, List):
        tp = str
    if "choices" in meta and default is not None:
        help_text += f" (default {default})"
    elif default not in (None, []):
        help_text += f" (default {default})"
    group.add_argument(flag, dest=f.name, type=tp, default=default, help=help_text, **meta)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    return parser


def config_from_namespace(ns: argparse.Namespace) -> Config:
    cfg = Config()
    for _, section in cfg.sections():
        for f in dataclasses.fields(section):
            setattr(section, f.name, getattr(ns, f.name))
    return cfg


def parse_args(argv: Optional[Sequence[str]] = None) -> Config:
    return config_from_namespace(build_parser().parse_args(argv))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: Config, world_size: int) -> None:
    """Check every flag against the others and the world size; raise ConfigError."""
    from .topology import RankLayout

    m, p, o, d = cfg.model, cfg.parallel, cfg.optimizer, cfg.data
    try:
        layout = RankLayout(world_size, cfg.streaming.diloco_workers, p.tensor_model_parallel_size,
                            p.pipeline_model_parallel_size, p.ds_sequence_parallel_size)
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
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    _require(ffn % tp == 0, f"--ffn-hidden-size ({ffn}) is not divisible by "
             f"--tensor-model-parallel-size ({tp})")
    if p.sequence_parallel:
        _require(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1, got "
                 f"{tp}")
        _require(m.seq_length % tp == 0,
                 f"--seq-length ({m.seq_length}) is not divisible by "
                 f"--tensor-model-parallel-size ({tp}) as --sequence-parallel needs")
    max_pos = m.max_position_embeddings or m.seq_length
    _require(m.position_embedding_type == "rope" or max_pos >= m.seq_length,
             f"--max-position-embeddings ({max_pos}) is smaller than --seq-length "
             f"({m.seq_length})")
    _validate_layer_kinds(cfg)
    _validate_streaming(cfg)
    _validate_zero(cfg, pp)
    _validate_batches(cfg, dp)
    _require(o.lr >= 0 and o.min_lr >= 0, f"--lr ({o.lr}) and --min-lr ({o.min_lr}) must be "
             ">= 0")
    _require(o.clip_grad >= 0, f"--clip-grad must be >= 0, got {o.clip_grad}")
    _require(o.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {o.lr_warmup_iters}")
    _require(cfg.logging.log_interval > 0,
             f"--log-interval must be > 0, got {cfg.logging.log_interval}")
    _validate_data(d)
    _validate_checkpoint(cfg)


def _validate_layer_kinds(cfg: Config) -> None:
    """Ulysses and Ladder residual: checked up front (an uneven Ulysses split hangs gloo)."""
    m, p = cfg.model, cfg.parallel
    try:
        if p.ds_sequence_parallel_size > 1:
            from .ulysses import check_ulysses

            check_ulysses(m.num_attention_heads, None, p.tensor_model_parallel_size,
                          p.ds_sequence_parallel_size, m.seq_length, p.sequence_parallel)
        if m.ladder_residual or m.ladder_layers:
            from .ladder import ladder_layer_set

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


def _validate_streaming(cfg: Config) -> None:
    """The sync's own checks (schedule, fragments, outer optimizer, codec), as flag errors."""
    from .streaming import builder
    from .streaming.codec import make_codec

    s, layers = cfg.streaming, cfg.model.num_layers
    if s.diloco_fragment_layers is not None:
        _require(s.diloco_fragment_layers > 0 and layers % s.diloco_fragment_layers == 0,
                 f"--diloco-fragment-layers ({s.diloco_fragment_layers}) must divide "
                 f"--num-layers ({layers})")
    _require(0.0 <= s.diloco_alpha <= 1.0,
             f"--diloco-alpha must be in [0, 1], got {s.diloco_alpha}")
    _require(s.diloco_timeout > 0, f"--diloco-timeout must be > 0, got {s.diloco_timeout}")
    _require(s.diloco_control_lag >= 1,
             f"--diloco-control-lag must be >= 1, got {s.diloco_control_lag}")
    import torch

    for flag, backend in (("--diloco-backend", s.diloco_backend),
                          ("--distributed-backend", cfg.parallel.distributed_backend)):
        _require(backend != "nccl" or torch.cuda.is_available(),
                 f"{flag} nccl needs CUDA, and this machine has no GPU")
    try:
        builder.fragment_plan(cfg)
        builder.sync_schedule(cfg)
        builder.outer_optimizer(cfg)
        make_codec(s.diloco_quantize, s.diloco_quant_block)
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
    _require(not (stage == 0 and cfg.model.bf16),
             "--bf16 needs --zero-stage 1 or 2 (the fp32 master weights live in the ZeRO "
             "optimizer), got --zero-stage 0")


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


def _validate_data(d) -> None:
    sources = [bool(d.data_path), bool(d.train_data_path or d.valid_data_path
                                        or d.test_data_path), d.mock_data]
    _require(sum(sources) == 1,
             "give exactly one data source: --data-path, --train-data-path (with "
             "--valid-data-path/--test-data-path), or --mock-data")
    if d.mock_data:
        _require(d.vocab_size > 1, f"--vocab-size must be > 1, got {d.vocab_size}")
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
    _require(d.tokenizer_model is not None,
             "--tokenizer-model is required with --data-path / --train-data-path")
    _require(os.path.isfile(d.tokenizer_model) and os.access(d.tokenizer_model, os.R_OK),
             f"--tokenizer-model {d.tokenizer_model}: not a readable file")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _validate_checkpoint(cfg: Config) -> None:
    c, t = cfg.checkpoint, cfg.training
    _require(c.save_interval >= 0, f"--save-interval must be >= 0, got {c.save_interval}")
    _require(not c.save_interval or c.save,
             f"--save-interval {c.save_interval} needs --save DIR")
    if c.load is not None and c.load != c.save:
        _require(os.path.isdir(c.load), f"--load {c.load}: no such directory")
    _require(not t.skip_train or c.load is not None or t.eval_iters > 0,
             "--skip-train with no --load and --eval-iters 0 does nothing")

"""Megatron-LM's own checkpoints (``torch_dist`` format) as a starting point: found, checked
against this run's flags, and their model weights read into this rank's model slice.

Megatron-LM's layout under ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt    the iteration, or ``release``
    DIR/iter_0000010/  (or DIR/release/)     megatron-core dist_checkpointing, torch_dist:
        metadata.json, .metadata, __<rank>_<n>.distcp, common.pt

Its tensors are keyed by megatron-core's sharded keys (``embedding.word_embeddings.weight``,
``decoder.layers.self_attention.linear_qkv.weight`` with the layer axis in front, ...), which
are exactly what the worker's megatron-core ``GPTModel.sharded_state_dict()`` asks for under
any TP / PP layout: the model's own mapping reads its slice (``load_weights``). That happens
right after the model is built and before the engine and the sync are: the inner optimizer's
fp32 masters and the sync's global parameters then start from the loaded weights as they
would from an initialisation. The optimizer state, the RNG states, the data iterators and the
learning-rate scheduler of the checkpoint are not read (Megatron-LM's ``--no-load-optim
--no-load-rng``); the iteration is the checkpoint's, or 0 with ``--finetune``.

megatron-core keys the layers one of two ways, by the TransformerConfig's ``moe_layer_freq``:
the int 1 (Megatron-LM's default ``--moe-layer-freq``: every dense model, and an MoE model
with every layer MoE) stacks them (``decoder.layers.<name>``, layer axis in front); any other
int or a list keys each layer apart (``decoder.layers.<i>.<name>``). The worker's MoE model
holds a list, so the form is chosen per checkpoint (``sharded_model_state``): the stored
keys' for a load, the one Megatron-LM's parser gives the ``--moe-layer-freq`` flag
(``megatron_layer_freq``) for an export.

``common.pt`` holds Megatron-LM's ``args`` (an ``argparse.Namespace``): it is read with
``torch.load(weights_only=True)`` allowing only megatron-core's safe classes, never by
unpickling code, and torch's ``.metadata`` through the restricted unpickler; the model flags
in ``args`` are compared with this run's (``check_compatible``). Writing one from a checkpoint
of ours: ``megatron_export``.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from .resume import CheckpointError
from .store import RELEASE, TRACKER, is_megatron_lm, iteration_directory, legacy_megatron_lm

__all__ = ["MegatronCheckpoint", "RELEASE", "check_compatible", "is_megatron_lm",
           "iteration_directory", "load_weights", "megatron_layer_freq", "model_config_of",
           "open_checkpoint", "read_common", "sharded_model_state", "stacked_layers"]

CHECKPOINT_VERSION = 3.0  # what Megatron-LM's torch_dist saves write


@dataclass
class MegatronCheckpoint:
    """A Megatron-LM checkpoint found under a ``--load`` directory."""

    root: str
    directory: str  # its iter_NNNNNNN or release directory
    iteration: int  # 0 for a release checkpoint
    args: Optional[argparse.Namespace]  # Megatron-LM's flags, as it saved them
    notes: List[str] = field(default_factory=list)  # warnings for the start of the run

    @property
    def consumed_samples(self) -> Optional[int]:
        return getattr(self.args, "consumed_train_samples", None)


def read_common(path: str) -> dict:
    """megatron-core's ``common.pt``, with ``weights_only``: plain data and the classes of
    megatron-core's safe list only (``argparse.Namespace``, its enums and dataclasses); a
    file holding anything else is refused unread."""
    import pickle

    import torch
    from megatron.core.safe_globals import register_safe_globals

    # What importing megatron.core registers already; said here, as this read depends on it.
    # (torch's ``safe_globals`` context would unregister them again on exit, for everyone.)
    register_safe_globals()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        from ..errors import first_line

        raise CheckpointError(f"{path} holds more than data and was not loaded "
                              f"({type(e).__name__}: {first_line(e)[:200]})") from None


def open_checkpoint(root: str) -> MegatronCheckpoint:
    """The Megatron-LM checkpoint under ``root``, its two pickled files checked safe and its
    ``args`` read. Needs no process group."""
    from .store import check_safe

    directory = iteration_directory(root)
    if directory is None or not os.path.isdir(directory):
        raise CheckpointError(f"--load {root}: {TRACKER} names {directory or 'nothing'}, "
                              "which is not a directory")
    if legacy_megatron_lm(directory) and not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise CheckpointError(
            f"--load {root}: a Megatron-LM checkpoint of the legacy per-rank format "
            f"({directory}/mp_rank_*); only its torch_dist format is read: convert it with "
            "Megatron-LM (--ckpt-convert-format torch_dist)")
    backend = _sharded_backend(root, directory)
    if backend != "torch_dist":
        raise CheckpointError(f"--load {root}: a Megatron-LM checkpoint of the {backend} "
                              f"format ({directory}/metadata.json); only torch_dist is read")
    common = read_common(os.path.join(directory, "common.pt"))
    check_safe(root, directory)  # torch's .metadata (and common.pt, read the same way)
    args = common.get("args")
    if args is not None and not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"--load {root}: {directory}/common.pt holds no Megatron-LM "
                              f"args (found {type(args).__name__})")
    iteration = common.get("iteration", 0) if os.path.basename(directory) != RELEASE else 0
    return MegatronCheckpoint(root, directory, int(iteration or 0), args)


def _sharded_backend(root: str, directory: str) -> str:
    import json

    path = os.path.join(directory, "metadata.json")
    try:
        with open(path) as f:
            return json.load(f).get("sharded_backend", "?")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--load {root}: {path} is missing or unreadable ({e}); not a "
                              "megatron-core dist_checkpointing directory") from None


# ---- Megatron-LM's args <-> our model flags ------------------------------------------------

def model_config_of(args: argparse.Namespace):
    """The ModelConfig that Megatron-LM's ``args`` describe (the fields the stored tensors
    and the model's math depend on)."""
    from ..config import ModelConfig

    def get(name, default=None):
        value = getattr(args, name, None)
        return default if value is None else value

    position = get("position_embedding_type", "learned_absolute")
    if get("use_rotary_position_embeddings", False):  # Megatron-LM before the type flag
        position = "rope"
    elif not get("add_position_embedding", True) and position == "learned_absolute":
        position = "none"
    experts = get("num_experts")
    # An int, a list (Megatron-LM's parsed flag) or a string (an export of ours before it
    # wrote Megatron-LM's types): each reads as our flag's text.
    freq = get("moe_layer_freq", 1)
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=get("ffn_hidden_size"), swiglu=bool(get("swiglu", False)),
        group_query_attention=bool(get("group_query_attention", False)),
        num_query_groups=get("num_query_groups"), kv_channels=get("kv_channels"),
        seq_length=get("seq_length", 64), max_position_embeddings=get("max_position_embeddings"),
        position_embedding_type=position, rotary_base=get("rotary_base", 10000),
        rotary_percent=get("rotary_percent", 1.0),
        use_rope_scaling=bool(get("use_rope_scaling", False)),
        rope_scaling_factor=get("rope_scaling_factor", 8.0),
        normalization=get("normalization", "LayerNorm"),
        norm_epsilon=get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
        apply_layernorm_1p=bool(get("apply_layernorm_1p", False)),
        untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights",
                                                     False)),
        disable_bias_linear=not get("add_bias_linear", True),
        make_vocab_size_divisible_by=get("make_vocab_size_divisible_by", 128),
        num_experts=experts if (experts or 1) > 1 else None,
        moe_layer_freq=str(freq), moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
        moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
        moe_router_topk=get("moe_router_topk", 2))


# Flags of Megatron-LM's models that no model here has: (args field, its off value, flag);
# --add-qkv-bias only without the other linear layers' biases.
UNSUPPORTED = (("add_qkv_bias", False, "--add-qkv-bias"), ("qk_layernorm", False,
               "--qk-layernorm"), ("mtp_num_layers", None, "--mtp-num-layers"),
               ("multi_latent_attention", False, "--multi-latent-attention"))
# Flags that change the model's math but no tensor's shape: a difference is warned about.
NUMERICS = (("--norm-epsilon", "norm_epsilon"), ("--rotary-base", "rotary_base"),
            ("--rotary-percent", "rotary_percent"), ("--use-rope-scaling", "use_rope_scaling"))


def check_compatible(ckpt: MegatronCheckpoint, cfg, vocab_size: Optional[int]) -> List[str]:
    """Raise CheckpointError, naming the flag and both values, where this run's model cannot
    take the checkpoint's weights; returns warnings for what only changes the math."""
    from .resume import architecture

    root, args = ckpt.root, ckpt.args
    if args is None:  # a checkpoint without args: the tensors' shapes are checked at load
        return [f"--load {root}: {ckpt.directory}/common.pt holds no args; the model flags "
                "are not checked against it (the tensors' shapes are)"]
    for field, off, flag in UNSUPPORTED:
        value = getattr(args, field, off)
        if field == "add_qkv_bias" and getattr(args, "add_bias_linear", True):
            continue  # every linear layer has its bias: the QKV one too, as here
        if value not in (off, None, False, 0):
            raise CheckpointError(f"--load {root}: the Megatron-LM checkpoint's model has "
                                  f"{flag} {value}, which no model here has")
    saved = model_config_of(args)
    mine = architecture(cfg.model)
    for flag, value in architecture(saved).items():
        if value != mine[flag]:
            raise CheckpointError(f"--load {root}: the Megatron-LM checkpoint's model has "
                                  f"{flag} {_show(value)}, this run {_show(mine[flag])}; pass "
                                  "the checkpoint's value")
    _check_vocabulary(root, args, vocab_size)
    return [f"--load {root}: the Megatron-LM checkpoint's model has {flag} "
            f"{getattr(saved, name)}, this run {getattr(cfg.model, name)}"
            for flag, name in NUMERICS if getattr(saved, name) != getattr(cfg.model, name)]


def _show(value) -> str:
    return "(absent)" if value is None else str(value)


def checkpoint_tokens(args) -> Optional[int]:
    """The size of the tokenizer a Megatron-LM checkpoint was trained with, where its ``args``
    say it: NullTokenizer's ``--vocab-size V`` is V ids plus the end-of-document one that
    Megatron-LM's NullTokenizer adds (V + 1 tokens, ``args.vocab_size`` keeps V); args without
    a tokenizer type (exports of ours before they wrote one) hold the tokenizer's size. Other
    tokenizers' ``--vocab-size`` is no size (unused, or TikTokenizer's cap): None, and only
    the padded size is compared, as Megatron-LM's loader does (the tensors' shapes)."""
    saved = getattr(args, "vocab_size", None)
    kind = getattr(args, "tokenizer_type", None)
    if saved is None:
        return None
    if kind in ("NullTokenizer", "NullMultimodalTokenizer"):
        return saved + 1
    return saved if kind is None else None


def _check_vocabulary(root: str, args, vocab_size: Optional[int]) -> None:
    """The tokenizer's vocabulary is the one the checkpoint's padded vocabulary was made from
    (Megatron-LM pads it to a multiple of --make-vocab-size-divisible-by x its TP size)."""
    from ..config.shape import padded_vocab_size

    padded = getattr(args, "padded_vocab_size", None)
    if vocab_size is None or padded is None:
        return
    tokens = checkpoint_tokens(args)
    if tokens is not None and tokens != vocab_size:
        kind = getattr(args, "tokenizer_type", None)
        how = (f" (--tokenizer-type {kind} --vocab-size {args.vocab_size}: {args.vocab_size} "
               "ids and the end-of-document one)") if kind else ""
        raise CheckpointError(f"--load {root}: the Megatron-LM checkpoint's tokenizer has "
                              f"{tokens} tokens{how}, this run's tokenizer {vocab_size} "
                              "(--tokenizer-type / --tokenizer-model / --vocab-size)")
    multiple = getattr(args, "make_vocab_size_divisible_by", 128) or 1
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if padded_vocab_size(vocab_size, multiple, tp) != padded:
        raise CheckpointError(f"--load {root}: the Megatron-LM checkpoint's vocabulary is "
                              f"padded to {padded} rows (--make-vocab-size-divisible-by "
                              f"{multiple} x TP {tp}), which this run's tokenizer of "
                              f"{vocab_size} tokens does not pad to (--tokenizer-type / "
                              "--tokenizer-model / --vocab-size)")


# ---- the layers' two key forms ---------------------------------------------------------------

_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def megatron_layer_freq(freq, num_layers: int) -> Union[int, List[int]]:
    """``--moe-layer-freq`` as Megatron-LM's parser leaves it in ``args`` (its
    ``moe_freq_type``): an int for ``N`` (or ``"N"``), the list of 0 / 1 per layer for a list
    expression (``"([1]*3+[0]*1)"``); an int or a list (a checkpoint's args) is kept. Raises
    ValueError naming the flag."""
    from ..config.schema import moe_layer_pattern

    if isinstance(freq, int) and not isinstance(freq, bool):
        moe_layer_pattern(str(freq), num_layers)  # validated (>= 1)
        return freq
    if isinstance(freq, (list, tuple)):
        freq = str(list(freq))
    text = str(freq).strip()
    if "[" in text:
        return moe_layer_pattern(text, num_layers)
    moe_layer_pattern(text, num_layers)
    return int(text)


def stacked_layers(keys) -> Optional[bool]:
    """Whether these sharded keys hold the layers stacked (``decoder.layers.<name>``, the
    TransformerConfig's ``moe_layer_freq`` the int 1) rather than one key set per layer
    (``decoder.layers.<i>.<name>``); None when they hold no layer."""
    layers = [k for k in keys if k.startswith("decoder.layers.")]
    if not layers:
        return None
    return not any(_PER_LAYER.match(k) for k in layers)


def sharded_model_state(model, layer_freq) -> dict:
    """``model.sharded_state_dict()`` keyed as megatron-core keys a model whose
    TransformerConfig's ``moe_layer_freq`` is ``layer_freq`` (the int 1: layers stacked; any
    other: each layer apart). The key form is all that field changes once the model is
    built (megatron-core's ``TransformerBlock.sharded_state_dict`` reads it; the layer specs
    were made from our pattern), so it is set on the model's configs for this call only."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if isinstance(c, TransformerConfig)}
    kept = {k: c.moe_layer_freq for k, c in configs.items()}
    try:
        for c in configs.values():
            c.moe_layer_freq = layer_freq
        return model.sharded_state_dict()
    finally:
        for k, c in configs.items():
            c.moe_layer_freq = kept[k]


def _layer_freq_for(model, stacked: Optional[bool]):
    """The ``moe_layer_freq`` that keys ``model``'s layers as a checkpoint does: the int 1
    when it stacks them, else the model's own per-layer pattern (a list)."""
    config = model.config
    if stacked or stacked is None:
        return 1
    freq = config.moe_layer_freq
    if isinstance(freq, list):
        return freq
    return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]


# ---- the weights, into this rank's model slice ---------------------------------------------

def stored_shapes(directory: str) -> Dict[str, tuple]:
    """key -> global shape of every tensor of a torch_dist directory (its ``.metadata``,
    read through the restricted unpickler)."""
    from patches.torch_dcp_safe_metadata import SafeUnpickler

    with open(os.path.join(directory, ".metadata"), "rb") as f:
        index = SafeUnpickler(f).load().state_dict_metadata
    return {k: tuple(v.size) for k, v in index.items() if hasattr(v, "size")}


def load_weights(model, ckpt: MegatronCheckpoint) -> List[str]:
    """Fill this rank's ``model`` (a megatron-core GPTModel slice) with the checkpoint's
    weights through the model's own sharded mapping; collective over the worker's ranks
    (the default group). Returns notes (a vocabulary padded otherwise)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.safe_globals import register_safe_globals

    root, directory = ckpt.root, ckpt.directory
    stored = stored_shapes(directory)
    stacked = stacked_layers(stored)
    request, rows, notes = {}, {}, []
    sharded = sharded_model_state(model, _layer_freq_for(model, stacked))
    for name, item in sharded.items():
        if isinstance(item, ShardedObject):  # _extra_state (Transformer Engine's FP8 meta)
            continue
        key = item.key
        if key not in stored:
            raise CheckpointError(f"--load {root}: the Megatron-LM checkpoint holds no tensor "
                                  f"{key!r}, which this run's model has ({name}); check the "
                                  "model flags (--num-experts, --moe-layer-freq, "
                                  "--disable-bias-linear, ...)")
        if isinstance(item, ShardedTensor) and stored[key] != tuple(item.global_shape):
            request[name] = _whole_rows(root, item, stored[key])
            rows[name] = item
            notes.append(f"{key}: {stored[key][0]} rows stored, {item.global_shape[0]} here "
                         "(the vocabulary padded for another TP size): the stored rows are "
                         "read, rows beyond them keep their initial values")
            continue
        request[name] = item
    _check_layers(root, stored, {i.key for i in request.values()})
    register_safe_globals()  # dist_checkpointing.load reads common.pt with weights_only
    loaded = dist_checkpointing.load(request, directory, validate_access_integrity=False)
    params = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name in request:  # the result holds common.pt's items too
            target, value = params[name], loaded[name]
            if name in rows:
                value = _rows_of(rows[name], value, target)
            target.copy_(value.to(target.dtype))
    return notes


def _whole_rows(root: str, item, shape):
    """A request for the whole stored tensor, where only its rows (the vocabulary) differ."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if len(shape) != len(item.global_shape) or shape[1:] != tuple(item.global_shape[1:]) or \
            item.prepend_axis_num:
        raise CheckpointError(f"--load {root}: the Megatron-LM checkpoint's {item.key} has the "
                              f"shape {list(shape)}, this run's model {list(item.global_shape)}; "
                              "check the model flags")
    return ShardedTensor.from_rank_offsets(item.key, torch.empty(shape, dtype=item.data.dtype),
                                           replica_id=1)


def _rows_of(item, full, current):
    """This rank's rows of a stored vocabulary table of another padding: the stored rows
    where they exist, the current (initial) values beyond."""
    lo = item.global_offset[0]
    out = current.detach().clone()
    n = max(0, min(out.shape[0], full.shape[0] - lo))
    out[:n] = full[lo:lo + n].to(out.dtype)
    return out


def _check_layers(root: str, stored: Dict[str, tuple], requested: set) -> None:
    """A layer tensor the checkpoint has and this model does not (a bias, a norm it lacks)
    would be left out silently: refused. Stacked layers: every pipeline stage asks for every
    layer key (the layers share one axis); an MoE model's MLP keys differ between stages that
    hold only dense or only MoE layers, and its expert count was compared already. Layers
    keyed apart: a stage asks for its own layers' keys, all of them. Optimizer, RNG and
    other keys that are not the model's are ignored."""
    moe = any(".mlp.experts." in k for k in stored)
    mine = {m.group(1) for m in map(_PER_LAYER.match, requested) if m}

    def unasked(key: str) -> bool:
        if not key.startswith("decoder.layers.") or key.endswith("_extra_state") or \
                key in requested:
            return False
        layer = _PER_LAYER.match(key)
        if layer:
            return layer.group(1) in mine  # another stage's layer: not this rank's to read
        return not (moe and ".mlp." in key)

    extra = sorted(k for k in stored if unasked(k))
    if extra:
        raise CheckpointError(f"--load {root}: the Megatron-LM checkpoint holds {extra[0]!r}, "
                              "which this run's model has no parameter for; check the model "
                              "flags (--disable-bias-linear, --num-experts, --moe-layer-freq, "
                              "...)")

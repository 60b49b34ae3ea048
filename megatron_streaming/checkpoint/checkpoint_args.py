"""Megatron-LM's two flags about the checkpoint under ``--load``, applied while the flags are
parsed (``cli/megatron_flags.py`` lists them), before anything is built:

* ``--use-checkpoint-args``: the model flags come from the checkpoint, as Megatron-LM's
  ``load_args_from_checkpoint`` takes them: a shape flag (``--num-layers``, ``--hidden-size``,
  ``--ffn-hidden-size``, ``--seq-length``, ``--num-attention-heads``, ``--kv-channels``,
  ``--max-position-embeddings``) only where the launch does not give it, every other model
  flag of its list always; the tokenizer too (its ``--use-tokenizer-model-from-checkpoint-args``
  default). The checkpoint is Megatron-LM's (its ``args`` in ``common.pt``) or one of ours
  (the model flags in its ``checkpoint.json``). No checkpoint: the launch's flags, said once.
* ``--exit-on-missing-checkpoint``: a ``--load`` with no checkpoint stops the launch with
  Megatron-LM's words (exit status 0, as its ``sys.exit()``), instead of a fresh start.

``missing_lines`` are Megatron-LM's words for a ``--load`` with no checkpoint, which it
prints before starting from random.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from .store import TRACKER

# (ModelConfig field, our flag, Megatron-LM's ``force``): without ``force`` the checkpoint's
# value is taken only where the launch leaves the flag out (Megatron-LM: where it is None).
MODEL_FIELDS: Tuple[Tuple[str, str, bool], ...] = (
    ("num_layers", "--num-layers", False),
    ("hidden_size", "--hidden-size", False),
    ("ffn_hidden_size", "--ffn-hidden-size", False),
    ("seq_length", "--seq-length", False),
    ("num_attention_heads", "--num-attention-heads", False),
    ("kv_channels", "--kv-channels", False),
    ("max_position_embeddings", "--max-position-embeddings", False),
    ("num_query_groups", "--num-query-groups", True),
    ("group_query_attention", "--group-query-attention", True),
    ("position_embedding_type", "--position-embedding-type", True),
    ("rotary_base", "--rotary-base", True),
    ("rotary_percent", "--rotary-percent", True),
    ("disable_bias_linear", "--disable-bias-linear", True),
    ("swiglu", "--swiglu", True),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", True),
    ("apply_layernorm_1p", "--apply-layernorm-1p", True),
    ("normalization", "--normalization", True),
    ("attention_dropout", "--attention-dropout", True),
    ("hidden_dropout", "--hidden-dropout", True),
    ("num_experts", "--num-experts", True),
    ("moe_layer_freq", "--moe-layer-freq", True),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size", True),
    ("moe_router_topk", "--moe-router-topk", True),
    ("moe_router_pre_softmax", "--moe-router-pre-softmax", True),
    ("moe_grouped_gemm", "--moe-grouped-gemm", True),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", True),
)
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model")


def missing_lines(root: Optional[str]) -> List[str]:
    """Megatron-LM's warning for a ``--load`` with no checkpoint (its
    ``_load_base_checkpoint``), before it starts from random weights."""
    tracker = os.path.join(root, TRACKER) if root else "because load directory is not defined"
    return [f"WARNING: could not find the metadata file {tracker}",
            "    will not load any checkpoints and will start from random"]


def exit_on_missing(cfg, value, given: set) -> None:
    """``--exit-on-missing-checkpoint``: a ``--load`` with no checkpoint (of Megatron-LM's or
    ours: no tracker file) ends the launch here, with Megatron-LM's lines and its exit status
    0. Without ``--load`` nothing is loaded, as in Megatron-LM's training."""
    from .store import has_checkpoint

    root = cfg.checkpoint.load
    if "--load" not in given or not root or has_checkpoint(root):
        return
    if os.environ.get("RANK", "0") == "0":  # said once, as Megatron-LM's print_rank_0
        print("\n".join([*missing_lines(root),
                         ">> '--exit-on-missing-checkpoint' set ... exiting. <<"]), flush=True)
    raise SystemExit(0)


def use_checkpoint_args(cfg, value, given: set) -> None:
    """``--use-checkpoint-args``: set ``cfg``'s model (and tokenizer) flags from the checkpoint
    under ``--load``; one line per value taken goes to ``cfg.adjustments`` (Megatron-LM's
    "Setting X to V from checkpoint"). A checkpoint that cannot be read raises the
    CheckpointError naming it."""
    from .store import has_checkpoint

    root = cfg.checkpoint.load
    if not root or not has_checkpoint(root):
        cfg.adjustments.append(f"--use-checkpoint-args: no checkpoint under --load {root}; "
                               "the launch's flags are used (Megatron-LM: 'Checkpoint not "
                               "found to provide arguments, using provided arguments.')")
        return
    model, tokenizer = saved_flags(root)
    said = []
    for name, flag, force in MODEL_FIELDS:
        if name not in model or (not force and flag in given):
            continue
        if model[name] != getattr(cfg.model, name):
            setattr(cfg.model, name, model[name])
            said.append(f"{name} to {model[name]}")
    for name in TOKENIZER_FIELDS:
        if tokenizer.get(name) is not None and tokenizer[name] != getattr(cfg.data, name):
            setattr(cfg.data, name, tokenizer[name])
            said.append(f"{name} to {tokenizer[name]}")
    # NullTokenizer's ids are --vocab-size: Megatron-LM leaves the flag to the launch, where
    # a missing one fails; here the checkpoint's is taken then, as the only value that fits.
    if cfg.data.tokenizer_type == "NullTokenizer" and cfg.data.vocab_size is None and \
            tokenizer.get("vocab_size") is not None:
        cfg.data.vocab_size = tokenizer["vocab_size"]
        said.append(f"vocab_size to {cfg.data.vocab_size}")
    cfg.adjustments.append(f"--use-checkpoint-args: from --load {root}: setting "
                           f"{', '.join(said) if said else 'nothing (the flags match)'}")


def saved_flags(root: str) -> Tuple[Dict[str, object], Dict[str, object]]:
    """(model flags, tokenizer flags) of the checkpoint under ``root``, by our field names."""
    from .megatron_lm import is_megatron_lm, model_config_of, open_checkpoint
    from .resume import CheckpointError

    if is_megatron_lm(root):
        args = open_checkpoint(root).args
        if args is None:
            raise CheckpointError(f"--use-checkpoint-args: --load {root}: the Megatron-LM "
                                  "checkpoint's common.pt holds no args")
        saved = model_config_of(args)
        model = {name: getattr(saved, name) for name, _, _ in MODEL_FIELDS}
        for name in ("attention_dropout", "hidden_dropout", "moe_router_pre_softmax",
                     "moe_grouped_gemm"):  # not among the fields model_config_of reads
            value = getattr(args, name, None)
            if value is None:
                model.pop(name)
            else:
                model[name] = type(getattr(saved, name))(value)
        tokenizer = {k: getattr(args, k, None) for k in (*TOKENIZER_FIELDS, "vocab_size")}
        if tokenizer["tokenizer_type"] != "NullTokenizer":
            tokenizer["vocab_size"] = None
        return model, tokenizer
    from .store import find_checkpoint

    _, meta = find_checkpoint(root)
    config = meta["model"]["config"]
    model = {name: config[name] for name, _, _ in MODEL_FIELDS if name in config}
    tokenizer = {k: (meta.get("tokenizer") or {}).get(k) for k in TOKENIZER_FIELDS}
    return model, tokenizer


__all__ = ["MODEL_FIELDS", "exit_on_missing", "missing_lines", "saved_flags",
           "use_checkpoint_args"]

"""A checkpoint of ours written as a Megatron-LM one (``export-megatron``), for Megatron-LM's
own training, conversion and evaluation tools.

The global parameters (or one worker's local ones) are read whole, by global name
(``offline.parameters``), copied by name into a megatron-core ``GPTModel`` built at TP=1 /
PP=1 in a one-process gloo group, and saved with ``dist_checkpointing.save`` of the model's
``sharded_state_dict()``: the keys and the layout are megatron-core's own, so Megatron-LM
loads them under any TP / PP; the layers are keyed in the form megatron-core gives the
``--moe-layer-freq`` of the model as Megatron-LM parses it (stacked for its default 1, each
layer apart for any other int or a list: ``megatron_lm.sharded_model_state``). Beside them,
``common.pt`` holds what Megatron-LM's loader reads: ``args`` (an ``argparse.Namespace`` of
the flags as Megatron-LM's own parser and save leave them for that model: what
``check_checkpoint_args`` compares and ``--use-checkpoint-args`` takes), ``checkpoint_version``
3.0, ``iteration`` and the ``content_metadata`` of Megatron-LM's save; the tracker file names
the iteration (``release`` for iteration 0, which Megatron-LM's tracker cannot hold). No
optimizer, RNG or scheduler state is written, and ``args`` say so as Megatron-LM's own
weights-only save does (``no_save_optim``, ``no_save_rng``): a plain ``--load`` of it skips
them without ``--no-load-optim --no-load-rng`` or ``--finetune``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Dict, Optional

import torch

from .megatron_lm import CHECKPOINT_VERSION, RELEASE, sharded_model_state
from .resume import CheckpointError
from .store import TRACKER, atomic_write


# Megatron-LM's NullTokenizer: ``--vocab-size V`` gives V ids and an end-of-document one.
NULL_TOKENIZER = "NullTokenizer"


def megatron_tokenizer(tokenizer: Optional[dict], vocab_size: int) -> dict:
    """Megatron-LM's tokenizer flags for ours: its ``--tokenizer-type`` (ours, or the type
    ours resolved to without one; NullTokenizer for ``--mock-data`` ids, whose ``--vocab-size
    V`` makes the same V + 1 tokens) and ``--vocab-size`` as its parser keeps the flag
    (NullTokenizer's V; None for the tokenizers whose size their files give)."""
    from ..data.tokenizers import TokenizerSpec

    t = {k: v for k, v in (tokenizer or {}).items() if k in TokenizerSpec.__dataclass_fields__}
    named = t.get("tokenizer_type") or t.get("tokenizer_model") or \
        (t.get("vocab_file") and t.get("merge_file"))
    kind = TokenizerSpec(**t).kind if named else NULL_TOKENIZER
    return {"tokenizer_type": kind, "tokenizer_model": t.get("tokenizer_model"),
            "vocab_file": t.get("vocab_file"), "merge_file": t.get("merge_file"),
            "vocab_size": vocab_size - 1 if kind == NULL_TOKENIZER else None}


def megatron_args(model_cfg, vocab_size: int, padded_vocab: int, iteration: int,
                  consumed_samples: int, tokenizer: Optional[dict] = None) -> argparse.Namespace:
    """Megatron-LM's ``args`` for the model of ``model_cfg`` and a weights-only save, as its
    parser, its ``validate_args`` and its save leave them: its flag names and types
    (``moe_layer_freq`` an int or a list), its derived values (ffn size, head dimension,
    padded vocabulary), at TP=1 / PP=1. ``vocab_size`` is our tokenizer's size."""
    m = model_cfg
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_size(),
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
        group_query_attention=m.query_groups() != m.num_attention_heads,
        num_query_groups=m.query_groups(), seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings or m.seq_length,
        position_embedding_type=m.position_embedding_type,
        # Megatron-LM's defaults whatever the position type: --position-embedding-type is
        # the flag; --no-position-embedding (False here) and --use-rotary-position-embeddings
        # (True here) are its deprecated spellings, and check_checkpoint_args compares the
        # first with the loading run's (True unless it passes the deprecated flag).
        add_position_embedding=True, use_rotary_position_embeddings=False,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent, rotary_interleaved=False,
        use_rope_scaling=m.use_rope_scaling, rope_scaling_factor=m.rope_scaling_factor,
        normalization=m.normalization, norm_epsilon=m.norm_epsilon,
        apply_layernorm_1p=m.apply_layernorm_1p, swiglu=m.swiglu,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        add_bias_linear=not m.disable_bias_linear, add_qkv_bias=False,
        qk_layernorm=False, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, init_method_std=m.init_method_std,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab, **megatron_tokenizer(tokenizer, vocab_size),
        num_experts=m.num_experts if m.moe else None,
        moe_layer_freq=_layer_freq(m),
        moe_ffn_hidden_size=(m.moe_ffn_hidden_size or m.ffn_size()) if m.moe else None,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_router_topk=m.moe_router_topk, moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_grouped_gemm=m.moe_grouped_gemm,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        params_dtype=torch.float32, fp16=False, bf16=False,
        use_dist_ckpt=True, ckpt_format="torch_dist", dist_ckpt_format="torch_dist",
        transformer_impl="local", iteration=iteration, data_parallel_random_init=False,
        # Megatron-LM's weights-only save (--no-save-optim --no-save-rng): its load then
        # reads neither, with no --no-load-* flag.
        no_save_optim=True, no_save_rng=True,
        consumed_train_samples=consumed_samples, consumed_valid_samples=0)


def _layer_freq(m):
    """``--moe-layer-freq`` as Megatron-LM's parser leaves it; also for a dense model, whose
    layers megatron-core keys by it too (Megatron-LM's default 1 where a dense model's flag
    is not one Megatron-LM would take)."""
    from .megatron_lm import megatron_layer_freq

    try:
        return megatron_layer_freq(m.moe_layer_freq, m.num_layers)
    except ValueError:
        if m.moe:
            raise CheckpointError(f"--moe-layer-freq {m.moe_layer_freq!r}: not a layer "
                                  f"frequency of the model's {m.num_layers} layers") from None
        return 1


# What Megatron-LM's save_checkpoint stores as the checkpoint's content metadata (its
# _build_sharded_state_dict_metadata without the process group and optimizer entries).
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _one_process_topology(moe: bool):
    """A world of one (gloo, in memory) with megatron-core's groups set, unless the process
    has a world already (then it must be of one)."""
    import torch.distributed as dist

    from ..parallel.topology import RankLayout, Topology

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise CheckpointError("export-megatron runs in a process of its own (a world of one), "
                              f"not inside a world of {dist.get_world_size()}")
    topology = Topology.create(RankLayout(1, moe=moe), 0)
    topology.install_into_megatron()
    return topology


def build_filled_model(model_cfg, params: Dict[str, torch.Tensor]):
    """A megatron-core GPTModel at TP=1 / PP=1 holding ``params`` (global names, fp32)."""
    import dataclasses

    import patches

    from ..config import ParallelConfig
    from ..worker.model import build_model

    try:
        patches.apply()
    except patches.UpstreamVersionError as e:  # an unsupported torch: one line, not a traceback
        raise CheckpointError(str(e)) from None
    # megatron-core's local layers: Transformer Engine's keys are the same (its local spec
    # maps its norms onto them), and this runs without a GPU.
    model_cfg = dataclasses.replace(model_cfg, transformer_impl="local", ladder_residual=False,
                                    ladder_layers=None)
    topology = _one_process_topology(model_cfg.moe)
    rows = params["embedding.word_embeddings.weight"].shape[0]
    model = build_model(model_cfg, ParallelConfig(), topology, rows)
    named = dict(model.named_parameters())
    if set(named) != set(params):
        missing = sorted(set(named) - set(params)) or sorted(set(params) - set(named))
        raise CheckpointError(f"the checkpoint's parameters do not match the megatron-core "
                              f"model of its flags (first difference: {missing[0]!r})")
    with torch.no_grad():
        for name, p in named.items():
            if tuple(p.shape) != tuple(params[name].shape):
                raise CheckpointError(f"{name}: shape {list(params[name].shape)} in the "
                                      f"checkpoint, {list(p.shape)} in megatron-core's model")
            p.copy_(params[name])
    return model


def export(path: str, out: str, params: str = "global", worker: Optional[int] = None,
           dtype: torch.dtype = torch.float32) -> str:
    """Write checkpoint ``path``'s ``params`` as a Megatron-LM checkpoint under ``out``;
    returns the iteration directory written."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from ..config import ModelConfig
    from .offline import open_checkpoint, parameters

    _, meta = open_checkpoint(path, verify=False)
    config, vocab_size, tensors = parameters(path, params, worker)
    model_cfg = ModelConfig(**config)
    model = build_filled_model(model_cfg, tensors).to(dtype)
    run = meta["run"]
    iteration = int(run["iteration"])
    name = RELEASE if iteration == 0 else f"iter_{iteration:07d}"
    directory = os.path.join(out, name)
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    args = megatron_args(model_cfg, vocab_size, tensors["embedding.word_embeddings.weight"]
                         .shape[0], iteration, int(run.get("consumed_samples", 0)),
                         meta.get("tokenizer"))
    args.params_dtype, args.bf16, args.fp16 = dtype, dtype == torch.bfloat16, \
        dtype == torch.float16
    state = {"model": sharded_model_state(model, args.moe_layer_freq), "args": args,
             "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "num_floating_point_operations_so_far": 0}
    # One writer thread, synchronous: the files are there when it returns.
    dist_checkpointing.save(state, directory,
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1),
                            content_metadata=dict(CONTENT_METADATA))
    atomic_write(os.path.join(out, TRACKER), RELEASE if iteration == 0 else str(iteration))
    return directory

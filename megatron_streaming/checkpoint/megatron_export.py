"""A checkpoint of ours written as a Megatron-LM one (``export-megatron``), for Megatron-LM's
own training, conversion and evaluation tools.

The global parameters (or one worker's local ones) are read whole, by global name
(``offline.parameters``), copied by name into a megatron-core ``GPTModel`` built at TP=1 /
PP=1 in a one-process gloo group, and saved with ``dist_checkpointing.save`` of the model's
``sharded_state_dict()``: the keys and the layout are megatron-core's own, so Megatron-LM
loads them under any TP / PP. Beside them, ``common.pt`` holds what Megatron-LM's loader
reads: ``args`` (an ``argparse.Namespace`` of the architecture flags it checks and
``--use-checkpoint-args`` takes), ``checkpoint_version`` 3.0 and ``iteration``; the tracker
file names the iteration (``release`` for iteration 0, which Megatron-LM's tracker cannot
hold). No optimizer, RNG or scheduler state is written: Megatron-LM loads it with
``--no-load-optim --no-load-rng`` (or ``--finetune``).
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Dict, Optional

import torch

from .megatron_lm import CHECKPOINT_VERSION, RELEASE
from .resume import CheckpointError
from .store import TRACKER, atomic_write


def megatron_args(model_cfg, vocab_size: int, padded_vocab: int, iteration: int,
                  consumed_samples: int, tokenizer: Optional[dict] = None) -> argparse.Namespace:
    """Megatron-LM's ``args`` for the model of ``model_cfg``: its flag names, its derived
    values (ffn size, head dimension, padded vocabulary), at TP=1 / PP=1."""
    m = model_cfg
    rope = m.position_embedding_type == "rope"
    tokenizer = tokenizer or {}
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_size(),
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
        group_query_attention=m.query_groups() != m.num_attention_heads,
        num_query_groups=m.query_groups(), seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings or m.seq_length,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=rope, rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent, rotary_interleaved=False,
        use_rope_scaling=m.use_rope_scaling, rope_scaling_factor=m.rope_scaling_factor,
        normalization=m.normalization, norm_epsilon=m.norm_epsilon,
        apply_layernorm_1p=m.apply_layernorm_1p, swiglu=m.swiglu,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        add_bias_linear=not m.disable_bias_linear, add_qkv_bias=False,
        qk_layernorm=False, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, init_method_std=m.init_method_std,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab, vocab_size=vocab_size,
        tokenizer_type=tokenizer.get("tokenizer_type"),
        tokenizer_model=tokenizer.get("tokenizer_model"),
        num_experts=m.num_experts if m.moe else None,
        moe_layer_freq=m.moe_layer_freq if m.moe else 1,
        moe_ffn_hidden_size=(m.moe_ffn_hidden_size or m.ffn_size()) if m.moe else None,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_router_topk=m.moe_router_topk,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        params_dtype=torch.float32, fp16=False, bf16=False,
        use_dist_ckpt=True, ckpt_format="torch_dist", dist_ckpt_format="torch_dist",
        transformer_impl="local", iteration=iteration,
        consumed_train_samples=consumed_samples, consumed_valid_samples=0)


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
    state = {"model": model.sharded_state_dict(), "args": args,
             "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "num_floating_point_operations_so_far": 0}
    # One writer thread, synchronous: the files are there when it returns.
    dist_checkpointing.save(state, directory,
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
    atomic_write(os.path.join(out, TRACKER), RELEASE if iteration == 0 else str(iteration))
    return directory

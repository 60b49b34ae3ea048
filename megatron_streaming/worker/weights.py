"""Deterministic weight initialisation, independent of the parallel layout.

Megatron initialises a tensor-parallel weight by drawing the full matrix from the default
generator and slicing it, so the draw depends on the order in which this rank builds its
layers: a pipeline stage that starts at layer 2 draws different numbers than a single-stage
model. Here every parameter is drawn from a generator seeded by (seed, its *global* name)
and then sliced to this rank's TP shard, so any TP x PP layout starts from the very same
model. That is what makes distributed runs comparable with a single-process reference.
"""

from __future__ import annotations

import math
import re
import zlib

import torch

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


_LOCAL_EXPERT = re.compile(r"(^|\.)experts\.local_experts\.(\d+)\.")


def global_name(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """``decoder.layers.0.x`` on a stage starting at layer 4 -> ``decoder.layers.4.x``; and an
    MoE layer's ``experts.local_experts.K`` on a rank whose first expert is ``expert_offset``
    -> ``experts.local_experts.<expert_offset + K>`` (``moe.expert_offset``)."""
    name = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", name)
    if expert_offset:
        name = _LOCAL_EXPERT.sub(
            lambda m: f"{m.group(1)}experts.local_experts.{int(m.group(2)) + expert_offset}.",
            name)
    return name


# Transformer Engine's spec fuses the pre-attention / pre-MLP norms into the next linear layer:
# (local spec's prefix, TE's prefix) of the same parameters.
FUSED_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
               ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def local_spec_name(name: str) -> str:
    """A parameter's name in megatron-core's local spec (TE's fused norm names renamed):
    what checkpoints and conversions key by, so GPU (TE) and CPU runs share them."""
    for local, fused in FUSED_NORMS:
        name = name.replace(fused, local)
    return name


def _full_shape(param: torch.Tensor, tp_size: int):
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


def _draw(name: str, shape, std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def init_value(name: str, shape, std: float, num_layers: int, seed: int,
               zero_centered_norms: bool = False) -> torch.Tensor:
    """Megatron's scheme: N(0, std); std/sqrt(2L) for residual-branch outputs; norms 1, 0
    (weights 0 for zero-centred norms, which scale by weight + 1). Biases are zero whatever
    their leaf name: Transformer Engine's fused norm-and-linear layers name a norm's
    ``layer_norm_weight`` and ``layer_norm_bias``."""
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name
    if leaf == "bias" or leaf.endswith("_bias"):
        return torch.zeros(shape)
    if is_norm:
        return torch.zeros(shape) if zero_centered_norms else torch.ones(shape)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = std / math.sqrt(2.0 * num_layers)
    return _draw(name, shape, std, seed)


def tp_shard(name: str, full: torch.Tensor, partition_dim: int, tp_rank: int, tp_size: int,
             gated: bool) -> torch.Tensor:
    """This TP rank's slice of a full (TP=1) tensor.

    A gated MLP's ``linear_fc1`` (SwiGLU) holds ``[gate; up]`` at TP=1, but each TP rank
    holds ``[gate_r; up_r]``: the rank's rows of both halves (megatron-core's MLP splits its
    local output in two), so a plain chunk of the full tensor would be another model."""
    if gated and ".linear_fc1." in f".{name}":
        halves = full.chunk(2, dim=partition_dim)
        return torch.cat([h.chunk(tp_size, dim=partition_dim)[tp_rank] for h in halves],
                         dim=partition_dim)
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]


def tp_unshard(name: str, parts, partition_dim: int, gated: bool) -> torch.Tensor:
    """The full (TP=1) tensor from every TP rank's slice, in rank order: ``tp_shard``'s
    inverse."""
    if gated and ".linear_fc1." in f".{name}":
        halves = [p.chunk(2, dim=partition_dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=partition_dim)
    return torch.cat(list(parts), dim=partition_dim)


@torch.no_grad()
def initialize_weights(model, *, seed: int, std: float, num_layers: int, layer_offset: int,
                       tp_rank: int, tp_size: int, tied_output_name: str = None,
                       gated_mlp: bool = False, zero_centered_norms: bool = False,
                       expert_offset: int = 0) -> None:
    """Overwrite every parameter of this rank's model chunk with its layout-free value.

    ``tied_output_name``: on a last stage that holds its own copy of the tied embedding,
    the copy gets the embedding's value, as Megatron's embedding-group all-reduce would do.
    ``gated_mlp``: the MLP's first linear holds gate and up projections (``tp_shard``).
    """
    for name, param in model.named_parameters():
        gname = global_name(name, layer_offset, expert_offset)
        if tied_output_name and name == "output_layer.weight":
            gname = tied_output_name
        full = init_value(gname, _full_shape(param, tp_size), std, num_layers, seed,
                          zero_centered_norms)
        if getattr(param, "tensor_model_parallel", False):
            full = tp_shard(gname, full, param.partition_dim, tp_rank, tp_size, gated_mlp)
        param.copy_(full.to(param.dtype))

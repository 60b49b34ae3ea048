"""Mixture of experts inside a worker: megatron-core's MoE layers, named layout-free.

A worker's MoE layer is megatron-core's own (router, token dispatcher, sequential experts or
grouped GEMM on a GPU, shared experts), built from Megatron-LM's flags. Expert parallelism
cuts a pipeline stage's ranks again, as megatron-core does (``RankLayout.expert_coords``):
each rank holds ``E / EP`` experts, each an expert-TP shard. Three things here make experts
look like any other parameter to the rest of the package:

* ``expert_offset``: megatron-core names an expert by its index on this rank
  (``mlp.experts.local_experts.K``); checkpoints, the streaming fragments and the layout-free
  initialisation use the global index ``ep_rank * E / EP + K`` (``weights.global_name``);
* ``is_expert`` / ``expert_group_name``: which parameters are an expert's (their gradients are
  reduced over the expert-data-parallel group, not the data-parallel one);
* ``transformer_settings``: the TransformerConfig fields of the flags.
"""

from __future__ import annotations

import copy
import re
from typing import List

_EXPERT = re.compile(r"(^|\.)mlp\.experts\.")


def is_expert(name: str) -> bool:
    """A routed expert's parameter (not the router's, nor a shared expert's)."""
    return bool(_EXPERT.search(name))


def expert_offset(model_cfg, topology) -> int:
    """The global index of this rank's first expert: megatron-core names an expert by its
    index on the rank (``local_experts.K``), the package by ``offset + K``
    (``weights.global_name``)."""
    if not model_cfg.moe:
        return 0
    return topology.expert_coords["ep"] * (model_cfg.num_experts // topology.layout.ep)


def expert_group_name(ep: int) -> str:
    """The name DeepSpeed keys its expert groups by (``deepspeed.utils.groups``)."""
    return f"ep_size_{ep}"


def transformer_settings(model_cfg, parallel_cfg) -> dict:
    """TransformerConfig fields of the MoE flags (validated); none for a dense model."""
    m = model_cfg
    if not m.moe:
        return {}
    from ..config.schema import moe_layer_pattern

    return dict(
        num_moe_experts=m.num_experts,
        moe_layer_freq=moe_layer_pattern(m.moe_layer_freq, m.num_layers),
        moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_size(),
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_router_topk=m.moe_router_topk,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_z_loss_coeff=m.moe_z_loss_coeff,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_dtype=m.moe_router_dtype,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=m.moe_token_drop_policy,
        moe_grouped_gemm=m.moe_grouped_gemm,
        expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=(parallel_cfg.expert_tensor_parallel_size
                                     or parallel_cfg.tensor_model_parallel_size),
    )


def mlp_spec(model_cfg, transformer_engine: bool):
    """megatron-core's MoE MLP spec for the flags (local or Transformer Engine layers)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec

    return get_mlp_module_spec(use_te=transformer_engine, num_experts=model_cfg.num_experts,
                               moe_grouped_gemm=model_cfg.moe_grouped_gemm)


def layer_specs(spec, model_cfg, first: int, count: int, transformer_engine: bool,
                te_pre_mlp_norm=None) -> List:
    """The specs of layers ``first`` .. ``first + count - 1``: where ``--moe-layer-freq``
    says, a copy of the dense ``spec`` whose MLP is the MoE layer, else ``spec``. The MoE
    layer keeps the dense spec's pre-MLP norm, except on Transformer Engine's layers, which
    fuse that norm into the dense MLP's first linear: there it takes ``te_pre_mlp_norm``."""
    moe = copy.copy(spec)
    moe.submodules = copy.copy(spec.submodules)
    moe.submodules.mlp = mlp_spec(model_cfg, transformer_engine)
    if te_pre_mlp_norm is not None:
        moe.submodules.pre_mlp_layernorm = te_pre_mlp_norm
    pattern = model_cfg.moe_layers()
    return [moe if pattern[first + i] else spec for i in range(count)]


def for_deepspeed(model, groups: List[dict], topology):
    """``groups`` as DeepSpeed should take them, and the context ``deepspeed.initialize``
    runs in. Where the ranks holding an expert's shard are the data-parallel (ZeRO) group,
    as at EP = 1 with expert TP = TP, experts are parameters like any other; else they go
    into groups of their own, reduced and partitioned over the expert-data-parallel group
    (``patches.deepspeed_moe``)."""
    import contextlib

    if not topology.layout.moe or \
            topology.group_ranks["expt_dp"] == topology.group_ranks["sdp"]:
        return groups, contextlib.nullcontext()
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from patches import deepspeed_moe

    name = expert_group_name(topology.layout.ep)
    deepspeed_moe.register_groups(name, topology.groups["ep"], topology.groups["expt_dp"])
    deepspeed_moe.mark_experts([p for n, p in model.named_parameters() if is_expert(n)], name)
    return expert_param_groups(groups, model, name), deepspeed_moe.as_moe_layers(model,
                                                                                 MoELayer)


def expert_param_groups(groups: List[dict], model, name: str) -> List[dict]:
    """Split each optimizer group into its dense and expert parameters: an expert group
    carries DeepSpeed's ``moe: True`` and the expert-parallel group's name, so ZeRO
    partitions and reduces it over the expert-data-parallel ranks."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in groups:
        dense = [p for p in group["params"] if not is_expert(names[id(p)])]
        experts = [p for p in group["params"] if is_expert(names[id(p)])]
        if dense:
            out.append({**group, "params": dense})
        if experts:
            out.append({**group, "params": experts, "moe": True, "name": name})
    for index, group in enumerate(out):  # the sync tells the groups apart by it
        group["sync_index"] = index
    return out

"""Ulysses sequence parallelism: the core attention inside DeepSpeed's all-to-all.

DeepSpeed-Ulysses (Jacobs et al., arXiv 2309.14509). Every rank of a sequence-parallel (SP)
group holds ``seq / SP`` contiguous tokens of the same samples from the embedding to the loss.
Only attention needs the whole sequence: DeepSpeed's ``DistributedAttention`` turns the
sequence split of q, k, v into a head split with one all-to-all, the local attention runs
over the full sequence with ``heads / (TP x SP)`` heads, and a second all-to-all turns the
context back into a sequence split.

Where it sits: ``ulysses_layer_spec`` is the GPT local layer spec with ``core_attention``
replaced (the ``layer_spec`` seam of ``model.py``); ``slice_for_sequence_parallel`` cuts a
micro-batch into this rank's share before the forward; ``sequence_parallel_loss`` scales
the loss so that DeepSpeed's reduction over the sequence-data-parallel group (gradients
summed over SP, averaged over DP) yields the full-sequence mean gradient.
"""

from __future__ import annotations

import copy
import functools
from typing import Dict, Optional

import torch

SP_FLAG = "--ds-sequence-parallel-size"


def check_ulysses(num_heads: int, num_query_groups: Optional[int], tp: int, sp: int,
                  seq_length: int, megatron_sequence_parallel: bool = False) -> None:
    """Refuse a layout Ulysses cannot split evenly, before any collective runs.

    On gloo an uneven all-to-all does not fail cleanly: one rank raises and its peers wait
    forever. So every divisibility the all-to-alls rely on is checked here, up front.
    """
    check_heads(num_heads, num_query_groups, tp, sp)
    if seq_length % sp:
        raise ValueError(f"--seq-length ({seq_length}) must be divisible by {SP_FLAG} ({sp})")
    if megatron_sequence_parallel and seq_length % (tp * sp):
        raise ValueError(
            f"--seq-length ({seq_length}) must be divisible by --tensor-model-parallel-size "
            f"({tp}) x {SP_FLAG} ({sp}) = {tp * sp} with --sequence-parallel (Megatron's "
            f"sequence parallelism splits each rank's {seq_length // sp} tokens over TP)")


def check_heads(num_heads: int, num_query_groups: Optional[int], tp: int, sp: int) -> None:
    """Heads and key/value groups must split evenly over TP x SP."""
    if sp < 1:
        raise ValueError(f"{SP_FLAG} must be >= 1, got {sp}")
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if num_heads % (tp * sp):
        raise ValueError(
            f"--num-attention-heads ({num_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}) x {SP_FLAG} ({sp}) = {tp * sp}")
    groups = num_heads if num_query_groups is None else num_query_groups
    if groups % (tp * sp):
        raise ValueError(
            f"--num-query-groups ({groups}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}) x {SP_FLAG} ({sp}) = {tp * sp}: each rank "
            f"needs whole key/value groups after the all-to-all")


def _head_split_config(config, sp: int):
    """The config the inner attention is built from: ``1/SP`` of the heads and query groups,
    the same head size. A shallow copy, so ``__post_init__`` does not re-derive anything;
    ``kv_channels`` stays ``hidden / heads`` and with it the softmax scale."""
    inner = copy.copy(config)
    inner.num_attention_heads = config.num_attention_heads // sp
    inner.num_query_groups = (config.num_query_groups or config.num_attention_heads) // sp
    return inner


def __getattr__(name):
    # The class derives from MegatronModule; building it on first use keeps
    # ``check_ulysses`` importable without megatron (config validation runs before it).
    if name == "UlyssesCoreAttention":
        return _core_attention_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _core_attention_class():
    cls = globals().get("UlyssesCoreAttention")
    if cls is None:
        cls = globals()["UlyssesCoreAttention"] = _define_core_attention()
    return cls


def _define_core_attention():
    from megatron.core.transformer.module import MegatronModule

    class UlyssesCoreAttention(MegatronModule):
        """Drop-in for Megatron's ``core_attention``: q, k, v ``[s/SP, b, heads/TP, d]``
        in, context ``[s/SP, b, hidden/TP]`` out, full-sequence attention in between.

        The constructor is Megatron's core-attention signature plus ``sp_group`` and the
        inner attention's class (keywords), bound by the layer spec with ``functools.partial``:
        SelfAttention calls the builder directly with keywords, so the group arrives through
        the builder, not a global.
        """

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: Optional[float] = None,
                     softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                     pg_collection=None, *, sp_group, inner_class=None):
            super().__init__(config=config)
            import torch.distributed as dist
            from deepspeed.sequence.layer import DistributedAttention

            if inner_class is None:
                from megatron.core.transformer.dot_product_attention import (
                    DotProductAttention as inner_class,
                )
            sp = dist.get_world_size(group=sp_group)
            tp = pg_collection.tp.size() if pg_collection is not None else 1
            check_heads(config.num_attention_heads, config.num_query_groups, tp, sp)
            self.sp_size = sp
            self.sp_group = sp_group
            self.inner = inner_class(
                _head_split_config(config, sp), layer_number=layer_number,
                attn_mask_type=attn_mask_type, attention_type=attention_type,
                attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            # seq-first layout: scatter heads (dim 2), gather the sequence (dim 0). A plain
            # function, not a module, so the inner attention is registered once (as ``inner``).
            self.distributed = DistributedAttention(
                functools.partial(_local_attention, self.inner), sp_group,
                scatter_idx=2, gather_idx=0)

        @property
        def softmax_scale(self) -> float:
            return self.inner.softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if packed_seq_params is not None:
                raise ValueError("Ulysses attention does not support packed sequences")
            full = query.size(0) * self.sp_size
            if attention_mask is not None and attention_mask.size(-1) != full:
                # The mask is applied after the all-to-all, over the whole sequence: a mask cut
                # to the local slice would silently attend to the wrong keys.
                raise ValueError(
                    f"attention_mask covers {attention_mask.size(-1)} keys, but attention runs "
                    f"over the full sequence of {full} tokens: pass the full mask (or None)")
            context = self.distributed(query, key, value, 1, None,
                                       attention_mask=attention_mask,
                                       attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            # [s/SP, b, heads/TP, d] -> [s/SP, b, hidden/TP], what Megatron's linear_proj takes.
            return context.reshape(context.size(0), context.size(1), -1)

    return UlyssesCoreAttention


def _local_attention(inner, query, key, value, attention_mask=None, attn_mask_type=None,
                     attention_bias=None):
    """The inner core attention on the full sequence and this rank's heads; its
    ``[s, b, heads*d]`` output is given its head dim back for the return all-to-all."""
    context = inner(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                    attention_bias=attention_bias)
    return context.view(context.size(0), context.size(1), query.size(2), query.size(3))


def ulysses_core_attention(sp_group, inner_class=None):
    """The ``core_attention`` builder bound to one SP group, wrapping ``inner_class`` (a core
    attention of megatron-core's signature; default its ``DotProductAttention``)."""
    return functools.partial(_core_attention_class(), sp_group=sp_group,
                             inner_class=inner_class)


def ulysses_layer_spec(sp_group, normalization: str = "LayerNorm", inner_class=None):
    """Megatron's GPT local layer spec with core attention replaced by Ulysses attention
    around ``inner_class`` (the core attention ``--attention-backend`` names)."""
    from megatron.core.models.gpt import gpt_layer_specs

    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization)
    spec.submodules.self_attention.submodules.core_attention = ulysses_core_attention(
        sp_group, inner_class)
    return spec


# ---- data and loss ---------------------------------------------------------------------

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def slice_for_sequence_parallel(batch: Dict[str, Optional[torch.Tensor]], sp_rank: int,
                                sp_size: int) -> Dict[str, Optional[torch.Tensor]]:
    """This rank's contiguous ``seq / SP`` share of a micro-batch.

    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` (``[b, s]``) are cut along the
    sequence; ``position_ids`` keep their global values, which is what learned absolute
    position embeddings need. ``attention_mask`` (``[1, 1, s, s]`` or None) stays whole:
    attention runs over the full sequence after the all-to-all (None means causal there).
    Other entries pass through untouched.
    """
    if sp_size == 1:
        return dict(batch)
    out = dict(batch)
    seq = batch["tokens"].size(1)
    if seq % sp_size:
        raise ValueError(f"--seq-length ({seq}) must be divisible by {SP_FLAG} ({sp_size})")
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sequence-parallel rank {sp_rank} outside [0, {sp_size})")
    chunk = seq // sp_size
    for key in SEQUENCE_KEYS:
        if batch.get(key) is not None:
            out[key] = batch[key].narrow(1, sp_rank * chunk, chunk).contiguous()
    mask = batch.get("attention_mask")
    if mask is not None and mask.size(-1) != seq:
        raise ValueError(f"attention_mask must cover the full sequence ({seq}), got "
                         f"{tuple(mask.shape)}")
    return out


def sequence_parallel_loss(losses: torch.Tensor, loss_mask: torch.Tensor, sp_group):
    """``(loss for backward, full-sequence loss for reporting)`` on one SP rank.

    The backward loss is ``sum(local losses x mask) / (mask count of the full sequence)``:
    summed over the SP group it is the full-sequence mean, and so are its gradients, which is
    exactly what DeepSpeed builds (it sums gradients over SP and averages over DP). One
    small all-reduce over SP carries both the token count and the reported loss's sum.
    """
    import torch.distributed as dist

    mask = loss_mask.reshape(-1).float()
    local_sum = torch.sum(losses.float().reshape(-1) * mask)
    counts = torch.stack([mask.sum(), local_sum.detach()]).double()
    dist.all_reduce(counts, group=sp_group)
    total_tokens, total_loss = counts[0], counts[1]
    loss = local_sum / total_tokens.to(local_sum.dtype)
    return loss, (total_loss / total_tokens).to(torch.float32)


def offset_rotary_for_sequence_parallel(model, sp_rank: int) -> None:
    """Give RoPE this rank's positions: GPTModel asks its rotary module for the local length
    and would rotate every rank's slice as if it started at position 0. Each call is shifted
    by ``sp_rank x local length`` (Megatron's RotaryEmbedding takes an ``offset``)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None or sp_rank == 0:
        return
    original = rotary.forward

    def forward(max_seq_len, offset=0, *args, **kwargs):
        return original(max_seq_len, offset + sp_rank * max_seq_len, *args, **kwargs)

    rotary.forward = forward

"""Fused core attention: megatron-core's ``DotProductAttention`` on torch's
``scaled_dot_product_attention`` (SDPA).

megatron-core's own core attention materialises the ``[b, heads, s, s]`` scores, their fp32
softmax, dropout and gradients: O(s^2) memory and passes through memory that dominate a step
at a long sequence. SDPA computes the same attention in one kernel that keeps only the
softmax's log-sum-exp per query: FlashAttention-2 (Dao, arXiv 2307.08691) or the
memory-efficient kernel on a GPU, a fused flash kernel on the CPU.

Where it sits: the ``core_attention`` of megatron-core's local layer spec, chosen by
``model.layer_spec`` from Megatron's ``--attention-backend`` names (flash and fused), and so
the core attention of Ladder's layers (built on that spec) and the inner attention of
Ulysses (``ulysses.py``). Inputs and output are the local spec's: q ``[sq, b, heads, d]``,
k and v ``[sk, b, groups, d]``, the context ``[sq, b, heads x d]`` for the output projection.

On a GPU, SDPA picks its kernel per call, and where neither the flash nor the memory-efficient
kernel takes the inputs (a dtype, a head size, an old GPU) it runs its math kernel, which
holds the O(s^2) scores this attention exists to avoid. ``kernel_note`` asks torch's own
checks once, at start, which kernel the model's attention gets, and says so in a line when it
is the math one.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

FLAG = "--attention-backend"


class SDPAttention(MegatronModule):
    """Drop-in for megatron-core 0.16.1's ``DotProductAttention``: the same constructor, the
    same forward, the same result within rounding (megatron-core's ``-10000`` fill for
    masked scores and SDPA's ``-inf`` give the same probabilities), computed by SDPA.

    * Masks: causal by SDPA's own ``is_causal`` where the mask type is causal and no mask is
      given (a kernel that skips the masked half); an explicit boolean mask (megatron's:
      True = masked out) is used instead, as megatron-core does. A query whose every key is
      masked gets a zero context (megatron-core's: the mean of the values); a causal mask
      has none.
    * Grouped-query attention: key/value groups serve ``heads / groups`` query heads each,
      grouped as megatron-core's ``repeat_interleave`` does.
    * Dropout: SDPA's ``dropout_p`` while training, drawn inside the tensor-parallel RNG
      tracker's fork as megatron-core draws its own (different masks from the unfused ones,
      at the same rate); the recomputed forward of ``--recompute-granularity selective``
      restores that stream and redraws the same mask.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        _refuse_unsupported(config, layer_number)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.pg_collection = pg_collection
        # megatron-core divides the scale by the layer number under query-key layer scaling
        # and multiplies the fp32 scores back by it before the softmax: the net scale is the
        # undivided one, which SDPA applies (it accumulates in fp32, so nothing overflows).
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None \
            else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError(f"{FLAG} flash/fused on the local layers does not support packed "
                             "sequences; use --attention-backend unfused")
        if attention_bias is not None:
            raise ValueError(f"{FLAG} flash/fused on the local layers takes no attention "
                             "bias (neither does megatron-core's DotProductAttention)")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, sk = query.size(0), key.size(0)
        causal = attention_mask is None and mask_type == AttnMaskType.causal and sq > 1
        if causal and sq != sk:
            raise ValueError(f"causal attention needs as many queries as keys, got {sq} "
                             f"and {sk}")
        mask = None if attention_mask is None else _keep_mask(attention_mask)
        # [s, b, heads, d] -> [b, heads, s, d], SDPA's layout (a view: the head dim stays
        # innermost, which every kernel needs).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        repeat = q.size(1) // k.size(1)
        native_groups = repeat > 1 and _kernel_takes_groups(q, mask)
        if repeat > 1 and not native_groups:
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        p = self.dropout_p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                scale=self.softmax_scale, enable_gqa=native_groups)

        if p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:  # no draw without dropout; under sequence parallelism megatron draws unforked
            context = attend()
        # [b, heads, sq, d] -> [sq, b, heads x d]
        context = context.permute(2, 0, 1, 3)
        return context.reshape(sq, context.size(1), -1)


def _refuse_unsupported(config, layer_number: int) -> None:
    """What megatron-core's unfused attention does and this one does not, as flag errors."""
    if config.context_parallel_size != 1:
        raise ValueError(f"{FLAG} flash/fused on the local layers: context parallelism is "
                         "Transformer Engine's; use --ds-sequence-parallel-size (Ulysses)")
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                 layer_number):
        raise ValueError(f"{FLAG} flash/fused on the local layers: sliding-window attention "
                         f"(window {config.window_size}) is not supported; use "
                         f"{FLAG} unfused")
    if config.softmax_type != "vanilla":
        raise ValueError(f"{FLAG} flash/fused on the local layers: softmax type "
                         f"{config.softmax_type!r} is not supported; use {FLAG} unfused")


def _keep_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """megatron's mask (True = masked out) as SDPA's (True = takes part)."""
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"attention_mask must be boolean (True = masked out, megatron's "
                         f"convention), got {attention_mask.dtype}")
    return attention_mask.logical_not()


def _kernel_takes_groups(q: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether SDPA's fused kernel for these inputs runs grouped-query attention itself:
    the CPU's flash kernel always does; on CUDA only the flash kernel does (16-bit inputs, no
    mask), the memory-efficient one (fp32, or a mask) would fall back to the unfused math."""
    if q.device.type != "cuda":
        return True
    return mask is None and q.dtype in (torch.float16, torch.bfloat16)


PROBE_TOKENS = 64  # the sequence of the tensors torch's kernel checks look at (no kernel runs)
FUSED_KERNELS = ("flash", "memory-efficient")


def kernel_note(model) -> Optional[str]:
    """One line when torch's SDPA would run its math kernel for ``model``'s attention (the
    first ``SDPAttention`` in it, on the current GPU, in the model's dtype), with why each
    fused kernel refuses it; None where the flash or the memory-efficient kernel takes it, off
    a GPU (the CPU's fused kernel), and without an ``SDPAttention``. torch tries flash, then
    memory-efficient, then math (its default order: cuDNN's only where math is turned off)."""
    layer = next((m for m in model.modules() if isinstance(m, SDPAttention)), None)
    if layer is None or not torch.cuda.is_available():
        return None
    c = layer.config
    tp = c.tensor_model_parallel_size
    heads = max(1, c.num_attention_heads // tp)
    groups = max(1, (c.num_query_groups or c.num_attention_heads) // tp)
    dtype = c.params_dtype
    # As ``forward`` calls it: causal in the kernel, no mask; grouped where the kernel groups.
    native_groups = groups != heads and dtype in (torch.float16, torch.bfloat16)
    refusals = _probe(torch.device("cuda", torch.cuda.current_device()), dtype, heads, groups,
                      c.kv_channels, layer.dropout_p, native_groups)
    if any(why is None for why in refusals.values()):
        return None
    dtype_name = str(dtype).replace("torch.", "")
    return (f"{FLAG}: torch's scaled_dot_product_attention runs its math kernel on this GPU "
            f"for {dtype_name}, head size {c.kv_channels}, {heads} heads of {groups} groups"
            f"{f', dropout {layer.dropout_p:g}' if layer.dropout_p else ''}: O(s^2) memory "
            "for the scores, as the unfused attention (" +
            "; ".join(f"{name}: {why}" for name, why in refusals.items()) + ")")


def _probe(device: torch.device, dtype: torch.dtype, heads: int, groups: int, head_dim: int,
           dropout: float, native_groups: bool) -> Dict[str, Optional[str]]:
    """Per fused kernel: None if it takes these inputs, else why not (the first reason
    torch's check gives), from ``torch.backends.cuda.can_use_flash_attention`` and
    ``can_use_efficient_attention`` on empty tensors of ``PROBE_TOKENS`` tokens: they read
    shapes, dtypes, the GPU and torch's switches, and run no kernel."""
    from torch.backends.cuda import (SDPAParams, can_use_efficient_attention,
                                     can_use_flash_attention)

    q = torch.empty(1, heads, PROBE_TOKENS, head_dim, dtype=dtype, device=device)
    kv = torch.empty(1, groups if native_groups else heads, PROBE_TOKENS, head_dim,
                     dtype=dtype, device=device)
    params = SDPAParams(q, kv, kv, None, dropout, True, native_groups)
    out = {}
    for name, check in zip(FUSED_KERNELS, (can_use_flash_attention,
                                           can_use_efficient_attention)):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            takes = check(params, True)  # debug: says why not, as warnings
        out[name] = None if takes else \
            (str(said[0].message).splitlines()[0] if said else "not available")
    return out

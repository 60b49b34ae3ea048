"""Megatron-LM's count of a GPT's floating-point operations per training step, for its
``throughput`` scalar (TFLOP/s per GPU, ``--log-throughput``).

``num_floating_point_operations`` of Megatron-LM core_v0.16.1 (``megatron/training/
training.py``, ``transformer_flops``), for the models built here (standard or grouped-query
attention, dense or MoE MLPs, no multi-token prediction, no multi-latent or linear
attention). With B the samples of the step, s the sequence length, h the hidden size, L the
layers (L_moe of them MoE), f the MLP width (f_moe each expert's, f_sh the shared experts'),
k the experts a token goes to, e = 3 with SwiGLU else 2, d the head dimension (kv_channels),
n the attention heads, g the query groups, V the padded vocabulary:

    flops = 6 * B * s * (  h * (f * e * (L - L_moe) + (f_moe * k + f_sh) * e * L_moe)
                          + L * (h * (n*d + 2*g*d) + n*d * s / 2 * 2 + n*d * h)
                          + h * V )

(6 = 3 for forward, weight and data gradient x 2 for a multiply-add). It counts the GEMMs
only: norms, softmax and the activation function are left out, and so is recomputation.
"""

from __future__ import annotations


def floating_point_operations(model_cfg, padded_vocab: int, samples: int) -> float:
    """The step's operations for ``samples`` sequences (Megatron-LM's formula, above)."""
    m = model_cfg
    h, s = m.hidden_size, m.seq_length
    heads = m.num_attention_heads
    d = m.kv_channels or h // heads
    groups = m.num_query_groups if m.group_query_attention and m.num_query_groups else heads
    moe_layers = sum(m.moe_layers())
    dense_layers = m.num_layers - moe_layers
    ffn = m.ffn_size()
    moe_ffn = (m.moe_ffn_hidden_size or ffn) if moe_layers else 0
    shared_ffn = (m.moe_shared_expert_intermediate_size or 0) if moe_layers else 0
    topk = m.moe_router_topk if moe_layers else 0
    expansion = 3 if m.swiglu else 2
    fwd_bwd, fma = 3, 2
    q, kv = d * heads, d * groups
    attention = fwd_bwd * fma * (h * (q + 2 * kv) + q * s / 2 * 2 + q * h)
    mlp = fwd_bwd * fma * h * (ffn * expansion * dense_layers
                               + moe_ffn * topk * expansion * moe_layers
                               + shared_ffn * expansion * moe_layers)
    logits = fwd_bwd * fma * h * padded_vocab
    return float(samples * s * (mlp + attention * m.num_layers + logits))


__all__ = ["floating_point_operations"]

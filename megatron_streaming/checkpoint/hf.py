"""Conversion between our GPT's parameters and Hugging Face transformers checkpoints.

Three architectures convert both ways, exactly in fp32:

* Llama class (``--swiglu --normalization RMSNorm --position-embedding-type rope``, optional
  grouped-query attention, linear biases, RoPE base and Llama 3.1 scaling, tied or untied
  output) <-> ``LlamaForCausalLM``;
* the same with every MLP a mixture of experts (``--num-experts``, top-k routing with the
  softmax over the chosen experts, no shared experts, no biases) <-> ``MixtralForCausalLM``;
* GPT-2 class (our defaults: learned positions, LayerNorm, exact GELU, biases) <->
  ``GPT2LMHeadModel``.

Where it sits: ``to_hf`` / ``from_hf`` work on ``{global name: full tensor as at TP=1}`` (the
names of a TP1 PP1 model's ``named_parameters()``, what ``weights.tp_unshard`` rebuilds);
gathering shards and our own checkpoint files are the caller's business. ``save_hf`` /
``load_hf`` write and read a Hugging Face directory (config.json + safetensors, no pickles).

Layout facts the conversion rests on (megatron-core 0.16.1):

* ``linear_qkv`` rows are grouped per key/value head: for each group g, the rows of its
  query heads, then k_g, then v_g. Hugging Face keeps q, k and v apart (Llama) or as
  [all q; all k; all v] (GPT-2's ``c_attn``).
* SwiGLU's ``linear_fc1`` holds [gate; up]; Megatron computes silu(gate) * up, as Llama.
* Mixtral: the router's ``mlp.router.weight`` is ``mlp.gate.weight``; expert e's ``linear_fc1``
  is row e of ``mlp.experts.gate_up_proj`` ([gate; up], as ours) and its ``linear_fc2`` row e
  of ``mlp.experts.down_proj`` (transformers 5's modules); the files transformers writes name
  them ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.e.w1`` / ``w3`` / ``w2`` (gate,
  up, down), which ``from_hf`` reads too. Mixtral's router takes the softmax over all experts,
  the top k, and renormalises them: megatron-core's default top-k router, which takes the
  softmax over the k chosen logits, computes the same weights.
* RoPE: both rotate the two halves of each head (``rotate_half``, not interleaved pairs),
  with the same inverse frequencies; Megatron's ``--use-rope-scaling`` is Hugging Face's
  ``llama3`` rope type with low/high frequency factors 1 and 4 over 8192 original positions.
* ``--apply-layernorm-1p`` norms scale by weight + 1: +1 on export, -1 on import.
* GPT-2's ``Conv1D`` stores weights as [in, out]: the transpose of a ``Linear``.
* The embedding (and untied output) has ``padded_vocab_size`` rows; rows past the
  tokenizer's vocabulary are padding, dropped on export and left to the caller on import
  (``pad_vocab``).
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import UsageError
from ..worker.weights import FUSED_NORMS, local_spec_name

Params = Dict[str, torch.Tensor]

LLAMA, GPT2, MIXTRAL = "llama", "gpt2", "mixtral"
# The Llama 3.1 constants megatron-core's RotaryEmbedding._apply_scaling hard-codes.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# Hugging Face names of the input embedding, and the prefix a bare model's keys lack.
_EMBED = {LLAMA: "model.embed_tokens.weight", GPT2: "transformer.wte.weight",
          MIXTRAL: "model.embed_tokens.weight"}
_PREFIX = {LLAMA: "model.", GPT2: "transformer.", MIXTRAL: "model."}
# Buffers some checkpoints carry that are not weights: rotary frequencies, causal masks.
_BUFFERS = {LLAMA: r"rotary_emb\.inv_freq$", GPT2: r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$",
            MIXTRAL: r"rotary_emb\.inv_freq$"}
# GPT-2's names of our layer's norms and linears.
_GPT2_NORMS = (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))
_GPT2_LINEARS = (("self_attention.linear_qkv", "attn.c_attn"),
                 ("self_attention.linear_proj", "attn.c_proj"),
                 ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj"))


class HFConversionError(UsageError):
    """A model or checkpoint that has no exact counterpart on the other side; the message
    names the flag or the Hugging Face field, and the value."""


# ---- which architecture ---------------------------------------------------------------------

def architecture(model_cfg) -> str:
    """``"llama"`` or ``"gpt2"``: the Hugging Face class computing what ``model_cfg`` does;
    HFConversionError naming the flags when neither does."""
    m = model_cfg
    if m.ladder_residual or m.ladder_layers:  # each sub-block sees a stale residual
        raise HFConversionError(
            f"--ladder-residual / --ladder-layers ({m.ladder_residual}, {m.ladder_layers!r}): "
            "no Hugging Face model computes a ladder residual")
    if m.position_embedding_type == "rope":
        if not m.swiglu or m.normalization != "RMSNorm":
            raise HFConversionError(
                f"--position-embedding-type rope with --swiglu {m.swiglu} and --normalization "
                f"{m.normalization}: only the Llama class (--swiglu, RMSNorm) converts")
        if m.rotary_percent != 1.0:
            raise HFConversionError(
                f"--rotary-percent {m.rotary_percent}: Llama rotates whole heads (1.0)")
        return _mixtral(m) if m.moe else LLAMA
    if m.position_embedding_type == "learned_absolute":
        if m.swiglu or m.normalization != "LayerNorm":
            raise HFConversionError(
                f"--position-embedding-type learned_absolute with --swiglu {m.swiglu} and "
                f"--normalization {m.normalization}: only the GPT-2 class (GELU, LayerNorm) "
                "converts")
        if m.query_groups() != m.num_attention_heads:
            raise HFConversionError(
                f"--num-query-groups {m.query_groups()}: GPT-2 has one key/value head per "
                f"attention head ({m.num_attention_heads})")
        if (m.kv_channels or 0) not in (0, m.hidden_size // m.num_attention_heads) or \
                m.hidden_size % m.num_attention_heads:
            raise HFConversionError(
                f"--kv-channels {m.kv_channels}: GPT-2's heads are --hidden-size / "
                f"--num-attention-heads ({m.hidden_size} / {m.num_attention_heads}) wide")
        return GPT2
    raise HFConversionError(
        f"--position-embedding-type {m.position_embedding_type}: neither Llama (rope) nor "
        "GPT-2 (learned_absolute) runs without position embeddings")


def _mixtral(m) -> str:
    """What a Llama-class MoE model must be to be Mixtral."""
    problems = [
        (not all(m.moe_layers()), f"--moe-layer-freq {m.moe_layer_freq}: every Mixtral layer is "
         "a mixture of experts"),
        (m.moe_shared_expert_intermediate_size is not None,
         "--moe-shared-expert-intermediate-size: Mixtral has no shared experts"),
        (m.moe_router_pre_softmax, "--moe-router-pre-softmax: Mixtral renormalises the top-k "
         "of its softmax (megatron-core's default router)"),
        (not m.disable_bias_linear, "linear biases: Mixtral has none (add "
         "--disable-bias-linear)"),
        ((m.moe_ffn_hidden_size or m.ffn_size()) != m.ffn_size(),
         f"--moe-ffn-hidden-size {m.moe_ffn_hidden_size} with --ffn-hidden-size "
         f"{m.ffn_size()}: Mixtral has one intermediate size")]
    for bad, why in problems:
        if bad:
            raise HFConversionError(why)
    return MIXTRAL


# ---- fused attention rows ---------------------------------------------------------------------

def _split_qkv(qkv: torch.Tensor, groups: int, heads: int, head_dim: int):
    """Megatron's per-group [q heads; k; v] rows -> (q, k, v), each head-major."""
    per_group = heads // groups
    rows = qkv.reshape(groups, (per_group + 2) * head_dim, *qkv.shape[1:])
    q, k, v = rows.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]).clone() for t in (q, k, v))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int,
              head_dim: int) -> torch.Tensor:
    """``_split_qkv``'s inverse."""
    tail = q.shape[1:]
    parts = [t.reshape(groups, -1, *tail) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *tail).clone()


# ---- export ------------------------------------------------------------------------------------

def _local_names(params: Params) -> Params:
    """Transformer Engine's fused norm names -> the local spec's separate norm names."""
    return {local_spec_name(name): tensor for name, tensor in params.items()}


def layer_spec_names(params: Params, model_names) -> Params:
    """``from_hf``'s local-spec names renamed to what a model built with Transformer
    Engine's spec calls the same norms (``...linear_qkv.layer_norm_weight``), where
    ``model_names`` (its parameter names) has them."""
    wanted, out = set(model_names), {}
    for name, tensor in params.items():
        fused = name
        for local, te in FUSED_NORMS:
            fused = fused.replace(local, te)
        out[fused if name not in wanted and fused in wanted else name] = tensor
    return out


class _Taker:
    """Pops tensors by name so that a name nobody converted is an error, not a silent
    loss (a QK-norm, a bias the target has no slot for)."""

    def __init__(self, params: Params, what: str):
        self.left, self.what = dict(params), what

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.left:
            raise HFConversionError(f"{self.what} has no {name!r}")
        return self.left.pop(name)

    def get(self, name: str) -> Optional[torch.Tensor]:
        return self.left.pop(name, None)

    def finish(self) -> None:
        if self.left:
            raise HFConversionError(
                f"{self.what}: no conversion for {', '.join(sorted(self.left))}")


def _vocab_rows(tensor: torch.Tensor, vocab_size: int, name: str) -> torch.Tensor:
    if tensor.shape[0] < vocab_size:
        raise HFConversionError(f"{name} has {tensor.shape[0]} rows, fewer than the "
                                f"vocabulary ({vocab_size})")
    return tensor[:vocab_size].clone()


def to_hf(model_cfg, params: Params, vocab_size: int):
    """Our parameters -> (Hugging Face config, Hugging Face state dict).

    ``params``: ``{global name: full tensor as at TP=1}``; embedding and output rows past
    ``vocab_size`` (the tokenizer's) are padding and dropped. Tied: ``lm_head.weight`` is the
    embedding tensor itself, as Hugging Face ties it."""
    arch, m = architecture(model_cfg), model_cfg
    take = _Taker(_local_names(params), "our parameters")
    offset = 1.0 if m.apply_layernorm_1p else 0.0  # on norm weights, never on biases
    embed = _vocab_rows(take("embedding.word_embeddings.weight"), vocab_size,
                        "embedding.word_embeddings.weight")
    output = take.get("output_layer.weight")  # tied: a stage's copy of the embedding
    if m.untie_embeddings_and_output_weights:
        if output is None:
            raise HFConversionError("--untie-embeddings-and-output-weights but our parameters "
                                    "have no 'output_layer.weight'")
        head = _vocab_rows(output, vocab_size, "output_layer.weight")
    else:
        head = embed
    config = {LLAMA: _llama_config, MIXTRAL: _mixtral_config,
              GPT2: _gpt2_config}[arch](m, vocab_size, params)
    state = (_gpt2_tensors if arch == GPT2 else _llama_tensors)(m, take, offset)
    take.finish()
    state[_EMBED[arch]], state["lm_head.weight"] = embed, head
    return config, state


def _llama_config(m, vocab_size: int, params: Params):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.use_rope_scaling:
        rope.update(rope_type="llama3", factor=float(m.rope_scaling_factor), **LLAMA3_ROPE)
    bias = not m.disable_bias_linear
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_size(),
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.query_groups(),
        head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
        hidden_act="silu", max_position_embeddings=m.max_position_embeddings or m.seq_length,
        rms_norm_eps=m.norm_epsilon, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        rope_parameters=rope, attention_bias=bias, mlp_bias=bias,
        attention_dropout=m.attention_dropout, initializer_range=m.init_method_std,
        # The tokenizer is not ours to know; LlamaConfig's defaults (1, 2) would be guesses.
        bos_token_id=None, eos_token_id=None)


def _mixtral_config(m, vocab_size: int, params: Params):
    from transformers import MixtralConfig

    llama = _llama_config(m, vocab_size, params).to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "rope_parameters", "attention_dropout", "initializer_range", "bos_token_id",
            "eos_token_id")
    return MixtralConfig(**{k: llama[k] for k in keep}, num_local_experts=m.num_experts,
                         num_experts_per_tok=m.moe_router_topk,
                         router_aux_loss_coef=m.moe_aux_loss_coeff, router_jitter_noise=0.0)


def _llama_tensors(m, take: _Taker, offset: float) -> Params:
    heads, groups = m.num_attention_heads, m.query_groups()
    head_dim = m.kv_channels or m.hidden_size // heads
    leaves = ("weight",) if m.disable_bias_linear else ("weight", "bias")
    state = {}
    for i in range(m.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        state[hf + "input_layernorm.weight"] = take(ours + "input_layernorm.weight") + offset
        state[hf + "post_attention_layernorm.weight"] = \
            take(ours + "pre_mlp_layernorm.weight") + offset
        for leaf in leaves:
            q, k, v = _split_qkv(take(f"{ours}self_attention.linear_qkv.{leaf}"), groups, heads,
                                 head_dim)
            out = take(f"{ours}self_attention.linear_proj.{leaf}")
            named = [("self_attn.q_proj", q), ("self_attn.k_proj", k),
                     ("self_attn.v_proj", v), ("self_attn.o_proj", out)]
            if m.moe:  # Mixtral (``architecture``: every layer, no biases)
                experts = [f"{ours}mlp.experts.local_experts.{e}." for e in range(m.num_experts)]
                state[f"{hf}mlp.gate.weight"] = take(f"{ours}mlp.router.weight").clone()
                state[f"{hf}mlp.experts.gate_up_proj"] = torch.stack(
                    [take(e + "linear_fc1.weight") for e in experts])
                state[f"{hf}mlp.experts.down_proj"] = torch.stack(
                    [take(e + "linear_fc2.weight") for e in experts])
            else:
                gate, up = take(f"{ours}mlp.linear_fc1.{leaf}").chunk(2, dim=0)
                named += [("mlp.gate_proj", gate), ("mlp.up_proj", up),
                          ("mlp.down_proj", take(f"{ours}mlp.linear_fc2.{leaf}"))]
            for name, tensor in named:
                state[f"{hf}{name}.{leaf}"] = tensor.clone()
    state["model.norm.weight"] = take("decoder.final_layernorm.weight") + offset
    return state


def _gpt2_config(m, vocab_size: int, params: Params):
    from transformers import GPT2Config

    positions = params["embedding.position_embeddings.weight"].shape[0]
    return GPT2Config(
        vocab_size=vocab_size, n_positions=positions, n_embd=m.hidden_size,
        n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_size(),
        # Megatron's GELU is torch's exact (erf) one; GPT-2's own "gelu_new" is the tanh fit.
        activation_function="gelu", layer_norm_epsilon=m.norm_epsilon,
        resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout,
        attn_pdrop=m.attention_dropout, initializer_range=m.init_method_std,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        bos_token_id=None, eos_token_id=None)


def _gpt2_tensors(m, take: _Taker, offset: float) -> Params:
    heads, hidden = m.num_attention_heads, m.hidden_size
    state = {"transformer.wpe.weight": take("embedding.position_embeddings.weight").clone()}

    def linear(ours: str):
        """A Linear's weight and bias -> a Conv1D's ([in, out]); under --disable-bias-linear
        a zero bias, which computes the same."""
        weight = take(ours + ".weight")
        bias = torch.zeros(weight.shape[0], dtype=weight.dtype) if m.disable_bias_linear \
            else take(ours + ".bias")
        return weight.t().contiguous(), bias.clone()

    for i in range(m.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for norm, ln in _GPT2_NORMS:
            state[f"{hf}{ln}.weight"] = take(f"{ours}{norm}.weight") + offset
            state[f"{hf}{ln}.bias"] = take(f"{ours}{norm}.bias").clone()
        for ours_name, hf_name in _GPT2_LINEARS:
            weight, bias = linear(ours + ours_name)
            if hf_name == "attn.c_attn":  # per-head [q; k; v] -> [all q; all k; all v]
                weight = torch.cat(_split_qkv(weight.t(), heads, heads, hidden // heads)).t()
                bias = torch.cat(_split_qkv(bias, heads, heads, hidden // heads))
            state[f"{hf}{hf_name}.weight"] = weight.contiguous()
            state[f"{hf}{hf_name}.bias"] = bias
    state["transformer.ln_f.weight"] = take("decoder.final_layernorm.weight") + offset
    state["transformer.ln_f.bias"] = take("decoder.final_layernorm.bias").clone()
    return state


# ---- import ------------------------------------------------------------------------------------

def from_hf(hf_config, hf_state_dict: Params, *,
            apply_layernorm_1p: bool = False) -> Tuple[List[str], Params]:
    """(Hugging Face config, state dict) -> (our model flags, our fp32 parameters).

    The flags rebuild the architecture (no vocabulary: that comes from the tokenizer); the
    parameters have ``hf_config.vocab_size`` embedding rows, unpadded (``pad_vocab``).
    ``apply_layernorm_1p``: into zero-centred norms (Megatron-LM's Llama 3 recipe), the flag
    added and 1 taken off every norm weight. Bare models' keys (``LlamaModel``, GPT-2 files
    without ``transformer.``) are accepted too."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in (LLAMA, GPT2, MIXTRAL):
        raise HFConversionError(f"model_type {model_type!r}: only 'llama' (LlamaForCausalLM), "
                                "'mixtral' (MixtralForCausalLM) and 'gpt2' (GPT2LMHeadModel) "
                                "convert")
    tied = bool(getattr(hf_config, "tie_word_embeddings", model_type == GPT2))
    llama = model_type in (LLAMA, MIXTRAL)
    flags = {LLAMA: _llama_flags, MIXTRAL: _mixtral_flags, GPT2: _gpt2_flags}[model_type](
        hf_config)
    prefix = _PREFIX[model_type]
    take = _Taker({key if key.startswith((prefix, "lm_head.")) else prefix + key: tensor
                   for key, tensor in hf_state_dict.items()
                   if not re.search(_BUFFERS[model_type], key)}, "the Hugging Face state dict")
    params = (_llama_params if llama else _gpt2_params)(hf_config, take,
                                                        1.0 if apply_layernorm_1p else 0.0)
    params["embedding.word_embeddings.weight"] = take(_EMBED[model_type])
    head = take.get("lm_head.weight")  # tied: the embedding again, or absent
    if not tied:
        if head is None:
            raise HFConversionError("tie_word_embeddings False but the Hugging Face state dict "
                                    "has no 'lm_head.weight'")
        params["output_layer.weight"] = head
        flags.append("--untie-embeddings-and-output-weights")
    take.finish()
    if apply_layernorm_1p:
        flags.append("--apply-layernorm-1p")
    return flags, {name: t.to(torch.float32).contiguous() for name, t in params.items()}


def pad_vocab(params: Params, padded_vocab_size: int) -> Params:
    """Embedding and output rows zero-padded to ``padded_vocab_size`` (``config.shape.
    padded_vocab_size``), as our model holds them. The padding tokens' logits are then 0:
    never sampled from a real tokenizer, but they do enter the softmax of the training loss."""
    out = dict(params)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            rows = out[name]
            if rows.shape[0] > padded_vocab_size:
                raise HFConversionError(f"{name} has {rows.shape[0]} rows, more than the padded "
                                        f"vocabulary ({padded_vocab_size})")
            pad = rows.new_zeros(padded_vocab_size - rows.shape[0], *rows.shape[1:])
            out[name] = torch.cat([rows, pad])
    return out


def _num(value) -> str:
    return str(float(value))


def _llama_flags(c) -> List[str]:
    if c.hidden_act != "silu":
        raise HFConversionError(f"hidden_act {c.hidden_act!r}: --swiglu gates with silu")
    if bool(c.attention_bias) != bool(getattr(c, "mlp_bias", False)):
        raise HFConversionError(
            f"attention_bias {c.attention_bias} with mlp_bias {c.mlp_bias}: "
            "--disable-bias-linear turns the biases of all linear layers on or off together")
    heads, hidden = c.num_attention_heads, c.hidden_size
    groups = c.num_key_value_heads or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    flags = ["--num-layers", str(c.num_hidden_layers), "--hidden-size", str(hidden),
             "--num-attention-heads", str(heads), "--ffn-hidden-size", str(c.intermediate_size),
             "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", _num(c.rms_norm_eps),
             "--max-position-embeddings", str(c.max_position_embeddings),
             "--hidden-dropout", "0.0", "--attention-dropout", _num(c.attention_dropout or 0)]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if head_dim * heads != hidden:
        flags += ["--kv-channels", str(head_dim)]
    if not c.attention_bias:
        flags.append("--disable-bias-linear")
    return flags + _rope_flags(c)


def _mixtral_flags(c) -> List[str]:
    for name in ("attention_bias", "mlp_bias"):  # Mixtral has no linear biases
        if not hasattr(c, name):
            setattr(c, name, False)
    return _llama_flags(c) + [
        "--num-experts", str(c.num_local_experts), "--moe-router-topk",
        str(c.num_experts_per_tok), "--moe-aux-loss-coeff", _num(c.router_aux_loss_coef)]


def _rope_flags(c) -> List[str]:
    """RoPE settings megatron-core can express: an integer base, whole heads, and at most
    Llama 3.1's scaling with its fixed constants."""
    rope = dict(getattr(c, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    if theta != int(theta):
        raise HFConversionError(f"rope_theta {theta}: --rotary-base takes an integer")
    partial = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise HFConversionError(f"partial_rotary_factor {partial}: --rotary-percent other "
                                "than 1 does not convert")
    flags = ["--position-embedding-type", "rope", "--rotary-base", str(int(theta))]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return flags
    if rope_type != "llama3":
        raise HFConversionError(f"rope_parameters rope_type {rope_type!r}: megatron-core has "
                                "only the default RoPE and Llama 3.1's (llama3) scaling")
    for key, value in LLAMA3_ROPE.items():
        if float(rope.get(key, -1)) != value:
            raise HFConversionError(
                f"rope_parameters {key} {rope.get(key)}: --use-rope-scaling fixes it at "
                f"{value:g}")
    return flags + ["--use-rope-scaling", "--rope-scaling-factor", _num(rope["factor"])]


def _llama_params(c, take: _Taker, offset: float) -> Params:
    heads = c.num_attention_heads
    groups = c.num_key_value_heads or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    leaves = ("weight", "bias") if c.attention_bias else ("weight",)
    params = {}
    for i in range(c.num_hidden_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        params[ours + "input_layernorm.weight"] = take(hf + "input_layernorm.weight") - offset
        params[ours + "pre_mlp_layernorm.weight"] = \
            take(hf + "post_attention_layernorm.weight") - offset
        for leaf in leaves:
            q, k, v = (take(f"{hf}self_attn.{p}.{leaf}") for p in ("q_proj", "k_proj", "v_proj"))
            params[f"{ours}self_attention.linear_qkv.{leaf}"] = \
                _fuse_qkv(q, k, v, groups, head_dim)
            params[f"{ours}self_attention.linear_proj.{leaf}"] = \
                take(f"{hf}self_attn.o_proj.{leaf}")
            if getattr(c, "num_local_experts", None):
                params.update(_mixtral_experts(c, take, hf, ours))
                continue
            params[f"{ours}mlp.linear_fc1.{leaf}"] = torch.cat(
                [take(f"{hf}mlp.gate_proj.{leaf}"), take(f"{hf}mlp.up_proj.{leaf}")])
            params[f"{ours}mlp.linear_fc2.{leaf}"] = take(f"{hf}mlp.down_proj.{leaf}")
    params["decoder.final_layernorm.weight"] = take("model.norm.weight") - offset
    return params


def _mixtral_experts(c, take: _Taker, hf: str, ours: str) -> Params:
    """A Mixtral layer's router and experts: transformers 5's fused modules, or the files'
    per-expert ``block_sparse_moe`` names."""
    out, experts = {}, range(c.num_local_experts)
    fused = take.get(f"{hf}mlp.experts.gate_up_proj")
    if fused is not None:
        down = take(f"{hf}mlp.experts.down_proj")
        out[f"{ours}mlp.router.weight"] = take(f"{hf}mlp.gate.weight")
        for e in experts:
            out[f"{ours}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fused[e]
            out[f"{ours}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
        return out
    moe = f"{hf}block_sparse_moe."
    out[f"{ours}mlp.router.weight"] = take(moe + "gate.weight")
    for e in experts:
        w = {k: take(f"{moe}experts.{e}.{k}.weight") for k in ("w1", "w2", "w3")}
        out[f"{ours}mlp.experts.local_experts.{e}.linear_fc1.weight"] = \
            torch.cat([w["w1"], w["w3"]])
        out[f"{ours}mlp.experts.local_experts.{e}.linear_fc2.weight"] = w["w2"]
    return out


def _gpt2_flags(c) -> List[str]:
    for field, value, want in (("activation_function", c.activation_function, "gelu"),
                               ("scale_attn_weights", c.scale_attn_weights, True),
                               ("scale_attn_by_inverse_layer_idx",
                                c.scale_attn_by_inverse_layer_idx, False),
                               ("add_cross_attention", c.add_cross_attention, False)):
        if value != want:
            # GPT-2's own "gelu_new" is the tanh approximation; ours is the exact erf GELU.
            raise HFConversionError(f"{field} {value!r}: our GPT computes only {want!r}")
    return ["--num-layers", str(c.n_layer), "--hidden-size", str(c.n_embd),
             "--num-attention-heads", str(c.n_head),
             "--ffn-hidden-size", str(c.n_inner or 4 * c.n_embd),
             "--normalization", "LayerNorm", "--norm-epsilon", _num(c.layer_norm_epsilon),
             "--position-embedding-type", "learned_absolute",
             "--max-position-embeddings", str(c.n_positions),
             "--hidden-dropout", _num(c.resid_pdrop), "--attention-dropout", _num(c.attn_pdrop)]


def _gpt2_params(c, take: _Taker, offset: float) -> Params:
    heads, hidden = c.n_head, c.n_embd
    params = {"embedding.position_embeddings.weight": take("transformer.wpe.weight")}
    for i in range(c.n_layer):
        ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for norm, ln in _GPT2_NORMS:
            params[f"{ours}{norm}.weight"] = take(f"{hf}{ln}.weight") - offset
            params[f"{ours}{norm}.bias"] = take(f"{hf}{ln}.bias")
        for ours_name, hf_name in _GPT2_LINEARS:
            weight = take(f"{hf}{hf_name}.weight").t()  # Conv1D [in, out] -> Linear [out, in]
            bias = take(f"{hf}{hf_name}.bias")
            if hf_name == "attn.c_attn":  # [all q; all k; all v] -> per-head [q; k; v]
                weight = _fuse_qkv(*weight.chunk(3), heads, hidden // heads)
                bias = _fuse_qkv(*bias.chunk(3), heads, hidden // heads)
            params[f"{ours}{ours_name}.weight"] = weight
            params[f"{ours}{ours_name}.bias"] = bias
    params["decoder.final_layernorm.weight"] = take("transformer.ln_f.weight") - offset
    params["decoder.final_layernorm.bias"] = take("transformer.ln_f.bias")
    return params


# ---- Hugging Face directories ----------------------------------------------------------------

def _model_class(model_type: str):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM

    return {LLAMA: LlamaForCausalLM, GPT2: GPT2LMHeadModel,
            MIXTRAL: MixtralForCausalLM}[model_type]


def save_hf(model_cfg, params: Params, vocab_size: int, out_dir: str,
            dtype: torch.dtype = torch.float32) -> None:
    """``out_dir/config.json`` and ``model.safetensors`` (sharded past 50 GB) by transformers'
    ``save_pretrained``, weights cast to ``dtype``. The model is built on the meta device and
    the tensors assigned into it: no second copy, no random initialisation, and the strict
    load still checks that every Hugging Face parameter got one."""
    config, state = to_hf(model_cfg, params, vocab_size)
    cast = {}  # one cast per tensor: a tied lm_head stays the embedding's tensor
    state = {name: cast.setdefault(id(t), t.to(dtype)) for name, t in state.items()}
    with torch.device("meta"):
        model = _model_class(config.model_type)(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(out_dir)


def load_hf(hf_dir: str, *, apply_layernorm_1p: bool = False) -> Tuple[List[str], Params]:
    """``from_hf`` of a Hugging Face directory: config.json and ``model.safetensors`` (or
    its sharded index). Pickled weights (``pytorch_model.bin``) are never read: unpickling
    runs code from the file."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise HFConversionError(f"{config_path}: no such file (a Hugging Face model directory "
                                "holds config.json and model.safetensors)")
    with open(config_path, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type not in (LLAMA, GPT2, MIXTRAL):
        raise HFConversionError(f"{config_path}: model_type {model_type!r} does not convert "
                                "(only 'llama', 'mixtral' and 'gpt2')")
    config = _model_class(model_type).config_class.from_pretrained(hf_dir,
                                                                   local_files_only=True)
    return from_hf(config, _read_safetensors(hf_dir), apply_layernorm_1p=apply_layernorm_1p)


def _read_safetensors(hf_dir: str) -> Params:
    from safetensors.torch import load_file

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(hf_dir, shard) for shard in shards]
    else:
        found = ", ".join(sorted(os.listdir(hf_dir))) or "nothing"
        raise HFConversionError(
            f"{single}: no such file, nor {os.path.basename(index)} (found: {found}); only "
            "safetensors weights are read, never pickles such as pytorch_model.bin")
    state = {}
    for path in files:
        state.update(load_file(path))
    return state

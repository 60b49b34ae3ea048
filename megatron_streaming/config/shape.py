"""What the model flags describe, counted: the padded vocabulary and the parameters (the whole
model's, one layer's, one pipeline stage's on one TP rank).

Pure functions of the flags, without torch: the model's build (``worker.model``), the door's
fingerprint (``job.door``) and the planner (``plan.memory``, which adds what a rank keeps for
its backward) count with these, so the three cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron's padding: a multiple of ``divisible_by x TP`` so every TP shard is equal."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def parameter_count(model_cfg, vocab_size: int) -> int:
    """Parameters of the GPT the model flags describe, the vocabulary padded as Megatron pads
    it (without the TP factor: the count is the model's, whatever its layout)."""
    return ModelShape.from_config(model_cfg, vocab_size).parameters()


@dataclass(frozen=True)
class ModelShape:
    """What the parameter counts (and the planner's memory and time models) need of the model
    flags."""
    layers: int
    hidden: int
    heads: int
    ffn: int
    kv_channels: int
    query_groups: int
    vocab: int  # padded
    seq: int
    swiglu: bool = False
    bias: bool = True
    tied: bool = True
    learned_positions: bool = True
    rms_norm: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    positions: Optional[int] = None  # rows of the learned position table (default: seq)
    # Mixture of experts: routed experts per MoE layer (0: a dense model), how many layers
    # are MoE, each expert's width, the experts a token goes to, the shared experts' width.
    experts: int = 0
    moe_layers: int = 0
    expert_ffn: int = 0
    topk: int = 1
    shared_ffn: int = 0

    @classmethod
    def from_config(cls, m, vocab_size: int) -> "ModelShape":
        heads = m.num_attention_heads
        return cls(
            layers=m.num_layers, hidden=m.hidden_size, heads=heads,
            ffn=m.ffn_size(),
            kv_channels=m.kv_channels or m.hidden_size // heads,
            query_groups=(m.num_query_groups if m.group_query_attention and m.num_query_groups
                          else heads),
            vocab=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by),
            seq=m.seq_length, swiglu=m.swiglu,
            bias=not m.disable_bias_linear, tied=not m.untie_embeddings_and_output_weights,
            learned_positions=m.position_embedding_type == "learned_absolute",
            rms_norm=m.normalization == "RMSNorm", attention_dropout=m.attention_dropout,
            hidden_dropout=m.hidden_dropout,
            positions=m.max_position_embeddings or m.seq_length,
            experts=m.num_experts if m.moe else 0, moe_layers=sum(m.moe_layers()),
            expert_ffn=m.moe_ffn_hidden_size or m.ffn_size(), topk=m.moe_router_topk,
            shared_ffn=m.moe_shared_expert_intermediate_size or 0)

    def layer_parameters(self, tp: int = 1) -> float:
        """One transformer layer's parameters on one TP rank (norms replicated)."""
        h, q = self.hidden, self.heads * self.kv_channels
        kv = 2 * self.query_groups * self.kv_channels
        up = self.ffn * (2 if self.swiglu else 1)
        split = h * (q + kv) + q * h + h * up + self.ffn * h
        split += self.bias * (q + kv + up)
        replicated = self.bias * 2 * h + 2 * h * (1 if self.rms_norm else 2)
        return split / tp + replicated

    def mlp_parameters(self, width: int, tp: int = 1) -> float:
        """One MLP of ``width`` on one TP rank (its first linear twice as wide with SwiGLU)."""
        up = width * (2 if self.swiglu else 1)
        return (self.hidden * up + width * self.hidden) / tp + self.bias * (up / tp + self.hidden)

    def routed_parameters(self, tp: int = 1) -> float:
        """All routed experts of one MoE layer on one TP rank (an EP rank holds 1/EP)."""
        return self.experts * self.mlp_parameters(self.expert_ffn, tp)

    def moe_layer_change(self, tp: int = 1) -> float:
        """An MoE layer against a dense one, routed experts aside: the router (replicated)
        and the shared experts in, the dense MLP out."""
        shared = self.mlp_parameters(self.shared_ffn, tp) if self.shared_ffn else 0.0
        return self.experts * self.hidden + shared - self.mlp_parameters(self.ffn, tp)

    def stage_routed(self, tp: int, pp: int) -> float:
        """The routed experts of a pipeline stage on one TP rank, all EP ranks' together."""
        return self.moe_layers / pp * self.routed_parameters(tp)

    def embedding_parameters(self, tp: int = 1) -> float:
        positions = (self.positions or self.seq) * self.hidden if self.learned_positions else 0
        return self.vocab * self.hidden / tp + positions

    def parameters(self) -> int:
        out = self.layers * self.layer_parameters() + self.embedding_parameters()
        out += self.moe_layers * (self.moe_layer_change() + self.routed_parameters())
        out += self.hidden * (1 if self.rms_norm else 2)  # final norm
        return int(out + (0 if self.tied else self.vocab * self.hidden))

    def stage_tensors(self, pp: int, stage: int, ep: int = 1) -> float:
        """Parameter tensors on a rank of pipeline stage ``stage`` (megatron-core's local
        layers: two norms, the fused QKV, the projection and the two MLP matrices a layer,
        their biases and the norms' with bias and LayerNorm)."""
        per_layer = 6 + self.bias * 4 + (0 if self.rms_norm else 2)
        out = self.layers / pp * per_layer
        # an MoE layer: a router and its EP rank's experts (and shared experts) for the MLP
        mlp = 2 * (1 + self.bias)
        out += self.moe_layers / pp * (1 + (self.experts / ep + bool(self.shared_ffn)) * mlp
                                       - mlp)
        if stage == 0:
            out += 1 + self.learned_positions
        if stage == pp - 1:
            out += (1 if self.rms_norm else 2) + (not self.tied or pp > 1)
        return out

    def stage_parameters(self, tp: int, pp: int, stage: int) -> float:
        """Parameters on a rank of pipeline stage ``stage``: its layers, the embedding on
        the first, the final norm and the output layer (or the tied copy) on the last; every
        routed expert of its MoE layers (an EP rank holds ``stage_routed / EP`` of them)."""
        out = self.layers / pp * self.layer_parameters(tp)
        out += self.moe_layers / pp * self.moe_layer_change(tp) + self.stage_routed(tp, pp)
        if stage == 0:
            out += self.embedding_parameters(tp)
        if stage == pp - 1:
            out += self.hidden * (1 if self.rms_norm else 2)
            if not self.tied or pp > 1:  # a tied output layer on another stage is a copy
                out += self.vocab * self.hidden / tp
        return out

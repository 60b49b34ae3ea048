"""Configuration dataclasses, one per concern.

Every field carries its help text in ``metadata``; ``megatron_streaming.cli.arguments`` turns the
fields into argparse flags (``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``,
Megatron-LM's names wherever Megatron has the flag) and ``validate`` checks them together.
The library takes these objects; nothing reads a global ``args``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional


def canonical_normalization(value: str) -> str:
    """``rmsnorm`` / ``layernorm`` (Megatron-DeepSpeed's spelling) -> megatron-core's names."""
    return {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(value.lower(), value)


def flag_name(field_name: str) -> str:
    """The command-line flag of a config field."""
    return "--" + field_name.replace("_", "-")


def arg(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field whose metadata feeds the flag generator (``choices``, ``flag``...)."""
    meta = {"help": help, **extra}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def moe_layer_pattern(freq: str, num_layers: int) -> List[int]:
    """Megatron-LM's ``--moe-layer-freq``: ``N`` (layer i is MoE when i % N == 0) or a list
    expression of 0/1 per layer built from list literals, ``+`` and ``*`` (evaluated on the
    syntax tree, never ``eval``). Raises ValueError naming the flag."""
    import ast

    text = str(freq).strip()

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError
    try:
        parsed = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise ValueError(f"--moe-layer-freq {text!r}: expected an integer or a list of 0 and 1 "
                         "per layer such as '[1,0,1,0]' or '([0]+[1]*3)*2'") from None
    if isinstance(parsed, int):
        if parsed < 1:
            raise ValueError(f"--moe-layer-freq {text!r}: must be >= 1")
        return [1 if i % parsed == 0 else 0 for i in range(num_layers)]
    if len(parsed) != num_layers or any(x not in (0, 1) for x in parsed):
        raise ValueError(f"--moe-layer-freq {text!r}: needs one 0 or 1 per layer "
                         f"(--num-layers {num_layers}), got {parsed}")
    return parsed


@dataclass
class ModelConfig:
    """The GPT architecture (megatron.core.models.gpt.GPTModel)."""

    num_layers: int = arg(2, "Number of transformer layers.")
    hidden_size: int = arg(64, "Transformer hidden size.")
    num_attention_heads: int = arg(4, "Number of attention heads.")
    ffn_hidden_size: Optional[int] = arg(
        None, "MLP hidden size (default 4 x hidden size; with --swiglu, 2/3 of that rounded "
        "down to a multiple of 64, as Megatron-LM does).")
    swiglu: bool = arg(False, "SwiGLU MLP: silu(x W_gate) * (x W_up), as in Llama.")
    group_query_attention: bool = arg(
        False, "Grouped-query attention: --num-query-groups key/value heads shared by the "
        "query heads.")
    num_query_groups: Optional[int] = arg(
        None, "Key/value head groups with --group-query-attention (ignored without it, as in "
        "Megatron-LM; Megatron-DeepSpeed's --num-key-value-heads N sets both).")
    kv_channels: Optional[int] = arg(
        None, "Head dimension (default --hidden-size / --num-attention-heads).")
    seq_length: int = arg(64, "Tokens per sample.")
    max_position_embeddings: Optional[int] = arg(
        None, "Learned position table size (default: --seq-length).")
    position_embedding_type: str = arg(
        "learned_absolute", "Position embedding ('none': no position embedding).",
        choices=["learned_absolute", "rope", "none"])
    rotary_base: int = arg(10000, "RoPE base period (Llama 3: 500000).")
    rotary_percent: float = arg(1.0, "Fraction of each head's dimensions that RoPE rotates.")
    use_rope_scaling: bool = arg(
        False, "Llama 3.1's RoPE frequency scaling (factor --rope-scaling-factor).")
    rope_scaling_factor: float = arg(8.0, "RoPE scaling factor with --use-rope-scaling.")
    normalization: str = arg("LayerNorm", "Norm layer (case-insensitive).",
                             choices=["LayerNorm", "RMSNorm"], type=canonical_normalization)
    norm_epsilon: float = arg(1e-5, "Epsilon of the norm layers.",
                              aliases=["--layernorm-epsilon"])
    apply_layernorm_1p: bool = arg(
        False, "Zero-centred norm weights: the norm scales by weight + 1, weight starting at "
        "0 (Megatron-LM's Llama 3 script).")
    untie_embeddings_and_output_weights: bool = arg(
        False, "Give the output layer its own weight instead of the input embedding's.")
    disable_bias_linear: bool = arg(False, "No biases in the linear layers.")
    hidden_dropout: float = arg(0.1, "Dropout on the residual branches (Megatron's default).")
    attention_dropout: float = arg(
        0.1, "Dropout on the attention probabilities (Megatron's default).")
    init_method_std: float = arg(0.02, "Std of the normal weight initialisation.")
    make_vocab_size_divisible_by: int = arg(
        128, "Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    attention_backend: str = arg(
        "auto", "Core attention: flash and fused run torch's fused "
        "scaled_dot_product_attention (Transformer Engine's kernels on its layers), unfused "
        "and local megatron-core's own; auto the faster: the fused one (docs/RESULTS.md).",
        choices=["auto", "flash", "fused", "unfused", "local"])
    transformer_impl: str = arg(
        "auto", "Layer implementation: megatron-core's local spec (auto, local), or Transformer "
        "Engine's (transformer_engine: opt-in, needs the package and a GPU; untested here).",
        choices=["auto", "local", "transformer_engine"])
    recompute_granularity: Optional[str] = arg(
        None, "Activation recompute: a whole layer's activations (full) or only the core "
        "attention's (selective), recomputed in the backward.", choices=["full", "selective"])
    recompute_method: Optional[str] = arg(
        None, "With --recompute-granularity full: uniform (every --recompute-num-layers "
        "layers as one recompute unit) or block (the first --recompute-num-layers layers of "
        "each pipeline stage).", choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = arg(
        None, "Layers per recompute unit (uniform) or recomputed per stage (block); default 1 "
        "with --recompute-granularity full, as in Megatron-DeepSpeed.")
    recompute_modules: Optional[List[str]] = arg(
        None, "With --recompute-granularity selective: the submodules to recompute "
        "(core_attn, mlp, layernorm; default core_attn).", nargs="*")
    ladder_residual: bool = arg(
        False, "Ladder residual (arXiv 2501.06589) on every layer: each sub-block's "
        "tensor-parallel all-reduce overlaps the next sub-block's compute.")
    ladder_layers: Optional[str] = arg(
        None, "Ladder residual on some layers only: 0-based 'A-B', 'N', 'first:K', 'last:K' "
        "or 'all', comma-separated (e.g. last:8 = the upper 8 layers).")
    # ---- mixture of experts: megatron-core's MoE layers, Megatron-LM's flags ------------
    num_experts: Optional[int] = arg(
        None, "Routed experts per MoE layer: megatron-core's MoE layer replaces the dense MLP "
        "in the layers --moe-layer-freq picks (default: a dense model).")
    moe_layer_freq: str = arg(
        "1", "Which layers are MoE: N (every N-th layer, from layer 0) or a Python list of "
        "1 (MoE) and 0 (dense) per layer, e.g. '([0]+[1]*3)*2', as in Megatron-LM.")
    moe_ffn_hidden_size: Optional[int] = arg(
        None, "Each routed expert's MLP width (default --ffn-hidden-size).")
    moe_shared_expert_intermediate_size: Optional[int] = arg(
        None, "Width of the shared experts' MLP, which every token also goes through "
        "(DeepSeek, Qwen-MoE); default none.")
    moe_router_topk: int = arg(2, "Experts each token is routed to.")
    moe_router_load_balancing_type: str = arg(
        "aux_loss", "Load balancing: the Switch/GShard auxiliary loss over the micro-batch "
        "(aux_loss), per sequence (seq_aux_loss, DeepSeek-V2), or none.",
        choices=["aux_loss", "seq_aux_loss", "none"])
    moe_aux_loss_coeff: float = arg(0.0, "Weight of the load-balancing loss.")
    moe_z_loss_coeff: Optional[float] = arg(
        None, "Weight of the router z-loss (ST-MoE; default off).")
    moe_router_pre_softmax: bool = arg(
        False, "Softmax over all experts before the top-k (Mixtral: after it).")
    moe_router_dtype: Optional[str] = arg(
        None, "Router logits and probabilities in this precision (default: the model's).",
        choices=["fp32", "fp64"])
    moe_token_dispatcher_type: str = arg(
        "allgather", "How tokens reach their experts across the expert-parallel ranks.",
        choices=["allgather", "alltoall"])
    moe_expert_capacity_factor: Optional[float] = arg(
        None, "Each expert takes at most factor x tokens / experts x topk tokens; the rest "
        "are dropped (default: no limit, no dropping).")
    moe_pad_expert_input_to_capacity: bool = arg(
        False, "With --moe-expert-capacity-factor: pad every expert's input to its capacity.")
    moe_token_drop_policy: str = arg(
        "probs", "With --moe-expert-capacity-factor: drop the tokens of lowest routing "
        "probability (probs) or the last ones (position).", choices=["probs", "position"])
    moe_min_capacity: Optional[int] = arg(
        None, "DeepSpeed-MoE's minimum expert capacity (Megatron-DeepSpeed's flag): accepted "
        "where the capacity is at least this anyway; megatron-core has no minimum.")
    moe_grouped_gemm: bool = arg(
        False, "All local experts in one grouped GEMM (a GPU kernel; refused on CPU).")

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model (``--num-experts`` above 1; 1 is a dense model, as in
        Megatron-DeepSpeed's scripts)."""
        return (self.num_experts or 1) > 1

    def moe_layers(self) -> List[bool]:
        """Per layer, whether its MLP is an MoE layer (``--moe-layer-freq``)."""
        if not self.moe:
            return [False] * self.num_layers
        pattern = moe_layer_pattern(self.moe_layer_freq, self.num_layers)
        return [bool(x) for x in pattern]

    def ffn_size(self) -> int:
        """The MLP width Megatron-LM derives when --ffn-hidden-size is not given."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups under --group-query-attention, else one per
        attention head."""
        if self.group_query_attention and self.num_query_groups:
            return self.num_query_groups
        return self.num_attention_heads


@dataclass
class ParallelConfig:
    """Parallelism inside one worker, and the number of workers."""

    tensor_model_parallel_size: int = arg(1, "Tensor-parallel size (inside a worker).")
    pipeline_model_parallel_size: int = arg(1, "Pipeline-parallel size (inside a worker).")
    sequence_parallel: bool = arg(
        False, "Megatron sequence parallelism over the tensor-parallel group.")
    ds_sequence_parallel_size: int = arg(
        1, "DeepSpeed-Ulysses sequence-parallel size inside a worker: each rank holds "
        "seq/SP tokens; attention runs on heads/SP heads over the full sequence.")
    expert_model_parallel_size: int = arg(
        1, "Expert-parallel size inside a worker: each rank holds --num-experts / EP experts; "
        "carved from the tensor x sequence x data-parallel ranks of a pipeline stage, as "
        "megatron-core does.", aliases=["--moe-expert-parallel-size"])
    expert_tensor_parallel_size: Optional[int] = arg(
        None, "Tensor-parallel size of each expert (default --tensor-model-parallel-size).")
    zero_stage: int = arg(1, "DeepSpeed ZeRO stage over the worker's data-parallel group.",
                          choices=[0, 1, 2])
    distributed_backend: str = arg(
        "auto", "torch.distributed backend (auto: nccl with CUDA, else gloo).",
        choices=["auto", "gloo", "nccl"])
    distributed_timeout_minutes: float = arg(10.0, "Timeout of in-worker collectives.")
    overlap_grad_reduce: bool = arg(
        False, "Overlap the data-parallel gradient reduction with the backward (DeepSpeed's "
        "overlap_comm) at --zero-stage 2; at stages 0 and 1 (--use-distributed-optimizer) "
        "the reduction runs once, in the optimizer step: noted at start, no overlap.")
    master_addr: Optional[str] = arg(
        None, "Rendezvous host of the whole job (global rank 0's node) when each worker is "
        "launched on its own (--diloco-worker-index); default: the launcher's MASTER_ADDR.")
    master_port: Optional[int] = arg(
        None, "Rendezvous port that goes with --master-addr; default: the launcher's "
        "MASTER_PORT.")
    rendezvous_external: bool = arg(
        False, "The rendezvous store at --master-addr/--master-port is served by `python -m "
        "megatron_streaming.job.rendezvous` (launch/rendezvous.sh) on a host of its own, not by "
        "global rank 0: the job's meeting point does not die with worker 0.")


@dataclass
class TransformerEngineConfig:
    """GPU-only features, through Transformer Engine when it is importable on a GPU; refused
    on a machine without them."""

    fp8_format: Optional[str] = arg(
        None, "FP8 training through Transformer Engine: e4m3 or hybrid.",
        choices=["e4m3", "hybrid"])
    fp8_recipe: str = arg("delayed", "Transformer Engine FP8 scaling recipe.",
                          choices=["delayed", "tensorwise", "mxfp8", "blockwise"])
    fp8_margin: int = arg(0, "FP8 scaling margin.")
    fp8_amax_history_len: int = arg(1, "FP8 amax history length.")
    fp8_amax_compute_algo: str = arg("most_recent", "FP8 amax from the history.",
                                     choices=["most_recent", "max"])

    def gpu_only_flags(self) -> list:
        """The flags given that need Transformer Engine on a GPU."""
        flags = []
        if self.fp8_format:
            flags.append(f"--fp8-format {self.fp8_format}")
        return flags


@dataclass
class PrecisionConfig:
    """Training precision (DeepSpeed's ``fp16`` / ``bf16`` sections): 16-bit weights and
    activations, fp32 master weights in the optimizer, and fp16's loss scaling."""

    fp16: bool = arg(False, "Train in fp16 with fp32 master weights and loss scaling.")
    bf16: bool = arg(False, "Train in bf16 with fp32 master weights.")
    grad_reduce_in_bf16: bool = arg(
        False, "With --bf16: accumulate gradients over micro-batches and reduce them across "
        "data-parallel ranks in bf16, as Megatron-LM's flag does; without it both are in fp32, "
        "as in Megatron-LM (at --zero-stage 0 DeepSpeed accumulates in bf16 regardless).")
    loss_scale: Optional[float] = arg(
        None, "Static loss scale with --fp16; without it the loss scale is dynamic.")
    initial_loss_scale: float = arg(
        2.0**32, "Initial dynamic loss scale with --fp16 (a power of two).")
    min_loss_scale: float = arg(1.0, "Minimum dynamic loss scale with --fp16.")
    loss_scale_window: float = arg(
        1000, "Steps without overflow after which the dynamic loss scale doubles.")
    hysteresis: int = arg(
        2, "Overflows the dynamic loss scale tolerates before it halves (refilled when it "
        "doubles).")

    @property
    def dtype_name(self) -> str:
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"


@dataclass
class StreamingConfig:
    """Streaming DiLoCo between workers (DESIGN.md "Streaming DiLoCo")."""

    diloco_workers: int = arg(
        1, "Number of DiLoCo workers; each is a contiguous block of WORLD/M ranks.")
    diloco_worker_index: Optional[int] = arg(
        None, "This launch starts worker W only (one job per cluster): the launcher's ranks "
        "become global ranks W*R .. W*R+R-1 of a world of --diloco-workers x R, joined at "
        "--master-addr:--master-port. Default: one launch starts every worker.")
    diloco_sync: bool = arg(
        True, "Run the Streaming DiLoCo sync. Several workers: on unless --no-diloco-sync "
        "(off: the workers train independently). One worker: on only when --diloco-sync or a "
        "flag of the outer loop (--diloco-inner-steps, --diloco-outer-lr, ...) is typed: its "
        "outer optimizer every H steps, no traffic, no quantization unless --diloco-quantize is "
        "typed; otherwise plain training with no outer state.")
    diloco_inner_steps: Optional[int] = arg(
        None, "H: inner steps between two syncs of one fragment. Default: 30 (the setting "
        "every published result used), lowered to train-iters / 40 (at least 1) for a run that "
        "would give a fragment fewer than 40 outer steps; the value chosen is said at start.")
    diloco_fragments: Optional[int] = arg(
        None, "P: number of fragments (each syncs every H steps, one every H/P). Default: 3 "
        "where it divides --num-layers and H and leaves more than one step between sends, "
        "else 2, else 1.")
    diloco_fragment_layers: Optional[int] = arg(
        None, "Layers per fragment; sets --diloco-fragments to num-layers / this.")
    diloco_fragment_pattern: str = arg(
        "strided", "Layers of fragment p: p, p+P, ... (strided) or a contiguous block.",
        choices=["strided", "sequential"])
    diloco_sync_spacing: str = arg(
        "steps", "When fragments sync: every H/P steps (steps), or as often over the run but "
        "at equal shares of the summed learning rate (lr: often while the lr is high, "
        "seldom at the end of its decay) or of its inverse square root (decay: seldom at the "
        "peak, often in the warm-up and at the end of the decay).",
        choices=["steps", "lr", "decay"])
    diloco_overlap_steps: Optional[int] = arg(
        None, "tau: inner steps that overlap a fragment's exchange before its merge (< H/P). "
        "Default: 1 where H/P > 1 with several workers and no --diloco-eager, else 0.")
    diloco_eager: bool = arg(
        False, "Eager outer updates (arXiv 2502.12996): at a fragment's send the worker takes an "
        "outer step at once, its own fresh outer gradient standing in for its share of the "
        "mean in flight; that mean is applied at the fragment's next send, so an exchange may "
        "take a whole round (H steps) without stalling training. Needs "
        "--diloco-overlap-steps 0.")
    diloco_alpha: float = arg(
        0.0, "Merge: local = alpha * local + (1 - alpha) * global (0 = replace).")
    diloco_weighting: str = arg(
        "tokens", "Weights of the outer mean: each worker by the tokens it trained on in the "
        "round (its --global-batch-size; the same as uniform when the workers' batches are "
        "equal), or all alike (uniform).", choices=["tokens", "uniform"])
    diloco_outer_lr: float = arg(
        1.0, "Outer SGD learning rate (1 with no momentum: the global parameters become the "
        "workers' mean; the papers' 0.7 / 0.9 needs hundreds of outer steps, docs/RESULTS.md; "
        "untyped with --diloco-quantize sparse between workers: 2, measured best there).")
    diloco_outer_momentum: float = arg(0.0, "Outer SGD momentum.")
    diloco_nesterov: bool = arg(True, "Nesterov outer momentum.")
    diloco_quantize: str = arg(
        "fp4-e2m1", "Outer-gradient wire format: 4-bit E2M1 with a scale per block (fp4-e2m1), "
        "the Streaming DiLoCo paper's E3M0 in the same bytes (fp4), int8, bf16, fp32 "
        "(none), or sparse (SparseLoCo, arXiv 2508.15706: the --diloco-sparse-k largest "
        "entries of every --diloco-sparse-chunk elements at --diloco-sparse-value-bits bits, "
        "the rest kept in a per-worker accumulator that decays by --diloco-sparse-decay; one "
        "all-gather per exchange; docs/streaming.md).",
        choices=["none", "bf16", "int8", "fp4", "fp4-e2m1", "sparse"])
    diloco_quant_block: int = arg(128, "Elements per quantization scale.")
    diloco_error_feedback: bool = arg(
        False, "Carry each rank's quantization error into its next send of the fragment "
        "(always, as its decaying accumulator, with --diloco-quantize sparse).")
    diloco_sparse_k: int = arg(
        64, "--diloco-quantize sparse: entries sent per chunk (64 of 4,096: 1.6 %% density).")
    diloco_sparse_chunk: int = arg(
        4096, "--diloco-quantize sparse: elements per chunk (each chunk sends its k largest "
        "magnitudes, their positions at ceil(log2 chunk) bits, and one fp32 scale).")
    diloco_sparse_value_bits: int = arg(
        2, "--diloco-quantize sparse: bits per value sent (a sign and a power of two below "
        "the chunk's absmax: 2 bits send +-s/2, +-s).", choices=[1, 2, 3, 4])
    diloco_sparse_decay: float = arg(
        0.95, "--diloco-quantize sparse: decay of the per-worker accumulator of what was not "
        "sent (SparseLoCo's beta, standing in for outer momentum; 1: plain error feedback).")
    diloco_offload_outer_state: bool = arg(
        False, "Keep the outer state (global copy, momentum, residual) in CPU memory.")
    diloco_backend: str = arg(
        "gloo", "Backend of the cross-worker groups: gloo on every device (a GPU job stages "
        "the packed codes through pinned host memory), or nccl (opt-in, never run here: "
        "docs/gpu_clusters.md says what it needs); auto means gloo.",
        choices=["auto", "gloo", "nccl"])
    diloco_timeout: float = arg(
        600.0, "Seconds to wait for a cross-worker exchange before failing.")
    diloco_min_workers: Optional[int] = arg(
        None, "Elastic workers: keep training while at least this many workers are alive (and "
        "they are a strict majority of --diloco-workers); a lost worker is dropped and the "
        "outer mean goes over the others; fewer, or no majority: a checkpoint (--save) and a "
        "stop with the reason. Default: --diloco-workers (a lost worker stops the job).")
    diloco_control_lag: int = arg(
        1, "Steps between posting the per-step cross-worker stop flag and reading it: hides "
        "link latency up to this many steps; a SIGTERM stops the job this many steps later, plus "
        "one (the worker's own reduction is read a step after it is posted).")
    diloco_new_worker_optimizer: str = arg(
        "copy", "On resume with more workers than the checkpoint has: a new worker starts from "
        "the global parameters with worker 0's inner optimizer state (copy) or a fresh one "
        "(fresh).", choices=["copy", "fresh"])
    eval_params: str = arg("global", "Evaluate the global (outer) or the local parameters.",
                           choices=["global", "local"])
    co2_gap_penalty: float = arg(
        1.0, "CO2 staleness-gap penalty lambda: the outer gradient is divided by it.")
    co2_clip_threshold: float = arg(
        0.0, "CO2: clamp the outer momentum element-wise to [-phi, phi] (0 = off).")


@dataclass
class OptimizerConfig:
    """The inner optimizer and its learning-rate schedule."""

    optimizer: str = arg("adam", "Inner optimizer: AdamW, or SGD (for exactness checks).",
                         choices=["adam", "sgd"])
    lr: float = arg(1e-3, "Peak learning rate.")
    min_lr: float = arg(0.0, "Learning rate at the end of the decay.")
    decoupled_lr: Optional[float] = arg(
        None, "Peak learning rate of the word embedding and output layer weights (not the "
        "position embedding): a param group of their own, on the warmup and decay of --lr "
        "(default: --lr).")
    decoupled_min_lr: Optional[float] = arg(
        None, "Learning rate of the word embedding and output layer weights at the end of the "
        "decay (with --decoupled-lr; default: --min-lr).")
    lr_decay_style: str = arg(
        "linear", "Decay after warmup (Megatron's default: linear); WSD: constant, then "
        "--lr-wsd-decay-style over the last --lr-wsd-decay-iters/-samples.",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr_wsd_decay_style: str = arg("exponential", "Annealing shape of WSD's last phase.",
                                  choices=["exponential", "linear", "cosine", "minus_sqrt"])
    lr_warmup_iters: int = arg(0, "Linear warmup iterations (iteration-based training).")
    lr_warmup_samples: int = arg(0, "Linear warmup samples per worker (with --train-samples).")
    lr_warmup_fraction: Optional[float] = arg(
        None, "Warmup as a fraction of the decay length (instead of --lr-warmup-iters/-samples).")
    lr_warmup_tokens: Optional[int] = arg(
        None, "Linear warmup tokens per worker (Megatron-DeepSpeed; with --lr-decay-tokens).")
    lr_warmup_init: float = arg(0.0, "Learning rate the warmup starts from.")
    lr_decay_iters: Optional[int] = arg(None, "Decay iterations (default: --train-iters).")
    lr_decay_samples: Optional[int] = arg(
        None, "Decay samples per worker (with --train-samples; default: --train-samples).")
    lr_decay_tokens: Optional[int] = arg(
        None, "Decay tokens per worker (Megatron-DeepSpeed): the whole schedule counts tokens.")
    lr_wsd_decay_iters: Optional[int] = arg(None, "Iterations of WSD's annealing phase.")
    lr_wsd_decay_samples: Optional[int] = arg(
        None, "Samples per worker of WSD's annealing phase (with --train-samples).")
    weight_decay: float = arg(0.01, "AdamW weight decay (not on biases and norms).")
    adam_beta1: float = arg(0.9, "AdamW beta1.")
    adam_beta2: float = arg(0.999, "AdamW beta2 (Megatron's default).")
    adam_eps: float = arg(1e-8, "AdamW epsilon.")
    sgd_momentum: float = arg(0.0, "SGD momentum.")
    clip_grad: float = arg(1.0, "Clip the global gradient norm to this (0 = off).")


@dataclass
class TrainingConfig:
    """Batches, iterations and evaluation."""

    micro_batch_size: int = arg(2, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = arg(
        None, "Samples per step in one worker (micro batch x data-parallel size x "
        "accumulation); default one micro-batch per data-parallel rank.")
    train_iters: Optional[int] = arg(
        20, "Training iterations (derived from --train-samples when that is given instead).")
    train_samples: Optional[int] = arg(
        None, "Train on this many samples per worker (instead of --train-iters); "
        "iterations = samples / --global-batch-size, ramp-up included.")
    train_tokens: Optional[int] = arg(
        None, "Also stop once each worker has trained on this many tokens (Megatron-DeepSpeed).")
    rampup_batch_size: Optional[List[int]] = arg(
        None, "START INCREMENT SAMPLES: each worker's global batch grows from START by "
        "INCREMENT to --global-batch-size over its first SAMPLES samples (megatron-core's "
        "calculator).", nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"))
    step_batch_size_schedule: Optional[str] = arg(
        None, "Megatron-LM's step schedule of each worker's global batch: 'TOKENS:BATCH ...' "
        "by tokens trained per worker (K/M/B/T suffixes), e.g. '0:16 2.4B:320 4.8B:624'; the "
        "last batch is the global batch size.")
    eval_interval: int = arg(0, "Evaluate every this many iterations (0 = only at the end).")
    eval_iters: int = arg(2, "Global batches per evaluation (0 = no evaluation).")
    seed: int = arg(1234, "Random seed (model init and data order).")
    skip_train: bool = arg(False, "Do not train; with --load, only evaluate.")
    exit_interval: int = arg(
        0, "Stop once the iteration is a multiple of this (saving first with --save); "
        "the schedule still runs to --train-iters on resume.")
    exit_duration_in_mins: Optional[float] = arg(
        None, "Stop (saving first with --save) once this many minutes have passed since "
        "start-up; every rank of every worker stops after the same iteration.")
    manual_gc: bool = arg(
        False, "Python's automatic garbage collection off during training; collect every "
        "--manual-gc-interval iterations and around evaluations instead, on every rank at "
        "the same iteration.")
    manual_gc_interval: int = arg(
        0, "With --manual-gc: collect every this many iterations (0 = not in the step loop).")
    manual_gc_eval: bool = arg(
        True, "with --manual-gc, collect before each evaluation and (what it made) after it.")
    deepspeed_config: Optional[str] = arg(
        None, "A DeepSpeed JSON to merge into the generated one: keys that map to our flags "
        "set them (or must agree), DeepSpeed tuning keys pass through, the rest is refused.",
        flag="--deepspeed_config", aliases=["--deepspeed-config"])


@dataclass
class DataConfig:
    """Where samples come from."""

    data_path: List[str] = arg([], "Indexed dataset prefix(es), optionally weighted "
                               "('0.7 a 0.3 b'), split by --split.", nargs="*")
    split: str = arg("969,30,1", "Train/valid/test proportions of --data-path.")
    train_data_path: List[str] = arg([], "Training dataset prefix(es).", nargs="*")
    valid_data_path: List[str] = arg([], "Validation dataset prefix(es).", nargs="*")
    test_data_path: List[str] = arg([], "Test dataset prefix(es).", nargs="*")
    mock_data: bool = arg(False, "Synthetic data (megatron MockGPTDataset); no files needed.")
    tokenizer_type: Optional[str] = arg(
        None, "Megatron's tokenizer name: SentencePieceTokenizer (the default with "
        "--tokenizer-model), GPTSentencePieceTokenizer, Llama2Tokenizer, GPT2BPETokenizer, "
        "HuggingFaceTokenizer, TikTokenizer or NullTokenizer.")
    tokenizer_model: Optional[str] = arg(
        None, "The tokenizer: a sentencepiece model, a Hugging Face tokenizer directory "
        "(HuggingFaceTokenizer) or a tiktoken vocabulary (TikTokenizer).")
    vocab_file: Optional[str] = arg(None, "GPT2BPETokenizer's vocab.json.")
    merge_file: Optional[str] = arg(None, "GPT2BPETokenizer's merges.txt.")
    tiktoken_pattern: Optional[str] = arg(None, "TikTokenizer's split pattern (default v2).",
                                          choices=["v1", "v2"])
    tiktoken_num_special_tokens: int = arg(1000, "TikTokenizer's special-token ids.")
    vocab_size: Optional[int] = arg(
        None, "Vocabulary of --mock-data without --tokenizer-type (default 256), of "
        "NullTokenizer (plus its end-of-document id), or TikTokenizer's cap.")
    data_cache_path: Optional[str] = arg(None, "Where dataset index caches are written.")


@dataclass
class LoggingConfig:
    """What the run reports and where."""

    log_interval: int = arg(1, "Print a progress line every this many iterations.")
    tensorboard_dir: Optional[str] = arg(None, "Write TensorBoard scalars here.")
    summary_json: Optional[str] = arg(None, "Write a JSON summary of the run here at the end.")
    log_jsonl: Optional[str] = arg(
        None, "Append one JSON line per logged iteration and evaluation to this file.")
    wandb_project: Optional[str] = arg(
        None, "Log the same scalars to this Weights & Biases project (when wandb imports).")
    wandb_exp_name: Optional[str] = arg(None, "The W&B run name (needed with --wandb-project).")
    wandb_save_dir: Optional[str] = arg(
        None, "Where W&B keeps its local files (default: --save/wandb, else wandb's own).")
    wandb_entity: Optional[str] = arg(None, "The W&B entity (team) of the project.")
    timing_log_level: int = arg(
        0, "Per-phase step timers (Megatron's): 1 = forward-backward and optimizer, 2 = also "
        "the Streaming DiLoCo hook inside the optimizer step; 0 = none. Reported per "
        "iteration under each progress line; to TensorBoard and W&B (<name>-time, seconds) "
        "with --log-timers-to-tensorboard.",
        choices=[0, 1, 2])
    timing_log_option: str = arg(
        "minmax", "How timers are reported over the worker's ranks: max, minmax or all.",
        choices=["max", "minmax", "all"])
    # Megatron-LM's logging flags (its LoggerConfig: names, defaults and meanings). The
    # scalars go to TensorBoard, W&B and --log-jsonl alike (run.report).
    tensorboard_log_interval: Optional[int] = arg(
        None, "Write the training scalars (lm loss, learning-rate, ...) every this many "
        "iterations (default: with each progress line, --log-interval, and the last "
        "iteration; Megatron-LM's default is 1); timers, iteration-time and throughput "
        "follow --log-interval.")
    log_timers_to_tensorboard: bool = arg(
        False, "Write iteration-time (and, with --log-throughput, throughput) at every "
        "--log-interval, and the --timing-log-level timers as <name>-time.")
    log_loss_scale_to_tensorboard: bool = arg(
        True, "Write loss-scale (1 without --fp16's dynamic scaling).")
    log_validation_ppl_to_tensorboard: bool = arg(
        False, "Also write the validation perplexity, lm loss validation ppl = exp(min(20, "
        "loss)).")
    log_memory_to_tensorboard: bool = arg(
        False, "Write the logging rank's CUDA allocator statistics (mem-reserved-bytes, "
        "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count); on a CPU run "
        "its resident memory instead (memory/rss-bytes, memory/max-rss-bytes).")
    log_world_size_to_tensorboard: bool = arg(
        False, "Write world-size: the ranks of the whole job, every worker's.")
    log_params_norm: bool = arg(
        False, "Compute the L2 norm of the model's parameters at every point and write it "
        "(params-norm; each parameter counted once across tensor and pipeline ranks).")
    log_throughput: bool = arg(
        False, "Print the throughput per GPU (TFLOP/s/GPU, Megatron-LM's count of a GPT's "
        "floating-point operations) and, with --log-timers-to-tensorboard, write it "
        "(throughput).")
    log_num_zeros_in_grad: bool = arg(
        False, "Count the zeros of the gradient the optimizer steps on (unscaled and clipped; "
        "the whole model's, each element once) at every point: num-zeros, and in the "
        "progress line.")
    log_optimizer_states_to_tensorboard: bool = arg(
        False, "Megatron-DeepSpeed's: write the L2 and L1 norms and the largest magnitude of "
        "Adam's variance, its square root, the momentum and the fp32 weights at every point "
        "(optimizer/variance_l2 ..., each also vs tokens); needs --optimizer adam.")
    tensorboard_queue_size: int = arg(
        1000, "Events TensorBoard's writer queues before it writes them to disk (its "
        "max_queue; also every 2 minutes and at the end).")
    log_progress: bool = arg(
        False, "Append to progress.txt in --save a line when the job starts and one per "
        "checkpoint with the job's and the cumulative throughput (TFLOP/s/GPU), the "
        "operations and the tokens so far, as Megatron-LM does.")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: Optional[str] = arg(None, "Directory to save checkpoints to.")
    save_interval: int = arg(0, "Save every this many iterations (0 = only at the end); "
                             "without --save nothing is saved, as in Megatron-LM.")
    load: Optional[str] = arg(None, "Directory to resume from (its latest checkpoint), or a "
                              "Megatron-LM torch_dist checkpoint to start from its weights.")
    finetune: bool = arg(False, "With --load of a Megatron-LM checkpoint: start from its "
                         "weights at iteration 0 (Megatron-LM's flag).")
    async_save: bool = arg(
        False, "Save in the background: the step loop waits only while the tensors are copied "
        "out (to host memory on a GPU); writing, hashing and the commit follow while training "
        "goes on, and the checkpoint becomes the latest once every rank's files are written.")
    keep_last: int = arg(
        0, "Keep only the newest N committed checkpoints under --save (0 = keep all); older "
        "ones are deleted after a newer one is committed, never the latest.")


@dataclass
class Config:
    """Everything a run needs, grouped by concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    te: TransformerEngineConfig = field(default_factory=TransformerEngineConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    # Megatron flags that were accepted or mapped (``megatron_flags``), logged once per job
    # at start-up; what validation switched off where Megatron is lenient, warned once; and
    # settings the quality benchmark found harmful (``streaming/rule.py``), warned once.
    notes: List[str] = field(default_factory=list, metadata={"section": False})
    adjustments: List[str] = field(default_factory=list, metadata={"section": False})
    warnings: List[str] = field(default_factory=list, metadata={"section": False})

    def sections(self):
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.metadata.get("section", True)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

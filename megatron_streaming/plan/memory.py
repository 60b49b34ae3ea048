"""Peak memory of one rank of a worker, by component, from the model flags and a layout.

A formula, not a profile: each term is what the code holds at the peak of a step (the
backward of the first micro-batch on the first pipeline stage, the last micro-batch's
activations all still alive there under 1F1B), so a term that is wrong shows in the
validation against measured runs (``benchmarks/plan_validation.py``, docs/RESULTS.md) as a
residual that grows with that term, not as a constant.

* Weights: the rank's share of the parameters (``shape.rank_parameters``), at the
  training precision.
* Gradients: the same count in the dtype DeepSpeed accumulates the micro-batches in
  (``config.ds_config.grad_accum_dtype``: fp32 for fp32 and, as in Megatron-LM, for bf16
  under ZeRO; bf16 with ``--grad-reduce-in-bf16`` or at ZeRO-0; fp16 for fp16); ZeRO-2 keeps
  only its partition plus one reduce bucket (never more than the whole count: a model
  smaller than the bucket holds its gradients whole, as at stage 1). They live from the
  step's first backward to its optimizer step: with one micro-batch a step the backward's
  peak (its start) holds none, and the ``gradients`` part is 0 there. Except bf16 at ZeRO-1
  accumulating in fp32 (DeepSpeed's ``BF16_Optimizer``): whole fp32 buffers, made with the
  optimizer and kept, into which each parameter's bf16 gradient is added and freed as soon
  as it is made; no reduce bucket, but at the step the all-reduce flattens the buffers into
  one fp32 copy when they fit one bucket of ``ALLREDUCE_BUCKET`` elements (the largest
  group alone fills one in larger models and is reduced in place).
* Optimizer: the fp32 master partition (a copy even in fp32 runs: DeepSpeed's ZeRO keeps its
  flat partition apart from the module's weights; stage 0 with fp32 keeps none) and Adam's
  two moments, over the ZeRO partition (the data-parallel and Ulysses ranks together).
* Outer state (streaming): theta_g and the outer momentum, fp32, partition-sized; the
  error-feedback residual when on; the exchanges in flight (tau of the P fragments, fp32
  deltas, each the very buffer that travels) and one exchange's working set on the codec's
  device (``EXCHANGE_BYTES`` per element of a fragment's shard: the fp32 mean it returns and
  the reduce-scatter's fp32 chunk sums). ``--diloco-offload-outer-state`` moves all of it to
  host memory (the codec runs there, and the deltas are made beside theta_g): none on the
  device.
* DeepSpeed's reduce bucket (on CUDA, ZeRO 1-2, not BF16_Optimizer): ``reduce_bucket_size``
  elements (5e8 unless the DeepSpeed JSON says otherwise) of the weights' dtype (also where
  the gradients accumulate in fp32, beside it), allocated whole at the first
  backward whatever the model's size (``setup_buckets``; two with ``overlap_comm``). On the
  CPU an allocation commits only the pages written: at most the gradients, counted already.
* Activations: per layer per micro-batch, what Megatron-core's local layers keep for the
  backward (Korthikanti et al. 2022, "Reducing activation recomputation", Table 2, without
  sequence parallelism: ``s b h (10 + 24/t + 5 a s / (h t))`` at 2-byte activations and
  1-byte dropout masks), at the precision, with what the code runs instead of their
  assumptions: the attention softmax in fp32 (megatron-core's default), its output kept at
  4 bytes beside the dropped-out (or, without dropout, cast) probabilities the context's
  product keeps; dropout masks of 1 byte on CUDA (its fused kernel keeps a bool) and of the
  activation's width on the CPU (torch's composite dropout keeps a scaled noise tensor).
  ``benchmarks/memory_phases.py`` lists what autograd saved, by shape, on either device. A
  full recompute keeps each layer's input only, plus one layer's full set while it is
  recomputed; a selective one (the core attention) keeps no scores, and holds one layer's
  again while their backward runs. A layer's attention backward holds the scores' gradients
  at once (the probabilities' at the activations' width, the fp32 softmax's output and
  input), a layer's worth at a long sequence. Either comes after the loss's backward has
  freed the logits: the larger of the two is the backward's transient. The first stage
  holds ``min(pp, micro-batches)`` micro-batches (1F1B). Ulysses splits the sequence.
* Logits: the last stage's ``b s V / t`` fp32 logits, their softmax and its gradient.
* The optimizer step: fp32 copies of the partition held at once under ZeRO 1-2 and
  DeepSpeed's fp16/bf16 optimizers: about four with torch's single-tensor AdamW on the CPU
  (``STEP_COPIES``), 1.3 with its fused kernel on CUDA (``STEP_COPIES_FUSED``, the flat
  gradient partition and little else); one at stage 0 in fp32 (torch's own AdamW steps the
  module's parameters in place; ``STEP_COPIES_IN_PLACE``), in memory the backward's
  activations freed: the peak is the larger of the two, and ``optimizer step`` is what the
  step holds beyond the backward's peak (its gradients too where the backward held none).
* Runtime: what the process holds before any of this (the framework, the CUDA context and
  allocator reserve; on the CPU the interpreter and libraries): measured once per machine,
  given in the cluster description.

Host memory (``host_estimate``, per rank; a node holds ``devices_per_node`` of them) beside a
GPU, what the code keeps there, pinned (page-locked: the kernel can neither swap nor reclaim
it) or not:

* ``--async-save``'s staging buffer, pinned at its exact size (``comm.pinned``): the rank's
  share of a checkpoint (``checkpoint_bytes``); a synchronous save holds the same in pageable
  memory while it writes (megatron-core's copy of the device tensors).
* ``--diloco-offload-outer-state``: theta_g and the momentum in one buffer pinned at its
  exact size; in pageable memory the error-feedback residual, the deltas in flight and the
  exchange's working set (the codec runs on the CPU then); the local shard's copy on its way
  out of the GPU (torch's pinned allocation, rounded up to a power of two, kept for reuse).
* Otherwise the transport's codes between the GPU and gloo: one exchange's at a time (its
  thread runs them in turn), each buffer torch's pinned allocation rounded up to a power of
  two: the packed rows each way, the chunk mean's codes and the gathered ones (at two
  workers, where the chunks are largest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict

from ..config import shape
from .wire import DENSE_FP4, FP4_BITS, Wire  # FP4_BITS re-exported: the dense default's

GIB = 1024 ** 3
STEP_COPIES = 4  # fp32 copies of the ZeRO partition the optimizer step holds at once (CPU)
STEP_COPIES_FUSED = 1.3  # the same with CUDA's fused AdamW (memory_phases.py, one H200)
STEP_COPIES_IN_PLACE = 1  # the same for torch's AdamW on the module's parameters (ZeRO-0 fp32)
RECOMPUTE = ("none", "selective", "full")  # the planner's order of preference at a tie
# Bytes per element of a fragment's shard that one exchange holds on the codec's device
# beyond the delta it sends: the fp32 mean it returns (4) and the reduce-scatter's fp32 chunk
# sum, its decoded part and one decoded chunk (12 / workers: 6 at two workers, the most),
# with the 4-bit codes each way (1) and the quantization error's difference (4 / workers).
EXCHANGE_BYTES = 4 + 6 + 1 + 2
REDUCE_BUCKET = 5e8  # DeepSpeed's default reduce_bucket_size (elements)
ALLREDUCE_BUCKET = 5e8  # engine.allreduce_gradients' buffer (MEMORY_OPT_ALLREDUCE_SIZE)


@dataclass(frozen=True)
class Layout:
    """One worker's in-worker parallel layout and micro-batching."""
    tp: int = 1
    pp: int = 1
    sp: int = 1  # DeepSpeed-Ulysses sequence parallel
    dp: int = 1
    zero_stage: int = 1
    micro_batch: int = 1
    # --recompute-granularity: none, selective (the core attention: scores, softmax,
    # dropout and context, recomputed from Q, K and V) or full (a layer from its input)
    recompute: str = "none"
    ep: int = 1  # expert parallel (MoE), carved from the data and sequence ranks
    moe: bool = False  # the model has experts (TP > 1 then needs --sequence-parallel)

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}: choose from {', '.join(RECOMPUTE)}")

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.sp * self.dp

    def flags(self) -> list:
        out = ["--tensor-model-parallel-size", str(self.tp),
               "--pipeline-model-parallel-size", str(self.pp),
               "--zero-stage", str(self.zero_stage), "--micro-batch-size", str(self.micro_batch)]
        if self.sp > 1:
            out += ["--ds-sequence-parallel-size", str(self.sp)]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.moe and self.tp > 1:  # megatron-core's rule for MoE with TP
            out.append("--sequence-parallel")
        if self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        elif self.recompute == "selective":
            out += ["--recompute-granularity", "selective"]
        return out

    def describe(self) -> str:
        return (f"TP={self.tp} PP={self.pp} SP={self.sp} DP={self.dp} "
                + (f"EP={self.ep} " if self.ep > 1 else "") + f"ZeRO-{self.zero_stage} "
                f"micro-batch {self.micro_batch}" + (
                    "" if self.recompute == "none" else f" {self.recompute} recompute"))


@dataclass(frozen=True)
class ModelShape(shape.ModelShape):
    """The model flags' shape and its parameters (``config.shape.ModelShape``), and what one
    rank keeps for the backward: activations, attention scores, logits."""

    # ---- activations ------------------------------------------------------------------
    def scores(self, micro_batch: int, tp: int, sp: int) -> float:
        """Attention scores of one layer and micro-batch on a rank: ``b a s^2 / (t sp)``."""
        return micro_batch * self.heads / tp * self.seq / sp * self.seq

    def layer_activation_bytes(self, micro_batch: int, tp: int, sp: int,
                               element_bytes: int, mask_bytes: int = 1,
                               unfused: bool = True, selective: bool = False) -> float:
        """What one layer keeps for its backward, for one micro-batch (Korthikanti et al.,
        no sequence parallelism), with our head count, FFN width and dropout settings, the
        softmax in fp32 and dropout masks ``mask_bytes`` wide; a fused (flash) attention
        kernel keeps no scores, nor does a selective recompute (it keeps Q, K and V, which
        the layer keeps anyway, and runs the scores again in the backward)."""
        s, b, h = self.seq / sp, micro_batch, self.hidden
        a = self.heads
        e = element_bytes
        q = self.heads * self.kv_channels
        kv = 2 * self.query_groups * self.kv_channels
        up = self.ffn * (2 if self.swiglu else 1)
        kept = (
            2 * h * e                      # the two norms' inputs
            + 2 * h * e                    # QKV input and MLP input (norm outputs)
            + (q + kv) / tp * e            # Q, K, V for the scores' backward
            + q / tp * e                   # the attention context (projection input)
            + up / tp * e + self.ffn / tp * e  # the activation's input and output
        )
        masks = (h if self.hidden_dropout else 0) * 2 * mask_bytes  # two residual dropouts
        per_token = kept + masks
        # Per query, per head and key: the softmax's fp32 output; the probabilities the
        # context's product keeps: dropped out (with their mask) or cast to the activations'
        # width (the softmax output itself in fp32).
        probabilities = (e + mask_bytes) if self.attention_dropout else (e if e != 4 else 0)
        scores = a / tp * self.seq * (4 + probabilities) if unfused else 0.0
        if selective:  # the core attention keeps its input (Q, K, V) only
            scores = 0.0
        return s * b * (per_token + scores)

    def moe_activation_change(self, micro_batch: int, tp: int, sp: int,
                              element_bytes: int) -> float:
        """What an MoE layer keeps for its backward beyond a dense one: per token, top-k
        copies of its input dispatched to the experts and of each expert's activation input
        and output, the router's fp32 logits and probabilities, the shared experts', less
        the dense MLP's."""
        if not self.experts:
            return 0.0
        e, h = element_bytes, self.hidden
        up_e = self.expert_ffn * (2 if self.swiglu else 1)
        up_s = self.shared_ffn * (2 if self.swiglu else 1)
        dense = (self.ffn * (2 if self.swiglu else 1) + self.ffn) / tp * e
        routed = self.topk * (h + (up_e + self.expert_ffn) / tp) * e + 2 * 4 * self.experts
        shared = (up_s + self.shared_ffn) / tp * e
        return self.seq / sp * micro_batch * (routed + shared - dense)

    def attention_backward_bytes(self, micro_batch: int, tp: int, sp: int,
                                 element_bytes: int) -> float:
        """The gradients one layer's attention backward holds at once beyond what it saved:
        the probabilities' gradient at the activations' width and the fp32 softmax's output
        and input gradients, per score (``b a s^2 / (t sp)``): at a long sequence a layer's
        worth, the peak of a recomputed layer's backward."""
        return self.scores(micro_batch, tp, sp) * (element_bytes + 4 + 4)

    def logits_bytes(self, micro_batch: int, tp: int, sp: int) -> float:
        """The last stage's fp32 logits, their softmax and its gradient at once."""
        return 3 * 4 * micro_batch * self.seq / sp * self.vocab / tp


@dataclass
class Memory:
    """Bytes on one rank at the step's peak, by component."""
    parts: Dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def gib(self) -> Dict[str, float]:
        return {k: v / GIB for k, v in self.parts.items()}


@dataclass(frozen=True)
class Training:
    """What besides the layout decides memory: precision, batch and the streaming state."""
    precision: str = "fp32"  # fp32, bf16 or fp16
    global_batch: int = 8  # per worker
    streaming: bool = True
    fragments: int = 1
    overlap_steps: int = 1
    error_feedback: bool = False
    offload_outer_state: bool = False
    # The kernels the ranks run: "cuda" (dropout keeps bool masks, AdamW is fused) or "cpu"
    # (masks of the activations' width, torch's single-tensor AdamW).
    device: str = "cuda"
    # The core attention: "unfused" (megatron-core's, --attention-backend unfused/local: the
    # scores kept and passed through memory) or "flash" (a fused kernel: torch's on the local
    # layers, Ulysses and Ladder included, or Transformer Engine's on its own).
    attention: str = "unfused"
    # DeepSpeed's gradient reduction: its bucket (elements) and overlap_comm (two buckets).
    reduce_bucket: float = REDUCE_BUCKET
    overlap_comm: bool = False
    # --grad-reduce-in-bf16: bf16 gradients accumulated (and reduced) in bf16, not fp32.
    grad_reduce_in_bf16: bool = False
    # Checkpoints: saved at all (--save), and beside training (--async-save).
    save: bool = False
    async_save: bool = False
    # The exchange's format (``plan.wire``) and the workers it crosses: what the transport's
    # pinned buffers hold.
    wire: Wire = DENSE_FP4
    workers: int = 2

    @property
    def weight_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def mask_bytes(self) -> int:
        return 1 if self.device == "cuda" else self.activation_bytes

    def unfused(self, layout: Layout) -> bool:
        """Whether the attention keeps its scores (Ulysses wraps the same core attention)."""
        return self.attention == "unfused"

    @property
    def step_copies(self) -> float:
        return STEP_COPIES_FUSED if self.device == "cuda" else STEP_COPIES


def gradient_bytes(layout: Layout, training: Training) -> int:
    """Bytes of an accumulated gradient element: DeepSpeed's ``grad_accum_dtype`` as the
    generated config asks for it."""
    from ..config.ds_config import grad_accum_dtype

    dtype = grad_accum_dtype(training.precision, layout.zero_stage,
                             training.grad_reduce_in_bf16)
    return 4 if dtype == "fp32" else 2


def fp32_buffers_whole(layout: Layout, training: Training) -> bool:
    """bf16 at ZeRO-1 accumulating in fp32: DeepSpeed's ``BF16_Optimizer``, whose fp32
    gradient buffers are whole, made with it and kept."""
    return training.precision == "bf16" and layout.zero_stage == 1 and \
        gradient_bytes(layout, training) == 4


def steps_in_place(layout: Layout, training: Training) -> bool:
    """Whether torch's AdamW steps the module's own parameters (ZeRO-0 in fp32), rather
    than DeepSpeed a flat fp32 partition apart from them."""
    return training.precision == "fp32" and layout.zero_stage == 0


def zero_partition(params: float, layout: Layout) -> float:
    """A rank's share of ``params`` in the optimizer: the data and sequence ranks together
    under ZeRO 1-2, all of them at stage 0."""
    return params / (layout.dp * layout.sp) if layout.zero_stage >= 1 else params


def rank_parameters(shape: ModelShape, layout: Layout, stage: int):
    """(parameters on a rank of ``stage``, its optimizer partition). An EP rank holds 1/EP
    of the routed experts, partitioned over the expert-data-parallel ranks (data x
    sequence / EP): its partition is the stage's experts over data x sequence, as dense."""
    every = shape.stage_parameters(layout.tp, layout.pp, stage)
    params = every - shape.stage_routed(layout.tp, layout.pp) * (1 - 1 / layout.ep)
    return params, zero_partition(every, layout) if layout.zero_stage >= 1 else params


def estimate(shape: ModelShape, layout: Layout, training: Training,
             runtime_bytes: float = 0.0) -> Memory:
    """Peak bytes on the busiest rank (the first pipeline stage, or the last when its
    output layer and logits outweigh the first stage's extra activations)."""
    return max((estimate_stage(shape, layout, training, runtime_bytes, stage)
                for stage in {0, layout.pp - 1}), key=lambda m: m.total)


def estimate_stage(shape: ModelShape, layout: Layout, training: Training,
                   runtime_bytes: float, stage: int) -> Memory:
    t, p = layout.tp, layout.pp
    params, partition = rank_parameters(shape, layout, stage)
    zero = layout.dp * layout.sp  # the ZeRO partition: data and sequence ranks together
    w = training.weight_bytes
    parts = {"runtime": runtime_bytes, "weights": params * w}
    cuda = training.device == "cuda"
    g = gradient_bytes(layout, training)
    whole = fp32_buffers_whole(layout, training)
    if layout.zero_stage >= 2:  # on CUDA the bucket is counted apart, whole
        gradients = g * min(params, partition + (0 if cuda else training.reduce_bucket / zero))
    else:
        gradients = g * params
    if cuda and layout.zero_stage >= 1 and not whole:
        parts["reduce bucket"] = training.reduce_bucket * w * (1 + training.overlap_comm)
    # BF16_Optimizer's all-reduce at the step: its buffers flattened into one fp32 copy when
    # they fit one bucket, freed before the optimizer's own step.
    reduce_copy = 4 * params if whole and params <= ALLREDUCE_BUCKET else 0.0
    in_place = steps_in_place(layout, training)
    master = 0 if in_place else 4 * partition
    parts["optimizer"] = master + 8 * partition
    if training.streaming:
        parts["outer state"] = 0.0 if training.offload_outer_state else \
            8 * partition + outer_working_set(partition, training)
    # The optimizer step's transient: DeepSpeed's flat fp32 gradient partition for the step,
    # Adam's multi-tensor temporaries (the square root of the second moment, the
    # weight-decayed gradient) and the updated partition on its way back into the weights:
    # about four fp32 copies of the partition with torch's single-tensor AdamW on the CPU
    # (benchmarks/memory_phases.py: 4.4 at TP=2), 1.3 with CUDA's fused AdamW (the same on
    # an H200, ZeRO-1 bf16); torch's AdamW stepping the module's own fp32 parameters (ZeRO-0)
    # holds about one. It reuses what the activations freed, so the peak takes the larger.
    copies = STEP_COPIES_IN_PLACE if in_place else training.step_copies
    step_transient = copies * 4 * partition
    e = training.activation_bytes
    micro_batches = max(1, training.global_batch // (layout.micro_batch * layout.dp))
    in_flight = min(p - stage, micro_batches)  # 1F1B: the first stage holds pp of them
    layers = shape.layers / p
    unfused = training.unfused(layout)
    one = shape.layer_activation_bytes(layout.micro_batch, t, layout.sp, e,
                                       training.mask_bytes, unfused)
    kept = shape.layer_activation_bytes(layout.micro_batch, t, layout.sp, e,
                                        training.mask_bytes, unfused,
                                        selective=layout.recompute == "selective")
    # MoE layers (spread evenly over the stages): their experts' activations
    moe = shape.moe_activation_change(layout.micro_batch, t, layout.sp, e) \
        * shape.moe_layers / max(1, shape.layers)
    one, kept = one + moe, kept + moe
    logits = shape.logits_bytes(layout.micro_batch, t, layout.sp) if stage == p - 1 else 0.0
    gradients_of_scores = shape.attention_backward_bytes(layout.micro_batch, t, layout.sp, e) \
        if unfused else 0.0
    if layout.recompute == "full":
        inputs = layout.micro_batch * shape.seq / layout.sp * shape.hidden * e
        parts["activations"] = in_flight * layers * inputs
        layer = ("recomputed layer", one + gradients_of_scores)
    else:
        parts["activations"] = in_flight * layers * kept
        # a selective recompute holds one layer's scores again while their backward runs
        layer = ("attention backward", one - kept + gradients_of_scores)
    # The loss's backward frees the logits before the last layer's backward (or its
    # recomputation) starts: the larger of the two is the backward's transient.
    name, size = ("logits", logits) if logits >= layer[1] else layer
    if size:
        parts[name] = size
    # The gradients exist from a step's first backward to its optimizer step (DeepSpeed sets
    # them to None after it): the backward's peak, at its start, holds them only when an
    # earlier micro-batch of the step made them, or always (BF16_Optimizer's buffers).
    held = gradients if micro_batches > 1 or whole else 0.0
    parts["gradients"] = held
    backward = held + parts["activations"] + size
    step = gradients + max(step_transient, reduce_copy)
    if step > backward:  # the optimizer step is the peak
        parts["optimizer step"] = step - backward
    return Memory(parts)


def outer_working_set(partition: float, training: Training) -> float:
    """The outer state beyond theta_g and the momentum, where the codec runs: the
    error-feedback residual, the deltas in flight and one exchange's working set."""
    in_flight = min(training.overlap_steps, training.fragments) / training.fragments
    return (4 * partition if training.error_feedback else 0.0) \
        + EXCHANGE_BYTES * partition / training.fragments \
        + 4 * partition * max(in_flight, 1 / training.fragments)


def checkpoint_bytes(shape: ModelShape, layout: Layout, training: Training,
                     stage: int = 0) -> float:
    """What one rank of ``stage`` writes to a checkpoint: its share of the stage's slices
    (one rank of those holding a slice writes it, ``checkpoint.state.replica_writer``
    spreading them over the data and sequence ranks) of the weights at their precision, the
    fp32 masters (where there are any besides the weights), AdamW's two moments and, with
    streaming, theta_g, the outer momentum, the residual and the means in flight."""
    share = shape.stage_parameters(layout.tp, layout.pp, stage) / (layout.dp * layout.sp)
    per = training.weight_bytes + (0 if steps_in_place(layout, training) else 4) + 8
    if training.streaming:
        in_flight = min(training.overlap_steps, training.fragments) / training.fragments
        per += 8 + 4 * training.error_feedback + 4 * in_flight
    return share * per


def power_of_two(nbytes: float) -> float:
    """What torch's pinned allocation takes for ``nbytes`` (its caching host allocator)."""
    return 0.0 if nbytes <= 0 else float(2 ** math.ceil(math.log2(nbytes)))


@dataclass
class HostMemory(Memory):
    """Bytes one rank keeps in host memory, by component, and how many of them are pinned."""
    pinned: float = 0.0


def host_estimate(shape: ModelShape, layout: Layout, training: Training) -> HostMemory:
    """Host memory of the busiest rank (the first pipeline stage or the last)."""
    return max((host_stage(shape, layout, training, stage) for stage in {0, layout.pp - 1}),
               key=lambda m: m.total)


def host_stage(shape: ModelShape, layout: Layout, training: Training,
               stage: int) -> HostMemory:
    gpu = training.device == "cuda"  # nothing is pinned without one
    partition = rank_parameters(shape, layout, stage)[1]
    parts, pinned = {}, 0.0
    checkpoint = checkpoint_bytes(shape, layout, training, stage)
    if training.save and training.async_save:
        parts["checkpoint staging"] = checkpoint
        pinned += checkpoint if gpu else 0.0
    elif training.save and gpu:  # megatron-core's copy of the device tensors, while saving
        parts["checkpoint being saved"] = checkpoint
    if training.streaming and training.offload_outer_state:
        parts["outer state"] = 8 * partition + outer_working_set(partition, training)
        if gpu:  # theta_g and momentum exact; the local shard's copy out of the GPU
            shard_copy = power_of_two(4 * partition / training.fragments)
            parts["outer state"] += shard_copy
            pinned += 8 * partition + shard_copy
    elif training.streaming and gpu and training.wire.sparse:
        # the row sent (one peer's share of the all-gather) and the M rows gathered
        row = training.wire.bytes_sent(partition / training.fragments, 2)
        parts["exchange payloads"] = (1 + training.workers) * power_of_two(row)
        pinned += parts["exchange payloads"]
    elif training.streaming and gpu:
        codes = partition / training.fragments * FP4_BITS / 8
        parts["exchange codes"] = 2 * power_of_two(codes) + 3 * power_of_two(codes / 2)
        pinned += parts["exchange codes"]
    return HostMemory(parts, pinned)


__all__ = ["ALLREDUCE_BUCKET", "EXCHANGE_BYTES", "FP4_BITS", "GIB", "RECOMPUTE", "REDUCE_BUCKET",
           "STEP_COPIES", "STEP_COPIES_FUSED", "HostMemory", "Layout", "ModelShape", "Memory",
           "Training", "checkpoint_bytes", "estimate", "estimate_stage", "fp32_buffers_whole",
           "gradient_bytes", "host_estimate", "host_stage", "outer_working_set",
           "power_of_two", "rank_parameters", "steps_in_place", "zero_partition"]

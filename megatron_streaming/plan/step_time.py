"""Time of one training step of one worker, from the model, a layout and its cluster.

* Compute: the step's FLOPs (matrix multiplies and attention, forward plus twice that
  backward, plus one more forward under a full recompute, the core attention's products
  once more under a selective one) split over the rank's share of the
  model (TP, PP) and of the sequence (Ulysses), at the cluster's sustained FLOP/s per device
  (peak x MFU, or what a measured step implies).
* Unfused attention (megatron-core's, ``--attention-backend unfused``): the scores' passes
  through memory, the fp32 softmax's casts, mask, dropout and their gradients,
  ``SCORE_BYTES`` per score element forward and backward (``SCORE_BYTES_FORWARD`` more under
  a recompute, full or selective: the scores' forward runs again) at the device's memory
  bandwidth. It is most of a step at a long sequence (one H200, its profile: 423 of 620 ms
  of a 1.28B GPT's forward-backward at sequence 2048, 1029 of 1335 ms of a 0.85B Llama's at
  4096; the GEMMs ran at 0.7 of the peak). A fused attention (torch's or Transformer
  Engine's) has none.
* Pipeline bubble (1F1B): the compute stretched by ``(pp - 1) / m`` for ``m`` micro-batches
  per data-parallel replica (Narayanan et al. 2021).
* Tensor parallel: four all-reduces of ``b s h`` activations per layer per micro-batch (two
  forward, two backward; two more under a full recompute, whose forward runs again), ring
  cost ``2 (t - 1) / t`` of the bytes at the intra-node bandwidth; not overlapped
  (Megatron-core's local layers wait for them). Every group's bandwidth is the intra-node
  one when its ranks share a node (ranks are ordered TP, SP, DP, PP, fastest first), the
  inter-node one otherwise.
* Ulysses (DeepSpeed's ``DistributedAttention``): per layer per micro-batch, all-to-alls of
  the query, key and value going in and of the context coming out, and the same four of
  their gradients backward (four more forward under a recompute, full or selective: they
  are inside the core attention), each rank sending
  ``(sp - 1) / sp`` of its part; key and value are ``query_groups / heads`` of the query.
* Pipeline: one activation forward and one gradient backward per stage boundary per
  micro-batch.
* Every blocking collective also costs ``collective_seconds`` on top of its bytes (the
  fabric's latency: microseconds with NCCL; milliseconds between gloo processes on busy CPU
  cores; ``benchmarks/plan_validation.py`` measures it, and finds no further wait for the
  slower rank that grows with the compute between collectives).
* Data parallel, as DeepSpeed 0.19.8 runs it: every ZeRO stage all-reduces the gradient
  buckets whole (stage 1/2 too: ``use_multi_rank_bucket_allreduce``, each rank then keeps
  its partition; a ring all-reduce moves ``2 (d - 1) / d`` of the rank's fp32 gradients), and
  ZeRO-1/2 then all-gather the updated weights (``(d - 1) / d`` of them, at the weights'
  width), on the inter-node bandwidth when the data-parallel group spans nodes; counted as
  exposed (DeepSpeed's overlap hides part of it on GPUs; the model stays on the safe side).
  An all-gather's rate is the all-reduce's times ``Fabric.gather_speed`` (NCCL: the same;
  gloo on CPU: about a third, ``benchmarks/plan_validation.py`` measures both).
* Optimizer step: memory-bound, its bytes counted in the code it runs, at the device's
  memory bandwidth (given in the cluster description; without it the term is left out).
  AdamW over the rank's partition: ``FUSED_ADAMW_BYTES`` per element with torch's fused
  kernel (GPUs: the weight, gradient and two moments read, three written, once), or
  ``UNFUSED_ADAMW_BYTES`` with its single-tensor path (CPU: a pass per operation, the
  temporaries included). DeepSpeed's ZeRO-1/2 and 16-bit paths add ``ZERO_PARTITION_BYTES``
  per partition element (the partition's gradient copied out of the bucket and flattened,
  its norm, the updated partition copied back into the weights) and ``ZERO_BUCKET_BYTES``
  per element of the rank's whole gradient (made contiguous and copied into the reduce
  bucket, the gathered weights written). ZeRO-0 in fp32 steps the module's own parameters
  (no partition copies) after DeepSpeed's bucketed all-reduce, which flattens the gradients
  and copies them back (``ALLREDUCE_BUCKET_BYTES`` per element, with data-parallel ranks).
  None of it shrinks with the batch, which the compute does: a layout of more data-parallel
  ranks pays it on a smaller share of the work. On a GPU the step is bound by the host as
  often as by the bytes: DeepSpeed checks each parameter tensor for non-finite values and
  copies it apart (about fifteen kernel launches a tensor), ``HOST_SECONDS_PER_TENSOR``
  each, and the phase takes the longer of the two (one H200, 1.28B GPT of 292 tensors:
  114 ms, where the bytes take 20; ``benchmarks/plan_device.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .memory import Layout, ModelShape, Training, rank_parameters, steps_in_place


# The unfused attention's memory traffic per score element: about 30 ps each on one H200
# (both models above), which is 150 bytes at its specified 4.8 TB/s; the forward's share.
SCORE_BYTES = 150
SCORE_BYTES_FORWARD = 65


@dataclass(frozen=True)
class Fabric:
    """What the step-time model needs of a cluster."""
    flops_per_device: float  # sustained (peak x MFU), per second
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    devices_per_node: int
    memory_bytes_per_s: float = 0.0  # the device's own memory; 0: no optimizer-step term
    collective_seconds: float = 0.0  # each blocking collective's cost beyond its bytes
    fused_optimizer: bool = True  # torch's fused AdamW (GPUs); False: its single-tensor path
    gather_speed: float = 1.0  # an all-gather's bytes/s against an all-reduce's (ring counts)
    # The unfused attention's bytes per score element; 0 where a measured FLOP/s already
    # holds them (benchmarks/plan_validation.py calibrates on the same model).
    score_bytes: float = SCORE_BYTES
    # ... and those of a recompute's second forward of the scores, which no calibration
    # without a recompute holds (on the CPU: its mask, softmax and dropout, timed there).
    score_bytes_again: float = SCORE_BYTES_FORWARD


FUSED_ADAMW_BYTES = 28  # one kernel: weight, gradient, two moments read; three written
# torch's _single_tensor_adamw: weight decay (8), first moment lerp (12), second moment mul and
# addcmul (8 + 12), the denominator's sqrt, division and eps into temporaries (24), addcdiv (16)
UNFUSED_ADAMW_BYTES = 80
ZERO_PARTITION_BYTES = 28  # out of the bucket (8), flattened (8), norm (4), copied back (8)
ZERO_BUCKET_BYTES = 20  # contiguous (8) and into the reduce bucket (8), gathered weights (4)
ALLREDUCE_BUCKET_BYTES = 16  # ZeRO-0's all-reduce: flattened into buckets, copied back
# The host's share of the GPU path's step, per parameter tensor (DeepSpeed 0.19.8, ZeRO-1
# bf16 on one H200's host: 110 ms of launches and checks for 292 tensors).
HOST_SECONDS_PER_TENSOR = 3.75e-4


def optimizer_bytes(shape: ModelShape, layout: Layout, training: Training,
                    fused: bool = True) -> float:
    """Bytes the busiest rank's optimizer step moves (the first stage's parameters)."""
    params, partition = rank_parameters(shape, layout, 0)
    adamw = FUSED_ADAMW_BYTES if fused else UNFUSED_ADAMW_BYTES
    if steps_in_place(layout, training):
        reduced = layout.dp * layout.sp > 1
        return params * (adamw + (ALLREDUCE_BUCKET_BYTES if reduced else 0))
    return partition * (adamw + ZERO_PARTITION_BYTES) + params * ZERO_BUCKET_BYTES


def optimizer_seconds(shape: ModelShape, layout: Layout, training: Training,
                      memory_bytes_per_s: float, fused: bool = True) -> float:
    """The optimizer step of the busiest rank: its bytes at the memory's speed or, with the
    fused (GPU) path, its tensors' host time, whichever is longer."""
    if not memory_bytes_per_s:
        return 0.0
    device = optimizer_bytes(shape, layout, training, fused) / memory_bytes_per_s
    if not fused:  # the CPU runs every operation where it is launched: bytes alone
        return device
    return max(device, shape.stage_tensors(layout.pp, 0, layout.ep) * HOST_SECONDS_PER_TENSOR)


def forward_flops_per_token(shape: ModelShape) -> float:
    """Matrix-multiply FLOPs of one token's forward pass (2 per multiply-add), attention's
    two sequence-long products included, logits included."""
    q = shape.heads * shape.kv_channels
    kv = 2 * shape.query_groups * shape.kv_channels
    up = shape.ffn * (2 if shape.swiglu else 1)
    dense = shape.hidden * (q + kv) + q * shape.hidden + shape.hidden * up \
        + shape.ffn * shape.hidden
    # an MoE layer: its token through top-k experts, the router and the shared experts
    # instead of the dense MLP
    moe = 0.0
    if shape.experts:
        def mlp(width):
            return shape.hidden * width * (2 if shape.swiglu else 1) + width * shape.hidden
        moe = shape.topk * mlp(shape.expert_ffn) + shape.hidden * shape.experts \
            + (mlp(shape.shared_ffn) if shape.shared_ffn else 0) - mlp(shape.ffn)
    return shape.layers * 2 * dense + shape.moe_layers * 2 * moe \
        + attention_flops_per_token(shape) + 2 * shape.hidden * shape.vocab


def attention_flops_per_token(shape: ModelShape) -> float:
    """FLOPs of one token's two sequence-long attention products in the forward (scores and
    context over every key: megatron-core's unfused attention computes the masked half
    too), all layers: what a selective recompute runs again."""
    q = shape.heads * shape.kv_channels
    return shape.layers * 2 * 2 * shape.seq * q


def step_flops_per_token(shape: ModelShape, recompute: str = "none") -> float:
    """A training step's FLOPs per token: the forward, twice that backward, and what the
    recompute runs again (a full one the forward, a selective one the core attention)."""
    extra = {"none": 0.0, "selective": attention_flops_per_token(shape),
             "full": forward_flops_per_token(shape)}[recompute]
    return 3 * forward_flops_per_token(shape) + extra


def step_time(shape: ModelShape, layout: Layout, training: Training,
              fabric: Fabric) -> Dict[str, float]:
    """Seconds per step by component, and ``total``."""
    e = training.activation_bytes
    replica_batch = training.global_batch / layout.dp
    micro_batches = max(1, replica_batch / layout.micro_batch)
    tokens = replica_batch * shape.seq
    full, again = layout.recompute == "full", layout.recompute != "none"
    flops = step_flops_per_token(shape, layout.recompute) * tokens \
        / (layout.tp * layout.pp * layout.sp)
    activation = layout.micro_batch * shape.seq / layout.sp * shape.hidden * e
    layers = shape.layers / layout.pp
    out = {"compute": flops / fabric.flops_per_device}
    per_score = fabric.score_bytes + (fabric.score_bytes_again if again else 0.0)
    if training.unfused(layout) and fabric.memory_bytes_per_s and per_score:
        scores = shape.scores(layout.micro_batch, layout.tp, layout.sp) * micro_batches * layers
        out["attention scores"] = scores * per_score / fabric.memory_bytes_per_s
    # 1F1B stretches the stage's whole forward-backward work, the scores' passes too.
    out["bubble"] = (out["compute"] + out.get("attention scores", 0.0)) \
        * (layout.pp - 1) / micro_batches
    intra = fabric.intra_node_bytes_per_s

    def bandwidth(span: int) -> float:  # a group of ranks within ``span`` consecutive ones
        return intra if span <= fabric.devices_per_node else fabric.inter_node_bytes_per_s

    # Rank order within a worker: TP fastest, then SP, DP, PP (``topology.IN_WORKER_AXES``).
    latency = fabric.collective_seconds
    per_layer = layers * micro_batches  # a collective per layer per micro-batch
    if layout.tp > 1:
        ring = 2 * (layout.tp - 1) / layout.tp
        count = (6 if full else 4) * per_layer
        out["tensor parallel"] = count * (ring * activation / intra + latency)
    if layout.sp > 1:
        share = (layout.sp - 1) / layout.sp
        # query and context: the rank's heads; key and value: its query groups
        heads = (2 * shape.heads + 2 * shape.query_groups) * shape.kv_channels / layout.tp
        volume = layout.micro_batch * shape.seq / layout.sp * heads * e
        # forward, backward (, forward again: Ulysses' all-to-alls are inside the core
        # attention, so a selective recompute runs them again too)
        rounds = 3 if again else 2
        out["sequence parallel"] = rounds * per_layer * (
            share * volume / bandwidth(layout.tp * layout.sp) + 4 * latency)
    if layout.ep > 1 and shape.experts:
        # the dispatcher's all-to-alls: each token's top-k copies of the hidden state out to
        # the experts and back, in the forward and the backward (and the recompute's forward)
        moe_layers = shape.moe_layers / layout.pp * micro_batches
        volume = shape.topk * activation / (layout.tp if layout.tp > 1 else 1)
        share = (layout.ep - 1) / layout.ep
        out["expert parallel"] = (6 if full else 4) * moe_layers * (
            share * volume / bandwidth(layout.tp * layout.ep) + latency)
    if layout.pp > 1:
        boundaries = min(2, layout.pp - 1)  # a middle stage sends and receives both ways
        out["pipeline"] = 2 * boundaries * micro_batches * (
            activation / layout.tp / bandwidth(layout.ranks) / boundaries + latency)
    if layout.dp > 1 or layout.sp > 1:
        from .memory import estimate_stage

        params = estimate_stage(shape, layout, training, 0.0, 0).parts["weights"] \
            / training.weight_bytes
        d = layout.dp * layout.sp
        link = bandwidth(layout.tp * layout.sp * layout.dp)
        out["data parallel"] = 2 * (d - 1) / d * 4 * params / link + 2 * latency
        if layout.zero_stage >= 1:  # the updated weights gathered back
            out["data parallel"] += (d - 1) / d * training.weight_bytes * params \
                / (link * fabric.gather_speed) + latency
    optimizer = optimizer_seconds(shape, layout, training, fabric.memory_bytes_per_s,
                                  fabric.fused_optimizer)
    if optimizer:
        out["optimizer"] = optimizer
    out["total"] = sum(out.values())
    return out


__all__ = ["HOST_SECONDS_PER_TENSOR", "SCORE_BYTES", "SCORE_BYTES_FORWARD", "Fabric",
           "attention_flops_per_token", "forward_flops_per_token", "optimizer_bytes",
           "optimizer_seconds", "step_flops_per_token", "step_time"]

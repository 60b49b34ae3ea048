"""Flags of Megatron-LM and Megatron-DeepSpeed launch scripts that are not fields of our config.

Our own flags (``config.py``) carry Megatron's names and meanings wherever Megatron has the
flag: those simply *work*. Every other flag that a public GPT/Llama pretraining script of
either project passes is listed here, with what ``pretrain_gpt.py`` does with it:

* ``accepted``: what it asks for is the only behaviour there is here (``--use-mcore-models``,
  ``--data-impl mmap``), or it tunes something that does not exist here and changes no
  math (a CUDA fusion switch, a logging option of a feature we always have); nothing changes;
* ``mapped``: our equivalent is set (``--use-distributed-optimizer`` -> ZeRO-1);
* ``refused``: one line naming the flag and what to use instead, before any process starts.

Where it sits: ``arguments.build_parser`` registers these flags (hidden from ``--help``; the
docs/megatron.md's table lists them) and ``arguments.parse_args`` calls ``apply`` on what was given.
``python -m megatron_streaming.cli.megatron_flags`` prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

ACCEPTED, MAPPED, REFUSED = "accepted", "mapped", "refused"
SWITCH, ONE, MANY = 0, 1, "+"  # argparse nargs of the flag's value


class Refusal(ValueError):
    """A flag we do not honour; the message names it and says what to use instead."""


@dataclass(frozen=True)
class ForeignFlag:
    """One Megatron flag that is not a field of our config."""

    flag: str
    kind: str  # ACCEPTED, MAPPED or REFUSED: the outcome for the table
    note: str  # what we do with it (the table, and the refusal message)
    nargs: object = SWITCH
    # (cfg, value, given flags) -> None; sets our equivalent or raises Refusal. Default:
    # nothing for ACCEPTED, the note as a refusal for REFUSED.
    act: Optional[Callable] = None

    def apply(self, cfg, value, given: set) -> None:
        if self.act is not None:
            self.act(cfg, value, given)
        elif self.kind == REFUSED:
            raise Refusal(f"{self.flag}: {self.note}")


def _only(flag: str, allowed: Sequence[str], why: str) -> Callable:
    """Accept these values only; any other is refused."""
    def act(cfg, value, given):
        if str(value) not in allowed:
            raise Refusal(f"{flag} {value}: {why}")
    return act


def _at_most_one(flag: str, why: str) -> Callable:
    """Accept a size of 1 (the feature is off); refuse more."""
    def act(cfg, value, given):
        if int(value) > 1:
            raise Refusal(f"{flag} {value}: {why}")
    return act


def _distributed_optimizer(cfg, value, given):
    if "--zero-stage" in given and cfg.parallel.zero_stage == 0:
        raise Refusal("--use-distributed-optimizer: shards the optimizer state, which "
                      "--zero-stage 0 does not; drop one of the two")
    if "--zero-stage" not in given:
        cfg.parallel.zero_stage = 1


def _checkpoint_activations(cfg, value, given):
    """Megatron-DeepSpeed's legacy switch: recompute every layer in full."""
    m = cfg.model
    if m.recompute_granularity is None:
        m.recompute_granularity, m.recompute_method = "full", "uniform"
        m.recompute_num_layers = m.recompute_num_layers or 1


def _key_value_heads(cfg, value, given):
    cfg.model.group_query_attention = True
    cfg.model.num_query_groups = int(value)


def _context_parallel(cfg, value, given):
    size = int(value)
    if size > 1:
        if "--ds-sequence-parallel-size" in given and \
                cfg.parallel.ds_sequence_parallel_size != size:
            raise Refusal(f"--context-parallel-size {size}: conflicts with "
                          f"--ds-sequence-parallel-size {cfg.parallel.ds_sequence_parallel_size}")
        cfg.parallel.ds_sequence_parallel_size = size


def _no_position_embedding(cfg, value, given):
    if cfg.model.position_embedding_type == "learned_absolute":
        cfg.model.position_embedding_type = "none"


def _rotary(cfg, value, given):
    cfg.model.position_embedding_type = "rope"


def _flash_attention(flag: str) -> Callable:
    """Megatron-DeepSpeed's flash-attention switches: ``--attention-backend flash`` on every
    device (torch's fused attention on the local layers, Transformer Engine's on its own)."""
    def act(cfg, value, given):
        m = cfg.model
        if "--attention-backend" in given and m.attention_backend not in ("flash", "auto"):
            raise Refusal(f"{flag}: conflicts with --attention-backend {m.attention_backend}; "
                          "drop one of the two")
        m.attention_backend = "flash"
    return act


def _fp32_accumulation(cfg, value, given):
    p = cfg.precision
    if p.fp16:
        raise Refusal("--accumulate-allreduce-grads-in-fp32: fp16 gradients accumulate in "
                      "fp16 here (DeepSpeed's fp32 accumulation of fp16 is not wired); drop "
                      "the flag")
    if p.grad_reduce_in_bf16:
        raise Refusal("--accumulate-allreduce-grads-in-fp32: conflicts with "
                      "--grad-reduce-in-bf16; drop one of the two")


def _set_model(field: str, kind) -> Callable:
    def act(cfg, value, given):
        setattr(cfg.model, field, kind(value))
    return act


def _capacity_factor(cfg, value, given):
    if "--disable-moe-token-dropping" not in given:
        cfg.model.moe_expert_capacity_factor = float(value)


def _without_load(flag: str, what: str) -> Callable:
    def act(cfg, value, given):
        from ..checkpoint.megatron_lm import is_megatron_lm

        # A Megatron-LM checkpoint gives its weights only: what the flag asks for.
        if "--load" in given and not is_megatron_lm(cfg.checkpoint.load):
            raise Refusal(f"{flag}: a resume restores the {what} with the weights; drop the "
                          "flag (or --load)")
    return act


def _checkpoint_flag(name: str) -> Callable:
    """Megatron-LM's checkpoint flags that act at parse time (``checkpoint.checkpoint_args``)."""
    def act(cfg, value, given):
        from ..checkpoint import checkpoint_args

        getattr(checkpoint_args, name)(cfg, value, given)
    return act


def _no_dropping(cfg, value, given):
    cfg.model.moe_expert_capacity_factor = None


# Flags only a Megatron-DeepSpeed (DeepSpeed-MoE) script passes: its router's defaults then
# hold where the script leaves them (top-1 gating over a softmax of every expert).
DEEPSPEED_MOE = ("--moe-loss-coeff", "--moe-train-capacity-factor", "--create-moe-param-group",
                 "--mlp-type", "--topk", "--moe-expert-parallel-size", "--moe-min-capacity",
                 "--disable-moe-token-dropping", "--moe-eval-capacity-factor")


def deepspeed_moe_defaults(cfg, given: set) -> List[str]:
    """A DeepSpeed-MoE script without ``--topk``: DeepSpeed-MoE's top-1 gating, which is
    megatron-core's top-1 router with the softmax before the choice."""
    if not (given & set(DEEPSPEED_MOE)) or given & {"--topk", "--moe-router-topk"} or \
            not cfg.model.moe:
        return []
    cfg.model.moe_router_topk, cfg.model.moe_router_pre_softmax = 1, True
    return ["DeepSpeed-MoE flags without --topk: its default top-1 gating "
            "(--moe-router-topk 1 --moe-router-pre-softmax)"]


_FUSION = "a CUDA kernel-fusion switch: the math is the same fused or not"
_LOG_ALWAYS = ("written at every point, as by Megatron-LM core_v0.16 (which has dropped the "
               "flag)")
_FLASH = ("--attention-backend flash on every device: torch's fused scaled_dot_product_attention "
          "on the local layers, Transformer Engine's flash kernel on its own")

FLAGS: List[ForeignFlag] = [
    # --- the only behaviour there is ------------------------------------------------------
    ForeignFlag("--use-mcore-models", ACCEPTED, "megatron-core's GPTModel is the only model"),
    ForeignFlag("--deepspeed", ACCEPTED, "DeepSpeed (ZeRO) always wraps the optimizer"),
    ForeignFlag("--no-pipeline-parallel", ACCEPTED,
                "pipeline stages always run megatron-core's schedule, never DeepSpeed's "
                "pipeline engine"),
    ForeignFlag("--data-impl", ACCEPTED, "memory-mapped indexed datasets are the only kind",
                ONE, _only("--data-impl", ("mmap",), "only mmap indexed datasets exist here; "
                           "use --data-impl mmap (or drop the flag)")),
    ForeignFlag("--no-query-key-layer-scaling", ACCEPTED,
                "megatron-core does not scale attention scores by the layer number"),
    ForeignFlag("--attention-softmax-in-fp32", ACCEPTED,
                "megatron-core runs the attention softmax in fp32 already"),
    ForeignFlag("--override-opt_param-scheduler", ACCEPTED,
                "the learning-rate schedule always follows the flags, also on --load"),
    ForeignFlag("--override-opt-param-scheduler", ACCEPTED,
                "the learning-rate schedule always follows the flags, also on --load"),
    ForeignFlag("--exit-signal-handler", ACCEPTED,
                "SIGTERM always checkpoints (with --save) and stops every worker at the same "
                "step"),
    ForeignFlag("--deepspeed-activation-checkpointing", ACCEPTED,
                "recompute runs through megatron-core's checkpointing (--recompute-*)"),
    ForeignFlag("--num-workers", ACCEPTED,
                "samples are memory-mapped and read in the training process", ONE),
    # --- CUDA fusions and kernels: same math ----------------------------------------------
    *[ForeignFlag(flag, ACCEPTED, _FUSION) for flag in (
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
        "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm", "--no-async-tensor-model-parallel-allreduce",
        "--cross-entropy-loss-fusion")],
    # --- memory management of the CUDA allocator: no math ---------------------------------
    ForeignFlag("--empty-unused-memory-level", ACCEPTED,
                "empties the CUDA caching allocator; no effect on CPU, no math", ONE),
    # --- logging ---------------------------------------------------------------------------
    # (--tensorboard-log-interval, --tensorboard-queue-size, --log-timers-to-tensorboard,
    # --log-throughput, --log-params-norm, --log-num-zeros-in-grad, --log-progress,
    # --log-memory-to-tensorboard, --log-world-size-to-tensorboard,
    # --log-validation-ppl-to-tensorboard, --log-optimizer-states-to-tensorboard,
    # --[no-]log-loss-scale-to-tensorboard are ours: config.LoggingConfig.)
    *[ForeignFlag(flag, ACCEPTED, _LOG_ALWAYS) for flag in (
        "--log-learning-rate-to-tensorboard", "--log-batch-size-to-tensorboard")],
    # --- our equivalent --------------------------------------------------------------------
    ForeignFlag("--use-distributed-optimizer", MAPPED,
                "ZeRO stage 1 (--zero-stage 1) over the worker's data-parallel ranks",
                act=_distributed_optimizer),
    ForeignFlag("--checkpoint-activations", MAPPED,
                "--recompute-granularity full --recompute-method uniform "
                "--recompute-num-layers 1 (unless --recompute-* say otherwise)",
                act=_checkpoint_activations),
    ForeignFlag("--use-rotary-position-embeddings", MAPPED, "--position-embedding-type rope",
                act=_rotary),
    ForeignFlag("--no-position-embedding", MAPPED,
                "no learned position table: --position-embedding-type none (rope when "
                "rotary embeddings are asked for)", act=_no_position_embedding),
    ForeignFlag("--num-key-value-heads", MAPPED,
                "--group-query-attention --num-query-groups N", ONE, _key_value_heads),
    ForeignFlag("--context-parallel-size", MAPPED,
                "--ds-sequence-parallel-size N (DeepSpeed-Ulysses: the same model, the "
                "sequence split over N ranks with all-to-all attention)", ONE,
                _context_parallel),
    *[ForeignFlag(flag, MAPPED, _FLASH, act=_flash_attention(flag))
      for flag in ("--use-flash-attn", "--use-flash-attn-v2", "--use-flash-attn-triton")],
    ForeignFlag("--accumulate-allreduce-grads-in-fp32", ACCEPTED,
                "bf16 gradients accumulate and are reduced in fp32 here by default (ZeRO 1 "
                "and 2), unless --grad-reduce-in-bf16; refused with --fp16",
                act=_fp32_accumulation),
    ForeignFlag("--overlap-param-gather", ACCEPTED,
                "ZeRO-1/2 all-gather the updated weights inside DeepSpeed's step"),
    ForeignFlag("--calculate-per-token-loss", ACCEPTED,
                "every token of a sample counts in the loss (no loss mask), so the mean over "
                "tokens equals the mean over micro-batches it replaces"),
    ForeignFlag("--no-create-attention-mask-in-dataloader", ACCEPTED,
                "the causal mask is one shared tensor per micro-batch; the same attention"),
    ForeignFlag("--no-mmap-bin-files", ACCEPTED,
                "the .bin files are memory-mapped; the same tokens are read"),
    ForeignFlag("--ckpt-format", ACCEPTED,
                "checkpoints are always megatron-core's torch_dist format, keyed by global "
                "parameter names; `torch` and `torch_dist` are accepted", ONE,
                _only("--ckpt-format", ("torch", "torch_dist"),
                      "only torch and torch_dist are known; drop the flag")),
    ForeignFlag("--universal-checkpoint", ACCEPTED,
                "every checkpoint loads into any TP / PP / SP / DP / ZeRO layout and worker "
                "count; no conversion step"),
    ForeignFlag("--profile", ACCEPTED,
                "opens no profiler range (Megatron's marks steps for nsys on a GPU)"),
    *[ForeignFlag(flag, ACCEPTED, "goes with --profile", ONE)
      for flag in ("--profile-step-start", "--profile-step-end")],
    # --- refused ---------------------------------------------------------------------------
    ForeignFlag("--use-legacy-models", REFUSED,
                "only megatron-core models exist here; drop the flag"),
    ForeignFlag("--num-layers-per-virtual-pipeline-stage", REFUSED,
                "the interleaved pipeline schedule is not supported; use "
                "--pipeline-model-parallel-size alone", ONE),
    ForeignFlag("--virtual-pipeline-model-parallel-size", REFUSED,
                "the interleaved pipeline schedule is not supported; use "
                "--pipeline-model-parallel-size alone", ONE),
    ForeignFlag("--tp-comm-overlap", REFUSED,
                "needs Transformer Engine's userbuffers; --ladder-residual overlaps the "
                "tensor-parallel all-reduce instead"),
    ForeignFlag("--fp8-param-gather", REFUSED,
                "FP8 parameters cannot go into DeepSpeed ZeRO's flat 16/32-bit parameter and "
                "master buffers; drop it (--fp8-format keeps FP8 compute with bf16 "
                "parameters)"),
    ForeignFlag("--use-torch-fsdp2", REFUSED,
                "data parallelism inside a worker is DeepSpeed ZeRO; use --zero-stage"),
    ForeignFlag("--cpu-optimizer", REFUSED,
                "optimizer offload (ZeRO-Offload) is not supported; drop the flag"),
    *[ForeignFlag(flag, ACCEPTED, f"without --load there is nothing to load; with --load of "
                  "a Megatron-LM checkpoint, what happens anyway (its weights only are read); "
                  f"with one of ours, refused: a resume restores the {what} "
                  "(docs/checkpoints.md)", SWITCH,
                  _without_load(flag, what))
      for flag, what in (("--no-load-optim", "optimizer and outer state"),
                         ("--no-load-rng", "random-number generators' state"))],
    ForeignFlag("--use-checkpoint-args", MAPPED,
                "the model flags (and the tokenizer) of --load's checkpoint, Megatron-LM's or "
                "ours, as Megatron-LM takes them: a shape flag the launch leaves out, every "
                "other model flag always", SWITCH, _checkpoint_flag("use_checkpoint_args")),
    ForeignFlag("--exit-on-missing-checkpoint", ACCEPTED,
                "a --load with no checkpoint stops the launch with Megatron-LM's message "
                "(exit status 0) instead of starting from random", SWITCH,
                _checkpoint_flag("exit_on_missing")),
    # --- Megatron-DeepSpeed's DeepSpeed-MoE flags ---------------------------------------------
    ForeignFlag("--mlp-type", ACCEPTED,
                "standard: the MoE layer replaces the MLP; residual (PR-MoE) is refused", ONE,
                _only("--mlp-type", ("standard",), "Residual-MoE (a dense MLP beside each MoE "
                      "layer) has no megatron-core layer; --moe-shared-expert-intermediate-size "
                      "adds an always-on expert instead")),
    ForeignFlag("--topk", MAPPED, "-> --moe-router-topk", ONE, _set_model("moe_router_topk", int)),
    ForeignFlag("--moe-loss-coeff", MAPPED, "-> --moe-aux-loss-coeff (the same Switch-style "
                "load-balancing loss)", ONE, _set_model("moe_aux_loss_coeff", float)),
    ForeignFlag("--moe-train-capacity-factor", MAPPED,
                "-> --moe-expert-capacity-factor (DeepSpeed-MoE drops tokens beyond it unless "
                "--disable-moe-token-dropping)", ONE, _capacity_factor),
    ForeignFlag("--disable-moe-token-dropping", MAPPED,
                "no capacity limit: no --moe-expert-capacity-factor", SWITCH, _no_dropping),
    ForeignFlag("--moe-eval-capacity-factor", ACCEPTED,
                "evaluation routes with the training capacity, as megatron-core does", ONE),
    ForeignFlag("--create-moe-param-group", ACCEPTED,
                "expert parameters always have optimizer groups of their own here"),
    ForeignFlag("--use-tutel", REFUSED,
                "Tutel's kernels are DeepSpeed-MoE's; megatron-core's MoE layer runs here: "
                "drop the flag"),
]

BY_FLAG: Dict[str, ForeignFlag] = {f.flag: f for f in FLAGS}


def dest(flag: str) -> str:
    """The argparse destination of a foreign flag (never clashes with a config field)."""
    return "megatron__" + flag.lstrip("-").replace("-", "_")


def add_to_parser(parser) -> None:
    """Register every foreign flag, hidden from ``--help`` (docs/megatron.md lists them)."""
    import argparse

    group = parser.add_argument_group("Megatron-LM / Megatron-DeepSpeed flags (see docs/megatron.md)")
    for f in FLAGS:
        if f.nargs == SWITCH:
            group.add_argument(f.flag, dest=dest(f.flag), action="store_const", const=True,
                               default=None, help=argparse.SUPPRESS)
        else:
            group.add_argument(f.flag, dest=dest(f.flag), nargs=None if f.nargs == ONE
                               else f.nargs, default=None, help=argparse.SUPPRESS)


def given_flags(argv: Sequence[str]) -> set:
    """The ``--flags`` that appear in ``argv`` (``--x=1`` counts as ``--x``)."""
    return {token.split("=", 1)[0] for token in argv if token.startswith("--")}


def apply(cfg, namespace, given: set) -> List[str]:
    """Apply every foreign flag that was given; raise Refusal with one line per refused
    flag. Returns notes on what was accepted or mapped, one line each."""
    refusals, notes = [], []
    for f in FLAGS:
        value = getattr(namespace, dest(f.flag), None)
        if value is None:
            continue
        try:
            f.apply(cfg, value, given)
        except Refusal as e:
            refusals.append(str(e))
            continue
        notes.append(f"{f.flag}: {f.kind} ({f.note})")
    if refusals:
        raise Refusal("\n".join(refusals))
    return notes + deepspeed_moe_defaults(cfg, given)

"""One worker's training step: Megatron-core's pipeline schedule inside DeepSpeed ZeRO.

Data flow of a step: micro-batches -> Megatron's forward/backward schedule (TP/PP/SP inside
the worker, plain autograd backward) -> model-parallel gradient fix-ups (``grads``; under
ZeRO-2 the sequence-parallel one runs inside the step) -> DeepSpeed ``engine.step()``: ZeRO
reduces gradients over the worker's data-parallel group, clips, runs AdamW on each rank's
fp32 partition and gathers the weights back.

DeepSpeed runs with ``managed_gradient_accumulation: false``: the schedule owns the
micro-batch loop and ``engine.step()`` is the accumulation boundary. The inner optimizer is
exposed so that hooks (the streaming sync) can attach to its step without a forked loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property, partial
from types import SimpleNamespace
from typing import Iterator, List, Optional, Union

import torch

from patches import deepspeed_zero

from . import grads, moe
from .optimizer_state import InnerOptimizerState
from ..config import Config
from ..config.ds_config import precision_sections
from ..parallel.topology import Topology

log = logging.getLogger("megatron_streaming")


def deepspeed_config(cfg: Config) -> dict:
    """The DeepSpeed JSON, generated from the dataclasses (never from a template)."""
    o = cfg.optimizer
    ds = {
        "train_micro_batch_size_per_gpu": cfg.training.micro_batch_size,
        # The schedule accumulates micro-batches itself and already divides the loss by
        # their number; DeepSpeed must not divide again.
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": cfg.parallel.zero_stage,
                              "overlap_comm": cfg.parallel.overlap_grad_reduce},
        # DeepSpeed's default is 1.0: always say what we mean.
        "gradient_clipping": o.clip_grad,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the device before every
        # micro-batch's forward and at every step, for a rate printed only every
        # steps_per_print steps (never, unless a --deepspeed_config asks): the host would
        # wait for nothing.
        "timers": {"throughput": {"enabled": False}},
        "zero_allow_untested_optimizer": True,
    }
    ds.update(precision_sections(cfg.precision, cfg.parallel.zero_stage))
    if cfg.training.deepspeed_config:
        from ..config.ds_config import load_user_config, merge_user_config

        ds = merge_user_config(ds, load_user_config(cfg.training.deepspeed_config), cfg)
    return ds


def inner_optimizer(cfg: Config, groups: List[dict]) -> torch.optim.Optimizer:
    """The torch optimizer ZeRO wraps (it then steps only this rank's fp32 partitions)."""
    o = cfg.optimizer
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                             eps=o.adam_eps, fused=torch.cuda.is_available() or None)


def param_groups(model: torch.nn.Module, optimizer_cfg) -> List[dict]:
    """AdamW groups: no decay on biases and norm weights (Megatron's rule); with
    --decoupled-lr, a third group of the weights megatron-core marks
    ``is_embedding_or_output_parameter`` (the word embedding and the output layer, a tied
    copy on the last stage included; not the position embedding), decayed like any weight.
    Each group carries the ``max_lr`` / ``min_lr`` its schedule runs between, as Megatron's.

    Every rank has the same groups whatever its pipeline stage holds: DeepSpeed reduces
    each group's gradient norm over the model-parallel group, so the group count must agree
    across stages, and ZeRO cannot flatten an empty group. A stage holding neither the
    embedding nor the output layer (a middle one, PP >= 3) fills the third group with its last
    decay weight at the regular schedule: AdamW and SGD step each element on its own and the
    clipping norm covers all groups, so a group is only where a parameter takes its lr from.
    ``sync_index`` lets a step hook tell which group is being stepped.
    """
    from ..config.schedules import decoupled_bounds

    o = optimizer_cfg
    bounds = decoupled_bounds(o)
    decay, no_decay, decoupled = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if bounds is not None and getattr(param, "is_embedding_or_output_parameter", False):
            decoupled.append(param)
        elif param.ndim == 1 or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    regular = {"max_lr": o.lr, "min_lr": o.min_lr}
    groups = [{"params": decay, "weight_decay": o.weight_decay, **regular},
              {"params": no_decay, "weight_decay": 0.0, **regular}]
    if bounds is not None:
        if decoupled:
            third = {"max_lr": bounds[0], "min_lr": bounds[1]}
        else:
            decoupled, third = [decay.pop()], regular
        groups.append({"params": decoupled, "weight_decay": o.weight_decay, **third})
    groups = [g for g in groups if g["params"]]
    for index, group in enumerate(groups):
        group["sync_index"] = index
    return groups


@dataclass(eq=False)  # holds device tensors: no element-wise comparison
class StepResult:
    """What one training step reports. ``loss`` and ``grad_norm`` stay where the step made
    them (on a GPU: tensors the device may still be computing) until first read; reading one
    waits for the device to finish the step, so the loop reads them at log steps only, as
    Megatron-LM reads its loss: the steps in between do not wait for their own end on their
    account (DeepSpeed's step still reads its gradient norm and overflow flag to decide on
    the host whether to skip)."""

    lr: float
    skipped: bool = False  # the optimizer skipped the update (a gradient overflow)
    loss_scale: Optional[float] = None  # --fp16: the loss scale after this step
    decoupled_lr: Optional[float] = None  # --decoupled-lr: the embedding and output layer's
    # Each data-parallel rank's mean over micro-batches, summed over them (fp64, reduced on
    # the device); None off the last pipeline stage. ``loss`` divides it by ``data_parallel``.
    loss_sum: Optional[torch.Tensor] = None
    data_parallel: int = 1
    norm: Union[torch.Tensor, float, None] = None  # as DeepSpeed reports it

    @cached_property
    def loss(self) -> Optional[float]:
        """The worker's loss: mean over micro-batches and data-parallel ranks (a host read)."""
        return None if self.loss_sum is None else _per_rank(self.loss_sum, self.data_parallel)

    @cached_property
    def grad_norm(self) -> Optional[float]:
        """The gradient norm DeepSpeed clipped with (a host read); None where it has none."""
        return None if self.norm is None else float(self.norm)


def _per_rank(loss_sum: torch.Tensor, data_parallel: int) -> float:
    return float(loss_sum) / data_parallel


def _loss_func(loss_mask: torch.Tensor, sp_group, output_tensor: torch.Tensor):
    if sp_group is not None:  # Ulysses: this rank holds a slice of every sequence
        from .ulysses import sequence_parallel_loss

        loss, reported = sequence_parallel_loss(output_tensor, loss_mask, sp_group)
        return loss, {"lm loss": reported.detach().clone()}
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # The schedule divides the returned loss in place: report a copy.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(forward, sequence, data_iterator, model):
    # The schedule hands over the bare Megatron model (it reads ``model.config`` and calls
    # ``set_input_tensor`` on it); under ZeRO the forward goes through the DeepSpeed engine
    # so that the ZeRO optimizer sees the backward begin and end.
    del model
    batch = next(data_iterator)
    if torch.cuda.is_available():  # the loader builds batches on the CPU
        batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v
                 for k, v in batch.items()}
    sp_group = None
    if sequence is not None:
        from .ulysses import slice_for_sequence_parallel

        sp_rank, sp_size, sp_group = sequence
        batch = slice_for_sequence_parallel(batch, sp_rank, sp_size)
    output = forward(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                     labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"], sp_group)


def _undo_warm_up_step(optimizer) -> None:
    """FP16_UnfusedOptimizer's constructor runs one inner step on zero gradients to create
    the optimizer state; AdamW's decoupled weight decay moves the fp32 masters in it and
    Adam's step count starts at 1. Undo both, so that --zero-stage 0 trains the same math
    as ZeRO (whose constructor steps nothing): the masters are reset from the 16-bit weights,
    which hold the initial values exactly, and the state is created at the first real step."""
    from patches import deepspeed_zero

    deepspeed_zero.reset_unfused_masters(optimizer)


class WorkerEngine:
    """The model wrapped by DeepSpeed, and the train / eval steps of one worker."""

    def __init__(self, cfg: Config, topology: Topology, model: torch.nn.Module):
        import deepspeed
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        self.cfg, self.topology, self.model = cfg, topology, model
        from ..config.schedules import BatchSchedule, LrSchedule, decoupled_bounds
        from .timers import StepTimers

        log_cfg = cfg.logging
        self.timers = StepTimers(log_cfg.timing_log_level, log_cfg.timing_log_option,
                                 torch.cuda.synchronize if torch.cuda.is_available()
                                 else lambda: None)

        # The batch (and so the micro-batch count) and the learning rate of every step.
        self.batches = BatchSchedule(cfg.training, cfg.model.seq_length, topology.layout.dp)
        self.lr_at = LrSchedule(cfg, self.batches)
        self.decoupled_bounds = decoupled_bounds(cfg.optimizer)
        self.num_microbatches = self.batches.final_micro_batches  # evaluation's
        grads.mark_pipeline_replicas(model, topology)
        groups, moe_context = moe.for_deepspeed(model, param_groups(model, cfg.optimizer),
                                                topology)
        with moe_context:
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model,
                optimizer=inner_optimizer(cfg, groups),
                config=deepspeed_config(cfg),
                mpu=topology.mpu(),
                dist_init_required=False,
                # The device init_distributed chose (LOCAL_RANK modulo the GPUs).
                args=SimpleNamespace(device_rank=torch.cuda.current_device())
                if torch.cuda.is_available() else None,
            )
        # Without ZeRO, DeepSpeed refuses a backward it did not start; its step() then does
        # the plain data-parallel all-reduce of the accumulated gradients itself.
        self._forward = self.engine if cfg.parallel.zero_stage > 0 else model
        if self.sixteen_bit_without_zero:
            _undo_warm_up_step(self.optimizer)
        if cfg.precision.fp16:
            # The schedule runs the backward itself, so it applies the loss scale (megatron's
            # hook for exactly this); DeepSpeed's step unscales and checks for overflow.
            model.config.grad_scale_func = self._scale_loss
            if self.zero and not topology.is_last_stage:
                self._forward = self._forward_declaring_scaled_backward
                self._loss_stand_in = torch.ones((), requires_grad=True) * 1.0
        sp = topology.layout.sp
        self._sequence = (topology.coords["sp"], sp, topology.groups["sp"]) if sp > 1 else None
        self.pg_collection = topology.pg_collection()
        self.p2p = P2PCommunicator(pp_group=topology.groups["pp"], config=model.config)
        self.forward_backward = get_forward_backward_func(pp_size=topology.layout.pp,
                                                          vp_size=None)
        self.sequence_parallel_grads = grads.SequenceParallelGrads(model, self.optimizer,
                                                                   topology.groups["tp"])
        self.step_hooks: list = []  # objects with before_step(step) and after_step()
        # What a checkpoint keeps of this worker's optimizer (``state_dict`` and back).
        self.optimizer_state = InnerOptimizerState(self)

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps each rank's fp32 partition (hook point)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    @property
    def zero(self) -> bool:
        return deepspeed_zero.is_zero(self.optimizer)

    @property
    def sixteen_bit_without_zero(self) -> bool:
        """--bf16 / --fp16 at --zero-stage 0: DeepSpeed's FP16_UnfusedOptimizer (for bf16
        too, outside its pipeline engine) keeps an fp32 master copy of every parameter."""
        return deepspeed_zero.is_unfused_16bit(self.optimizer)

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.zero:  # DeepSpeed's own scaling, which also tells it the loss was scaled
            return self.engine.scale(loss)
        return loss * self.optimizer.loss_scale

    def _forward_declaring_scaled_backward(self, *args, **kwargs):
        """Under ZeRO with --fp16 DeepSpeed checks every backward for a loss that went through
        ``engine.scale``; before the last pipeline stage the backward starts from the next
        stage's gradient, which carries the loss scale already. When that gradient arrives,
        say so through ``engine.scale`` (on a stand-in; its product is not used)."""
        output = self.engine(*args, **kwargs)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._declare_scaled)
        return output

    def _declare_scaled(self, grad: torch.Tensor) -> torch.Tensor:
        self.engine.scale(self._loss_stand_in)
        return grad

    def master_views(self) -> List[List[tuple]]:
        """Per param group, ``(parameter, fp32 view)`` for every parameter with elements on
        this rank: the view is the parameter's slice of this rank's flat ZeRO partition (or,
        without ZeRO, its fp32 master copy under --bf16 / --fp16, else the parameter)."""
        return [[(p, view) for p, view, _ in group] for group in self.master_slices()]

    def master_slices(self) -> List[List[tuple]]:
        """``master_views`` with where each view starts in its parameter (flat, row-major
        elements): ``(parameter, fp32 view, first element)``."""
        if self.sixteen_bit_without_zero:
            return [[(p, m, 0) for p, m in group]
                    for group in deepspeed_zero.master_pairs(self.optimizer)]
        if not self.zero:
            return [[(p, p, 0) for p in g["params"]] for g in self.inner_optimizer.param_groups]
        return [[(s.param, zero.partition.narrow(0, s.at, s.size), s.first) for s in slices]
                for zero, slices in zip(deepspeed_zero.zero_groups(self.optimizer),
                                        deepspeed_zero.partition_layout(self.optimizer))]

    def push_to_model(self) -> None:
        """After editing fp32 partitions outside a step: copy them into the model weights."""
        if self.zero:
            deepspeed_zero.push_partitions(self.optimizer)
        elif self.sixteen_bit_without_zero:
            with torch.no_grad():
                for group in self.master_views():
                    for low, master in group:
                        low.copy_(master)

    def _run_schedule(self, data_iterator: Iterator, forward_only: bool,
                      num_microbatches: int):
        t = self.cfg.training
        return self.forward_backward(
            forward_step_func=partial(_forward_step, self._forward, self._sequence),
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=num_microbatches,
            # Pipeline messages carry this rank's slice of the sequence under Ulysses.
            seq_length=self.cfg.model.seq_length // self.topology.layout.sp,
            micro_batch_size=t.micro_batch_size,
            forward_only=forward_only,
            p2p_communicator=self.p2p,
            pg_collection=self.pg_collection,
        )

    def _loss_sum(self, outputs) -> Optional[torch.Tensor]:
        """Each data-parallel rank's mean loss over micro-batches, summed over the ranks, left
        on the device (last stage; else None): ``_per_rank`` reads the worker's loss."""
        if not self.topology.is_last_stage or not outputs:
            return None
        loss = torch.stack([o["lm loss"] for o in outputs]).mean().double()
        torch.distributed.all_reduce(loss, group=self.topology.groups["dp"])
        return loss

    def train_step(self, data_iterator: Iterator, iteration: int) -> StepResult:
        lr = self.lr_at(iteration)
        decoupled_lr = self.lr_at(iteration, *self.decoupled_bounds) \
            if self.decoupled_bounds else None
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(iteration, group["max_lr"], group["min_lr"])
        self.engine.train()
        with self.timers.phase("forward-backward"):
            outputs = self._run_schedule(data_iterator, False,
                                         self.batches.micro_batches(iteration))
            self.sequence_parallel_grads.after_schedule()
            grads.allreduce_tied_embedding_grads(self.model, self.topology, self.optimizer)
        with self.timers.phase("optimizer"):
            for hook in self.step_hooks:
                hook.before_step(iteration + 1)
            skipped_before, scale = self.skipped_iterations, self.loss_scale()
            self.engine.step()
            for hook in self.step_hooks:
                hook.after_step()
        self.timers.end_iteration()
        norm = self.engine.get_global_grad_norm()  # under ZeRO a tensor on the device
        if norm is not None and self.sixteen_bit_without_zero and scale:
            norm = norm / scale  # FP16_UnfusedOptimizer reports the norm of scaled gradients
        # Whether DeepSpeed skipped the step (and the loss scale) it decided on the host.
        result = StepResult(lr, skipped=self.skipped_iterations > skipped_before,
                            loss_scale=self.loss_scale(), decoupled_lr=decoupled_lr,
                            loss_sum=self._loss_sum(outputs),
                            data_parallel=self.topology.layout.dp, norm=norm)
        if result.skipped and self.topology.is_worker_reporter():
            log.warning("iteration %d (worker %d): gradient overflow, the optimizer step was "
                        "skipped%s", iteration + 1, self.topology.worker,
                        f"; loss scale now {result.loss_scale:g}"
                        if result.loss_scale is not None else "")
        return result

    @property
    def skipped_iterations(self) -> int:
        """Optimizer steps skipped for a non-finite gradient so far (fp16 overflows)."""
        return self.engine.skipped_steps

    def loss_scale(self) -> Optional[float]:
        """The current loss scale under --fp16, else None."""
        return float(self.optimizer.loss_scale) if self.cfg.precision.fp16 else None

    @torch.no_grad()
    def eval_step(self, data_iterator: Iterator) -> Optional[float]:
        self.engine.eval()
        outputs = self._run_schedule(data_iterator, True, self.num_microbatches)
        loss = self._loss_sum(outputs)
        return None if loss is None else _per_rank(loss, self.topology.layout.dp)

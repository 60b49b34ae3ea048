"""The inner optimizer's state on this rank, as a checkpoint keeps it (torchtitan's
``Stateful``): ``WorkerEngine.optimizer_state`` exports and restores it, ``checkpoint.job``
maps it to whole parameters by global name.

Per inner param group, every tensor is one flat fp32 vector of the group's space on this rank:
ZeRO's partition (DeepSpeed's ZeRO optimizer's, or under --bf16 at ZeRO-1 its
``BF16_Optimizer``'s, laid out alike: ``patches.deepspeed_zero``), or without ZeRO the group's
master tensors one after another (under fp32 the parameters themselves). The state: the fp32 master weights (where there are any besides the
parameters), the per-element state (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's
``momentum_buffer``), each group's step count and, under --fp16, the loss scaler.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from patches import deepspeed_zero


class InnerOptimizerState:
    def __init__(self, engine):
        self.engine = engine
        self.groups = len(engine.master_views())  # inner param groups

    @property
    def has_master(self) -> bool:
        """An fp32 master copy besides the parameters: ZeRO's partitions, or DeepSpeed's
        masters under --bf16 / --fp16 without ZeRO."""
        return self.engine.zero or self.engine.sixteen_bit_without_zero

    def zero_partitions(self) -> Optional[List[torch.Tensor]]:
        """Under ZeRO, per param group this rank's fp32 partition (the masters, flat), which a
        restore may write in place; else None."""
        if not self.engine.zero:
            return None
        return [deepspeed_zero.fp32_partition(self.engine.optimizer, i)
                for i in range(self.groups)]

    def zero_state_vectors(self, key: str) -> Optional[List[torch.Tensor]]:
        """Under ZeRO, per param group a flat fp32 vector for ``key`` state that a restore may
        write in place and give to ``load_state_dict``: the optimizer's own or, before its
        first step has made them, new ones of the partitions' sizes; else None."""
        partitions = self.zero_partitions()
        if partitions is None:
            return None
        state = self.engine.inner_optimizer.state
        live = [state.get(t, {}).get(key) for t in partitions]
        if all(v is not None and v.dtype == torch.float32 and v.numel() == t.numel() and
               v.is_contiguous() for v, t in zip(live, partitions)):
            return [v.view(-1) for v in live]
        return [torch.empty(t.numel(), dtype=torch.float32, device=t.device) for t in partitions]

    def tensors(self, i: int) -> List[torch.Tensor]:
        """The tensors the inner optimizer keeps state for, in param group ``i``."""
        if self.engine.zero:
            return [deepspeed_zero.fp32_partition(self.engine.optimizer, i)]
        return [v for _, v in self.engine.master_views()[i]]

    def keys(self) -> List[str]:
        """Per-element state of the inner optimizer (empty before its first step)."""
        state = self.engine.inner_optimizer.state
        for i in range(self.groups):
            for t in self.tensors(i):
                if t in state:
                    return sorted(k for k, v in state[t].items()
                                  if torch.is_tensor(v) and v.numel() == t.numel())
        return []

    def steps(self) -> List[Optional[float]]:
        """Each param group's step count (None: not stepped yet)."""
        state = self.engine.inner_optimizer.state
        steps = []
        for i in range(self.groups):
            found = [state[t]["step"] for t in self.tensors(i)
                     if t in state and "step" in state[t]]
            steps.append(float(found[0]) if found else None)
        return steps

    def loss_scaler(self) -> dict:
        """--fp16: the dynamic loss scaler's state (empty otherwise)."""
        if not self.engine.cfg.precision.fp16:
            return {}
        return deepspeed_zero.loss_scaler_state(self.engine.optimizer) or {}

    def _master(self, i: int) -> torch.Tensor:
        if self.engine.zero:
            return deepspeed_zero.fp32_partition(self.engine.optimizer, i)
        tensors = self.tensors(i)
        return torch.cat([v.detach().reshape(-1).float() for v in tensors]) if tensors \
            else torch.zeros(0)

    def _vector(self, i: int, key: str) -> torch.Tensor:
        state = self.engine.inner_optimizer.state
        parts = [state[t][key].reshape(-1) if t in state and key in state[t]
                 else torch.zeros(t.numel(), device=t.device) for t in self.tensors(i)]
        if len(parts) == 1:  # ZeRO's partition: its state itself (a save writes, not keeps)
            return parts[0].float()
        return torch.cat([p.float() for p in parts]) if parts else torch.zeros(0)

    def state_dict(self) -> dict:
        """``master``: per group, the fp32 masters (None: the parameters are the weights);
        ``state``: per-element state name -> per group; ``steps``; ``loss_scaler``."""
        groups = range(self.groups)
        return {"master": [self._master(i) for i in groups] if self.has_master else None,
                "state": {key: [self._vector(i, key) for i in groups] for key in self.keys()},
                "steps": self.steps(), "loss_scaler": self.loss_scaler()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """What ``state_dict`` gave, from any checkpoint: ``master`` None leaves the weights
        alone (the caller restores the parameters), an empty ``state`` leaves a fresh
        optimizer (its state is created at the next step), ``steps`` may lack a group (one
        --decoupled-lr added), an empty ``loss_scaler`` keeps the configured one. The masters
        reach the model with ``WorkerEngine.push_to_model``. The ``state`` vectors are given
        away: on the parameters' device the optimizer's state is views of them."""
        masters = state.get("master")
        if masters is not None and self.has_master:
            self._restore_masters(masters)
        opt = self.engine.inner_optimizer
        opt.state.clear()
        vectors = state.get("state") or {}
        for i in range(self.groups) if vectors else ():
            step = _group_step(state.get("steps") or [], i)
            offset = 0
            for t in self.tensors(i):  # views of the vectors given (the state's own now)
                values = {k: v[i][offset:offset + t.numel()].view_as(t).to(t.device)
                          for k, v in vectors.items()}
                if step is not None:
                    values["step"] = step_tensor(step, t, opt.param_groups[i])
                opt.state[t] = values
                offset += t.numel()
        scaler = state.get("loss_scaler")
        if scaler and self.engine.cfg.precision.fp16:
            deepspeed_zero.restore_loss_scaler(self.engine.optimizer, scaler)

    def _restore_masters(self, vectors: List[torch.Tensor]) -> None:
        for i, vector in enumerate(vectors):
            if self.engine.zero:
                deepspeed_zero.fp32_partition(self.engine.optimizer, i).copy_(vector)
                continue
            offset = 0
            for t in self.tensors(i):
                t.copy_(vector[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def _group_step(steps: List[Optional[float]], i: int) -> Optional[float]:
    """Adam's step count of param group ``i`` as saved. Every group steps at every step, so
    a group the checkpoint lacks (--decoupled-lr added on resume: a third group) takes the
    count of the others."""
    if i < len(steps):
        return steps[i]
    return next((s for s in steps if s is not None), None)


def step_tensor(step: float, param: torch.Tensor, group: dict) -> torch.Tensor:
    """Adam's step count where torch keeps it: with the parameter for fused (on a GPU, the
    only fused Adam the run picks) or capturable Adam, on the CPU otherwise, as
    ``Optimizer.load_state_dict`` places it."""
    with_param = bool(group.get("fused") or group.get("capturable"))
    return torch.tensor(step, dtype=torch.float32, device=param.device if with_param else "cpu")


__all__ = ["InnerOptimizerState", "step_tensor"]

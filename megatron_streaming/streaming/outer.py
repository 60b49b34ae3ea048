"""The outer optimizer and the merge, on one shard of one fragment, in fp32.

DiLoCo's outer step treats the averaged ``theta_g - theta_local`` as a gradient for the global
parameters and applies SGD with (Nesterov) momentum (DiLoCo, arXiv 2311.08105; Streaming
DiLoCo, arXiv 2501.18512: lr 0.7, momentum 0.9, tuned with hundreds of outer steps). The
default is lr 1 without momentum, plain averaging: ``rule.py`` says why. CO2 (arXiv 2401.16265) adds a
staleness-gap penalty lambda (the gradient is divided by it) and an element-wise clamp of the
momentum to [-phi, phi]; unlike CO2's released code, the clamp here is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class OuterOptimizer:
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True
    gap_penalty: float = 1.0     # CO2 lambda; 1 = off
    clip_threshold: float = 0.0  # CO2 phi; 0 = off

    def __post_init__(self):
        if self.lr < 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"--diloco-outer-lr ({self.lr}) must be >= 0 and "
                             f"--diloco-outer-momentum ({self.momentum}) in [0, 1)")
        if self.gap_penalty <= 0 or self.clip_threshold < 0:
            raise ValueError(f"--co2-gap-penalty ({self.gap_penalty}) must be > 0 and "
                             f"--co2-clip-threshold ({self.clip_threshold}) >= 0")

    @property
    def averages(self) -> bool:
        """Plain averaging: the step moves ``theta_g`` by exactly the outer gradient, onto the
        workers' mean (lr 1, no momentum, no gap penalty; the clamp then bounds a momentum that
        Nesterov's update multiplies by 0, and heavy ball's is the gradient itself unless
        clamped)."""
        return self.lr == 1.0 and self.momentum == 0.0 and self.gap_penalty == 1.0 and \
            (self.nesterov or self.clip_threshold == 0)

    @torch.no_grad()
    def step(self, theta_g: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor) -> None:
        """In place: ``theta_g -= lr * update(grad)``; ``grad`` is the averaged outer gradient."""
        if self.gap_penalty != 1.0:
            grad = grad / self.gap_penalty
        momentum.mul_(self.momentum).add_(grad)
        if self.clip_threshold > 0:
            momentum.clamp_(-self.clip_threshold, self.clip_threshold)
        update = grad.add(momentum, alpha=self.momentum) if self.nesterov else momentum
        theta_g.sub_(update, alpha=self.lr)


@torch.no_grad()
def merge(theta_local: torch.Tensor, theta_g: torch.Tensor, alpha: float) -> None:
    """``theta_local = alpha * theta_local + (1 - alpha) * theta_g``, in place."""
    if alpha == 0.0:
        theta_local.copy_(theta_g)  # exact replacement, also for a non-finite local value
    else:
        theta_local.mul_(alpha).add_(theta_g.to(theta_local.device), alpha=1.0 - alpha)


def eager_grad(own: torch.Tensor, mean: Optional[torch.Tensor], fresh: torch.Tensor,
               workers: int) -> torch.Tensor:
    """The eager outer gradient (arXiv 2502.12996): the round's ``mean`` (None: dropped)
    less this worker's share ``own`` of it, applied at its send, plus its ``fresh`` share of
    the round now sent; the shares are over ``workers``."""
    grad = own.div(-workers)
    if mean is not None:
        grad.add_(mean.to(own.device))
    grad.add_(fresh, alpha=1.0 / workers)
    return grad

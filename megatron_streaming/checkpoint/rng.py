"""This rank's random number generators as a checkpoint keeps them: Python's, torch's CPU and
CUDA generators and megatron-core's tracker (dropout under TP). They are per rank, so a resume
restores them only into the same layout (``resume.plan``); elsewhere they start from --seed.
"""

from __future__ import annotations

import random
from typing import Dict

import torch


class RngState:
    """``state_dict``: generator name -> its state as a tensor; ``load_state_dict`` the
    reverse."""

    def state_dict(self) -> Dict[str, torch.Tensor]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        version, state, gauss = random.getstate()
        tensors = {"torch": torch.get_rng_state(),
                   "python": torch.tensor([version, *state], dtype=torch.int64)}
        if gauss is not None:
            tensors["python_gauss"] = torch.tensor([gauss], dtype=torch.float64)
        for name, value in get_cuda_rng_tracker().get_states().items():
            tensors[f"tracker.{name}"] = value.cpu()
        if torch.cuda.is_available():
            tensors["cuda"] = torch.cuda.get_rng_state()
        return tensors

    def load_state_dict(self, tensors: Dict[str, torch.Tensor]) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        python = tensors["python"].tolist()
        gauss = float(tensors["python_gauss"][0]) if "python_gauss" in tensors else None
        random.setstate((python[0], tuple(python[1:]), gauss))
        torch.set_rng_state(tensors["torch"].to(torch.uint8))
        tracker = {k[len("tracker."):]: v.to(torch.uint8) for k, v in tensors.items()
                   if k.startswith("tracker.")}
        if tracker:
            get_cuda_rng_tracker().set_states(tracker)
        if "cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["cuda"].to(torch.uint8))

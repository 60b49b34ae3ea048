"""Process start-up: torch.distributed from the launcher's environment, device and seeds.

Works under ``torchrun`` and the ``deepspeed`` launcher (both set RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and as a single process with none of them.
"""

from __future__ import annotations

import datetime
import os
import random

import torch


def backend_for(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str, timeout_minutes: float) -> tuple:
    """Initialise the default process group once; returns (rank, world_size)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a lone process, started without a launcher
            os.environ["MASTER_PORT"] = str(_free_port())
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        backend = backend_for(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    # DeepSpeed wraps the existing default group instead of creating its own.
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_everything(seed: int, tp_rank: int) -> None:
    """Same default generator on every rank (weights are drawn, then sliced), and Megatron's
    tensor-parallel RNG tracker for dropout inside TP regions."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)


def cpu_threads() -> None:
    """One compute thread per process unless told otherwise: ranks share the cores."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

"""Process start-up: torch.distributed from the launcher's environment, device and seeds.

Works under ``torchrun`` and the ``deepspeed`` launcher (both set RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and as a single process with none of them.
"""

from __future__ import annotations

import datetime
import os
import random
from typing import Optional

import torch


def join_worker_launch(env, workers: int, worker_index: Optional[int],
                       master_addr: Optional[str], master_port: Optional[int]) -> None:
    """Turn a launch of one worker's ranks into its share of the whole job, in ``env``.

    With ``--diloco-worker-index W`` the launcher (one per cluster) numbered only this
    worker's R ranks: rank r becomes global rank ``W*R + r`` of ``M*R``, and every worker
    meets at the same rendezvous (global rank 0 hosts the store), so only the cross-worker
    groups span the clusters. Raises ConfigError naming the flag on a bad index."""
    from .arguments import ConfigError

    if master_addr:
        env["MASTER_ADDR"] = master_addr
    if master_port:
        env["MASTER_PORT"] = str(master_port)
    if worker_index is None:
        return
    if not 0 <= worker_index < workers:
        raise ConfigError(f"--diloco-worker-index must be in [0, --diloco-workers ({workers})), "
                          f"got {worker_index}")
    if not (master_addr or "MASTER_ADDR" in env):
        raise ConfigError("--diloco-worker-index needs --master-addr (the host of worker 0's "
                          "first rank), or MASTER_ADDR in the environment")
    # Provisional where workers differ in size: renumbered once every worker's size is known
    # (``renumber``); the worker index and the rank within it stand either way.
    ranks_per_worker = int(env.get("WORLD_SIZE", "1"))
    env["RANK"] = str(worker_index * ranks_per_worker + int(env.get("RANK", "0")))
    env["WORLD_SIZE"] = str(workers * ranks_per_worker)
    env.setdefault("LOCAL_RANK", "0")
    # torchrun's agent hosts a store per launch; the job's one store is global rank 0's.
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def renumber(env, layout, worker: int, local: int) -> None:
    """This rank's global number in the job of workers of their own sizes (``layout``)."""
    env["RANK"] = str(layout.offset(worker) + local)
    env["WORLD_SIZE"] = str(layout.world_size)


def backend_for(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


STORE_HOST = "MEGATRON_STREAMING_STORE_HOST"  # set here: rank0, agent or external


def rendezvous_store(timeout_minutes: float, external: bool = False):
    """The job's TCPStore, before any process group: global rank 0 hosts it at
    MASTER_ADDR:MASTER_PORT, every other rank connects; with ``external``
    (``--rendezvous-external``) nobody in the job hosts it: ``python -m
    megatron_streaming.rendezvous`` serves it elsewhere. The workers meet here first (the
    door, ``megatron_streaming.door``); ``init_distributed`` then builds the default group on
    it. A lone process (no launcher) picks a free port, retrying if it was taken meanwhile."""
    import torch.distributed as dist

    from .errors import JobFailure

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    lone = "MASTER_PORT" not in os.environ and not external  # started without a launcher
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Under torchrun the agent already hosts the store on MASTER_PORT (as torch's own env://
    # rendezvous does, join it then rather than fail to bind).
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts = rank == 0 and not agent and not external
    os.environ[STORE_HOST] = "external" if external else "agent" if agent else "rank0"
    if external and "MASTER_PORT" not in os.environ:
        raise JobFailure("--rendezvous-external needs --master-addr/--master-port (where "
                         "`python -m megatron_streaming.rendezvous` serves the store)")
    for attempt in range(5 if lone else 1):
        if lone:
            os.environ["MASTER_PORT"] = str(_free_port())
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 world, is_master=hosts, wait_for_workers=False,
                                 timeout=datetime.timedelta(minutes=timeout_minutes))
        except dist.DistNetworkError as err:
            if lone and "EADDRINUSE" in str(err) and attempt < 4:
                continue
            if hosts:
                raise
            where = ("`python -m megatron_streaming.rendezvous --port "
                     f"{os.environ['MASTER_PORT']}` (launch/rendezvous.sh) serves it" if external
                     else "worker 0's first rank hosts it; is worker 0 running?")
            raise JobFailure(f"rendezvous store {address} unreachable within "
                             f"{timeout_minutes:g} min (--distributed-timeout-minutes): "
                             f"{where} ({type(err).__name__}: {str(err).splitlines()[0]})") \
                from None


def worker_store(store, worker: int, incarnation: int = 0):
    """The part of the job's store where worker ``worker``'s own world meets (a restarted
    worker's, rejoining after membership epoch ``incarnation``, meets apart from the keys
    its predecessor left)."""
    import torch.distributed as dist

    again = f"epoch{incarnation}/" if incarnation else ""
    return dist.PrefixStore(f"megatron_streaming/worker{worker}/{again}", store)


def init_distributed(backend: str, timeout_minutes: float, store=None,
                     layout=None, incarnation: int = 0) -> tuple:
    """Initialise the default process group once, on ``store`` (else on a new
    ``rendezvous_store``), with the in-worker ``backend``; returns this rank's (global rank,
    job size), from the launcher's numbering.

    With the job's ``layout`` (``topology.RankLayout``) the default group is this rank's
    worker, not the job: global rank ``g`` is its local rank in its worker's world, made on
    the worker's own part of the store. Each worker is then a plain Megatron/DeepSpeed job
    (its checkpoint, its barriers, its object collectives) and losing another worker breaks
    nothing of it; the groups that cross workers are made on the store by their members alone
    (``Topology``)."""
    import torch.distributed as dist

    if dist.is_initialized():  # embedded: the caller's world is the job
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        store = store if store is not None else rendezvous_store(timeout_minutes)
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        world_rank, world_size = rank, size
        if layout is not None:
            coords = layout.coords(rank)
            world_rank, world_size = coords["local"], layout.ranks_per_worker
            store = worker_store(store, coords["worker"], incarnation)
        if backend_for(backend) == "nccl":
            # More local ranks than GPUs (two one-rank workers on one test GPU) share them;
            # NCCL refuses two ranks of one device only within one group.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0"))
                                  % torch.cuda.device_count())
        dist.init_process_group(backend=backend_for(backend), store=store, rank=world_rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    # DeepSpeed wraps the existing default group instead of creating its own.
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    return rank, size


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

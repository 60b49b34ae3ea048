"""Process start-up: torch.distributed from the launcher's environment, device and seeds.

Works under ``torchrun`` and the ``deepspeed`` launcher (both set RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), under a bare ``srun`` (``slurm.task_environment`` sets
them from the step), and as a single process with none of them.

Two stores: the job's (``rendezvous_store``: global rank 0 hosts it, or a standalone
rendezvous) carries what crosses workers: the door, membership, heartbeats and the
cross-worker groups. Each worker's own world (its default group, the in-worker groups, NCCL's
unique ids) meets on a store its first rank hosts (``worker_world_store``), so none of that
crosses the link between clusters; one key in the job's store says where it is.

Every client of a store that another process hosts is made by ``store_client``. Where the
job's store is, and who hosts it, travels as a ``StoreAddress`` to the parts that connect to
it again later (the heartbeat, elastic recovery, the failure message).
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import first_line


def join_worker_launch(env, workers: int, worker_index: Optional[int],
                       master_addr: Optional[str], master_port: Optional[int]) -> Optional[str]:
    """Turn a launch of one worker's ranks into its share of the whole job, in ``env``.

    With ``--diloco-worker-index W`` the launcher (one per cluster) numbered only this
    worker's R ranks: rank r becomes global rank ``W*R + r`` of ``M*R``, and every worker
    meets at the same rendezvous (global rank 0 hosts the store), so only the cross-worker
    groups span the clusters. Raises ConfigError naming the flag on a bad index.

    Returns the launcher's own MASTER_ADDR where it is this worker's alone (a launch of one
    worker, its rendezvous moved by ``--master-addr``): the worker's first node, which its
    other nodes reach, so the worker's own store is published there; else None."""
    from ..errors import ConfigError

    launched_at = env.get("MASTER_ADDR")
    if master_addr:
        env["MASTER_ADDR"] = master_addr
    if master_port:
        env["MASTER_PORT"] = str(master_port)
    if worker_index is None:
        return None
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
    return launched_at if master_addr else None  # without the flag it is the job's


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


@dataclass(frozen=True)
class StoreAddress:
    """Where the job's rendezvous store listens, and who hosts it: global rank 0 (``rank0``),
    torchrun's agent (``agent``) or a standalone rendezvous (``external``)."""

    host: Optional[str]
    port: Optional[int]
    hosted_by: str = "rank0"

    @classmethod
    def of_launcher(cls, env) -> "StoreAddress":
        """The launcher's MASTER_ADDR:MASTER_PORT, for a run whose processes and groups its
        caller made (its store is the launcher's, or rank 0's)."""
        port = env.get("MASTER_PORT")
        return cls(env.get("MASTER_ADDR"), int(port) if port else None,
                   "agent" if _agent_hosts_store(env) else "rank0")

    @property
    def known(self) -> bool:
        return bool(self.host and self.port)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self, seconds: float):
        """A fresh client of the store (``store_client``)."""
        return store_client(self.host, self.port, seconds)

    def answers(self, seconds: float) -> None:
        """Raise ``OSError`` unless the store's port takes a connection (``port_answers``)."""
        port_answers(self.host, self.port, seconds)


def store_client(host: str, port: int, seconds: float):
    """A client of the TCPStore another process hosts at ``host:port``: it waits for no other
    client, and each of its calls gives up after ``seconds``. Every store this package connects
    to without hosting it is reached through here."""
    import torch.distributed as dist

    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=seconds))


def port_answers(host: str, port: int, seconds: float) -> None:
    """Raise ``OSError`` unless ``host:port`` takes a connection within ``seconds`` (a plain
    socket: a store client's failed tries log pages of traces)."""
    import socket

    socket.create_connection((host, int(port)), timeout=seconds).close()


def _agent_hosts_store(env) -> bool:
    """Under torchrun the agent already hosts the store on MASTER_PORT."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def rendezvous_store(timeout_minutes: float, external: bool = False) -> tuple:
    """The job's TCPStore, before any process group, and its ``StoreAddress``: ``(store,
    address)``. Global rank 0 hosts it at MASTER_ADDR:MASTER_PORT, every other rank connects;
    with ``external`` (``--rendezvous-external``) nobody in the job hosts it: ``python -m
    megatron_streaming.job.rendezvous`` serves it elsewhere. The workers meet here first (the
    door, ``megatron_streaming.job.door``); ``init_distributed`` then builds the default group on
    it. A lone process (no launcher) picks a free port, retrying if it was taken meanwhile."""
    import torch.distributed as dist

    from ..errors import JobFailure

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    lone = "MASTER_PORT" not in os.environ and not external  # started without a launcher
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Under torchrun the agent already hosts the store on MASTER_PORT (as torch's own env://
    # rendezvous does, join it then rather than fail to bind).
    agent = _agent_hosts_store(os.environ)
    hosts = rank == 0 and not agent and not external
    hosted_by = "external" if external else "agent" if agent else "rank0"
    if external and "MASTER_PORT" not in os.environ:
        raise JobFailure("--rendezvous-external needs --master-addr/--master-port (where "
                         "`python -m megatron_streaming.job.rendezvous` serves the store)")
    for attempt in range(5 if lone else 1):
        if lone:
            os.environ["MASTER_PORT"] = str(_free_port())
        address = StoreAddress(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               hosted_by)
        timeout = datetime.timedelta(minutes=timeout_minutes)
        try:
            if hosts:
                return dist.TCPStore(address.host, address.port, world, is_master=True,
                                     wait_for_workers=False, timeout=timeout), address
            return store_client(address.host, address.port, timeout.total_seconds()), address
        except dist.DistNetworkError as err:
            if lone and "EADDRINUSE" in str(err) and attempt < 4:
                continue
            if hosts:
                raise
            where = ("`python -m megatron_streaming.job.rendezvous --port "
                     f"{os.environ['MASTER_PORT']}` (launch/rendezvous.sh) serves it" if external
                     else "worker 0's first rank hosts it; is worker 0 running?")
            raise JobFailure(f"rendezvous store {address} unreachable within "
                             f"{timeout_minutes:g} min (--distributed-timeout-minutes): "
                             f"{where} ({type(err).__name__}: {first_line(err)})") \
                from None


def worker_store_key(worker: int, incarnation: int = 0) -> str:
    """The key of the job's store where worker ``worker``'s first rank says where the
    worker's own store is (``worker_world_store``); a restarted worker's, rejoining after
    membership epoch ``incarnation``, apart from what its predecessor left."""
    return f"{WORKER_PREFIX}{worker}/{f'epoch{incarnation}/' if incarnation else ''}store"


WORKER_PREFIX = "megatron_streaming/worker"
WORKER_STORE_ENV = "MEGATRON_STREAMING_WORKER_STORE"  # host[:port]: where the first rank binds


def worker_world_store(job_store, layout, rank: int, incarnation: int, timeout_minutes: float,
                       own_host: Optional[str] = None) -> tuple:
    """The store global rank ``rank``'s worker's own world meets on (``layout``: the job's
    ``topology.RankLayout``), and the bytes this rank sent and read through the job's store
    for it: ``(store, bytes)``.

    The worker's first rank (``local`` 0) hosts a TCPStore on a free port and publishes
    ``host:port`` once in the job's store (``worker_store_key``); its other ranks read it
    there and connect. So the in-worker set-up (the default group, every in-worker group,
    NCCL's communicator ids) stays inside the worker: only that one key crosses the link. The
    host published: ``MEGATRON_STREAMING_WORKER_STORE`` (``host`` or ``host:port``, also the
    port bound) if set; else ``own_host`` (``join_worker_launch``: the worker's own launcher's
    MASTER_ADDR); else this node's address towards MASTER_ADDR (``address_towards``). A
    one-rank worker needs no meeting: an in-process store, nothing published. A job of one
    worker has no link to spare: its world meets on the job's store."""
    import datetime

    import torch.distributed as dist

    coords, ranks = layout.coords(rank), layout.ranks_per_worker
    worker, local = coords["worker"], coords["local"]
    if layout.workers == 1:  # apart from the job's own keys, as torchrun's agent's store
        return dist.PrefixStore(f"{WORKER_PREFIX}0/", job_store), 0
    if ranks == 1:
        return dist.HashStore(), 0
    timeout = datetime.timedelta(minutes=timeout_minutes)
    key = worker_store_key(worker, incarnation)
    if local == 0:
        from ..errors import JobFailure

        host, port = store_address(os.environ, own_host)
        try:
            store = dist.TCPStore(host, port or 0, ranks, is_master=True,
                                  wait_for_workers=False, timeout=timeout)
        except dist.DistNetworkError as err:
            raise JobFailure(f"worker {worker}'s own store cannot start at {host}:{port or 0}"
                             f": {first_line(err)} (set {WORKER_STORE_ENV} to an "
                             "address of this node, with a free port or none)") from None
        address = f"{host}:{store.port}"
        job_store.set(key, address)
        return store, len(key) + len(address)
    address, crossed = _published_address(job_store, key, worker, timeout)
    host, port = address.rsplit(":", 1)
    return store_client(host, int(port), timeout.total_seconds()), crossed


def _published_address(job_store, key: str, worker: int, timeout) -> tuple:
    """The address worker ``worker``'s first rank published, once it takes a connection (a
    launch that took over a predecessor's claim may find the predecessor's address first)."""
    import time

    from ..errors import JobFailure

    deadline = time.monotonic() + timeout.total_seconds()
    crossed, address, error, pause = 0, None, None, 0.02
    while time.monotonic() < deadline:
        crossed += len(key)
        if job_store.check([key]):  # polled: a timed-out wait logs in C++
            address = job_store.get(key).decode()
            crossed += len(key) + len(address)
            host, port = address.rsplit(":", 1)
            try:
                port_answers(host, int(port), 10)
                return address, crossed
            except OSError as e:
                error = e
        time.sleep(pause)  # published within ms of the others' start, or much later
        pause = min(0.5, 2 * pause)
    where = f"worker {worker}'s store at {address}, as its first rank published it," \
        if address else f"no address of worker {worker}'s own store from its first rank"
    raise JobFailure(f"{where} within {timeout.total_seconds():.0f} s "
                     f"(--distributed-timeout-minutes){f': {error}' if error else ''}; "
                     f"set {WORKER_STORE_ENV}=HOST[:PORT] to an address of the worker's "
                     "first node its other nodes reach")


def store_address(env, own_host: Optional[str] = None) -> tuple:
    """(host, port or None) where a worker's first rank hosts the worker's store: see
    ``worker_world_store``."""
    override = env.get(WORKER_STORE_ENV, "").strip()
    if override:
        host, sep, port = override.rpartition(":")
        if sep and port.isdigit() and (override.count(":") == 1 or host.endswith("]")):
            return host.strip("[]"), int(port)
        return override.strip("[]"), None  # a name, or an IPv6 address alone
    if own_host:
        return own_host, None
    return address_towards(env.get("MASTER_ADDR", "127.0.0.1")), None


def address_towards(master: str) -> str:
    """This node's address on the route to ``master`` (the job's rendezvous host, which every
    node of a launch reaches): the interface's own address, or ``master`` itself where the
    route is the loopback (this node is the master's host, or the launch is one node), since
    the other nodes reach it by that name."""
    import ipaddress
    import socket

    try:
        family, _, _, _, target = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)  # no packet: only picks the route
            mine = s.getsockname()[0]
    except OSError:
        return socket.gethostname()
    return master if ipaddress.ip_address(mine).is_loopback else mine


def set_device(local_rank: int, in_worker_here: Optional[int] = None) -> Optional[int]:
    """This rank's GPU, for every backend (gloo on a GPU node too, or every rank would make
    its tensors on cuda:0): the launcher's LOCAL_RANK, modulo the devices seen. Workers may
    share GPUs (two one-rank workers on one test GPU: NCCL refuses two ranks of one device
    only within one group); two ranks of one worker may not. ``in_worker_here``: this rank's
    index among its worker's ranks on this node (``index_in_worker_here``); one beyond the
    GPUs seen is refused (ConfigError, one line). None without CUDA."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    gpus = torch.cuda.device_count()
    if in_worker_here is not None and in_worker_here >= gpus:
        from ..errors import ConfigError

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            f"LOCAL_RANK {local_rank}: its worker has at least {in_worker_here + 1} ranks on "
            f"this node, which sees {gpus} GPU{'s' if gpus > 1 else ''} (CUDA_VISIBLE_DEVICES="
            f"{visible if visible is not None else 'unset'}): two ranks of one worker would "
            f"share a GPU; launch at most {gpus} rank{'s' if gpus > 1 else ''} of a worker "
            "per node")
    device = local_rank % gpus
    torch.cuda.set_device(device)
    return device


def index_in_worker_here(rank: int, local_rank: int, worker_first: int) -> int:
    """A rank's index among its worker's ranks on its node: a launcher numbers a node's ranks
    (LOCAL_RANK) in the order of the job's (RANK), and a worker is a block of consecutive
    ranks starting at ``worker_first``, so its ranks on this node are those from the later of
    the node's first rank and the worker's first."""
    return rank - max(rank - local_rank, worker_first)


def claim_device(env, workers: int) -> Optional[int]:
    """Set this process's GPU from the launcher's variables in ``env`` (the job's RANK and
    WORLD_SIZE, ``join_worker_launch`` done) before anything else can touch CUDA: Transformer
    Engine, imported with megatron-core, may make a CUDA context at import, on device 0
    unless one is set. Refuses two ranks of one worker on one GPU (``set_device``)."""
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    per_worker = world // workers if workers > 0 and world % workers == 0 else None
    here = None if per_worker is None else \
        index_in_worker_here(rank, local_rank, rank // per_worker * per_worker)
    return set_device(local_rank, here)


LAUNCH_ORDER = "NCCL_LAUNCH_ORDER_IMPLICIT"
LAUNCH_ORDER_SINCE = (2, 26)  # the NCCL release that added it


def order_nccl_launches(env) -> None:
    """NCCL across workers: have NCCL run the operations of this GPU's communicators (the
    worker's and the cross-worker ones) in the order this process launches them
    (``NCCL_LAUNCH_ORDER_IMPLICIT=1`` in ``env``; the exchange launches its collectives from
    the training loop's thread, ``comm.transport``). Without it operations of two
    communicators of one device can deadlock unless the application orders them itself
    (NCCL user guide, "Using multiple NCCL communicators concurrently"). Call before the
    first NCCL communicator starts. Refuses (ConfigError) an NCCL older than 2.26 and the
    variable set to anything but 1."""
    from ..errors import ConfigError

    value = env.get(LAUNCH_ORDER, "1")
    if value != "1":
        raise ConfigError(f"--diloco-backend nccl needs {LAUNCH_ORDER}=1 (NCCL then runs the "
                          "worker's and the cross-worker collectives in the order they are "
                          f"launched), found {value!r}: unset it")
    try:
        version = tuple(torch.cuda.nccl.version())
    except Exception as e:  # a torch built without NCCL
        raise ConfigError(f"--diloco-backend nccl: this torch has no NCCL ({e})") from None
    if version[:2] < LAUNCH_ORDER_SINCE:
        raise ConfigError(
            f"--diloco-backend nccl: torch's NCCL {'.'.join(map(str, version))} cannot order "
            "the worker's and the cross-worker collectives on one GPU ({} needs NCCL {} or "
            "later); use --diloco-backend gloo".format(
                LAUNCH_ORDER, ".".join(map(str, LAUNCH_ORDER_SINCE))))
    env[LAUNCH_ORDER] = "1"


def init_distributed(backend: str, timeout_minutes: float, store=None,
                     layout=None) -> tuple:
    """Initialise the default process group once, on ``store`` (else on a new
    ``rendezvous_store``), with the in-worker ``backend``; returns this rank's (global rank,
    job size), from the launcher's numbering.

    With the job's ``layout`` (``topology.RankLayout``) the default group is this rank's
    worker, not the job: global rank ``g`` is its local rank in its worker's world, made on
    ``store``, the worker's own (``worker_world_store``). Each worker is then a plain
    Megatron/DeepSpeed job (its checkpoint, its barriers, its object collectives) and losing
    another worker breaks nothing of it; the groups that cross workers are made on the job's
    store by their members alone (``Topology``)."""
    import torch.distributed as dist

    if dist.is_initialized():  # embedded: the caller's world is the job
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        store = store if store is not None else rendezvous_store(timeout_minutes)[0]
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        world_rank, world_size = rank, size
        here = None
        if layout is not None:
            world_rank, world_size = layout.coords(rank)["local"], layout.ranks_per_worker
            here = index_in_worker_here(rank, int(os.environ.get("LOCAL_RANK", "0")),
                                        layout.offset(layout.coords(rank)["worker"]))
        set_device(int(os.environ.get("LOCAL_RANK", "0")), here)
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

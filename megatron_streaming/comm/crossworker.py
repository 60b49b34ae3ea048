"""The one door across workers: every collective over a cross-worker group goes through here,
and every byte this rank puts on the cross-worker wire is counted here, data and control apart.

* data: the outer-gradient exchanges (``transport.Transport``, built by
  ``make_transport`` over this rank's cross-worker data group, which pairs the ranks at one
  in-worker coordinate of every worker);
* control: the stop flag of every step (``lifecycle.StopAgreement``), checkpoint agreement
  (``ranks_reporting``) and the end-of-run barrier (``job_barrier``), over the control group
  (those two over the worker's group first: every rank of the job takes part), plus what the
  door (``door``) and the heartbeats (``lifecycle.Liveness``) exchange through the rendezvous
  store (``count_control``).

Counting convention for a collective on the control group: the tensor's bytes to and from
each of the M-1 peers (``2 x bytes x (M-1)``), whatever the backend's algorithm. Tensors are
moved to the group's device (CUDA for NCCL, else CPU) before the collective.
"""

from __future__ import annotations

import logging
import threading
from typing import List, Optional

import torch
import torch.distributed as dist

from ..errors import first_line
from .failures import is_communication_error

log = logging.getLogger("megatron_streaming")


class CrossWorker:
    def __init__(self, topology):
        self.rank = topology.rank
        self.backend = topology.cross_worker_backend
        self.transport = None
        self._control_bytes = 0
        self._lock = threading.Lock()  # the heartbeat thread counts too
        # The failure state. ``tolerates_loss``: an elastic run goes on without a lost
        # worker (``job.elastic``); ``lost``: the first line of what failed since the last
        # recovery (the error itself is not kept: its traceback holds the frames, and so the
        # groups, that must be destroyed before new ones are made).
        self.tolerates_loss = False
        self.lost: Optional[str] = None
        self.regroup(topology)

    # ---- failures --------------------------------------------------------------------------
    def failed(self, error: BaseException) -> None:
        """A collective across workers raised ``error`` (an exchange, the stop flag, a
        checkpoint's agreement). In an elastic run a lost or stuck peer is recorded and the
        caller goes on (skipping what failed); the job's membership acts on it after the
        step. Anything else, or any failure of a run that does not tolerate a loss, is
        raised."""
        if not self.tolerates_loss or not is_communication_error(error):
            raise error
        if self.lost is None:
            self.lost = first_line(error)
            log.warning("rank %d: %s", self.rank, self.lost)

    def take_lost(self) -> Optional[str]:
        """What failed since the last call (and forget it: recovery has started)."""
        lost, self.lost = self.lost, None
        return lost

    def regroup(self, topology) -> None:
        """Take the topology's cross-worker groups (those of a new membership epoch)."""
        from ..parallel.topology import device_of

        self.workers = len(topology.members)
        self.worker_group = topology.groups["worker"]  # in-worker half of a job-wide call
        self.world_size = topology.layout.world_size
        self.data_group = topology.groups.get("cross_worker")
        self.data_ranks: List[int] = topology.group_ranks.get("cross_worker", [topology.rank])
        self.control_group = topology.groups.get("cross_worker_control")
        # Workers of different sizes: the control groups of the coordinates beyond this
        # worker's size that this rank stands in for. Every control collective runs on them
        # too, with the same value: it is the worker's (reduced over the worker first), so
        # each group's result is every worker's, whichever of its ranks stands there.
        self.proxy_groups = list(topology.proxy_groups)
        self.control_device = device_of(self.control_group) if self.control_group is not None \
            else torch.device("cpu")
        self.data_device = device_of(self.data_group) if self.data_group is not None \
            else torch.device("cpu")

    # ---- data ------------------------------------------------------------------------------
    def make_transport(self, codec, timeout: float, codec_device=None):
        """The quantized exchange over this rank's data group (one per rank); the codec runs
        on ``codec_device`` (default: the wire's, CUDA for NCCL, else the CPU)."""
        from .sparse import SparseCodec
        from .sparse_transport import SparseTransport
        from .transport import Transport

        nccl = self.backend == "nccl"
        kind = SparseTransport if isinstance(codec, SparseCodec) else Transport
        self.transport = kind(
            self.data_group, self.data_ranks, self.rank, codec, timeout,
            wire_device=f"cuda:{torch.cuda.current_device()}" if nccl else "cpu",
            use_cuda_stream=nccl, codec_device=codec_device)
        return self.transport

    # ---- control ---------------------------------------------------------------------------
    @property
    def control_bytes(self) -> int:
        with self._lock:
            return self._control_bytes

    def count_control(self, nbytes: int) -> None:
        """Bytes that crossed workers outside a collective (the rendezvous store)."""
        with self._lock:
            self._control_bytes += int(nbytes)

    def all_reduce_control(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM,
                           async_op: bool = False):
        """All-reduce over the control group (every worker's rank at this coordinate).
        Returns ``(work or None, the reduced tensor)``: on the group's device, so a caller
        on another device reads the result from what is returned, not from its input."""
        if self.control_group is None:
            return None, tensor
        on_wire = tensor.to(self.control_device)
        work = dist.all_reduce(on_wire, op=op, group=self.control_group, async_op=async_op)
        works = [dist.all_reduce(on_wire.clone(), op=op, group=g, async_op=async_op)
                 for g in self.proxy_groups]  # in coordinate order on every rank: no cycle
        self.count_control(2 * on_wire.numel() * on_wire.element_size() * (self.workers - 1)
                           * (1 + len(works)))
        return (_AllOf([work, *works]) if async_op and works else work), on_wire

    def gather_control(self, obj) -> list:
        """Every worker's ``obj`` (a picklable object), in worker order, over the control
        group (collective over every worker's rank at this coordinate)."""
        if self.control_group is None:
            return [obj]
        import pickle

        mine = len(pickle.dumps(obj))
        gathered = []
        for group in (self.control_group, *self.proxy_groups):  # the same on each
            out = [None] * self.workers
            dist.all_gather_object(out, obj, group=group)
            self.count_control(mine * (self.workers - 1)
                               + sum(len(pickle.dumps(o)) for o in out) - mine)
            gathered.append(out)
        return gathered[0]

    def barrier(self) -> None:
        if self.control_group is not None:
            for group in (self.control_group, *self.proxy_groups):
                dist.barrier(group=group)
                self.count_control(2 * (self.workers - 1))  # a byte each way (gloo's)

    # ---- over every rank of the job (the worker's group, then across) ----------------------
    def job_barrier(self) -> None:
        """Wait for every rank of every worker, without a world-spanning group: after the
        in-worker barrier each rank of worker w knows w arrived; after the barrier over its
        cross-worker group it knows every worker did."""
        dist.barrier(group=self.worker_group)
        self.barrier()

    def ranks_reporting(self, flag: bool) -> List[int]:
        """The global ranks whose ``flag`` is set, known to every rank (collective over
        all ranks, like ``job_barrier``: summed over the worker, then across workers)."""
        flags = torch.zeros(self.world_size, dtype=torch.int32)
        flags[self.rank] = int(flag)
        return [int(r) for r in self._summed_over_the_job(flags).nonzero().flatten().tolist()]

    def total_control_bytes(self) -> int:
        """Control bytes of every rank of every worker, as counted before this call
        (collective over the worker, then across workers)."""
        mine = torch.tensor([self.control_bytes], dtype=torch.float64)
        return int(self._summed_over_the_job(mine).item())

    def _summed_over_the_job(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over every rank of the job: over the worker, then across."""
        from ..parallel.topology import device_of

        tensor = tensor.to(device_of(self.worker_group))
        dist.all_reduce(tensor, group=self.worker_group)
        return self.all_reduce_control(tensor)[1]


class _AllOf:
    """The works of one control collective on several groups, waited for together."""

    def __init__(self, works):
        self.works = works

    def wait(self, *args) -> bool:
        return all(w.wait(*args) is not False for w in self.works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def byte_count(*parts: str) -> int:
    """Bytes of store keys and values as they travel."""
    return sum(len(p.encode()) for p in parts)

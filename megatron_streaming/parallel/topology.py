"""The rank layout, and the one object that owns every process group.

``WORLD = M workers x R ranks per worker`` with ``R = TP x PP x DP`` (DESIGN.md, "Rank
layout"), or workers of their own sizes ``R_w`` (``sizes``; each cluster a worker of all its
devices). A worker is a contiguous block of global ranks (worker w's start at the sum of the
sizes before it), so it maps onto one cluster's nodes. Inside a worker the order is Megatron's
default (tensor-parallel rank fastest, then data-parallel, pipeline stage slowest), so a
worker looks exactly like a Megatron job.

Every Megatron/DeepSpeed group lives inside one worker. The only groups that span workers are
the cross-worker groups, reached through ``crossworker.CrossWorker``: a data group per lane
``c < L = min R_w`` (the local ranks ``c`` of every worker) and a control group per coordinate
``c < max R_w``, in which worker w is represented by its local rank ``c mod R_w`` (a rank of
a smaller worker stands in for the coordinates beyond its size: ``proxied``). With equal
sizes both are ``{w*R + c : w < M}``. With gloo across workers they are not subgroups of the
world: their members make them on the rendezvous store under their membership epoch's prefix
(``add_cross_worker_groups``), so the workers of a later epoch can make new ones without a
lost worker.

``RankLayout`` is pure arithmetic (testable without processes); ``Topology`` creates the
torch.distributed groups from it, in the same order on every rank as ``new_group`` requires.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

IN_WORKER_AXES = ("tp", "sp", "dp", "pp")  # fastest first; sp = Ulysses sequence parallel
# The groups a mixture-of-experts model adds (``RankLayout._moe_groups``).
MOE_GROUPS = ("tp_sdp", "tp_sp", "ep", "expt_tp", "expt_dp", "tp_ep")


# NCCL across workers: the cross-worker groups' own timeout (NCCL's watchdog, which ends the
# process) exceeds --diloco-timeout by this much, so the exchange gives up first and says which
# step, fragment and peers it waited for (``comm.transport``).
NCCL_TIMEOUT_MARGIN = datetime.timedelta(seconds=60)


def cross_worker_group_timeout(backend: str, timeout: Optional[datetime.timedelta],
                               in_worker: Optional[datetime.timedelta] = None):
    """The timeout the cross-worker groups are made with, for ``--diloco-timeout``
    ``timeout``. gloo: ``timeout`` (a collective that runs out fails, and the exchange reports
    it). NCCL: ``timeout`` plus ``NCCL_TIMEOUT_MARGIN``. NCCL's watchdog counts from a
    collective's launch, as the exchange's own deadline does, and ends the process when it
    fires: the exchange's deadline must come first, and the in-worker groups' watchdog
    (``in_worker``: ``--distributed-timeout-minutes``) after both, or it ends the process
    while a worker waits at a collective behind the stuck exchange. Raises ConfigError
    naming the flags where that order cannot hold."""
    if backend != "nccl" or timeout is None:
        return timeout
    nccl = timeout + NCCL_TIMEOUT_MARGIN
    if in_worker is not None and nccl >= in_worker:
        from ..errors import ConfigError

        raise ConfigError(
            f"--diloco-backend nccl: --diloco-timeout {timeout.total_seconds():g} s plus "
            f"{NCCL_TIMEOUT_MARGIN.total_seconds():g} s (the NCCL groups' own watchdog) must "
            f"be below --distributed-timeout-minutes {in_worker.total_seconds() / 60:g} "
            f"({in_worker.total_seconds():g} s)")
    return nccl


@dataclass(frozen=True)
class RankLayout:
    """Sizes of every parallel axis; validates that they tile the world."""

    world_size: int
    workers: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    # Workers of their own sizes (ranks of each, in worker order; empty: all alike) and the
    # worker whose TP/PP/SP these are (the layout of the others is theirs).
    sizes: Tuple[int, ...] = ()
    worker: int = 0
    # Expert parallelism (MoE): each pipeline stage's TP x SP x DP ranks cut again as expert
    # TP (fastest; 0: the TP size) x EP x expert data parallel, as megatron-core cuts them.
    ep: int = 1
    etp: int = 0
    moe: bool = False  # the model has experts: the expert groups are made

    def __post_init__(self):
        flags = (("--diloco-workers", self.workers), ("--tensor-model-parallel-size", self.tp),
                 ("--pipeline-model-parallel-size", self.pp),
                 ("--ds-sequence-parallel-size", self.sp))
        for name, value in flags:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        used = [(name, value) for name, value in flags if value > 1 or
                name != "--ds-sequence-parallel-size"]
        if self.sizes:
            if len(self.sizes) != self.workers or sum(self.sizes) != self.world_size:
                raise ValueError(f"worker sizes {list(self.sizes)} do not make "
                                 f"{self.workers} workers of {self.world_size} ranks")
            used = used[1:]
            world, denom = self.sizes[self.worker], self.tp * self.pp * self.sp
        else:
            world, denom = self.world_size, self.workers * self.tp * self.pp * self.sp
        if world % denom:
            factors = " x ".join(f"{name} ({value})" for name, value in used)
            raise ValueError(f"world size {world} is not divisible by {factors} = {denom}")
        if self.ep < 1 or self.etp < 0:
            raise ValueError(f"--expert-model-parallel-size ({self.ep}) and "
                             f"--expert-tensor-parallel-size ({self.etp}) must be >= 1")
        stage = self.ranks_per_worker // self.pp
        if stage % (self.expert_tp * self.ep):
            raise ValueError(
                f"the {stage} ranks of a pipeline stage (tensor x sequence x data parallel) are "
                f"not divisible by --expert-tensor-parallel-size ({self.expert_tp}) x "
                f"--expert-model-parallel-size ({self.ep})")

    @classmethod
    def of(cls, cfg, world_size: int) -> "RankLayout":
        """The layout a run's flags ask for (``config.Config``) on ``world_size`` ranks."""
        p = cfg.parallel
        return cls(world_size, cfg.streaming.diloco_workers, p.tensor_model_parallel_size,
                   p.pipeline_model_parallel_size, p.ds_sequence_parallel_size,
                   ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size or 0,
                   moe=cfg.model.moe)

    @property
    def ranks_per_worker(self) -> int:
        """This worker's ranks (every worker's, unless they have their own ``sizes``)."""
        return self.sizes[self.worker] if self.sizes else self.world_size // self.workers

    @property
    def worker_sizes(self) -> Tuple[int, ...]:
        return self.sizes or (self.world_size // self.workers,) * self.workers

    @property
    def uniform(self) -> bool:
        return len(set(self.worker_sizes)) == 1

    def offset(self, worker: int) -> int:
        """Worker ``worker``'s first global rank."""
        return sum(self.worker_sizes[:worker])

    @property
    def lanes(self) -> int:
        """In-worker coordinates that every worker has: the cross-worker data groups."""
        return min(self.worker_sizes)

    @property
    def coordinates(self) -> int:
        """In-worker coordinates of the largest worker: the cross-worker control groups."""
        return max(self.worker_sizes)

    @property
    def dp(self) -> int:
        return self.ranks_per_worker // (self.tp * self.sp * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks of a stage that hold the same expert shard (expert data parallel)."""
        return self.tp * self.sp * self.dp // (self.expert_tp * self.ep)

    def expert_coords(self, rank: int) -> Dict[str, int]:
        """Expert TP, EP and expert-DP coordinates of a global rank: its index inside its
        pipeline stage (TP fastest, then SP, then DP) read as ETP fastest, then EP, then
        expert DP."""
        c = self.coords(rank)
        inside = c["tp"] + self.tp * (c["sp"] + self.sp * c["dp"])
        etp, rest = inside % self.expert_tp, inside // self.expert_tp
        return {"etp": etp, "ep": rest % self.ep, "edp": rest // self.ep}

    def axis_sizes(self) -> Dict[str, int]:
        return {"tp": self.tp, "sp": self.sp, "dp": self.dp, "pp": self.pp}

    def coords(self, rank: int) -> Dict[str, int]:
        """Worker and in-worker coordinates of a global rank (the axes as this worker's
        layout cuts them)."""
        if self.sizes:
            worker, local = 0, rank
            while worker < self.workers - 1 and local >= self.sizes[worker]:
                local -= self.sizes[worker]
                worker += 1
        else:
            worker, local = divmod(rank, self.ranks_per_worker)
        out = {"worker": worker, "local": local}
        for axis in IN_WORKER_AXES:
            local, out[axis] = divmod(local, self.axis_sizes()[axis])
        return out

    def rank(self, worker: int, tp: int = 0, dp: int = 0, pp: int = 0, sp: int = 0) -> int:
        local = tp + self.tp * (sp + self.sp * (dp + self.dp * pp))
        return self.offset(worker) + local

    def _groups_varying(self, axes) -> List[List[int]]:
        """All groups of ranks that differ only along ``axes``, worker by worker."""
        sizes = self.axis_sizes()
        fixed = [a for a in IN_WORKER_AXES if a not in axes]
        groups = []
        # Workers of other sizes are cut their own way: only this one's groups are known.
        for worker in range(self.workers) if self.uniform else (self.worker,):
            for fixed_vals in itertools.product(*(range(sizes[a]) for a in fixed)):
                base = dict(zip(fixed, fixed_vals))
                ranks = []
                for vals in itertools.product(*(range(sizes[a]) for a in reversed(axes))):
                    coords = {**base, **dict(zip(reversed(axes), vals))}
                    ranks.append(self.rank(worker, **coords))
                groups.append(sorted(ranks))
        return groups

    def _expert_groups(self, axes) -> List[List[int]]:
        """All groups of ranks of one pipeline stage that differ only along the expert axes
        ``axes`` (of etp, ep, edp), worker by worker."""
        groups: Dict[tuple, List[int]] = {}
        for worker in range(self.workers) if self.uniform else (self.worker,):
            first = self.offset(worker)
            for rank in range(first, first + self.worker_sizes[worker]):
                e = self.expert_coords(rank)
                key = (worker, self.coords(rank)["pp"],
                       *(e[a] for a in ("etp", "ep", "edp") if a not in axes))
                groups.setdefault(key, []).append(rank)
        return [sorted(g) for g in groups.values()]

    def embedding_groups(self) -> List[List[int]]:
        """First and last stage of each pipeline: they share the tied embedding weight."""
        return [sorted({g[0], g[-1]}) for g in self._groups_varying(("pp",))]

    def position_embedding_groups(self) -> List[List[int]]:
        return [[g[0]] for g in self._groups_varying(("pp",))]

    def cross_worker_groups(self) -> List[List[int]]:
        """The data groups: one per lane, the local ranks ``c < L`` of every worker."""
        return [[self.offset(w) + c for w in range(self.workers)] for c in range(self.lanes)]

    def control_groups(self) -> List[List[int]]:
        """The control groups: one per coordinate ``c`` of the largest worker, worker w's
        member its local rank ``c mod R_w`` (the data groups, with equal sizes)."""
        sizes = self.worker_sizes
        return [[self.offset(w) + c % sizes[w] for w in range(self.workers)]
                for c in range(self.coordinates)]

    def proxied(self, local: int) -> List[int]:
        """The coordinates whose control group this worker's local rank ``local`` is in: its
        own first, then those beyond this worker's size that it stands in for."""
        return list(range(local, self.coordinates, self.ranks_per_worker))

    def all_groups(self) -> Dict[str, List[List[int]]]:
        """Every group by name, in a fixed order (the creation order on every rank)."""
        return {**self._dense_groups(), **(self._moe_groups() if self.moe else {}),
                **self._cross_groups()}

    def _moe_groups(self) -> Dict[str, List[List[int]]]:
        """The groups a mixture-of-experts model adds (``Topology.create`` reuses an earlier
        group of the same ranks: at EP=1 most are one)."""
        return {
            # A pipeline stage's ranks (megatron-core's tensor-data-context group: the MoE
            # router's global load statistics) and its tensor x sequence ranks, which hold
            # the tokens of one micro-batch between them (the router's per-batch ones).
            "tp_sdp": self._groups_varying(("tp", "sp", "dp")),
            "tp_sp": self._groups_varying(("tp", "sp")),
            # Expert parallel, expert tensor parallel, expert data parallel (the ranks holding
            # the same expert shard: ZeRO partitions and reduces expert gradients over it)
            # and expert tensor x expert parallel.
            "ep": self._expert_groups(("ep",)),
            "expt_tp": self._expert_groups(("etp",)),
            "expt_dp": self._expert_groups(("edp",)),
            "tp_ep": self._expert_groups(("etp", "ep")),
        }

    def _dense_groups(self) -> Dict[str, List[List[int]]]:
        return {
            "tp": self._groups_varying(("tp",)),
            "sp": self._groups_varying(("sp",)),
            "pp": self._groups_varying(("pp",)),
            "dp": self._groups_varying(("dp",)),
            # ZeRO's reduction group: the ranks that share a model shard (sequence x data).
            "sdp": self._groups_varying(("sp", "dp")),
            "mp": self._groups_varying(("tp", "pp")),
            # megatron-core's tensor-and-data-parallel group: Transformer Engine's FP8 amax
            # reduction (the ranks whose activations share the scaling; no Ulysses with FP8).
            "tp_dp": self._groups_varying(("tp", "dp")),
            "worker": self._groups_varying(("tp", "sp", "dp", "pp")),
            "embd": self.embedding_groups(),
            "pos_embd": self.position_embedding_groups(),
            "single": [[r] for r in range(self.world_size)],
        }

    def _cross_groups(self) -> Dict[str, List[List[int]]]:
        return {
            # Two groups per coordinate: the transport's (used only by its background thread)
            # and one for control (barriers from the main thread). Sharing one group between
            # threads would let a barrier pair up with an in-flight exchange on another worker.
            "cross_worker": self.cross_worker_groups(),
            "cross_worker_control": self.control_groups(),
        }

    def data_shard(self, rank: int):
        """(index, count) of this rank's data shard: disjoint across workers and DP ranks;
        the sequence-parallel ranks of one sample share it (each takes a slice of it)."""
        c = self.coords(rank)
        return c["worker"] * self.dp + c["dp"], self.workers * self.dp


@dataclass
class Topology:
    """This rank's process groups, all of them, created once from a ``RankLayout``."""

    layout: RankLayout
    rank: int
    groups: Dict[str, object] = field(default_factory=dict)
    group_ranks: Dict[str, List[int]] = field(default_factory=dict)
    cross_worker_backend: Optional[str] = None
    # The communicator (``comm.crossworker.CrossWorker``), set by whoever connects the worker:
    # every collective across workers goes through it.
    cross: object = None

    # Added to a global rank of this worker to get its rank in the default (world) group:
    # 0 when the world is the whole job (an embedded run, the tests' worlds), -w*R when it is
    # this worker (``distributed.init_distributed`` with ``ranks_per_worker``).
    world_offset: int = 0
    per_worker_world: bool = False
    store: object = None  # the rendezvous store (membership records, cross-worker groups)
    members: tuple = ()  # the workers of the current membership epoch (``elastic``)
    # The control groups of the coordinates beyond this worker's size that this rank stands
    # in for (``RankLayout.proxied``; none where every worker has the same size).
    proxy_groups: list = field(default_factory=list)
    in_worker_timeout: Optional[datetime.timedelta] = None  # the in-worker groups'

    @classmethod
    def create(cls, layout: RankLayout, rank: int, timeout=None,
               cross_worker_backend: str = "gloo",
               cross_worker_timeout=None, backend: Optional[str] = None,
               store=None, cross_members: Optional[List[int]] = None) -> "Topology":
        """Create every group. The cross-worker groups have their own backend (gloo over
        the slow link, also where NCCL runs inside the worker; NCCL only when asked for) and
        their own timeout; the in-worker groups use ``backend`` (default: the world group's).

        The world (default group) is either this rank's worker (each worker its own world,
        as a launch makes it) or the whole job. The in-worker groups are subgroups of the
        world; the cross-worker groups are made on ``store`` (default: the world's) by their
        members alone, except with NCCL across workers in a world that spans the job (then
        ``new_group``)."""
        import torch.distributed as dist

        members = list(range(layout.workers)) if cross_members is None else cross_members
        topo = cls(layout=layout, rank=rank, members=tuple(members), in_worker_timeout=timeout)
        topo.cross_worker_backend = cross_worker_backend
        if cross_worker_backend == "nccl":  # before any NCCL communicator starts (torch
            # starts each at its group's first collective)
            import os

            from .distributed import order_nccl_launches

            order_nccl_launches(os.environ)
        cross_group_timeout = cross_worker_group_timeout(
            cross_worker_backend, cross_worker_timeout or timeout, timeout)
        per_worker = dist.get_world_size() != layout.world_size
        if per_worker and dist.get_world_size() != layout.ranks_per_worker:
            raise ValueError(f"the default group has {dist.get_world_size()} ranks: neither "
                             f"the job ({layout.world_size}) nor one worker "
                             f"({layout.ranks_per_worker})")
        if per_worker:
            topo.per_worker_world = True
            topo.world_offset = -layout.offset(topo.worker)
        standalone = per_worker or topo.cross_worker_backend == "gloo"
        if not (standalone or layout.uniform):
            raise ValueError("workers of different sizes need each worker in its own world "
                             "(one launch per worker) or gloo across workers")
        made: Dict[tuple, object] = {}  # in-worker groups by their ranks
        for name, rank_lists in layout.all_groups().items():
            cross = name.startswith("cross_worker")
            if cross and standalone:
                continue
            for ranks in rank_lists:
                if per_worker and layout.coords(ranks[0])["worker"] != topo.worker:
                    continue  # another worker's group, made in that worker's world
                if name in MOE_GROUPS and tuple(ranks) in made:
                    if rank in ranks:  # the same ranks as an earlier group: that group
                        topo.groups[name] = made[tuple(ranks)]
                        topo.group_ranks[name] = ranks
                    continue
                group = dist.new_group(
                    [r + topo.world_offset for r in ranks],
                    timeout=cross_group_timeout if cross else timeout,
                    backend=cross_worker_backend if cross else backend)
                if not cross:
                    made.setdefault(tuple(ranks), group)
                if rank in ranks:
                    topo.groups[name] = group
                    topo.group_ranks[name] = ranks
        from patches.torch_process_group import default_store

        topo.store = store or default_store()
        if standalone and members:  # none yet: a restarted worker, until it is admitted
            topo.add_cross_worker_groups(topo.store, 0, members,
                                         cross_worker_timeout or timeout)
        return topo

    def add_cross_worker_groups(self, store, epoch: int, members: List[int], timeout) -> None:
        """This rank's two cross-worker groups (data and control) over the workers
        ``members`` (sorted indices), made on ``store`` under the epoch's own prefix by the
        members' ranks at this in-worker coordinate alone (``patches.torch_process_group``);
        ``timeout``: ``--diloco-timeout`` (``cross_worker_group_timeout`` gives the groups')."""
        import torch.distributed as dist

        from patches.torch_process_group import standalone_group

        backend = self.cross_worker_backend or "gloo"
        timeout = cross_worker_group_timeout(
            backend, timeout or datetime.timedelta(minutes=10), self.in_worker_timeout)
        layout, c = self.layout, self.coords
        sizes, local = layout.worker_sizes, c["local"]
        wanted = [("cross_worker", local)] if local < layout.lanes else []
        wanted += [("cross_worker_control", coord) for coord in layout.proxied(local)]
        for name in ("cross_worker", "cross_worker_control"):
            self.groups.pop(name, None)
            self.group_ranks.pop(name, None)
        self.proxy_groups = []
        for name, coord in wanted:
            ranks = [layout.offset(w) + coord % sizes[w] for w in members]
            prefix = f"megatron_streaming/epoch{epoch}/{name}/{coord}/"
            group = standalone_group(
                backend, dist.PrefixStore(prefix, store), members.index(c["worker"]),
                len(members), timeout,
                # the members' ranks in the world, for torch's registry: only this rank's
                # where each worker is its own world
                {self.rank + self.world_offset: members.index(c["worker"])}
                if self.per_worker_world else {r: i for i, r in enumerate(ranks)}, prefix)
            if name in self.groups:  # a coordinate this rank stands in for
                self.proxy_groups.append(group)
                continue
            self.groups[name] = group
            self.group_ranks[name] = ranks

    # ---- coordinates -------------------------------------------------------------------
    @property
    def coords(self) -> Dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def worker(self) -> int:
        return self.coords["worker"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def expert_coords(self) -> Dict[str, int]:
        return self.layout.expert_coords(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def first_layer(self, num_layers: int) -> int:
        """Global index of this rank's first transformer layer: the pipeline stages hold
        ``num_layers / PP`` layers each (an even split, checked with the flags)."""
        return self.pp_rank * (num_layers // self.layout.pp)

    @property
    def data_shard(self):
        return self.layout.data_shard(self.rank)

    def is_logging_rank(self) -> bool:
        """Rank that prints and writes TensorBoard: the lowest live worker's (worker 0's)
        last stage, TP/SP/DP rank 0."""
        return self.worker == min(self.members or (0,)) and self.is_worker_reporter()

    def leads_job(self) -> bool:
        """The first rank of the lowest live worker: commits checkpoints for the job."""
        return self.coords["local"] == 0 and bool(self.members) and \
            self.worker == min(self.members)

    def is_worker_reporter(self) -> bool:
        """One rank per worker that holds the worker's loss (last stage, TP/SP/DP rank 0)."""
        c = self.coords
        return c["tp"] == 0 and c["sp"] == 0 and c["dp"] == 0 and self.is_last_stage

    def describe(self) -> str:
        return describe(self.layout, self.rank)

    # ---- adapters ----------------------------------------------------------------------
    def pg_collection(self):
        """Megatron-core's ProcessGroupCollection for the model and the pipeline schedule."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection()
        g = self.groups
        single = g["single"]  # context parallelism is not used: a group of one
        # Middle pipeline stages belong to no embedding group: None, as in Megatron.
        for name, group in (("tp", g["tp"]), ("pp", g["pp"]), ("mp", g["mp"]),
                            ("embd", g.get("embd")), ("pos_embd", g.get("pos_embd")),
                            ("cp", single), ("tp_cp", g["tp"]), ("dp", g["dp"]),
                            ("dp_cp", g["dp"]), ("hcp", [single])):
            setattr(pgs, name, group)
        # Mixture of experts. Under Ulysses the ranks of a sequence hold its tokens between
        # them as context parallelism would: the router's per-batch statistics sum over
        # tensor x sequence ranks (``tp_cp``; attention never reads it here).
        if self.layout.moe:
            for name, group in (("ep", g["ep"]), ("expt_tp", g["expt_tp"]),
                                ("expt_dp", g["expt_dp"]), ("tp_ep", g["tp_ep"]),
                                ("tp_dp_cp", g["tp_sdp"]), ("tp_cp", g["tp_sp"])):
                setattr(pgs, name, group)
        return pgs

    def mpu(self) -> "WorkerMPU":
        return WorkerMPU(self)

    def install_into_megatron(self) -> None:
        """Point megatron-core's ``parallel_state`` at this worker's groups (the few
        megatron-core paths that still read module state; ``patches/megatron_parallel_state``
        says which)."""
        from patches.megatron_parallel_state import install_groups

        install_groups(self.groups, self.world_ranks())

    def world_ranks(self) -> Dict[str, List[int]]:
        """The in-worker groups' ranks as the default (world) group numbers them."""
        return {name: [r + self.world_offset for r in ranks]
                for name, ranks in self.group_ranks.items()
                if not name.startswith("cross_worker")}


class WorkerMPU:
    """The Megatron-style ``mpu`` DeepSpeed queries, answering for this rank's worker only.

    It deliberately has no ``initialize_sequence_parallel`` attribute: DeepSpeed would then
    treat it as its own sequence-parallel module and ignore the data-parallel group.
    """

    def __init__(self, topology: Topology):
        self._t = topology

    def _size(self, name: str) -> int:
        return len(self._t.group_ranks[name])

    def _rank_in(self, name: str) -> int:
        return self._t.group_ranks[name].index(self._t.rank)

    def get_data_parallel_group(self):
        return self._t.groups["dp"]

    def get_data_parallel_world_size(self) -> int:
        return self._size("dp")

    def get_data_parallel_rank(self) -> int:
        return self._rank_in("dp")

    def get_data_parallel_group_ranks(self) -> List[int]:
        return self._t.world_ranks()["dp"]

    def get_model_parallel_group(self):
        return self._t.groups["mp"]

    def get_model_parallel_world_size(self) -> int:
        return self._size("mp")

    def get_model_parallel_rank(self) -> int:
        return self._rank_in("mp")

    def get_tensor_model_parallel_group(self):
        return self._t.groups["tp"]

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._size("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self._rank_in("tp")

    def get_pipeline_model_parallel_group(self):
        return self._t.groups["pp"]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._size("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._rank_in("pp")

    # Ulysses: ZeRO reduces over the sequence-data-parallel group (the ranks sharing a model
    # shard); with a sequence axis of 1 it is the data-parallel group.
    def get_sequence_parallel_group(self):
        return self._t.groups["sp"]

    def get_sequence_parallel_world_size(self) -> int:
        return self._size("sp")

    def get_sequence_parallel_rank(self) -> int:
        return self._rank_in("sp")

    def get_sequence_data_parallel_group(self):
        return self._t.groups["sdp"]

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._size("sdp")

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank_in("sdp")


def device_of(group):
    """Where a tensor for a collective on ``group`` must live: CUDA for NCCL, else CPU."""
    import torch

    from patches.torch_process_group import backend_of

    if backend_of(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def describe(layout: RankLayout, rank: Optional[int] = None) -> str:
    c = layout.coords(rank) if rank is not None else None
    text = (f"world={layout.world_size} workers={layout.workers} "
            + ("" if layout.uniform else f"of {list(layout.worker_sizes)} ranks ")
            + f"tp={layout.tp} sp={layout.sp} pp={layout.pp} dp={layout.dp}"
            + (f" ep={layout.ep} etp={layout.expert_tp}" if layout.ep > 1 or
               layout.expert_tp != layout.tp else ""))
    return text if c is None else f"{text} rank={rank} {c}"

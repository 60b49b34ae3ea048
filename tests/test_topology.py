"""The rank layout (DESIGN.md, "Rank layout"): workers are contiguous blocks, every group but
the cross-worker ones stays inside one worker, and workers read disjoint data.

Pure arithmetic on ``RankLayout`` for several shapes, the sampler fed with each rank's data
shard, and one 8-process gloo run proving ``Topology.create`` builds exactly those groups.
"""

import itertools
import math
import os

import pytest

from megatron_streaming.comm.crossworker import CrossWorker
from megatron_streaming.data import MicroBatchSampler
from megatron_streaming.parallel.topology import IN_WORKER_AXES, RankLayout, Topology

# (world, workers, tp, pp[, sp]) -> dp follows
SHAPES = [
    (8, 2, 2, 2),   # DP=1
    (8, 2, 2, 1),   # DP=2
    (16, 2, 2, 2),  # DP=2, every axis > 1
    (12, 3, 2, 1),  # DP=2, an odd number of workers
    (4, 1, 2, 2),   # one worker, DP=1
    (8, 1, 2, 1),   # one worker, DP=4
    (1, 1, 1, 1),
    (6, 6, 1, 1),   # one rank per worker
    (16, 2, 2, 1, 2),   # Ulysses SP=2 with TP=2, DP=2
    (32, 2, 2, 2, 2),   # every axis > 1 but DP
]
EXPECTED_DP = {(8, 2, 2, 2): 1, (8, 2, 2, 1): 2, (16, 2, 2, 2): 2, (12, 3, 2, 1): 2,
               (4, 1, 2, 2): 1, (8, 1, 2, 1): 4, (1, 1, 1, 1): 1, (6, 6, 1, 1): 1,
               (16, 2, 2, 1, 2): 2, (32, 2, 2, 2, 2): 2}
# Groups whose members differ only along these axes (same worker, same other coordinates).
VARYING = {"tp": ("tp",), "sp": ("sp",), "dp": ("dp",), "pp": ("pp",), "sdp": ("sp", "dp"),
           "mp": ("tp", "pp"), "tp_dp": ("tp", "dp"), "worker": ("tp", "sp", "dp", "pp"),
           "single": ()}


def _ids(shape):
    world, workers, tp, pp, *sp = shape
    return f"world{world}-M{workers}-tp{tp}-pp{pp}" + (f"-sp{sp[0]}" if sp else "")


@pytest.fixture(params=SHAPES, ids=_ids)
def layout(request):
    world, workers, tp, pp, *sp = request.param
    return RankLayout(world, workers, tp, pp, *sp)


def _worker(layout, rank):
    return rank // layout.ranks_per_worker


def _in_worker_coords(layout, rank):
    c = layout.coords(rank)
    return tuple(c[a] for a in IN_WORKER_AXES)


# ---- sizes and coordinates -------------------------------------------------------------------

def test_sizes_tile_the_world(layout):
    shape = (layout.world_size, layout.workers, layout.tp, layout.pp) + \
        ((layout.sp,) if layout.sp > 1 else ())
    assert layout.dp == EXPECTED_DP[shape]
    assert layout.ranks_per_worker == layout.tp * layout.sp * layout.dp * layout.pp
    assert layout.workers * layout.ranks_per_worker == layout.world_size


def test_coords_and_rank_round_trip(layout):
    seen = set()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert c["worker"] == _worker(layout, rank)
        assert c["local"] == rank % layout.ranks_per_worker
        assert all(0 <= c[a] < layout.axis_sizes()[a] for a in IN_WORKER_AXES)
        assert layout.rank(c["worker"], tp=c["tp"], sp=c["sp"], dp=c["dp"], pp=c["pp"]) == rank
        seen.add((c["worker"], *_in_worker_coords(layout, rank)))
    assert len(seen) == layout.world_size  # coordinates are a bijection
    for worker in range(layout.workers):
        for tp, sp, dp, pp in itertools.product(range(layout.tp), range(layout.sp),
                                                range(layout.dp), range(layout.pp)):
            c = layout.coords(layout.rank(worker, tp=tp, sp=sp, dp=dp, pp=pp))
            assert (c["worker"], c["tp"], c["sp"], c["dp"], c["pp"]) == (worker, tp, sp, dp, pp)


def test_megatron_order_tp_fastest_then_sp_dp_pp(layout):
    R = layout.ranks_per_worker
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        inner = c["sp"] + layout.sp * (c["dp"] + layout.dp * c["pp"])
        assert rank == c["worker"] * R + c["tp"] + layout.tp * inner


# ---- groups ----------------------------------------------------------------------------------

def test_workers_are_contiguous_blocks(layout):
    R = layout.ranks_per_worker
    assert layout.all_groups()["worker"] == [list(range(w * R, (w + 1) * R))
                                             for w in range(layout.workers)]


def test_every_group_but_cross_worker_stays_inside_one_worker(layout):
    for name, groups in layout.all_groups().items():
        if name.startswith("cross_worker"):
            continue
        for group in groups:
            assert len({_worker(layout, r) for r in group}) == 1, (name, group)


def test_each_group_kind_partitions_the_world(layout):
    world = list(range(layout.world_size))
    for name, groups in layout.all_groups().items():
        if name in ("embd", "pos_embd"):
            continue
        assert sorted(r for g in groups for r in g) == world, name
        assert all(g == sorted(g) and len(set(g)) == len(g) for g in groups), name


def test_groups_vary_along_their_axes_only(layout):
    groups = layout.all_groups()
    sizes = layout.axis_sizes()
    for name, axes in VARYING.items():
        for group in groups[name]:
            assert len(group) == math.prod(sizes[a] for a in axes), (name, group)
            coords = [layout.coords(r) for r in group]
            for key in ("worker", *IN_WORKER_AXES):
                values = {c[key] for c in coords}
                if key in axes:
                    assert values == set(range(sizes[key])), (name, group, key)
                else:
                    assert len(values) == 1, (name, group, key)


def test_tp_groups_are_consecutive_ranks(layout):
    for group in layout.all_groups()["tp"]:
        assert group == list(range(group[0], group[0] + layout.tp))
        assert group[0] % layout.tp == 0


def test_embedding_groups_cover_first_and_last_stages(layout):
    groups = layout.all_groups()
    first = [r for r in range(layout.world_size) if layout.coords(r)["pp"] == 0]
    last = [r for r in range(layout.world_size) if layout.coords(r)["pp"] == layout.pp - 1]
    assert sorted(r for g in groups["embd"] for r in g) == sorted(set(first) | set(last))
    assert sorted(r for g in groups["pos_embd"] for r in g) == first
    for group in groups["embd"]:  # one pipeline's first and last stage
        assert {layout.coords(r)["pp"] for r in group} == {0, layout.pp - 1}
        assert len({(_worker(layout, r), layout.coords(r)["tp"], layout.coords(r)["dp"])
                    for r in group}) == 1


def test_cross_worker_groups_join_the_same_coordinates_of_every_worker(layout):
    groups = layout.all_groups()["cross_worker"]
    assert len(groups) == layout.ranks_per_worker
    assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
    for group in groups:
        assert [_worker(layout, r) for r in group] == list(range(layout.workers))
        assert len({_in_worker_coords(layout, r) for r in group}) == 1


def test_control_groups_equal_the_data_groups_when_workers_have_one_size(layout):
    groups = layout.all_groups()
    assert groups["cross_worker_control"] == groups["cross_worker"]
    assert all(layout.proxied(c) == [c] for c in range(layout.ranks_per_worker))


@pytest.mark.parametrize("sizes", [(2, 1), (4, 2, 1), (1, 3), (4, 6)])
def test_workers_of_their_own_sizes(sizes):
    """Contiguous blocks; data groups over the lanes every worker has; one control group per
    coordinate of the largest worker, with exactly one member of each worker, whose rank
    stands there (its own coordinate, or its coordinate modulo its size); each rank is in the
    control groups ``proxied`` names, its own first."""
    world, M = sum(sizes), len(sizes)
    layouts = [RankLayout(world, M, sizes=sizes, worker=w) for w in range(M)]
    starts = [sum(sizes[:w]) for w in range(M)]
    for w, layout in enumerate(layouts):
        assert layout.ranks_per_worker == sizes[w] and layout.offset(w) == starts[w]
        for local in range(sizes[w]):
            rank = starts[w] + local
            assert layout.coords(rank)["worker"] == w and layout.coords(rank)["local"] == local
            assert layout.rank(w, dp=local) == rank
    layout = layouts[0]
    assert layout.lanes == min(sizes) and layout.coordinates == max(sizes)
    data = layout.cross_worker_groups()
    assert data == [[starts[w] + c for w in range(M)] for c in range(min(sizes))]
    control = layout.control_groups()
    assert len(control) == max(sizes)
    for c, group in enumerate(control):
        assert [layout.coords(r)["worker"] for r in group] == list(range(M))
        assert [layout.coords(r)["local"] for r in group] == [c % n for n in sizes]
    for w, lw in enumerate(layouts):
        for local in range(sizes[w]):
            stands = lw.proxied(local)
            assert stands[0] == local
            assert stands == [c for c, g in enumerate(control) if starts[w] + local in g]
    # each worker's own groups only: the others are cut their own way
    worker_groups = layouts[1].all_groups()["worker"]
    assert worker_groups == [list(range(starts[1], starts[1] + sizes[1]))]


def test_worker_sizes_that_do_not_tile_are_refused():
    with pytest.raises(ValueError, match=r"worker sizes \[2, 1\] do not make 2 workers of 4"):
        RankLayout(4, 2, sizes=(2, 1))
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by "
                                         r"--tensor-model-parallel-size \(2\)"):
        RankLayout(4, 2, tp=2, sizes=(1, 3), worker=1)


def test_data_shard_is_per_worker_and_dp_rank(layout):
    by_position = {}
    for rank in range(layout.world_size):
        index, count = layout.data_shard(rank)
        c = layout.coords(rank)
        assert count == layout.workers * layout.dp
        assert index == c["worker"] * layout.dp + c["dp"]
        # Ranks that differ only in tp/sp/pp read the same shard; (worker, dp) -> one index.
        assert by_position.setdefault((c["worker"], c["dp"]), index) == index
    assert sorted(by_position.values()) == list(range(layout.workers * layout.dp))


@pytest.mark.parametrize("world,workers,tp,pp,flag,value", [
    (6, 1, 4, 1, "--tensor-model-parallel-size", 4),
    (8, 1, 1, 3, "--pipeline-model-parallel-size", 3),
    (8, 3, 1, 1, "--diloco-workers", 3),
    (2, 4, 1, 1, "--diloco-workers", 4),
    (12, 2, 2, 2, "--pipeline-model-parallel-size", 2),
])
def test_world_not_divisible_names_flags_and_values(world, workers, tp, pp, flag, value):
    with pytest.raises(ValueError) as err:
        RankLayout(world, workers, tp, pp)
    message = str(err.value)
    assert f"world size {world}" in message
    assert f"{flag} ({value})" in message
    assert f"= {workers * tp * pp}" in message


@pytest.mark.parametrize("kwargs,flag", [
    ({"workers": 0}, "--diloco-workers"),
    ({"tp": 0}, "--tensor-model-parallel-size"),
    ({"pp": -1}, "--pipeline-model-parallel-size"),
])
def test_sizes_below_one_name_the_flag(kwargs, flag):
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError, match=f"{flag} must be >= 1, got {value}"):
        RankLayout(8, **kwargs)


# ---- data: workers read disjoint samples -----------------------------------------------------

@pytest.mark.parametrize("consumed", [0, 24])  # from the start, and as after a resume
def test_workers_read_disjoint_samples(consumed):
    layout = RankLayout(8, workers=2, tp=2, pp=1)  # DP=2
    assert layout.dp == 2
    micro_batch, steps = 3, 5
    per_rank = {}
    for rank in range(layout.world_size):
        index, count = layout.data_shard(rank)
        sampler = MicroBatchSampler(1000, consumed, micro_batch, index, count)
        batches = list(itertools.islice(iter(sampler), steps))
        assert len(batches) == steps and all(len(b) == micro_batch for b in batches)
        per_rank[rank] = batches
    # Tensor-parallel peers see the same batches (they split the model, not the data).
    for group in layout.all_groups()["tp"]:
        assert all(per_rank[r] == per_rank[group[0]] for r in group)

    def samples(ranks):
        return {i for r in ranks for batch in per_rank[r] for i in batch}

    workers = [samples(g) for g in layout.all_groups()["worker"]]
    assert workers[0].isdisjoint(workers[1])
    assert all(len(w) == steps * micro_batch * layout.dp for w in workers)
    consumed_range = set(range(consumed, consumed + steps * micro_batch * layout.dp * 2))
    assert workers[0] | workers[1] == consumed_range
    # Inside a worker the DP ranks are disjoint too.
    for dp_group in layout.all_groups()["dp"]:
        a, b = (samples([r]) for r in dp_group)
        assert a.isdisjoint(b)


# ---- real process groups ---------------------------------------------------------------------

def _check_topology_on_rank(rank, world, store_path):
    import torch
    import torch.distributed as dist

    # As a launch makes it: each worker (4 ranks) is its own world, on its own store; the
    # job's store is for the cross-worker groups.
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_path}.worker{rank // 4}", 4),
                            rank=rank % 4, world_size=4)
    try:
        layout = RankLayout(world, workers=2, tp=2, pp=2)
        topo = Topology.create(layout, rank, store=store)
        assert topo.per_worker_world and topo.world_offset == -4 * topo.worker
        expected = {name: next(g for g in groups if rank in g)
                    for name, groups in layout.all_groups().items()
                    if any(rank in g for g in groups)}
        assert topo.group_ranks == expected  # global ranks, as the layout numbers them
        assert set(topo.groups) == set(expected)
        assert ("pos_embd" in topo.groups) == topo.is_first_stage
        for name, group in topo.groups.items():
            members = dist.get_process_group_ranks(group)
            if name.startswith("cross_worker"):  # made by the epoch's members on the store,
                # outside the world: numbered by worker
                assert (group.size(), group.rank()) == (2, topo.worker), (rank, name)
            else:  # subgroups of the worker's world, numbered within it
                assert members == [r % 4 for r in topo.group_ranks[name]], (rank, name)
        assert topo.group_ranks["cross_worker"] == [rank % 4, rank % 4 + 4]

        # The groups are real: sums over them need exactly their members.
        for name in ("tp", "cross_worker", "pp", "worker"):
            value = torch.tensor([float(rank + 1)])
            dist.all_reduce(value, group=topo.groups[name])
            assert value.item() == sum(r + 1 for r in topo.group_ranks[name]), (rank, name)
        topo.cross = CrossWorker(topo)
        topo.cross.job_barrier()
        assert topo.cross.gather_control(rank) == [rank % 4, rank % 4 + 4]

        mpu = topo.mpu()
        assert mpu.get_data_parallel_world_size() == 1
        assert mpu.get_data_parallel_rank() == 0
        assert mpu.get_data_parallel_group_ranks() == [rank % 4]  # in the worker's world
        assert mpu.get_tensor_model_parallel_world_size() == 2
        assert mpu.get_tensor_model_parallel_rank() == topo.tp_rank == rank % 2
        assert mpu.get_pipeline_model_parallel_world_size() == 2
        assert mpu.get_pipeline_model_parallel_rank() == topo.pp_rank == (rank % 4) // 2
        assert mpu.get_model_parallel_world_size() == 4  # TP x PP
        assert mpu.get_model_parallel_group() is topo.groups["mp"]
        assert mpu.get_sequence_data_parallel_world_size() == 1
        assert not hasattr(mpu, "initialize_sequence_parallel")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_topology_creates_real_groups_on_8_gloo_ranks(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    if "OMP_NUM_THREADS" not in os.environ:  # 8 processes share 2 cores
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_check_topology_on_rank, args=(8, str(tmp_path / "store")), nprocs=8, join=True)


# ---- the cross-worker groups' timeouts -------------------------------------------------------

class _RecordedGroups:
    """Stands in for torch's group constructors: records (kind, backend, timeout) of each
    group ``Topology`` makes, and makes none."""

    def __init__(self, monkeypatch, world_size: int):
        import torch
        import torch.distributed as dist

        import patches.torch_process_group as adapter

        self.made = []
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
        monkeypatch.setattr(dist, "new_group", self.new_group)
        monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: store)
        monkeypatch.setattr(adapter, "standalone_group", self.standalone_group)
        monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
        monkeypatch.delenv("NCCL_LAUNCH_ORDER_IMPLICIT", raising=False)

    def new_group(self, ranks, timeout=None, backend=None):
        self.made.append(("new_group", backend, timeout))
        return object()

    def standalone_group(self, backend, store, rank, size, timeout, world_ranks=None,
                         name=""):
        self.made.append(("standalone", backend, timeout))
        return object()


@pytest.mark.parametrize("world", ["per worker", "the job"])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_nccl_cross_worker_groups_time_out_after_the_exchange_before_the_worker(
        monkeypatch, world, backend):
    """NCCL's watchdog ends the process when a collective outlives its group's timeout,
    counted from the launch: made with --diloco-timeout it would fire with the exchange's own
    deadline, and the job's message naming the step and the peers could come too late. Over
    NCCL the cross-worker groups get --diloco-timeout plus a margin, below the in-worker
    timeout; over gloo (a collective that runs out fails, and the exchange says so) the
    timeout itself. Also for the groups of a later membership epoch."""
    import datetime

    from megatron_streaming.parallel.topology import NCCL_TIMEOUT_MARGIN

    groups = _RecordedGroups(monkeypatch, 1 if world == "per worker" else 2)
    in_worker, diloco = datetime.timedelta(minutes=10), datetime.timedelta(seconds=300)
    topo = Topology.create(RankLayout(2, workers=2), 0, timeout=in_worker,
                           cross_worker_backend=backend, cross_worker_timeout=diloco,
                           store=object())
    cross = diloco + NCCL_TIMEOUT_MARGIN if backend == "nccl" else diloco
    assert diloco < cross < in_worker or backend == "gloo"
    crossing = [(kind, t) for kind, b, t in groups.made if b == backend]
    # NCCL in a world of the whole job: subgroups of it; else made by their members alone
    kind = "new_group" if backend == "nccl" and world == "the job" else "standalone"
    assert crossing == [(kind, cross)] * 2  # data and control
    assert {t for k, b, t in groups.made if b != backend} == {in_worker}
    if backend == "nccl":
        import os

        assert os.environ["NCCL_LAUNCH_ORDER_IMPLICIT"] == "1"
    if kind == "standalone":  # a later epoch's groups (an elastic job's)
        groups.made.clear()
        topo.add_cross_worker_groups(object(), 1, [0, 1], diloco)
        assert groups.made == [("standalone", backend, cross)] * 2


def test_nccl_cross_worker_timeout_must_leave_the_margin_below_the_in_worker_one(
        monkeypatch):
    import datetime

    from megatron_streaming.errors import ConfigError

    _RecordedGroups(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"--diloco-backend nccl: --diloco-timeout 590 s plus "
                       r"60 s \(the NCCL groups' own watchdog\) must be below "
                       r"--distributed-timeout-minutes 10 \(600 s\)"):
        Topology.create(RankLayout(2, workers=2), 0, timeout=datetime.timedelta(minutes=10),
                        cross_worker_backend="nccl",
                        cross_worker_timeout=datetime.timedelta(seconds=590), store=object())

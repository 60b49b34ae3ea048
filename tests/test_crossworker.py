"""The cross-worker communicator: every control collective goes through it, and it counts
the bytes (2 gloo processes, one rank per worker)."""

import pytest
import torch
import torch.distributed as dist

from conftest import spawn_gloo


def _worker(rank, world, group):
    from megatron_streaming.comm.crossworker import CrossWorker
    from megatron_streaming.parallel.topology import RankLayout, Topology

    topo = Topology.create(RankLayout(world, workers=world), rank)
    cross = topo.cross = CrossWorker(topo)
    out = {"start": cross.control_bytes}
    _, total = cross.all_reduce_control(torch.tensor([rank + 1, 10], dtype=torch.int32))
    out["sum"] = total.tolist()
    work, top = cross.all_reduce_control(torch.tensor([rank * 5.0]), dist.ReduceOp.MAX,
                                         async_op=True)
    work.wait()
    out["max"] = top.tolist()
    out["after_two"] = cross.control_bytes
    out["reporting"] = cross.ranks_reporting(rank == 1)
    cross.job_barrier()
    cross.count_control(100 * (rank + 1))  # what the store carried for this rank
    before = cross.control_bytes
    out["total"] = cross.total_control_bytes()
    out["before_total"] = before
    return out


@pytest.mark.timeout(120)
def test_control_collectives_go_through_the_communicator_and_are_counted(tmp_path):
    results = spawn_gloo(_worker, 2, tmp_path)
    for r in results:
        assert r["start"] == 0
        assert r["sum"] == [3, 20] and r["max"] == [5.0]
        # int32 x 2 and fp32 x 1, to and from the one peer: 2 x (8 + 4) x (M - 1).
        assert r["after_two"] == 24
        assert r["reporting"] == [1]
    # ranks_reporting (int32 x world, 8 bytes) and the barrier (2) add 2 x 8 + 2 = 18 each.
    assert [r["before_total"] for r in results] == [24 + 18 + 100, 24 + 18 + 200]
    assert results[0]["total"] == results[1]["total"] == 2 * (24 + 18) + 300

"""The stop flag (``lifecycle.StopAgreement``): every rank of every worker stops after the same
iteration, and no step's host waits on that step's own reduction (read a step later)."""

import signal
from types import SimpleNamespace

import pytest

from conftest import spawn_gloo

ASKED_AT = 3  # the call before which rank 0 gets SIGTERM
CALLS = 6


class _Done:
    def wait(self, *args):
        return True


class _FakeCross:
    """Another worker that never asks to stop: records what this rank posted to it."""

    def __init__(self):
        self.posted = []

    def all_reduce_control(self, tensor, op, async_op=False):
        self.posted.append(tensor.tolist())
        return _Done(), tensor.clone()


def _decisions(rank, group, workers, lag, saves=None):
    from megatron_streaming.job.lifecycle import StopAgreement, StopRequest

    request = StopRequest(signals=())
    cross = _FakeCross()
    topology = SimpleNamespace(groups={"worker": group}, layout=SimpleNamespace(workers=workers),
                               cross=cross)
    stop = StopAgreement(topology, request, lag)
    read = []
    if saves is not None:
        stop.saves = lambda: saves
    out = []
    for call in range(1, CALLS + 1):
        if rank == 0 and call == ASKED_AT:
            request.request(signal.SIGTERM)
        out.append(stop.should_stop())
        read.append(stop.saves_everywhere)
    stop.close()
    return out, cross.posted, read


# --async-save: each rank's progress of the checkpoint being committed (written, finalised,
# committed, failed: ``Checkpointer.progress``)
SAVES = ([12, 12, 0, 0], [0, 12, 12, 0])


def _worker(rank, world, group):
    return {"alone": _decisions(rank, group, 1, 1), "lag2": _decisions(rank, group, 2, 2),
            "saves": _decisions(rank, group, 1, 1, SAVES[rank])}


@pytest.mark.timeout(120)
def test_every_rank_stops_after_the_same_step_reading_the_worker_flag_a_step_late(tmp_path):
    results = spawn_gloo(_worker, 2, tmp_path)
    for rank, got in enumerate(results):
        alone, _, _ = got["alone"]
        # posted with call 3, read at call 4: the decision after the step that follows
        assert alone == [None] * ASKED_AT + ["SIGTERM"] * (CALLS - ASKED_AT), (rank, alone)
        lag2, posted, _ = got["lag2"]
        # one post across workers per call, each carrying the worker's flag of a step before
        assert posted == [[0], [0], [0], [15], [15], [15]], (rank, posted)
        # ... read --diloco-control-lag calls later
        assert lag2 == [None] * (ASKED_AT + 2) + ["SIGTERM"], (rank, lag2)
        # the first two the least over the ranks, the others the most; read a step late
        decisions, _, read = got["saves"]
        assert decisions == alone
        assert read == [(0, 0, 0, 0)] + [(0, 12, 12, 0)] * (CALLS - 1), (rank, read)

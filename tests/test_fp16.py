"""--fp16 through DeepSpeed's dynamic loss scaler, and a skipped step under the streaming sync.

One launch of two workers (one rank each, ZeRO-1, 2 fragments, overlap 1): on worker 1 a
gradient becomes inf right before the optimizer step of iteration 3 (tests/overflow_driver.py),
as an fp16 overflow does. DeepSpeed must skip that step on worker 1 only and halve its loss
scale (--hysteresis 1), and both workers must still send and merge every fragment at the same
iterations: the schedule counts iterations, not optimizer updates.
"""

import pytest
import torch

from harness import TINY, run

ITERS = 8


@pytest.mark.timeout(300)
def test_overflow_on_one_worker_keeps_the_sync_in_lockstep(tmp_path):
    args = [*TINY, "--train-iters", str(ITERS), "--eval-iters", "0", "--fp16",
            "--initial-loss-scale", "1024", "--hysteresis", "1", "--zero-stage", "1",
            "--diloco-workers", "2", "--diloco-inner-steps", "4", "--diloco-fragments", "2",
            "--diloco-overlap-steps", "1"]
    run(2, [str(tmp_path), "1:3", *args], script="tests/overflow_driver.py", timeout=280)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    by_worker = {r["worker"]: r for r in ranks}
    healthy, hit = by_worker[0], by_worker[1]
    assert hit["skipped"] == [i == 2 for i in range(ITERS)]
    assert hit["loss_scale"][:4] == [1024.0, 1024.0, 512.0, 512.0]
    assert healthy["skipped"] == [False] * ITERS
    assert healthy["loss_scale"] == [1024.0] * ITERS
    assert hit["events"] == healthy["events"]
    kinds = {kind for _, kind, _, _ in healthy["events"]}
    assert {"send", "merge"} <= kinds
    sends = [e for e in healthy["events"] if e[1] == "send"]
    # A fragment every H/P = 2 iterations (two shard groups each), none dropped.
    assert [e[0] for e in sends] == [2, 2, 4, 4, 6, 6, 8, 8]
    assert all(loss == loss for loss in hit["losses"])  # finite after the skip

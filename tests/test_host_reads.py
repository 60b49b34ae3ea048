"""What a training step makes the host read from the device: between log steps nothing of
ours but the stop flag's host copy (read a step late, so it never waits for the step just
queued), and DeepSpeed's own reads; the loss and the gradient norm at log steps only, as
Megatron-LM reads its loss. On a CPU nothing waits, so the reads are counted
(``tests/host_reads_driver.py``); on a GPU the device's own sync reports are checked too.
"""

import json
from collections import Counter

import pytest
import torch

from harness import TINY, read_jsonl, run

ITERS, LOG_INTERVAL = 6, 4  # logs after steps 4 and 6 (the last); 1, 2, 3 and 5 do not
FLAGS = [*TINY, "--train-iters", str(ITERS), "--log-interval", str(LOG_INTERVAL),
         "--eval-iters", "0"]
PLAIN = [1, 2, 3, 5]

STOP_FLAG = ("megatron_streaming/job/lifecycle.py:should_stop", "__int__")
LOSS = ("megatron_streaming/worker/engine.py:_per_rank", "__float__")
GRAD_NORM = ("megatron_streaming/worker/engine.py:grad_norm", "__float__")
# DeepSpeed 0.19.8's own reads in a ZeRO-1/2 step, per step (two param groups: decay and no
# decay): the gradient norm checked for inf/NaN after it is computed, and again in
# ``unscale_and_clip_grads`` per group; under --fp16 (and --bf16: check_grad_overflow) the
# overflow flag; on the CPU, torch's unfused AdamW reads its step count once per group (the
# fused CUDA kernel that runs on a GPU does not). No ``synchronize`` of the whole device:
# DeepSpeed's throughput timer, which makes one before every micro-batch's forward and at the
# step from the third step on, is off.
DEEPSPEED = {("deepspeed/runtime/utils.py:is_invalid_grad_norm", "__bool__"): 3,
             ("deepspeed/runtime/zero/stage_1_and_2.py:_optimizer_step", "item"): 2}
OVERFLOW = {("deepspeed/runtime/zero/stage_1_and_2.py:has_overflow", "item"): 1}

CASES = {
    "one_rank": (1, [], DEEPSPEED),
    "dp2_fp16_zero2": (2, ["--fp16", "--initial-loss-scale", "1024", "--zero-stage", "2"],
                       {**DEEPSPEED, **OVERFLOW}),
}


def host_reads(tmp_path, nproc, flags):
    """Each rank's reads by iteration, ``{iteration: Counter((site, kind))}`` of ours and of
    upstream's, the iterations logged, what ``Run.train`` returned and the logged losses."""
    out, log = tmp_path / "reads", tmp_path / "log.jsonl"
    run(nproc, [str(out), *flags, "--log-jsonl", str(log)], script="tests/host_reads_driver.py",
        timeout=240)
    ranks = []
    for rank in range(nproc):
        saved = json.loads((tmp_path / f"reads.rank{rank}").read_text())
        by = {"ours": {}, "upstream": {}}
        for r in saved["records"]:
            by[r["origin"]].setdefault(r["iteration"], Counter())[(r["site"], r["kind"])] += 1
        ranks.append({**by, "logged": saved["logged"], "train_loss": saved["train_loss"]})
    return ranks, [r["train/loss"] for r in read_jsonl(log)]


def check_steps(ranks, losses, deepspeed):
    for rank, reads in enumerate(ranks):
        assert reads["logged"] == [LOG_INTERVAL, ITERS]
        for step in PLAIN:  # only the stop flag's host copy; nothing from the step itself
            assert reads["ours"].get(step) == Counter({STOP_FLAG: 1}), (rank, step)
            if deepspeed is not None:
                assert reads["upstream"].get(step) == Counter(deepspeed), (rank, step)
    logging = ranks[0]["ours"]  # the logging rank reads the loss and the norm to log them,
    for step in (LOG_INTERVAL, ITERS):  # once each
        assert (logging[step][LOSS], logging[step][GRAD_NORM]) == (1, 1), step
    assert logging.get(None) is None  # the last step's loss was read when it was logged
    assert ranks[0]["train_loss"] == losses[-1] and len(losses) == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_between_log_steps_read_nothing_of_ours_but_the_stop_flag(case, tmp_path):
    nproc, flags, deepspeed = CASES[case]
    ranks, losses = host_reads(tmp_path, nproc, [*FLAGS, *flags])
    check_steps(ranks, losses, deepspeed)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(300)
def test_cuda_steps_between_log_steps_wait_only_in_deepspeed(tmp_path, record_property):
    """On the GPU (NCCL inside the worker, bf16): the same reads of ours, and none of our
    code's calls between log steps makes the device report a sync; DeepSpeed's are recorded."""
    ranks, losses = host_reads(tmp_path, 1, [*FLAGS, "--bf16", "--distributed-backend",
                                             "nccl"])
    check_steps(ranks, losses, None)
    upstream = Counter()
    for step in PLAIN:
        upstream.update(ranks[0]["upstream"].get(step, Counter()))
    record_property("upstream_reads_per_step",
                    {f"{site} {kind}": n / len(PLAIN) for (site, kind), n in upstream.items()})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_stop_flag_leaves_from_pinned_memory_without_a_wait():
    """The stop flag goes to the device from two pinned buffers made once, used in turn (a
    copy from pageable memory waits for the device: the sync debug mode would raise)."""
    from megatron_streaming.job.lifecycle import _PinnedFlags

    flags = _PinnedFlags(torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.set_sync_debug_mode("error")
    try:
        sent = []
        for i in range(4):
            sent.append(flags.to_device([i, -i]))
            # What StopAgreement does between two calls: wait for the copy's reduction.
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [t.tolist() for t in sent] == [[i, -i] for i in range(4)]
    buffers = flags._buffers[2]
    assert len(buffers) == 2 and all(b.is_pinned() for b in buffers)

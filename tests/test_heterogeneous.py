"""Workers of different layouts and batches (one launch each, two ranks each), against the
single-process reference that trains each worker on its own block of every step's samples
and weighs the outer mean by each worker's tokens.

* TP=2 (global batch 8, micro-batch 2) beside PP=2 (global batch 4, micro-batch 1): the
  exchange goes by the layout-free lanes (``streaming.canonical``);
* ZeRO-1 over DP=2 beside TP=2, equal batches: lanes again, uniform data.

Every parameter, local and global, of both workers is held to the reference's: the whole
model to 1e-6 as in test_streaming, each tensor to 5e-5 (not 1e-5): a layer norm's bias with
a gradient near zero is where Adam's normalisation turns a summation order (ZeRO's flat
partition on one worker, TP's partial sums on the other) into a few 1e-5 of its small norm;
a misrouted element would be off by its whole value. The workers' global parameters are
bitwise equal; the cross-worker bytes are, to the byte, those of exchanging each fragment's
canonical vector, cut in two lanes, once per send: the lanes cut the fragment, they add
nothing to it.
"""

import json

import pytest
import torch

from harness import free_port, start
from test_streaming import BASE, dumps, reference, relative

DRIVER = "tests/streaming_driver.py"

def _strip_batches(flags):
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f in ("--micro-batch-size", "--global-batch-size"):
            skip = True
            continue
        out.append(f)
    return out


SHARED = [*_strip_batches(BASE), "--num-layers", "2", "--diloco-inner-steps", "4",
          "--diloco-fragments", "2", "--diloco-overlap-steps", "1", "--diloco-alpha", "0.5"]
CASES = {
    "tp2_vs_pp2_batches_8_4": (
        ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
         "--global-batch-size", "8"],
        ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
         "--global-batch-size", "4"]),
    "zero1_dp2_vs_tp2": (
        ["--zero-stage", "1", "--micro-batch-size", "2", "--global-batch-size", "4"],
        ["--tensor-model-parallel-size", "2", "--micro-batch-size", "4",
         "--global-batch-size", "4"]),
}


def _run_pair(tmp_path, per_worker, timeout=400):
    port = str(free_port())
    procs, logs = [], []
    for w, flags in enumerate(per_worker):
        logs.append(tmp_path / f"w{w}.log")
        procs.append(start(2, [str(tmp_path), *SHARED, *flags, "--master-addr", "127.0.0.1",
                               "--master-port", port, "--diloco-worker-index", str(w)],
                           logs[w], None, DRIVER))
    try:
        for p, log in zip(procs, logs):
            assert p.wait(timeout=timeout) == 0, log.read_text()[-5000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [log.read_text() for log in logs]


@pytest.mark.timeout(900)
def test_workers_of_different_layouts_and_batches_match_the_reference(tmp_path):
    for name, per_worker in CASES.items():
        out = tmp_path / name
        out.mkdir()
        _run_pair(out, per_worker)
        ref = reference([*SHARED, *per_worker[0]], out, 4,
                        {"REFERENCE_WORKER_ARGS": json.dumps([[*SHARED, *f]
                                                              for f in per_worker])})
        got = [dumps(out, w) for w in range(2)]
        for w in range(2):
            for kind, expected in (("local", ref["local"][w]), ("global", ref["global"])):
                worst, whole = relative(got[w][kind], expected)
                print(name, w, kind, f"worst {worst:.2e} whole {whole:.2e}")
                assert whole <= 1e-6 and worst <= 5e-5, (name, w, kind, worst, whole)
        for n in ref["global"]:
            assert torch.equal(got[0]["global"][n], got[1]["global"][n]), (name, n)
        assert any(kind == "merge" for _, kind, _, _ in got[0]["events"])
        assert got[0]["cross_worker_bytes"] == lane_bytes(ref["global"], SHARED), name


def lane_bytes(params: dict, flags, workers: int = 2, lanes: int = 2) -> int:
    """fp32 lanes: per send, per lane of n elements (the canonical vector cut in ``lanes``),
    a 4-byte finiteness flag to each peer and n / M fp32 values out in the reduce-scatter and
    in the all-gather; every worker's ranks do the same."""
    from megatron_streaming.arguments import parse_args
    from megatron_streaming.streaming.builder import fragment_plan, sync_schedule

    cfg = parse_args(flags)
    plan, schedule = fragment_plan(cfg), sync_schedule(cfg)
    numel = {}
    for name, tensor in params.items():
        p = plan.fragment_of(name)
        numel[p] = numel.get(p, 0) + tensor.numel()
    total = 0
    for step in range(1, cfg.training.train_iters + 1):
        for p in schedule.sends_after(step):
            bounds = [lane * numel[p] // lanes for lane in range(lanes + 1)]
            for n in (b - a for a, b in zip(bounds, bounds[1:])):
                chunk = -(-n // workers)
                total += 4 * (workers - 1) + 2 * (workers - 1) * 4 * chunk
    return total * workers

"""Workers of different layouts and batches (one launch each, two ranks each), against the
single-process reference that trains each worker on its own block of every step's samples
and weighs the outer mean by each worker's tokens.

* TP=2 (global batch 8, micro-batch 2) beside PP=2 (global batch 4, micro-batch 1): the
  exchange goes by the layout-free lanes (``streaming.canonical``);
* ZeRO-1 over DP=2 (global batch 4, micro-batch 1) beside TP=2 (global batch 8,
  micro-batch 4), with eager outer updates (each worker's global copy its own);
* a mixture-of-experts model at EP=2 (global batch 4) beside TP=2 (global batch 8);
* the first pair again with FP4 and error feedback, whose residual lives on the lanes: the
  reference has no codec, so this one is held to the resume below (a residual left out of
  the restore puts it 1.1e-1 / 4.0e-3 off), to a non-zero residual in its checkpoint, and to
  the fp32 reference within what FP4 costs (4.4e-3 of the whole model measured).

The first and the third job save after step 6 with a fragment in flight and resume from
there, each worker in its own layout, to the uninterrupted run's parameters (the third's
residuals go from the lanes to the checkpoint and back).

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
from contextlib import contextmanager

import pytest
import torch

from harness import free_port, start
from test_streaming import BASE, dumps, reference_result, relative, start_reference

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
EAGER = ["--diloco-eager", "--diloco-overlap-steps", "0"]
CASES = {
    "tp2_vs_pp2_batches_8_4": (
        ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
         "--global-batch-size", "8"],
        ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
         "--global-batch-size", "4"]),
    "eager_zero1_dp2_vs_tp2_batches_4_8": (
        [*EAGER, "--zero-stage", "1", "--micro-batch-size", "1", "--global-batch-size", "4"],
        [*EAGER, "--tensor-model-parallel-size", "2", "--micro-batch-size", "4",
         "--global-batch-size", "8"]),
}
# Mixture of experts: experts over EP=2 on one worker, TP=2 (with sequence parallelism) on
# the other; the lanes carry every expert once.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
CASES["moe_ep2_vs_tp2_batches_4_8"] = (
    [*MOE, "--expert-model-parallel-size", "2", "--micro-batch-size", "1",
     "--global-batch-size", "4"],
    [*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size",
     "2", "--global-batch-size", "8"])
FP4_EF = ["--diloco-quantize", "fp4", "--diloco-error-feedback"]
CASES["fp4_error_feedback_tp2_vs_pp2"] = tuple(
    [*f, *FP4_EF] for f in CASES["tp2_vs_pp2_batches_8_4"])

SAVES = ("tp2_vs_pp2_batches_8_4", "fp4_error_feedback_tp2_vs_pp2")


def _start_pair(out, per_worker, save=()):
    port = str(free_port())
    return [(start(2, [str(out), *SHARED, *flags, *save, "--master-addr", "127.0.0.1",
                       "--master-port", port, "--diloco-worker-index", str(w)],
                   out / f"w{w}.log", None, DRIVER),
             out / f"w{w}.log") for w, flags in enumerate(per_worker)]


@pytest.mark.timeout(900)
def test_workers_of_different_layouts_and_batches_match_the_reference(tmp_path):
    started = []
    try:
        _train_and_compare(tmp_path, started)
    finally:  # at the end only: a reference may well outlast every launch
        for proc in started:
            if proc.poll() is None:
                proc.kill()


def _train_and_compare(tmp_path, started: list):
    launches, references = [], {}
    # Both jobs at once, and their references: much of a launch is waiting.
    for name, per_worker in CASES.items():
        out = tmp_path / name
        out.mkdir()
        references[name] = start_reference(
            [*SHARED, *per_worker[0]], out, 4,
            {"REFERENCE_WORKER_ARGS": json.dumps([[*SHARED, *f] for f in per_worker])})
        started.append(references[name])
        # The first job saves after step 6, with fragment 1's lanes in flight (sent after
        # 6, merged after 7): they come back to the shards for it, and the run goes on.
        save = ["--save", str(out / "ckpt"), "--save-interval", "6"] \
            if name in SAVES else []
        launches += _start_pair(out, per_worker, save)
        started += [p for p, _ in launches[-2:]]
    for proc, log in launches:
        assert proc.wait(timeout=600) == 0, log.read_text()[-5000:]
    # Those jobs again from their checkpoints of step 6 (fragment 1 in flight), each
    # worker in its own layout: they must end where the uninterrupted runs ended.
    launches = []
    for name in SAVES:
        resumed = tmp_path / name / "resumed"
        resumed.mkdir()
        (tmp_path / name / "ckpt" / "latest_checkpointed_iteration.txt").write_text("6\n")
        launches += _start_pair(resumed, CASES[name],
                                ["--load", str(tmp_path / name / "ckpt")])
        started += [p for p, _ in launches[-2:]]
    for proc, log in launches:
        assert proc.wait(timeout=600) == 0, log.read_text()[-5000:]
    for name in SAVES:
        for w in range(2):
            again, first = dumps(tmp_path / name / "resumed", w), dumps(tmp_path / name, w)
            for kind in ("local", "global"):
                worst, whole = relative(again[kind], first[kind])
                assert worst <= 1e-6, (name, w, kind, worst, whole)
    for name, per_worker in CASES.items():
        out = tmp_path / name
        ref = reference_result(references[name], out)
        got = [dumps(out, w) for w in range(2)]
        eager = "--diloco-eager" in per_worker[0]
        quantized = "--diloco-error-feedback" in per_worker[0]
        for w in range(2):
            for kind, expected in (("local", ref["local"][w]), ("global", ref["globals"][w])):
                worst, whole = relative(got[w][kind], expected)
                print(name, w, kind, f"worst {worst:.2e} whole {whole:.2e}")
                if quantized:  # FP4 moves it off the fp32 reference, a little
                    assert 1e-6 < whole <= FP4_WHOLE, (name, w, kind, worst, whole)
                else:
                    assert whole <= 1e-6 and worst <= 5e-5, (name, w, kind, worst, whole)
        if quantized:
            residual = _residual_norms(out / "ckpt" / "iter_0000006")
            assert all(n > 0 for n in residual.values()) and len(residual) == 2, residual
            assert all(torch.equal(got[0]["global"][n], got[1]["global"][n])
                       for n in ref["global"])
            continue
        differ = [n for n in ref["global"]  # eager: each leads by its own latest share
                  if not torch.equal(got[0]["global"][n], got[1]["global"][n])]
        assert bool(differ) == eager, (name, differ)
        assert any(kind == ("send" if eager else "merge") for _, kind, _, _ in got[0]["events"])
        assert got[0]["cross_worker_bytes"] == lane_bytes(ref["global"], SHARED), name
        print(name, "cross-worker bytes", got[0]["cross_worker_bytes"], "in-worker bytes of "
              "the dumping ranks", [got[w]["in_worker_bytes"] for w in range(2)])
        if name in SAVES:
            meta = json.loads((out / "ckpt" / "iter_0000006" / "checkpoint.json").read_text())
            assert [p["fragment"] for p in meta["pending"]] == [1], meta["pending"]


FP4_WHOLE = 1e-2  # FP4 with error feedback against the fp32 reference, whole model


def _residual_norms(directory) -> dict:
    """Each worker's error-feedback residual in a checkpoint: its norm over the model."""
    import torch.distributed.checkpoint as dcp

    from megatron_streaming.checkpoint.offline import read_tensors

    out = {}
    for w in range(2):
        part = str(directory / f"worker{w}")
        keys = [k for k in dcp.FileSystemReader(part).read_metadata().state_dict_metadata
                if k.startswith(f"worker{w}.outer.residual")]
        out[w] = sum(float(t.double().pow(2).sum()) for t in read_tensors(part, keys).values())
    return out


def lane_bytes(params: dict, flags, workers: int = 2, lanes: int = 2) -> int:
    """fp32 lanes: per send, per lane of n elements (the canonical vector cut in ``lanes``),
    a 4-byte finiteness flag to each peer and n / M fp32 values out in the reduce-scatter and
    in the all-gather; every worker's ranks do the same."""
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.streaming.settings import fragment_plan, sync_schedule

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


@pytest.mark.parametrize("shape,dim,gated", [((8, 6), 0, False), ((8, 6), 1, False),
                                             ((8, 6), 0, True), ((4, 6, 5), 1, False)])
def test_canonical_positions_find_every_shard_element_in_the_full_tensor(shape, dim, gated):
    """Any slice of any TP rank's shard (a ZeRO partition cuts shards anywhere) maps onto the
    full tensor's elements it was cut from, as ``weights.tp_shard`` cuts them."""
    from megatron_streaming.streaming.canonical import parameter_positions
    from megatron_streaming.worker.weights import tp_shard

    full = torch.randn(shape)
    name = "decoder.layers.0.mlp.linear_fc1.weight" if gated else "x.weight"
    for tp in (1, 2):
        for t in range(tp):
            shard = tp_shard(name, full, dim, t, tp, gated)
            param = torch.nn.Parameter(shard.clone())
            param.tensor_model_parallel, param.partition_dim = True, dim
            for first, count in ((0, shard.numel()), (5, 7), (shard.numel() - 3, 3)):
                where = parameter_positions(param, first, count, t, tp, gated)
                assert torch.equal(full.reshape(-1)[where], shard.reshape(-1)[first:first + count])


def test_workers_of_different_batches_read_disjoint_blocks_and_weigh_by_tokens():
    from megatron_streaming.data.sampler import WorkerBlockSampler
    from megatron_streaming.job.workers import JobShape, WorkerShape

    job = JobShape((WorkerShape(tp=2, micro_batch_size=2, global_batch_size=8),
                    WorkerShape(pp=2, dp=2, micro_batch_size=1, global_batch_size=4)))
    assert not job.same_layout and not job.same_batches and job.job_batch == 12
    read = []
    for w, s in enumerate(job.workers):
        for d in range(s.dp):
            sampler = WorkerBlockSampler(12 * 5, 12, s.micro_batch_size, d, s.dp,
                                         job.offset(w), s.global_batch_size, job.job_batch)
            read += [i for batch in sampler for i in batch]
    assert sorted(read) == list(range(12, 60))  # steps 1-4, every sample once
    # Shares: M x batch / sum over the members; one alone or equal batches: 1 exactly.
    assert job.share(0, [0, 1], "tokens") == pytest.approx(2 * 8 / 12)
    assert job.share(1, [0, 1], "tokens") == pytest.approx(2 * 4 / 12)
    assert job.share(1, [1], "tokens") == 1.0 and job.share(0, [0, 1], "uniform") == 1.0


def test_the_planner_splits_a_batch_by_speed_in_whole_grains():
    from megatron_streaming.plan.search import _split

    assert _split(512, [3.0, 1.0], [1, 1]) == [384, 128]
    parts = _split(512, [2.8, 1.0], [2, 4])
    assert sum(parts) == 512 and parts[0] % 2 == 0 and parts[1] % 4 == 0
    assert abs(parts[0] / 2.8 - parts[1] / 1.0) <= 4


# Workers of different sizes: 2 ranks (TP=2, batch 8) beside 1 rank (batch 4). One lane per
# fragment (the smaller worker's one rank); worker 0's second rank holds none, and worker 1's
# rank stands in for it in the control group of coordinate 1 (stop flag, checkpoint
# agreement, barriers). Resumed from step 6 the other way round (1 rank beside PP=2 on 2):
# the checkpoint is layout-free, and the reference does not depend on the ranks.
SIZED = (["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
          "--global-batch-size", "8"],
         ["--micro-batch-size", "2", "--global-batch-size", "4"])
RESIZED = (["--micro-batch-size", "2", "--global-batch-size", "8"],
           ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
            "--global-batch-size", "4"])


def _start_sized(out, per_worker, ranks, extra=()):
    port = str(free_port())
    return [(start(n, [str(out), *SHARED, *flags, *extra, "--master-addr", "127.0.0.1",
                       "--master-port", port, "--diloco-worker-index", str(w)],
                   out / f"w{w}.log", None, DRIVER), out / f"w{w}.log")
            for w, (flags, n) in enumerate(zip(per_worker, ranks))]


@contextmanager
def _reaped():
    """A list to put started processes in; whichever still runs at the end is killed."""
    started = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()


def _sized_reference(out, per_worker, world: str, started: list):
    """The reference of workers with their own flags, started in the background."""
    reference = start_reference(
        [*SHARED, *per_worker[0]], out, world,
        {"REFERENCE_WORKER_ARGS": json.dumps([[*SHARED, *f] for f in per_worker])})
    started.append(reference)
    return reference


def _wait(launches, started: list) -> None:
    """Every launch of ``launches`` (from ``_start_sized``) ends with status 0."""
    started += [proc for proc, _ in launches]
    for proc, log in launches:
        assert proc.wait(timeout=400) == 0, log.read_text()[-5000:]


@pytest.mark.timeout(600)
def test_workers_of_different_sizes_match_the_reference(tmp_path):
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    with _reaped() as started:
        reference = _sized_reference(tmp_path, SIZED, "2,1", started)
        _wait(_start_sized(tmp_path, SIZED, (2, 1),
                           ["--save", str(tmp_path / "ckpt"), "--save-interval", "6"]), started)
        (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("6\n")
        _wait(_start_sized(resumed, RESIZED, (1, 2), ["--load", str(tmp_path / "ckpt")]),
              started)
        ref = reference_result(reference, tmp_path)
    assert "by 1 layout-free lane(s) per fragment" in (tmp_path / "w0.log").read_text()
    for out in (tmp_path, resumed):
        got = [dumps(out, w) for w in range(2)]
        for w in range(2):
            for kind, expected in (("local", ref["local"][w]), ("global", ref["globals"][w])):
                worst, whole = relative(got[w][kind], expected)
                print(out.name, w, kind, f"worst {worst:.2e} whole {whole:.2e}")
                assert whole <= 1e-6 and worst <= 5e-5, (out.name, w, kind, worst, whole)
        assert all(torch.equal(got[0]["global"][n], got[1]["global"][n]) for n in ref["global"])
    got = dumps(tmp_path, 0)
    assert got["cross_worker_bytes"] == lane_bytes(ref["global"], SHARED, lanes=1)
    meta = json.loads((tmp_path / "ckpt" / "iter_0000006" / "checkpoint.json").read_text())
    assert [p["fragment"] for p in meta["pending"]] == [1], meta["pending"]


@pytest.mark.timeout(600)
def test_sparse_workers_of_different_batches_match_the_reference_bit_for_bit(tmp_path):
    """The sparse exchange weighs each worker's outer gradient by its tokens before its
    accumulator (batches 4 and 2 on one rank each: shares 4/3 and 2/3), as the dense one does:
    every parameter, local and global, of both workers equals the reference's, bit for bit
    (SGD without clipping, as in test_streaming's sparse cases)."""
    from test_streaming import SPARSE

    per_worker = (["--micro-batch-size", "2", "--global-batch-size", "4", *SPARSE],
                  ["--micro-batch-size", "2", "--global-batch-size", "2", *SPARSE])
    with _reaped() as started:
        reference = _sized_reference(tmp_path, per_worker, "1,1", started)
        _wait(_start_sized(tmp_path, per_worker, (1, 1)), started)
        ref = reference_result(reference, tmp_path)
    got = [dumps(tmp_path, w) for w in range(2)]
    for w in range(2):
        for kind, expected in (("local", ref["local"][w]), ("global", ref["globals"][w])):
            assert relative(got[w][kind], expected) == (0.0, 0.0), (w, kind)
    assert got[0]["cross_worker_bytes"] > 0


@pytest.mark.timeout(600)
def test_sparse_workers_of_different_layouts_match_the_reference(tmp_path):
    """TP=2 (batch 8) beside PP=2 (batch 4) with the sparse exchange: each lane holder chooses
    its top-k per chunk of its lane of the canonical vector (two lanes, each with its own
    accumulator), as the reference does on the same cut. The layouts sum in other orders, so
    inner steps agree to about 1e-7, not bit for bit: held to 1e-5 of the whole model (a
    choice flipped by that noise moves one element of a chunk; chunking the ranks' shards
    instead of the lanes, or one accumulator per fragment, moves most of them); the workers'
    global parameters bitwise equal."""
    from test_streaming import SPARSE

    per_worker = tuple([*f, *SPARSE] for f in CASES["tp2_vs_pp2_batches_8_4"])
    with _reaped() as started:
        reference = _sized_reference(tmp_path, per_worker, "2,2", started)
        _wait(_start_sized(tmp_path, per_worker, (2, 2)), started)
        ref = reference_result(reference, tmp_path)
    assert "by 2 layout-free lane(s) per fragment" in (tmp_path / "w0.log").read_text()
    got = [dumps(tmp_path, w) for w in range(2)]
    for w in range(2):
        for kind, expected in (("local", ref["local"][w]), ("global", ref["globals"][w])):
            worst, whole = relative(got[w][kind], expected)
            print("sparse lanes", w, kind, f"worst {worst:.2e} whole {whole:.2e}")
            assert whole <= 1e-5, (w, kind, worst, whole)
    assert all(torch.equal(got[0]["global"][n], got[1]["global"][n]) for n in ref["global"])
    assert got[0]["cross_worker_bytes"] > 0

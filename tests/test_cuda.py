"""The CUDA path: ``pytest -m cuda`` on a machine with a GPU (skipped without one).

One GPU is enough: each worker is one rank, its in-worker groups NCCL groups of one, and the
workers meet over gloo (NCCL refuses two ranks of one device in one group). What runs here:

* streaming against the single-process reference (fp32 on the GPU, the reference on the CPU),
  plain DiLoCo, Streaming with overlap and alpha, and eager; FP4 with error feedback (the
  residual on the wire's device) runs and keeps both workers' global copies identical;
* a checkpoint with an exchange in flight resumes with the very same losses and bytes;
* the codecs on CUDA tensors give the CPU's codes;
* one rank on the GPU in fp32 and bf16 against the same run on the CPU in fp32.

The differences measured are recorded as test properties (``--junitxml`` keeps them).
"""

import json

import pytest
import torch

from harness import TINY, run
from test_checkpoint import (STREAMING, resumes_async_save_in_flight_exactly,
                             resumes_in_flight_exactly, sharded)
from test_streaming import BASE, matches_reference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = ["--distributed-backend", "nccl", "--diloco-backend", "gloo"]
# cuBLAS picks the same kernels run to run with a fixed workspace: resumed runs compare exactly.
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

# Two one-rank workers each (the reference's cases that fit one GPU).
CASES = {
    "diloco_p1_tau0": ["--num-layers", "2", "--diloco-inner-steps", "4",
                       "--diloco-fragments", "1"],
    "zero1_p3_tau1_alpha05": ["--num-layers", "3", "--zero-stage", "1",
                              "--diloco-inner-steps", "6", "--diloco-fragments", "3",
                              "--diloco-overlap-steps", "1", "--diloco-alpha", "0.5"],
    "eager_p2": ["--num-layers", "2", "--diloco-inner-steps", "4", "--diloco-fragments", "2",
                 "--diloco-eager"],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_matches_single_process_reference(name, tmp_path, record_property):
    # The GPU's fp32 kernels sum in other orders than the CPU's: 1e-4 of the whole model
    # (the CPU runs hold 1e-6), still far below what a wrong outer step moves (1e-2).
    worst, whole = matches_reference(2, [*BASE, *CASES[name], *GPU], tmp_path,
                                     whole_tol=1e-4, worst_tol=1e-3, extra_env=DETERMINISTIC)
    record_property("worst_tensor_rel", worst)
    record_property("whole_model_rel", whole)


@pytest.mark.timeout(600)
def test_cuda_fp4_error_feedback_keeps_the_workers_identical(tmp_path):
    from test_streaming import distributed, dumps

    distributed(2, [*BASE, "--num-layers", "2", "--diloco-inner-steps", "4",
                    "--diloco-fragments", "2", "--diloco-overlap-steps", "1",
                    "--diloco-quantize", "fp4", "--diloco-error-feedback", *GPU], tmp_path)
    w0, w1 = dumps(tmp_path, 0), dumps(tmp_path, 1)
    assert any(kind == "merge" for _, kind, _, _ in w0["events"])
    for name, tensor in w0["global"].items():
        assert torch.isfinite(tensor).all() and torch.equal(tensor, w1["global"][name]), name
    assert w0["cross_worker_bytes"] > 0


@pytest.mark.timeout(600)
def test_cuda_resume_with_a_fragment_in_flight_continues_exactly(tmp_path):
    resumes_in_flight_exactly(tmp_path, [*STREAMING, *GPU], extra_env=DETERMINISTIC)


@pytest.mark.timeout(600)
def test_cuda_async_save_resumes_exactly(tmp_path):
    """--async-save on a GPU: the tensors copied into pinned host memory before the background
    write."""
    resumes_async_save_in_flight_exactly(tmp_path, [*STREAMING, *GPU], extra_env=DETERMINISTIC)


def test_cuda_staging_copies_device_tensors_into_pinned_memory():
    """--async-save's copy out of the GPU: a save's device tensors (and the host ones beside
    them) are in the kept host buffer, pinned, when ``snapshot`` returns; the next save copies
    into the same memory."""
    from megatron_streaming.checkpoint.background import Staging

    live = [torch.arange(6.0, device="cuda").view(2, 3), torch.ones(5, dtype=torch.bfloat16)]
    staging = Staging()
    staging.reserve(sharded(*live))
    first = staging.snapshot(sharded(*live))
    assert staging.buffer.is_pinned()
    copies = [first[k].data for k in ("t0", "t1")]
    assert [c.device.type for c in copies] == ["cpu", "cpu"]
    assert torch.equal(copies[0], live[0].cpu()) and torch.equal(copies[1], live[1])
    live[0].mul_(-1.0)  # the steps after the save
    torch.cuda.synchronize()
    assert torch.equal(copies[0], torch.arange(6.0).view(2, 3))
    second = staging.snapshot(sharded(*live))
    assert [second[k].data.data_ptr() for k in ("t0", "t1")] == [c.data_ptr() for c in copies]
    assert torch.equal(second["t0"].data, live[0].cpu())


@pytest.mark.parametrize("codec", ["fp4", "int8", "bf16"])
def test_cuda_codec_gives_the_cpu_codes(codec):
    """fp4 and bf16 decide by comparisons and casts: the very same bytes on both devices.
    int8 divides by 127, which CUDA does as a multiplication by the reciprocal: its scales may
    differ in the last bit and a code by one near a tie, still within the codec's bound (the
    workers agree regardless: each decodes the bytes on the wire)."""
    from megatron_streaming.comm.codec import make_codec, warm_up

    c = make_codec(codec, 128)
    for numel in (1000, 1 << 20):  # the eager path and the compiled one
        warm_up(c, numel, "cuda")
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        x *= torch.logspace(-4, 0, numel)
        on_cpu, on_gpu = c.encode(x), c.encode(x.cuda())
        assert on_gpu.payload.is_cuda
        out = torch.empty(numel, device="cuda")
        c.decode(on_gpu, out=out)
        if codec == "int8":
            assert torch.allclose(on_gpu.scales.cpu(), on_cpu.scales, rtol=3e-7, atol=0)
            diff = (on_gpu.payload.cpu().int() - on_cpu.payload.int()).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
            step = on_gpu.scales.cpu().repeat_interleave(128)[:numel]
            assert bool(((out.cpu() - x).abs() <= step * (0.5 + 2 ** -16)).all())
            continue
        assert torch.equal(on_gpu.payload.cpu(), on_cpu.payload), (codec, numel)
        if on_cpu.scales is not None:
            assert torch.equal(on_gpu.scales.cpu(), on_cpu.scales), (codec, numel)
        assert torch.equal(out.cpu(), c.decode(on_cpu)), (codec, numel)


def _losses(tmp_path, name, args, extra_env=None):
    log = tmp_path / f"{name}.jsonl"
    run(1, [*args, "--log-jsonl", str(log)], extra_env=extra_env)
    return [json.loads(line)["train/loss"] for line in log.read_text().splitlines()
            if "train/loss" in line]


@pytest.mark.timeout(600)
def test_cuda_fp32_and_bf16_losses_follow_the_cpu(tmp_path, record_property):
    """The same model and data (initialised on the CPU either way) on the CPU in fp32, on the
    GPU in fp32 and in bf16: fp32 agrees to float noise, bf16 within its 8 bits of mantissa."""
    args = [*TINY, "--num-layers", "2", "--train-iters", "12", "--eval-iters", "0"]
    cpu = _losses(tmp_path, "cpu", args, {"CUDA_VISIBLE_DEVICES": ""})
    fp32 = _losses(tmp_path, "fp32", args)
    bf16 = _losses(tmp_path, "bf16", [*args, "--bf16"])
    assert len(cpu) == len(fp32) == len(bf16) == 12
    rel32 = max(abs(a - b) / b for a, b in zip(fp32, cpu))
    rel16 = max(abs(a - b) / b for a, b in zip(bf16, cpu))
    record_property("fp32_max_rel", rel32)
    record_property("bf16_max_rel", rel16)
    record_property("losses", json.dumps({"cpu": cpu, "fp32": fp32, "bf16": bf16}))
    assert rel32 < 1e-4, (cpu, fp32)
    assert rel16 < 2e-2, (cpu, bf16)
    assert cpu[-1] < cpu[0] and bf16[-1] < bf16[0]  # it trains

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
                       "--diloco-fragments", "1", "--diloco-overlap-steps", "0"],
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


def test_cuda_sync_counter_counts_every_synchronizing_call_at_its_line(tmp_path):
    """benchmarks/sync_sites.py's counter under set_sync_debug_mode("warn"): each ``.item()``
    of a device tensor is counted, every time, at the line that made it; a copy to the
    device that does not wait is not."""
    import atexit
    import sys
    import warnings
    from types import SimpleNamespace

    from harness import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sync_sites

    x = torch.ones(4, device="cuda")
    previous = torch.is_warn_always_enabled()
    with warnings.catch_warnings():
        counter = sync_sites.SyncCounter(SimpleNamespace(topology=SimpleNamespace(rank=0)),
                                         tmp_path, warmup=0, rehearse=False)
        atexit.unregister(counter.write)
        try:
            for _ in range(3):
                x.sum().item()  # the line counted
                x.add_(torch.ones(4).pin_memory().to("cuda", non_blocking=True))
            counter.after_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.set_warn_always(previous)
    sites = json.loads((tmp_path / "sync_sites_rank0.json").read_text())["sites"]["steady"]
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1)
                if "x.sum().item()  # the line counted" in text)
    assert sites == {f"tests/test_cuda.py:{line}": 3}, sites


def test_cuda_sdpa_probe_finds_the_kernel_torch_runs():
    """``attention.kernel_note``'s probe on this GPU: bf16 takes flash, fp32 with dropout the
    memory-efficient kernel, fp64 neither (the math kernel, said at start)."""
    from megatron_streaming.worker.attention import _probe

    device = torch.device("cuda", torch.cuda.current_device())
    assert _probe(device, torch.bfloat16, 8, 2, 128, 0.0, True)["flash"] is None
    fp32 = _probe(device, torch.float32, 8, 8, 128, 0.1, False)
    assert fp32["flash"] and fp32["memory-efficient"] is None, fp32
    fp64 = _probe(device, torch.float64, 8, 8, 128, 0.0, False)
    assert all(fp64.values()), fp64



def test_cuda_pinned_buffers_take_their_exact_size_not_torchs_power_of_two():
    """``comm.pinned`` beside torch's ``pin_memory``: 97 MiB and a byte pinned by torch take a
    128 MiB block of its caching host allocator ("rounded up to the next power of two",
    ``torch.cuda.host_memory_stats``); ours take none of its bytes, are pinned, exactly as
    large, and copy to and from the GPU asynchronously. The staging buffer of --async-save and
    the offloaded outer state are such buffers."""
    from megatron_streaming.comm import pinned
    from megatron_streaming.streaming.sync import _outer_state

    def allocated():
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)

    nbytes = (97 << 20) + 1
    before = allocated()
    theirs = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    assert allocated() - before == 128 << 20  # what this module avoids
    del theirs
    before = allocated()
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = pinned.host_buffer(nbytes, device)
    assert buffer.is_pinned() and buffer.numel() == nbytes and allocated() == before
    gpu = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    back = torch.empty_like(gpu)
    buffer.copy_(gpu, non_blocking=True)
    back.copy_(buffer, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, gpu)
    local = [torch.randn(1000, device=device), torch.randn(7, device=device)]
    theta_g, momentum = _outer_state(local, offload=True)
    assert all(t.is_pinned() and t.device.type == "cpu" for t in theta_g + momentum)
    assert theta_g[0].untyped_storage().nbytes() == pinned.layout([4000, 28, 4000, 28])[1]
    assert all(torch.equal(t, l.cpu()) for t, l in zip(theta_g, local))
    assert allocated() == before

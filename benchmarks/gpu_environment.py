"""On a machine with a GPU: what the GPU environment changes (docs/gpu_clusters.md).

    python3 benchmarks/gpu_environment.py sync-memory --out OUT    # two workers, one GPU
    python3 benchmarks/gpu_environment.py devices --out OUT        # two workers on the node

* ``sync-memory``: the device memory a send of one fragment's shard of ``--numel`` elements
  takes on each of two workers (two processes on the one GPU, gloo across, as the timeline
  runs them): the peak allocated above what was held before it, through the exchange's
  return, as the sync sends it now (the outer gradient made in the buffer that travels:
  encoded, all-to-all, decoded and summed, the mean encoded, all-gathered and decoded), beside
  what the planner counts for it (``plan.memory``: the buffer, 4 bytes an element, and one
  exchange's working set, ``EXCHANGE_BYTES``); and what the two pieces it no longer has cost
  on their own: the norm through an fp64 copy (``delta.double().pow(2).sum()``) and a shard
  copied on its way to the wire (the transport with a caller that keeps its tensor).
* ``devices``: two one-rank workers of ``pretrain_gpt.py`` (NCCL inside, gloo across) on the
  node's GPUs (both on GPU 0 with one GPU); while they train, ``nvidia-smi`` lists the
  processes on each GPU: each rank must appear on its own GPU only, and the summary's
  allocator peaks say what each held.

``--rehearse``: the same on the CPU. There is no device allocator there: ``sync-memory``
measures each process's peak resident memory above its level before (``/proc``'s VmHWM,
reset first), which also counts the CPU allocator's own keeping and freeing of pages; it
rehearses the code path, not the GPU's number.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _peak_above(fn, device) -> int:
    """Bytes at the peak of ``fn()`` above what was held before it: allocated on a GPU,
    resident on the CPU (the process's high-water mark, reset before)."""
    import torch

    if device.type != "cuda":
        before = _resident()
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark := now
        fn()
        return _resident("VmHWM") - before
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _resident(field: str = "VmRSS") -> int:
    """This process's resident memory (or its high-water mark), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return 1024 * int(line.split()[1])
    return 0


def sync_memory(numel: int, device_name: str, out: Path) -> dict:
    """Two workers (processes) on the one device, gloo across: what each measured."""
    import torch.multiprocessing as mp

    from megatron_streaming.plan.memory import EXCHANGE_BYTES

    store = out / "sync-memory.store"
    store.unlink(missing_ok=True)
    mp.start_processes(_sync_memory_member, args=(numel, device_name, str(store), str(out)),
                       nprocs=2, join=True, start_method="spawn")
    ranks = [json.loads((out / f"sync-memory.rank{r}.json").read_text()) for r in range(2)]
    return {"numel": numel, "workers": 2, "device": device_name,
            "measured": "allocated on the GPU" if device_name.startswith("cuda") else
            "resident memory of the process (CPU: not the GPU's number)",
            "planned_bytes_per_element": 4 + EXCHANGE_BYTES,
            "per_rank": ranks}


def _sync_memory_member(rank: int, numel: int, device_name: str, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_streaming.comm.codec import make_codec, warm_up
    from megatron_streaming.comm.transport import Transport
    from megatron_streaming.streaming.outer import OuterOptimizer
    from megatron_streaming.streaming.schedule import SyncSchedule
    from megatron_streaming.streaming.sync import ShardGroup, StreamingSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    device = torch.device(device_name)
    local = torch.randn(numel, device=device,
                        generator=torch.Generator(device).manual_seed(rank))
    transport = Transport(group, [0, 1], rank, make_codec("fp4-e2m1", 128), 300.0,
                          codec_device=str(device))
    sync = StreamingSync([ShardGroup(0, 0, 0, [local])], SyncSchedule(2, 1, 1), transport,
                         OuterOptimizer(1.0, 0.0, False), 0.0, False, False, lambda: None)
    local.add_(1e-3 * (rank + 1))
    # The codec's fused kernels, compiled as a run compiles them at start (streaming.builder):
    # the eager ones hold more temporaries.
    warm_up(transport.codec, transport.padded_numel(numel), device)

    def send():
        sync.before_step(2)
        sync._process(sync.groups[0])
        sync.pending.pop(0).wait()

    def measured(fn) -> int:
        dist.barrier(group)  # both workers at the same point: each is the other's peer
        return _peak_above(fn, device)

    delta = sync.theta_g[0] - local
    result = {"rank": rank, "shard_bytes": 4 * numel, "send_now": measured(send)}
    result["send_now_bytes_per_element"] = round(result["send_now"] / numel, 2)
    result["fp64_norm"] = measured(lambda: float(delta.double().pow(2).sum()))
    result["copy_on_the_way"] = measured(
        lambda: transport.all_reduce_mean_many([delta], 3, ["copy"], [None])[0].wait())
    result["bytes_sent"] = transport.bytes_sent  # the two exchanges really crossed
    transport.close()
    Path(out, f"sync-memory.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def devices(out: Path, rehearse: bool) -> dict:
    """Two one-rank workers on the node; the GPUs each process appears on while they train."""
    import torch

    gpus = max(1, torch.cuda.device_count())
    flags = ["--mock-data", "--num-layers", "4", "--hidden-size", "256",
             "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "60", "--eval-iters", "0",
             "--diloco-workers", "2", "--diloco-inner-steps", "4", "--diloco-fragments", "2",
             "--diloco-overlap-steps", "1", "--log-interval", "10",
             "--summary-json", str(out / "summary.json")]
    if not rehearse:
        flags += ["--bf16", "--distributed-backend", "nccl"]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(REPO / "pretrain_gpt.py"), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out / "devices.log", "w"),
                            stderr=subprocess.STDOUT)
    seen = {}  # pid -> GPUs it appeared on
    while proc.poll() is None:
        if not rehearse:
            query = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                 "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            for line in query.splitlines():
                pid, gpu, used = [x.strip() for x in line.split(",")]
                seen.setdefault(pid, {})[gpu] = max(int(used), seen.get(pid, {}).get(gpu, 0))
        time.sleep(0.5)
    summary = json.loads((out / "summary.json").read_text()) if proc.returncode == 0 else {}
    return {"gpus": gpus, "returncode": proc.returncode, "processes": seen,
            "one_gpu_each": all(len(g) == 1 for g in seen.values()),
            "peak_device_mib_per_rank": summary.get("peak_device_mib_per_rank"),
            "peak_device_reserved_mib_per_rank":
                summary.get("peak_device_reserved_mib_per_rank")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["sync-memory", "devices"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--numel", type=int, default=256 << 20)
    parser.add_argument("--rehearse", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "sync-memory":
        result = sync_memory(args.numel if not args.rehearse else min(args.numel, 1 << 22),
                             "cpu" if args.rehearse else "cuda", args.out)
    else:
        result = devices(args.out, args.rehearse)
    (args.out / f"{args.what}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

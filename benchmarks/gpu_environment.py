"""On a machine with a GPU: what the GPU environment changes (docs/gpu_clusters.md).

    python3 benchmarks/gpu_environment.py sync-memory --out OUT    # one process, one GPU
    python3 benchmarks/gpu_environment.py devices --out OUT        # two workers on the node

* ``sync-memory``: the device memory a send of one fragment's shard of ``--numel`` elements
  takes (the peak allocated above what was held before it, through the exchange's return),
  as the sync sends it now (the outer gradient made in the buffer that travels), and what the
  two pieces it no longer has cost on their own: the norm through an fp64 copy
  (``delta.double().pow(2).sum()``) and a shard copied on its way to the wire (the transport
  with a caller that keeps its tensor). One worker: the exchange's two collectives have no
  peer, its codec and buffers run as with peers.
* ``devices``: two one-rank workers of ``pretrain_gpt.py`` (NCCL inside, gloo across) on the
  node's GPUs (both on GPU 0 with one GPU); while they train, ``nvidia-smi`` lists the
  processes on each GPU: each rank must appear on its own GPU only, and the summary's
  allocator peaks say what each held.

``--rehearse``: the same on the CPU (no allocator statistics there: the sizes print as 0).
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
    """Bytes allocated at the peak of ``fn()`` above what was allocated before it."""
    import torch

    if device.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def sync_memory(numel: int, device_name: str) -> dict:
    import torch

    from megatron_streaming.comm.codec import make_codec
    from megatron_streaming.streaming.outer import OuterOptimizer
    from megatron_streaming.streaming.schedule import SyncSchedule
    from megatron_streaming.streaming.sync import ShardGroup, StreamingSync
    from megatron_streaming.comm.transport import Transport

    device = torch.device(device_name)
    local = torch.randn(numel, device=device)
    transport = Transport(None, [0], 0, make_codec("fp4-e2m1", 128), 60.0,
                          codec_device=str(device))
    sync = StreamingSync([ShardGroup(0, 0, 0, [local])], SyncSchedule(2, 1, 1), transport,
                         OuterOptimizer(1.0, 0.0, False), 0.0, False, False, lambda: None)
    local.add_(1e-3)

    def send():
        sync.before_step(2)
        sync._process(sync.groups[0])
        sync.pending.pop(0).wait()

    delta = sync.theta_g[0] - local
    out = {"numel": numel, "shard_bytes": 4 * numel,
           "send_now": _peak_above(send, device),
           "fp64_norm": _peak_above(lambda: float(delta.double().pow(2).sum()), device),
           "copy_on_the_way": _peak_above(
               lambda: transport.all_reduce_mean_many([delta], 3, ["copy"], [None])[0].wait(),
               device)}
    transport.close()
    return out


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
        result = sync_memory(args.numel if not args.rehearse else 1 << 20,
                             "cpu" if args.rehearse else "cuda")
    else:
        result = devices(args.out, args.rehearse)
    (args.out / f"{args.what}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

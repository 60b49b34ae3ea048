"""Runs a real distributed training (torchrun, pretrain_gpt.py's flags) and dumps, per worker,
the full (un-sharded) local and global parameters by global name.

    python -m torch.distributed.run --nproc-per-node N tests/streaming_driver.py OUT flags...

Used by the streaming tests to compare the distributed implementation with the single-process
reference (``diloco_reference.py``).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pretrain_with_faults import Faults  # noqa: E402  (no-op unless its variables are set)

from megatron_streaming.cli.arguments import parse_args  # noqa: E402
from megatron_streaming.run.train import Run  # noqa: E402
from megatron_streaming.worker.moe import is_expert  # noqa: E402
from megatron_streaming.worker.weights import global_name, tp_unshard  # noqa: E402


def full_parameters(run) -> dict:
    """This stage's parameters, TP shards gathered, by global name (collective over TP; and
    over EP, whose ranks hold experts of their own)."""
    topo = run.topology
    offset = topo.first_layer(run.cfg.model.num_layers)
    ep, m = topo.layout.ep, run.cfg.model
    out = {}
    for name, param in run.model.named_parameters():
        tensor = param.detach().float()
        if getattr(param, "tensor_model_parallel", False) and topo.layout.tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(topo.layout.tp)]
            dist.all_gather(parts, tensor.contiguous(), group=topo.groups["tp"])
            tensor = tp_unshard(name, parts, param.partition_dim, run.cfg.model.swiglu)
        if name == "output_layer.weight" and not run.cfg.model.untie_embeddings_and_output_weights:
            continue  # the last stage's copy of the tied embedding
        if ep > 1 and is_expert(name):
            parts = [torch.empty_like(tensor) for _ in range(ep)]
            dist.all_gather(parts, tensor.contiguous(), group=topo.groups["ep"])
            for r, part in enumerate(parts):
                out[global_name(name, offset, r * m.num_experts // ep)] = part.cpu().clone()
            continue
        out[global_name(name, offset)] = tensor.cpu().clone()  # compared on the CPU
    return out


def sent_by(run) -> int:
    transport = getattr(run.sync, "transport", None)  # none without a sync (one worker)
    return transport.bytes_sent if transport is not None else 0


class BytesByStep:
    """A step hook: the bytes this rank's transport had sent before each step (after the
    previous step's recovery or admission, if any)."""

    def __init__(self, run):
        self.run, self.sent = run, {}

    def before_step(self, step):
        self.sent[step] = sent_by(self.run)

    def after_step(self):
        pass


# gloo's address of rank 0 in the default group, a key of the store the world met on
# (torch 2.13: the default group is "0", its gloo device "cpu").
IN_WORLD_KEY = "0//cpu//0/0"


def stores(run) -> dict:
    """Where this rank's world met (its default group's store, under torch's prefixes) and
    the job's store: their addresses, the address the worker's first rank published in the
    job's store, and whether an in-worker key is in each (in the job's, also where the
    worker's part of it used to hold the worker's world)."""
    from megatron_streaming.parallel.distributed import WORKER_PREFIX, worker_store_key

    world = dist.distributed_c10d._get_default_store()
    while isinstance(world, dist.PrefixStore):
        world = world.underlying_store
    job, worker = run.topology.store, run.topology.worker
    key = worker_store_key(worker)

    def where(store):
        return f"{store.host}:{store.port}" if isinstance(store, dist.TCPStore) \
            else type(store).__name__

    return {"world": where(world), "job": where(job),
            "published": job.get(key).decode() if job.check([key]) else None,
            "in_world": world.check([IN_WORLD_KEY]),
            "in_job": job.check([IN_WORLD_KEY, f"{WORKER_PREFIX}{worker}//{IN_WORLD_KEY}"])}


def main():
    out_dir, argv = sys.argv[1], sys.argv[2:]
    hooks = []

    def bytes_by_step(run):
        hooks.append(BytesByStep(run))
        return hooks[-1]

    with Run(parse_args(argv), [Faults, bytes_by_step]) as run:
        met = stores(run)
        run.sync.events = []  # what the sync did, step by step (off by default)
        run.train()
        if run.cfg.checkpoint.save:
            run.finish_saving("training ends")  # a save in flight (--async-save)
        run.stop.close()
        run.sync.close()
        sync_bytes = run.report.cross_worker_bytes()
        local = full_parameters(run)
        with run.sync.global_parameters():
            global_ = full_parameters(run)
        topo = run.topology
        if topo.tp_rank == 0 and topo.dp_rank == 0 and topo.coords["sp"] == 0:
            tag = f"worker{topo.worker}_stage{topo.pp_rank}"
            epochs = [(r.epoch, list(r.members), r.step) for r in run.elastic.history]
            sent = {**hooks[0].sent, "end": sent_by(run)}
            torch.save({"local": local, "global": global_, "events": run.sync.events or [],
                        "cross_worker_bytes": sync_bytes, "epochs": epochs, "sent": sent,
                        "stores": met,
                        # lanes (workers of different layouts): what moved inside the worker
                        "in_worker_bytes": getattr(run.sync, "in_worker_bytes", 0)},
                       os.path.join(out_dir, f"{tag}.pt"))
    topo.cross.job_barrier()

if __name__ == "__main__":
    main()

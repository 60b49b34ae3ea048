"""Shared test helpers: small gloo process groups, and a world-1 Megatron set-up in-process."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist



# ---- process groups ---------------------------------------------------------------------------

def _gloo_main(rank, world, store, out_dir, group_timeout_s, hard_exit, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    timeout = datetime.timedelta(seconds=group_timeout_s) if group_timeout_s else None
    group = dist.new_group(list(range(world)), timeout=timeout)
    result = fn(rank, world, group, *args)
    if result is not None:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if hard_exit:
        # A collective left blocked on purpose would keep the interpreter from exiting
        # (the transport's executor thread is joined at exit): leave without tearing down.
        os._exit(0)
    dist.destroy_process_group()


def spawn_gloo(fn, world, tmp_dir, *args, group_timeout_s=None, hard_exit=False):
    """Run ``fn(rank, world, group, *args)`` on ``world`` fresh processes joined by a gloo
    default group (FileStore in ``tmp_dir``) and ``group`` = all of them; returns what each
    rank returned (saved to ``tmp_dir``; None where it returned None)."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.start_processes(
        _gloo_main, args=(world, str(tmp_dir / "store"), str(tmp_dir), group_timeout_s,
                          hard_exit, fn, args),
        nprocs=world, join=True, start_method="spawn")
    paths = [tmp_dir / f"rank{r}.pt" for r in range(world)]
    return [torch.load(p) if p.exists() else None for p in paths]


@pytest.fixture(scope="module")
def megatron_world():
    """World-1 gloo group in this process, Megatron pointed at it (as diloco_reference.py)."""
    import patches
    from megatron_streaming.parallel import distributed
    from megatron_streaming.parallel.topology import RankLayout, Topology

    saved_env = dict(os.environ)
    owned = not dist.is_initialized()
    patches.apply()
    distributed.init_distributed("gloo", 5)
    topo = Topology.create(RankLayout(1), 0)
    topo.install_into_megatron()
    yield topo
    if owned:
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)


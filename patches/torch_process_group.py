"""Adapter: a gloo (or NCCL) process group made on a store, outside the default (world) group (the
torch series of ``_pinning.TORCH_VERSIONS``; not a patch, nothing upstream is changed).

``torch.distributed.new_group`` only makes subgroups of the world: every rank of the world
takes part in creating each one, and a lost rank breaks the world for good. The cross-worker
groups of a membership epoch must be made by the live workers alone, on the job's rendezvous
store, and dropped when the epoch ends (DESIGN.md, "Membership epochs"). torch has the parts
but no public constructor for them: a ``ProcessGroup`` on the store with a gloo backend
registered as its CPU backend (``_set_default_backend`` / ``_register_backend``, what
``new_group`` does inside). Such a group serves ``torch.distributed``'s collectives as usual.
Where a world exists, the group is also entered in the world's registry (``_world``'s maps,
as ``new_group`` enters its groups), because torch's collectives describe their group through
it when one fails (``c10d_logger``; an unknown group turns the real error into a
``ValueError``), and so that ``dist.get_backend`` / ``dist.get_rank(group)`` answer;
``drop`` takes it out again. ``backend_of`` answers for a group made before or without a world.
``default_store`` is the world's store (an embedded run, whose world a test made, has no
other).
"""

import datetime

from ._pinning import TORCH_VERSIONS, require_version

NAME = "torch_process_group"
PACKAGE, VERSIONS = "torch", TORCH_VERSIONS


def _check() -> None:  # cheap (groups are made a few times per run): no caching
    require_version(PACKAGE, VERSIONS, NAME)


def standalone_group(backend: str, store, rank: int, size: int,
                     timeout: datetime.timedelta, world_ranks=None, name: str = ""):
    """A ``backend`` ("gloo" or "nccl") group of ``size`` ranks meeting on ``store`` (give
    each group its own prefix: ``torch.distributed.PrefixStore``); every member calls this
    with its own ``rank``. ``world_ranks``: {rank in the world: rank in this group} for the
    members in this process's world (for the registry, where a world exists; default
    ``0..size-1``); ``name``: unique per group. NCCL: made as torch makes its own NCCL
    groups, on the current device; verified on gloo only (one GPU cannot hold two NCCL ranks
    of one group)."""
    _check()
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup

    group = ProcessGroup(store, rank, size)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl = dist.ProcessGroupNCCL(store, rank, size, options)
        kind, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    elif backend == "gloo":
        impl = dist.ProcessGroupGloo(store, rank, size, timeout)
        kind, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        raise ValueError(f"a standalone group has backend gloo or nccl, not {backend!r}")
    group._set_default_backend(kind)
    group._register_backend(device, kind, impl)
    if dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        w = c10d._world
        w.pg_map[group] = (backend, store)
        w.pg_names[group] = name
        w.pg_group_ranks[group] = dict(world_ranks) if world_ranks is not None else \
            {i: i for i in range(size)}
        w.pg_backend_config[group] = f"{device.type}:{backend}"
        w.pg_to_tag[group] = f"user:{name}"
    return group


def drop(group) -> None:
    """Abort ``group`` (a blocked collective on it returns with an error) and take it out of
    the world's registry."""
    _check()
    from torch.distributed import distributed_c10d as c10d

    try:
        group.abort()
    except Exception:  # already broken
        pass
    w = c10d._world
    for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag):
        table.pop(group, None)


def backend_of(group) -> str:
    """``dist.get_backend(group)``, also for a group made by ``standalone_group``."""
    import torch.distributed as dist

    try:
        return dist.get_backend(group)
    except ValueError:  # not in the world's registry: a standalone group
        _check()
        return group.name()


def default_store():
    """The store the world group was made on."""
    _check()
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()

"""Adapter: a gloo process group made on a store, outside the default (world) group (torch
2.13.0, also verified on 2.11.0; not a patch, nothing upstream is changed).

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

from ._pinning import require_version

NAME = "torch_process_group"
PACKAGE, VERSIONS = "torch", ("2.13.0", "2.11.0")


def _check() -> None:  # cheap (groups are made a few times per run): no caching
    require_version(PACKAGE, VERSIONS, NAME)


def standalone_gloo_group(store, rank: int, size: int, timeout: datetime.timedelta,
                          global_ranks=None, name: str = ""):
    """A gloo group of ``size`` ranks meeting on ``store`` (give each group its own prefix:
    ``torch.distributed.PrefixStore``); every member calls this with its own ``rank``.
    ``global_ranks``: the world's rank of each member (for the registry, where a world
    exists; default ``0..size-1``); ``name``: unique per group."""
    _check()
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup

    group = ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    kind = ProcessGroup.BackendType.GLOO
    group._set_default_backend(kind)
    group._register_backend(torch.device("cpu"), kind, backend)
    if dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        w = c10d._world
        w.pg_map[group] = ("gloo", store)
        w.pg_names[group] = name
        w.pg_group_ranks[group] = {g: i for i, g in enumerate(global_ranks or range(size))}
        w.pg_backend_config[group] = "cpu:gloo"
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
    """``dist.get_backend(group)``, also for a group made by ``standalone_gloo_group``."""
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

"""Adapter: the private fields of DeepSpeed's optimizers that the engine, the sync and the
checkpoint read or write, in one place (DeepSpeed 0.19.8; not a patch, nothing is changed).

* ZeRO stage 1/2 (``DeepSpeedZeroOptimizer``): per param group the 16-bit parameters
  (``bit16_groups``), their flat buffer (``bit16_groups_flat``), this rank's fp32 partition
  (``single_partition_of_fp32_groups``), the partition size and the data-parallel group it
  partitions over (``partition_size``, ``real_dp_process_group``); ``update_lp_params`` copies
  the partitions into the 16-bit weights and all-gathers them.
* ``FP16_UnfusedOptimizer`` (``--bf16`` / ``--fp16`` at ``--zero-stage 0``): 16-bit and fp32
  master lists per group (``fp16_groups``, ``fp32_groups``), ``refresh_fp32_params``.
* The dynamic loss scaler's state (``loss_scaler.cur_scale`` ...).

Every accessor checks the installed version first (``UpstreamVersionError`` on another one):
on another release these names may have moved, and reading the wrong field would corrupt a
checkpoint silently rather than fail.
"""

from typing import Dict, List, NamedTuple

import torch.distributed as dist

from ._pinning import require_version

NAME = "deepspeed_zero"
PACKAGE, VERSION = "deepspeed", "0.19.8"
LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

_checked = False


def _check() -> None:
    global _checked
    if not _checked:
        require_version(PACKAGE, VERSION, NAME)
        _checked = True


class ZeroGroup(NamedTuple):
    """One ZeRO param group on this rank."""

    params: list        # the group's 16-bit parameters, each a view of ``flat``
    flat: object        # their flat buffer
    partition: object   # this rank's fp32 partition (flat)
    start: int          # its offset in ``flat``
    size: int           # its length
    group: object       # the process group it is partitioned over


def is_zero(optimizer) -> bool:
    _check()
    return hasattr(optimizer, "single_partition_of_fp32_groups")


def is_unfused_16bit(optimizer) -> bool:
    """``FP16_UnfusedOptimizer``: fp32 master copies of every parameter, no partitioning."""
    _check()
    return hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups")


def zero_groups(optimizer) -> List[ZeroGroup]:
    _check()
    out = []
    for i, params in enumerate(optimizer.bit16_groups):
        group, size = optimizer.real_dp_process_group[i], optimizer.partition_size[i]
        out.append(ZeroGroup(params, optimizer.bit16_groups_flat[i],
                             optimizer.single_partition_of_fp32_groups[i],
                             dist.get_rank(group) * size, size, group))
    return out


def fp32_partition(optimizer, i: int):
    """This rank's fp32 ZeRO partition of param group ``i`` (flat)."""
    _check()
    return optimizer.single_partition_of_fp32_groups[i]


def master_pairs(optimizer) -> List[list]:
    """``FP16_UnfusedOptimizer``: per group, ``(16-bit parameter, fp32 master)``."""
    _check()
    return [list(zip(low, master)) for low, master in
            zip(optimizer.fp16_groups, optimizer.fp32_groups)]


def push_partitions(optimizer) -> None:
    """ZeRO: the fp32 partitions into the 16-bit weights, all-gathered over the group."""
    _check()
    optimizer.update_lp_params()


def reset_unfused_masters(optimizer) -> None:
    """``FP16_UnfusedOptimizer``: masters from the 16-bit weights, inner state dropped."""
    _check()
    optimizer.refresh_fp32_params()
    optimizer.optimizer.state.clear()


def loss_scaler_state(optimizer) -> Dict[str, float]:
    _check()
    scaler = getattr(optimizer, "loss_scaler", None)
    return {k: getattr(scaler, k) for k in LOSS_SCALER_FIELDS if hasattr(scaler, k)} \
        if scaler is not None else {}


def restore_loss_scaler(optimizer, state: Dict[str, float]) -> None:
    _check()
    scaler = getattr(optimizer, "loss_scaler", None)
    for k, v in state.items():
        if scaler is not None and hasattr(scaler, k):
            setattr(scaler, k, v)

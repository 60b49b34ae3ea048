"""Adapter: the private fields of DeepSpeed's optimizers that the engine, the sync and the
checkpoint read or write, in one place (DeepSpeed 0.19.8; not a patch, nothing is changed).

Which optimizer DeepSpeed builds (``engine._do_optimizer_sanity_check``) follows the ZeRO stage
and the gradients' accumulation dtype (``data_types.grad_accum_dtype``,
``config.ds_config.grad_accum_dtype``):

* ZeRO stage 1/2 (``DeepSpeedZeroOptimizer``; at stage 1 only when gradients accumulate in
  the weights' dtype): per param group the 16-bit parameters (``bit16_groups``), their flat
  buffer (``bit16_groups_flat``), this rank's fp32 partition
  (``single_partition_of_fp32_groups``), the partition size and the data-parallel group it
  partitions over (``partition_size``, ``real_dp_process_group``); ``update_lp_params``
  copies the partitions into the 16-bit weights and all-gathers them.
* ZeRO stage 1 with bf16 weights and fp32 accumulation (``BF16_Optimizer``, which DeepSpeed
  builds instead): the same layout under other names (``bf16_groups``, ``bf16_groups_flat``,
  ``fp32_groups_flat_partition``; each partition ``flat.numel() // group size`` long), and a
  whole fp32 gradient buffer per param group (``fp32_groups_gradients``, one view per
  parameter) into which each backward adds the parameters' bf16 gradients; the step
  all-reduces those buffers over the data-parallel group and reads them, never ``param.grad``.
* ZeRO's gradients before its step: at stage 1 in ``param.grad`` (``param.grad_accum`` when
  it accumulates in a dtype of its own, ``use_grad_accum_attribute``), in the fp32 buffer's
  views under ``BF16_Optimizer``; at stage 2 (``partition_gradients``) reduced at every
  backward, and this rank's partition of them finalized by
  ``finalize_gradient_accumulation_boundary`` (called by ``engine.step()`` with
  ``managed_gradient_accumulation: false``) into ``averaged_gradients``: per param group one
  tensor per parameter of ``params_in_partition`` plus padding (``_zero_padding``), which
  the step's overflow check, norm, clipping and update then read (with fp32 accumulation of
  16-bit weights, views of one fp32 partition buffer that every backward's reduction adds to).
* ``FP16_UnfusedOptimizer`` (``--bf16`` / ``--fp16`` at ``--zero-stage 0``): 16-bit and fp32
  master lists per group (``fp16_groups``, ``fp32_groups``), ``refresh_fp32_params``.
* The dynamic loss scaler's state (``loss_scaler.cur_scale`` ...).

Every accessor checks the installed version first (``UpstreamVersionError`` on another one):
on another release these names may have moved, and reading the wrong field would corrupt a
checkpoint silently rather than fail.
"""

from typing import Callable, Dict, List, NamedTuple

import torch.distributed as dist

from ._pinning import require_version_once

NAME = "deepspeed_zero"
PACKAGE, VERSION = "deepspeed", "0.19.8"
LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _check() -> None:
    require_version_once(PACKAGE, VERSION, NAME)


class ZeroGroup(NamedTuple):
    """One ZeRO param group on this rank."""

    params: list        # the group's 16-bit parameters, each a view of ``flat``
    flat: object        # their flat buffer
    partition: object   # this rank's fp32 partition (flat)
    start: int          # its offset in ``flat``
    size: int           # its length
    group: object       # the process group it is partitioned over


def is_zero(optimizer) -> bool:
    """A ZeRO optimizer: this rank steps an fp32 partition of each param group
    (``DeepSpeedZeroOptimizer``, or ``BF16_Optimizer`` at stage 1 with fp32 accumulation)."""
    _check()
    return hasattr(optimizer, "single_partition_of_fp32_groups") or _is_bf16(optimizer)


def _is_bf16(optimizer) -> bool:
    """``BF16_Optimizer``: ZeRO-1's layout, gradients accumulated in whole fp32 buffers."""
    return hasattr(optimizer, "fp32_groups_flat_partition") and \
        hasattr(optimizer, "fp32_groups_gradients")


def is_unfused_16bit(optimizer) -> bool:
    """``FP16_UnfusedOptimizer``: fp32 master copies of every parameter, no partitioning."""
    _check()
    return hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups")


def zero_groups(optimizer) -> List[ZeroGroup]:
    _check()
    out = []
    if _is_bf16(optimizer):
        for i, params in enumerate(optimizer.bf16_groups):
            group, flat = optimizer.real_dp_process_group[i], optimizer.bf16_groups_flat[i]
            size = flat.numel() // dist.get_world_size(group)  # as BF16_Optimizer cuts it
            out.append(ZeroGroup(params, flat, optimizer.fp32_groups_flat_partition[i],
                                 dist.get_rank(group) * size, size, group))
        return out
    for i, params in enumerate(optimizer.bit16_groups):
        group, size = optimizer.real_dp_process_group[i], optimizer.partition_size[i]
        out.append(ZeroGroup(params, optimizer.bit16_groups_flat[i],
                             optimizer.single_partition_of_fp32_groups[i],
                             dist.get_rank(group) * size, size, group))
    return out


class Slice(NamedTuple):
    """A parameter's elements in this rank's ZeRO partition."""

    param: object
    first: int   # its first element there (flat, row-major)
    size: int    # how many
    at: int      # where they start in the partition


def partition_layout(optimizer) -> List[List[Slice]]:
    """ZeRO-1/2: per param group, the parameters with elements in this rank's partition, in
    partition order."""
    out = []
    for params, flat, _, start, size, _ in zero_groups(optimizer):
        group = []
        for p in params:
            # Offsets from storage addresses: ZeRO made each parameter a view of ``flat``.
            offset = (p.data_ptr() - flat.data_ptr()) // p.element_size()
            lo, hi = max(offset, start), min(offset + p.numel(), start + size)
            if lo < hi:
                group.append(Slice(p, lo - offset, hi - lo, lo - start))
        out.append(sorted(group, key=lambda s: s.at))
    return out


def reduces_per_backward(optimizer) -> bool:
    """ZeRO-2: gradients are reduced over the data-parallel group, and taken away from the
    parameters, at every backward."""
    _check()
    return is_zero(optimizer) and not _is_bf16(optimizer) and \
        bool(optimizer.partition_gradients)


def accumulated_grad(optimizer, param):
    """Without ZeRO or at ZeRO-1, after the micro-batches' backwards: the gradient the step
    will reduce and read (None if there is none), a tensor of the parameter's shape whose
    in-place change is the step's gradient: under ``BF16_Optimizer`` the parameter's view of
    its fp32 buffer (``param.grad`` is added to it and dropped as each backward makes it)."""
    _check()
    if _is_bf16(optimizer):
        i, j = _bf16_index(optimizer)[id(param)]
        return optimizer.fp32_groups_gradients[i][j].view(param.shape)
    if getattr(optimizer, "use_grad_accum_attribute", False):
        return param.grad_accum
    return param.grad


def _bf16_index(optimizer) -> Dict[int, tuple]:
    """``BF16_Optimizer``: parameter id -> (param group, index in it), as its fp32 gradient
    views are listed."""
    return {id(p): (i, j) for i, group in enumerate(optimizer.bf16_groups)
            for j, p in enumerate(group)}


def after_gradient_partition(optimizer, callback: Callable) -> None:
    """ZeRO-2 with the step as the accumulation boundary: ``callback(slices)`` runs inside
    ``engine.step()`` right after DeepSpeed has finalized this rank's reduced gradient
    partition, before its overflow check, norm and clipping read it. ``slices``: per param
    group, ``(parameter, its gradient's elements in the partition)`` as ``partition_layout``
    orders them; tensors the step reads, so an in-place change is the step's gradient."""
    _check()
    if "finalize_gradient_accumulation_boundary" in vars(optimizer):
        raise RuntimeError("after_gradient_partition: this ZeRO optimizer has a callback "
                           "already (a second one would sum the gradients twice)")
    layout = partition_layout(optimizer)
    finalize = optimizer.finalize_gradient_accumulation_boundary

    def finalize_then_callback():
        finalize()
        callback(_gradient_slices(optimizer, layout))

    optimizer.finalize_gradient_accumulation_boundary = finalize_then_callback


def _gradient_slices(optimizer, layout: List[List[Slice]]) -> List[list]:
    out = []
    for i, expected in enumerate(layout):
        params = optimizer.params_in_partition[i]
        grads = [g for g in optimizer.averaged_gradients[i]
                 if not getattr(g, "_zero_padding", False)][:len(params)]
        # The unpadded partition's trailing zeros are unmarked; the slice above drops them.
        if [id(p) for p in params] != [id(s.param) for s in expected] or \
                [g.numel() for g in grads] != [s.size for s in expected]:
            raise RuntimeError(f"ZeRO's finalized gradient partition of param group {i} does "
                               "not match its parameter layout (DeepSpeed "
                               f"{VERSION}'s averaged_gradients changed?)")
        out.append(list(zip(params, grads)))
    return out


def fp32_partition(optimizer, i: int):
    """This rank's fp32 ZeRO partition of param group ``i`` (flat)."""
    _check()
    if _is_bf16(optimizer):
        return optimizer.fp32_groups_flat_partition[i]
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

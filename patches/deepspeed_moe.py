"""Adapter: DeepSpeed's expert-parameter handling for megatron-core's MoE layers (DeepSpeed
0.19.8; not a patch, nothing upstream is changed).

DeepSpeed reduces and partitions an expert's gradients over its expert-data-parallel group
when three things hold, all private to it:

* ``deepspeed.utils.groups`` knows the expert-parallel and expert-data-parallel groups under
  a name (``_EXPERT_PARALLEL_GROUP[name]``, ``_EXPERT_DATA_PARALLEL_GROUP[name]``);
* each expert parameter says so: ``param.allreduce = False`` (``deepspeed.moe.utils.
  is_moe_param``) and ``param.group_name = name``; the optimizer's param group holding them
  has ``moe: True`` and ``name`` (ZeRO 1/2 ``_configure_moe_settings``);
* the engine found MoE layers (``has_moe_layers``), which it decides in
  ``_configure_distributed_model`` by ``isinstance(module, MoE)`` with ``MoE`` the module
  global of ``deepspeed.runtime.engine``: ``as_moe_layers`` widens that name to megatron-core's
  ``MoELayer`` for the length of ``deepspeed.initialize``, so the engine broadcasts experts
  over their expert-data-parallel group, ZeRO partitions them there, and stage 0 reduces
  them there (each divided by the data-parallel size, as dense gradients).
"""

import contextlib
from typing import Iterable

from ._pinning import require_version_once

NAME = "deepspeed_moe"
PACKAGE, VERSION = "deepspeed", "0.19.8"


def _check() -> None:
    require_version_once(PACKAGE, VERSION, NAME)


def register_groups(name: str, ep_group, edp_group) -> None:
    """Make ``name`` DeepSpeed's name of this rank's expert-parallel and expert-data-parallel
    groups."""
    _check()
    from deepspeed.utils import groups

    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group


def mark_experts(params: Iterable, name: str) -> None:
    """Mark parameters as experts of the groups registered under ``name``."""
    _check()
    for param in params:
        param.allreduce = False
        param.group_name = name


@contextlib.contextmanager
def as_moe_layers(model, layer_class):
    """While ``deepspeed.initialize`` runs, its engine counts ``model``'s ``layer_class``
    modules (megatron-core's ``MoELayer``) as MoE layers; it reads their ``num_experts``,
    which they get from their config."""
    _check()
    import deepspeed.runtime.engine as engine

    for module in model.modules():
        if isinstance(module, layer_class):
            module.num_experts = module.config.num_moe_experts
    original = engine.MoE
    engine.MoE = (original, layer_class)
    try:
        yield
    finally:
        engine.MoE = original

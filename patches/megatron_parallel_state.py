"""Adapter: megatron-core's ``parallel_state`` module globals, set to groups we made
(megatron-core 0.16.1; not a patch, nothing upstream is changed).

The model and the pipeline schedule get their groups explicitly (``pg_collection``), but a few
megatron-core 0.16.1 paths still read module state: ``vocab_parallel_cross_entropy`` takes the
TP group from ``parallel_state``, attention its scratch buffer. Pointing those globals at a
worker's own in-worker groups keeps such paths inside the worker without megatron creating any
group of its own (``initialize_model_parallel`` would build world-spanning ones). The names
below are private and release-specific: another megatron-core version is refused.
"""

from typing import Dict

from ._pinning import require_version

NAME = "megatron_parallel_state"
PACKAGE, VERSION = "megatron-core", "0.16.1"


def install_groups(groups: Dict[str, object], ranks: Dict[str, list]) -> None:
    """``groups`` / ``ranks``: the worker's groups and their global ranks by role (``tp``,
    ``pp``, ``mp``, ``dp``, ``tp_dp``, ``single``; ``embd`` and ``pos_embd`` where the stage has
    them)."""
    require_version(PACKAGE, VERSION, NAME)
    from megatron.core import parallel_state as ps

    ps._TENSOR_MODEL_PARALLEL_GROUP = groups["tp"]
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = ranks["tp"]
    ps._PIPELINE_MODEL_PARALLEL_GROUP = groups["pp"]
    ps._PIPELINE_GLOBAL_RANKS = ranks["pp"]
    ps._MODEL_PARALLEL_GROUP = groups["mp"]
    ps._MODEL_PARALLEL_GLOBAL_RANKS = ranks["mp"]
    ps._EMBEDDING_GROUP = groups.get("embd")
    ps._EMBEDDING_GLOBAL_RANKS = ranks.get("embd")
    ps._POSITION_EMBEDDING_GROUP = groups.get("pos_embd")
    ps._POSITION_EMBEDDING_GLOBAL_RANKS = ranks.get("pos_embd")
    for name in ("_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP_WITH_CP"):
        setattr(ps, name, groups["dp"])
    # Transformer Engine's FP8 amax reduction asserts these once model_parallel_is_initialized
    # answers yes (megatron's context parallelism is 1 here: WITH_CP is the same group).
    for name in ("_TENSOR_AND_DATA_PARALLEL_GROUP", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP"):
        setattr(ps, name, groups["tp_dp"])
    ps._DATA_PARALLEL_GLOBAL_RANKS = ranks["dp"]
    ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = ranks["dp"]
    ps._CONTEXT_PARALLEL_GROUP = groups["single"]
    ps._CONTEXT_PARALLEL_GLOBAL_RANKS = ranks["single"]
    ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = groups["tp"]
    ensure_global_memory_buffer()


def ensure_global_memory_buffer() -> None:
    """Megatron's scratch buffer (attention, sequence parallelism), created once."""
    from megatron.core import parallel_state as ps

    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()

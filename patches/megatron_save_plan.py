"""Adapter: megatron-core's torch_dist save, planned once and reused while what a rank saves
keeps its structure (megatron-core 0.16.1).

Before writing, a torch_dist save (``dist_checkpointing.save``) plans: ``save_preprocess``
checks that every shard is written exactly once (``validate_sharding_integrity``: an
all-gather of every rank's shard metadata over the worker), and the planner gathers every
rank's local plan to the coordinator (the worker's first rank), which builds the global
metadata (torch's ``.metadata`` index, less the file offsets the write adds). None of it
depends on the tensors' values: while the sharded state dict keeps its keys, shapes, offsets,
dtypes and replicas, the plans of one save serve the next.

``TorchDistSaveShardedStrategy(cached_metadata=True)`` (Megatron-LM's
``--ckpt-assume-constant-structure``) keeps them, but reuses them only from the third save
on, once the second save's plan, gathered again, equals the first's, and it takes the
structure to be constant. ``SavePlans`` instead fills the strategy's cache from the first plan
(``validated_cache_reuse``, and the global metadata on the coordinator, which the strategy
keeps only on reuse: ``_get_save_and_finalize_callbacks`` is where it passes) and reuses it
when the caller says every rank of the worker still has the structure it was planned for
(``structure``): the plan is then this rank's alone, with no collective and no validation.

After the write, megatron-core's finalisation (the request's ``finalize_fns``) gathers every
rank's write results to the coordinator, which writes ``.metadata``, then broadcasts whether
that failed and waits for every rank. ``SavePlans.finish`` does the coordinator's part from
results the caller carries (``megatron_streaming.checkpoint``: over its own in-worker gather,
or as files beside the checkpoint's): the other ranks take no part.
"""

from __future__ import annotations

from typing import Optional

from ._pinning import require_version_once

NAME = "megatron_save_plan"
PACKAGE, VERSION = "megatron-core", "0.16.1"

# What of a sharded value the plan depends on (ShardedTensor, ShardedObject, factories).
_FIELDS = ("key", "dtype", "local_shape", "global_shape", "global_offset",
           "axis_fragmentations", "replica_id", "prepend_axis_num", "flattened_range",
           "allow_shape_mismatch")


def structure(sharded: dict) -> tuple:
    """What the plan of a save of ``sharded`` depends on, to compare with ``==``: each value's
    key, type, dtype, shapes, offsets and replica (not its data). The fields are plain values
    (strings, tuples, dtypes, slices)."""
    out = []
    for name in sorted(sharded):
        value = sharded[name]
        data = getattr(value, "data", None)
        shape = tuple(data.shape) if hasattr(data, "shape") else None
        out.append((name, type(value).__name__, shape,
                    tuple(getattr(value, f, None) for f in _FIELDS)))
    return tuple(out)


def _strategy_class():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class Strategy(TorchDistSaveShardedStrategy):
        """The strategy, keeping the global metadata of its latest plan (the coordinator's;
        None elsewhere) and the writer of its latest request (its directory)."""

        planned_metadata = None
        planned_writer = None

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            self.planned_writer, self.planned_metadata = save_state_dict_ret[:2]
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)

    return Strategy


class SavePlans:
    """The plan of this rank's latest torch_dist save, for the next ones of the same
    structure. Its requests write through this process's results queue
    (``megatron_checkpoint_writer.in_process_results``)."""

    def __init__(self):
        self._strategy = None
        self.planned_for: Optional[tuple] = None  # the ``structure`` the kept plan is for

    def matches(self, sharded: dict) -> bool:
        """Whether the kept plan was made for ``sharded``'s structure."""
        return self.planned_for is not None and self.planned_for == structure(sharded)

    def request(self, sharded: dict, directory: str, reuse: bool):
        """``dist_checkpointing.save(..., async_sharded_save=True)``'s request for ``sharded``
        in ``directory``: planned afresh and validated (collective within the worker; the plan
        is kept), or with ``reuse`` (every rank of the worker must pass the same) from the
        kept plan, on this rank alone."""
        require_version_once(PACKAGE, VERSION, NAME)
        from megatron.core.dist_checkpointing import save

        return self._planned(sharded, lambda strategy: save(
            sharded, directory, sharded_strategy=strategy, validate_access_integrity=not reuse,
            async_sharded_save=True), reuse)

    def plan_ahead(self, sharded: dict, directory: str) -> None:
        """Plan a save of ``sharded`` and keep the plan, writing nothing (collective within
        the worker, as the first save's plan is): what ``save`` does before its request, less
        ``common.pt``. ``directory`` must exist (torch's writer makes it: no failure on one
        rank alone)."""
        require_version_once(PACKAGE, VERSION, NAME)
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

        def plan(strategy):
            sharded_part, _ = save_preprocess(dict(sharded), validate_access_integrity=True)
            strategy.async_save(sharded_part, directory)  # the request dropped

        self._planned(sharded, plan, reuse=False)

    def _planned(self, sharded: dict, plan, reuse: bool):
        from .megatron_checkpoint_writer import in_process_results

        in_process_results()  # the request's write results stay in this process
        if not reuse:
            self._strategy, self.planned_for = _strategy_class()("torch_dist", 1,
                                                                 cached_metadata=True), None
        elif self._strategy is None:
            raise RuntimeError("a kept save plan was asked for, but none was kept")
        strategy = self._strategy
        try:
            result = plan(strategy)
        except BaseException:
            self.forget()  # a plan cut short is not kept
            raise
        if not reuse:
            # The strategy caches a plan only once a second one equals it: from this one.
            strategy.validated_cache_reuse = True
            strategy.cached_global_metadata = strategy.planned_metadata
            self.planned_for = structure(sharded)
        return result

    def finish(self, results: list) -> None:
        """The latest request's finalisation, on the worker's first rank (the coordinator,
        which holds the global metadata), from every rank's write results (``results``, in
        rank order): torch's ``.metadata`` index and megatron-core's ``metadata.json``, in
        the request's directory. megatron-core's own (the request's ``finalize_fns``) gathers
        the results and then broadcasts and waits for every rank of the worker; the caller
        carries them instead, with nothing to wait for on the other ranks."""
        require_version_once(PACKAGE, VERSION, NAME)
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

        strategy = self._strategy
        if strategy is None or strategy.planned_metadata is None:
            raise RuntimeError("a save's finalisation was asked for on a rank that did not "
                               "coordinate its plan")
        writer = strategy.planned_writer
        writer.finish(strategy.planned_metadata, results)
        save_config(CheckpointingConfig(strategy.backend, strategy.version),
                    writer.checkpoint_id)

    def forget(self) -> None:
        self._strategy, self.planned_for = None, None

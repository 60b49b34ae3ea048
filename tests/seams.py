"""Ways in that only the tests (and benchmarks) need, kept out of the library.

* ``lr_at`` / ``num_microbatches``: the learning rate and micro-batch count of a step from
  the flags alone, without building an engine (``WorkerEngine`` holds its own schedules).
* ``all_reduce_mean``: one tensor through ``Transport.all_reduce_mean_many``.
* ``count_collectives``: the collectives a transport issues on its cross-worker group.
"""

from typing import Optional


def lr_at(iteration: int, cfg, dp: int = 1, max_lr: Optional[float] = None,
          min_lr: Optional[float] = None) -> float:
    """The learning rate of step ``iteration`` (0-based), as Megatron's scheduler sets it
    after the samples of the steps before (``schedules.LrSchedule``); ``max_lr`` / ``min_lr``:
    a param group's own (default --lr and --min-lr)."""
    from megatron_streaming.config.schedules import BatchSchedule, LrSchedule

    return LrSchedule(cfg, BatchSchedule(cfg.training, cfg.model.seq_length, dp))(
        iteration, max_lr, min_lr)


def num_microbatches(cfg, dp: int) -> int:
    """Micro-batches of a full step (after any batch ramp-up)."""
    from megatron_streaming.config.schedules import BatchSchedule

    return BatchSchedule(cfg.training, cfg.model.seq_length, dp).final_micro_batches


def all_reduce_mean(transport, x, step: int, tag: str, feedback=None):
    """Start averaging ``x`` (flat fp32) over the workers; returns its ``Pending`` at once."""
    return transport.all_reduce_mean_many([x], step, [tag], [feedback])[0]


def abandoned(transport, pending) -> Optional[str]:
    """Let ``transport`` go (a membership change) and wait for ``pending``, its exchange held
    before the wire: the ``GroupReleased`` message it ends with (None: it completed)."""
    from megatron_streaming.comm.transport import GroupReleased

    transport.abandon()
    transport.gate.set()
    try:
        pending.future.result(timeout=60)
        return None
    except GroupReleased as e:
        return str(e)


def count_collectives(transport):
    """Count on ``transport.collectives`` the collectives its exchanges issue on the
    cross-worker group from now on: the all-to-all of ``_reduce_scatter`` and the all-gather
    of ``_all_gather``, one each (2 per exchange), counted once they returned (the sparse
    exchange's one all-gather is its ``_all_gather``: 1 per exchange)."""
    transport.collectives = 0
    for name in ("_reduce_scatter", "_all_gather"):
        def counted(*args, _issue=getattr(transport, name)):
            out = _issue(*args)
            transport.collectives += 1
            return out

        setattr(transport, name, counted)
    return transport

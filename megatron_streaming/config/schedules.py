"""Training length, batch size and learning rate as pure functions of the iteration.

Megatron-LM's schedules under its flag names and meanings:

* length: ``--train-iters``, or ``--train-samples`` (the iteration count derived as Megatron
  derives it), capped by Megatron-DeepSpeed's ``--train-tokens``;
* batch: a constant ``--global-batch-size``; ``--rampup-batch-size START INCREMENT SAMPLES``
  (megatron-core's ``RampupBatchsizeNumMicroBatchesCalculator`` decides the batch from the
  samples consumed); or Megatron-LM's ``--step-batch-size-schedule "TOKENS:BATCH ..."``
  (megatron-core 0.16.1 does not have it yet: ``StepBatchSizes`` below);
* learning rate: the arithmetic of megatron-core's ``OptimizerParamScheduler.get_lr`` (warmup
  from ``--lr-warmup-init``, then constant, linear, cosine, inverse-square-root or WSD) over
  the samples consumed *before* the step, as Megatron steps its scheduler; or over tokens with
  Megatron-DeepSpeed's ``--lr-warmup-tokens`` / ``--lr-decay-tokens``. With
  ``--decoupled-lr`` the embedding and output layer's param group runs the same shape between
  its own peak and floor (megatron-core's per-group ``max_lr`` / ``min_lr``).
  ``tests/test_schedules.py`` checks it against ``OptimizerParamScheduler`` itself.

Where it sits: ``arguments`` calls ``check_and_resolve`` (flag rules, the iteration count);
``engine`` takes the micro-batch count and the learning rate of each step from here, ``inputs``
the data position, ``train`` the tokens. Everything counts one worker: ``--global-batch-size``
is per worker, so are the sample and token flags (a Megatron job of one worker's size), and
every worker ramps its own batch. The consumed samples being a function of the iteration, a
resume needs nothing but the iteration.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, List, Optional, Tuple

DEFAULT_TRAIN_ITERS = 20
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


# ---- batch size ----------------------------------------------------------------------------

class StepBatchSizes:
    """Megatron-LM's ``--step-batch-size-schedule``: the batch of the last threshold reached.

    ``"0:16 2.4B:320 12B:1536"``: thresholds in tokens (K/M/B/T suffixes), converted to
    samples by ``// seq_length``; the first must be 0, the rest strictly increasing; the last
    batch is the global batch size."""

    def __init__(self, text: str, seq_length: int):
        entries = text.replace(",", " ").split()
        if not entries:
            raise ValueError("--step-batch-size-schedule is empty; give 'TOKENS:BATCH ...'")
        pairs = []
        for entry in entries:
            threshold, sep, batch = entry.partition(":")
            if not sep:
                raise ValueError(f"--step-batch-size-schedule entry {entry!r}: expected "
                                 "TOKENS:BATCH, e.g. '0:16 2.4B:320'")
            pairs.append((_count(threshold, entry) // seq_length, _count(batch, entry)))
        pairs.sort()
        self.thresholds = [p[0] for p in pairs]
        self.batches = [p[1] for p in pairs]
        if self.thresholds[0] != 0:
            raise ValueError(f"--step-batch-size-schedule {text!r}: the first threshold must "
                             "be 0")
        for a, b in zip(self.thresholds, self.thresholds[1:]):
            if a == b:
                raise ValueError(f"--step-batch-size-schedule {text!r}: two thresholds fall on "
                                 f"sample {a} (tokens // --seq-length {seq_length})")
        if min(self.batches) <= 0:
            raise ValueError(f"--step-batch-size-schedule {text!r}: batch sizes must be > 0")

    def level(self, consumed: int) -> int:
        return bisect.bisect_right(self.thresholds, consumed) - 1

    def batch(self, consumed: int) -> int:
        return self.batches[self.level(consumed)]


def _count(text: str, entry: str) -> int:
    """'2.4B' -> 2400000000 (Megatron-LM's suffixes)."""
    value = text.strip().upper()
    scale = _SUFFIXES.get(value[-1:], 1)
    try:
        return int(float(value[:-1] if scale > 1 else value) * scale)
    except ValueError:
        raise ValueError(f"--step-batch-size-schedule entry {entry!r}: {text!r} is not a "
                         "number (K/M/B/T suffixes allowed)") from None


def _rampup_calculator(t, gbs: int, dp: int):
    """megatron-core's calculator of --rampup-batch-size (its checks as one-line errors)."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    start, increment, samples = t.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start <= 0 or increment <= 0 or samples <= 0:
        raise ValueError(f"{flag}: start batch, increment and ramp-up samples must be > 0")
    if start >= gbs or (gbs - start) % increment:
        raise ValueError(f"{flag}: --global-batch-size ({gbs}) minus the start batch must be a "
                         "positive multiple of the increment")
    # rank only decides whether the calculator logs: it must not.
    return RampupBatchsizeNumMicroBatchesCalculator(gbs, t.micro_batch_size, dp, False, 1, start,
                                                    increment, samples)


class BatchSchedule:
    """One worker's global batch at every iteration, and the samples consumed before it.

    Stored as segments ``(first iteration, samples consumed before it, batch)``; the batch of
    a segment is asked of the calculator at the segment's first iteration and the segment ends
    where the calculator's level (the rampup batch, the step schedule's entry) changes, found
    by galloping, so a long ramp costs a few hundred calls, not one per iteration."""

    def __init__(self, training, seq_length: int, dp: int):
        t = training
        self.micro_batch_size, self.dp = t.micro_batch_size, dp
        gbs = t.global_batch_size or t.micro_batch_size * dp
        if t.step_batch_size_schedule:
            steps = StepBatchSizes(t.step_batch_size_schedule, seq_length)
            self.kind, self.final_batch = "step", steps.batches[-1]
            level, batch, last = steps.level, steps.batch, steps.thresholds[-1]
            is_final = lambda consumed: consumed >= last  # noqa: E731
        elif t.rampup_batch_size:
            calculator = _rampup_calculator(t, gbs, dp)
            self.kind, self.final_batch, self.rampup_samples = "rampup", gbs, calculator.ramup_samples

            def batch(consumed: int) -> int:
                calculator.update(consumed, consistency_check=False)
                return calculator.get_current_global_batch_size()

            def is_final(consumed: int) -> bool:
                return consumed > self.rampup_samples

            def level(consumed: int):  # the ramp only grows; it may reach the end early
                return batch(consumed), is_final(consumed)
        else:
            self.kind, self.final_batch = "constant", gbs
            level = batch = lambda consumed: gbs  # noqa: E731
            is_final = lambda consumed: True  # noqa: E731
        self.segments = _segments(level, batch, is_final)
        self._starts = [s[0] for s in self.segments]

    def _segment(self, iteration: int) -> Tuple[int, int, int]:
        return self.segments[bisect.bisect_right(self._starts, iteration) - 1]

    def global_batch(self, iteration: int) -> int:
        """Samples one worker's step ``iteration`` (0-based) takes."""
        return self._segment(iteration)[2]

    def consumed(self, iteration: int) -> int:
        """Samples one worker consumed in iterations ``0 .. iteration - 1``."""
        first, consumed, batch = self._segment(iteration)
        return consumed + (iteration - first) * batch

    def micro_batches(self, iteration: int) -> int:
        return self.global_batch(iteration) // (self.micro_batch_size * self.dp)

    @property
    def final_micro_batches(self) -> int:
        return self.final_batch // (self.micro_batch_size * self.dp)

    def iteration_reaching(self, samples: int) -> int:
        """The first iteration before which at least ``samples`` were consumed."""
        bounds = self.segments[1:] + [None]
        for (first, consumed, batch), following in zip(self.segments, bounds):
            if samples <= consumed:
                return first
            if following is None or samples <= following[1]:
                return first + -(-(samples - consumed) // batch)
        raise AssertionError("unreachable: the last segment is open-ended")

    def iterations_for_samples(self, train_samples: int) -> int:
        """``--train-samples`` -> iterations, as Megatron derives them (``update_train_iters``):
        whole batches for a constant batch; for a ramp, the ramp's iterations then whole final
        batches (Megatron-LM / Megatron-DeepSpeed); for a step schedule, until the samples are
        reached (Megatron-LM)."""
        if self.kind == "constant":
            return train_samples // self.final_batch
        if self.kind == "step":
            return self.iteration_reaching(train_samples)
        ramp_end = self.iteration_reaching(self.rampup_samples + 1)
        return ramp_end + (train_samples - self.consumed(ramp_end)) // self.final_batch

    def check_divisible(self, until_iteration: int, flag: str) -> None:
        """Every batch used before ``until_iteration`` splits into whole micro-batches."""
        unit = self.micro_batch_size * self.dp
        for first, consumed, batch in self.segments:
            if first < max(until_iteration, 1) and batch % unit:
                raise ValueError(
                    f"{flag}: the global batch {batch} (from sample {consumed}) is not divisible "
                    f"by --micro-batch-size ({self.micro_batch_size}) x data-parallel size "
                    f"({self.dp})")


def _segments(level: Callable, batch: Callable, is_final: Callable) -> List[Tuple[int, int, int]]:
    segments, iteration, consumed = [], 0, 0
    while True:
        size = batch(consumed)
        segments.append((iteration, consumed, size))
        if is_final(consumed):
            return segments
        here = level(consumed)
        steps = _first_false(lambda k: level(consumed + k * size) == here)
        iteration, consumed = iteration + steps, consumed + steps * size


def _first_false(predicate: Callable[[int], bool]) -> int:
    """Smallest k >= 1 with ``predicate(k)`` false, for a predicate true on 0 .. k-1."""
    low, high = 0, 1
    while predicate(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if predicate(middle) else (low, middle)
    return high


# ---- learning rate ---------------------------------------------------------------------------

def megatron_lr(steps: float, init_lr: float, max_lr: float, min_lr: float, warmup: float,
                decay: float, style: str, wsd_decay: Optional[float] = None,
                wsd_style: str = "exponential") -> float:
    """``OptimizerParamScheduler.get_lr`` of megatron-core 0.16.1 at ``num_steps = steps``,
    restated term for term so the floats agree exactly; unlike its constructor, this is also
    defined for a warmup at least as long as the decay (then warmup, then ``min_lr``)."""
    if warmup > 0 and steps <= warmup:
        return init_lr + ((max_lr - init_lr) * float(steps) / float(warmup))
    if style == "constant":
        return max_lr
    if steps > decay:
        return min_lr
    if style == "inverse-square-root":
        lr = max_lr * max(warmup, 1) ** 0.5 / (max(steps, 1) ** 0.5)
        return max(min_lr, lr)
    ratio = float(steps - warmup) / float(decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: constant, then the annealing phase over the last ``wsd_decay`` steps
        anneal_start = decay - wsd_decay
        if steps <= anneal_start:
            coeff = 1.0
        else:
            wsd_ratio = float(steps - anneal_start) / float(wsd_decay)
            coeff = {"linear": lambda r: 1.0 - r,
                     "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": lambda r: (2.0 * math.pow(0.5, r)) - 1.0,
                     "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[wsd_style](wsd_ratio)
    return min_lr + coeff * (max_lr - min_lr)


class LrSchedule:
    """The learning rate of each step, from the samples (or tokens) consumed before it.

    Megatron's units: iteration-based flags become samples (iterations x --global-batch-size,
    so a ramped batch advances the schedule by the samples it took), sample flags are samples,
    and with ``--lr-decay-tokens`` everything is in tokens (samples x --seq-length)."""

    def __init__(self, cfg, batches: BatchSchedule):
        o, t = cfg.optimizer, cfg.training
        self.o, self.batches = o, batches
        gbs = batches.final_batch
        per_unit = 1
        if o.lr_decay_tokens is not None:
            per_unit, decay = cfg.model.seq_length, o.lr_decay_tokens
        elif t.train_samples is not None:
            decay = o.lr_decay_samples or t.train_samples
        else:
            decay = (o.lr_decay_iters or t.train_iters or DEFAULT_TRAIN_ITERS) * gbs
        if o.lr_warmup_tokens is not None:
            warmup = o.lr_warmup_tokens
        elif o.lr_warmup_fraction is not None:
            warmup = o.lr_warmup_fraction * decay
        elif t.train_samples is not None:
            warmup = o.lr_warmup_samples * per_unit
        else:
            warmup = o.lr_warmup_iters * gbs * per_unit
        wsd = None
        if o.lr_wsd_decay_samples is not None:
            wsd = o.lr_wsd_decay_samples * per_unit
        elif o.lr_wsd_decay_iters is not None:
            wsd = o.lr_wsd_decay_iters * gbs * per_unit
        self.per_unit, self.warmup, self.decay, self.wsd_decay = per_unit, warmup, decay, wsd

    def __call__(self, iteration: int, max_lr: Optional[float] = None,
                 min_lr: Optional[float] = None) -> float:
        """The lr of step ``iteration``; ``max_lr`` / ``min_lr``: a param group's own peak and
        floor (Megatron's per-group keys), by default --lr and --min-lr. The warmup starts
        from --lr-warmup-init for every group, as megatron-core's scheduler does."""
        o = self.o
        return megatron_lr(self.batches.consumed(iteration) * self.per_unit, o.lr_warmup_init,
                           o.lr if max_lr is None else max_lr,
                           o.min_lr if min_lr is None else min_lr, self.warmup, self.decay,
                           o.lr_decay_style, self.wsd_decay, o.lr_wsd_decay_style)


def decoupled_bounds(optimizer_cfg) -> Optional[Tuple[float, float]]:
    """``(max_lr, min_lr)`` of the embedding and output layer's group, None without
    --decoupled-lr. megatron-core (``get_standard_config_overrides``) overrides only what is
    given: the floor is --min-lr unless --decoupled-min-lr is."""
    o = optimizer_cfg
    if o.decoupled_lr is None:
        return None
    return o.decoupled_lr, o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr


# ---- flag rules ------------------------------------------------------------------------------

def apply_given(cfg, given: set) -> List[str]:
    """Parse-time rules that need to know which flags were typed (``--train-iters`` has a
    default of 20): returns one line per problem. ``--train-samples`` alone makes the run
    sample-based; its iteration count is derived by ``check_and_resolve``."""
    t, problems = cfg.training, []
    if "--train-samples" in given and "--train-iters" in given:
        problems.append("--train-iters and --train-samples are exclusive: give one "
                        "(iteration-based or sample-based training, as in Megatron-LM)")
    elif t.train_samples is not None:
        t.train_iters = None
    if t.train_tokens is not None and not given & {"--train-iters", "--train-samples"}:
        problems.append("--train-tokens needs --train-iters or --train-samples (it stops "
                        "training early, as in Megatron-DeepSpeed)")
    return problems


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_values(cfg) -> None:
    o, t = cfg.optimizer, cfg.training
    for flag, value in (("--train-samples", t.train_samples), ("--train-tokens", t.train_tokens),
                        ("--lr-decay-iters", o.lr_decay_iters),
                        ("--lr-decay-samples", o.lr_decay_samples),
                        ("--lr-decay-tokens", o.lr_decay_tokens),
                        ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters),
                        ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples),
                        ("--exit-duration-in-mins", t.exit_duration_in_mins)):
        _require(value is None or value > 0, f"{flag} must be > 0, got {value}")
    for flag, value in (("--lr-warmup-iters", o.lr_warmup_iters),
                        ("--lr-warmup-samples", o.lr_warmup_samples),
                        ("--lr-warmup-tokens", o.lr_warmup_tokens)):
        _require(value is None or value >= 0, f"{flag} must be >= 0, got {value}")
    _require(o.lr_warmup_fraction is None or 0 <= o.lr_warmup_fraction <= 1,
             f"--lr-warmup-fraction must be in [0, 1], got {o.lr_warmup_fraction}")
    _require(o.min_lr <= o.lr, f"--min-lr ({o.min_lr}) must not exceed --lr ({o.lr})")
    _require(0 <= o.lr_warmup_init <= o.lr,
             f"--lr-warmup-init ({o.lr_warmup_init}) must be in [0, --lr ({o.lr})]")
    _check_decoupled(o)


def _check_decoupled(o) -> None:
    """megatron-core ignores --decoupled-min-lr without --decoupled-lr; here that is an error
    rather than a flag that silently does nothing."""
    _require(o.decoupled_min_lr is None or o.decoupled_lr is not None,
             f"--decoupled-min-lr {o.decoupled_min_lr} needs --decoupled-lr (the embedding and "
             "output layer's peak learning rate)")
    bounds = decoupled_bounds(o)
    if bounds is None:
        return
    peak, floor = bounds
    _require(peak >= 0, f"--decoupled-lr must be >= 0, got {peak}")
    floor_flag = "--min-lr" if o.decoupled_min_lr is None else "--decoupled-min-lr"
    _require(0 <= floor <= peak, f"{floor_flag} ({floor}) must be in [0, --decoupled-lr "
             f"({peak})]: the floor of the embedding and output layer's decay")


def _check_lr_units(cfg) -> None:
    """Megatron-LM's rules: iteration- and sample-based flags do not mix, one warmup flag."""
    o, t = cfg.optimizer, cfg.training
    if t.train_samples is not None:
        kind, wrong = "sample-based training (--train-samples)", (
            ("--lr-decay-iters", o.lr_decay_iters is not None, "--lr-decay-samples"),
            ("--lr-warmup-iters", o.lr_warmup_iters != 0, "--lr-warmup-samples"),
            ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters is not None, "--lr-wsd-decay-samples"))
        warmups = (("--lr-warmup-samples", o.lr_warmup_samples != 0),)
    else:
        kind, wrong = "iteration-based training (--train-iters)", (
            ("--lr-decay-samples", o.lr_decay_samples is not None, "--lr-decay-iters"),
            ("--lr-warmup-samples", o.lr_warmup_samples != 0, "--lr-warmup-iters"),
            ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples is not None,
             "--lr-wsd-decay-iters"))
        warmups = (("--lr-warmup-iters", o.lr_warmup_iters != 0),)
    for flag, given, instead in wrong:
        _require(not given, f"{flag} does not go with {kind}; use {instead}")
    warmups += (("--lr-warmup-fraction", o.lr_warmup_fraction is not None),
                ("--lr-warmup-tokens", o.lr_warmup_tokens is not None))
    named = [flag for flag, given in warmups if given]
    _require(len(named) <= 1, f"{' and '.join(named)}: give only one warmup length")
    if o.lr_decay_tokens is not None:
        decays = [f for f, v in (("--lr-decay-iters", o.lr_decay_iters),
                                 ("--lr-decay-samples", o.lr_decay_samples)) if v is not None]
        _require(not decays, f"--lr-decay-tokens and {decays[0] if decays else ''}: give only "
                 "one decay length")
        _require(o.lr_warmup_fraction is None, "--lr-warmup-fraction does not go with "
                 "--lr-decay-tokens; give --lr-warmup-tokens")
    _require(o.lr_warmup_tokens is None or o.lr_decay_tokens is not None,
             "--lr-warmup-tokens needs --lr-decay-tokens (token-based schedules, as in "
             "Megatron-DeepSpeed)")
    if o.lr_decay_style == "WSD":
        need = "--lr-wsd-decay-samples" if t.train_samples is not None else "--lr-wsd-decay-iters"
        _require(o.lr_wsd_decay_samples is not None or o.lr_wsd_decay_iters is not None,
                 f"--lr-decay-style WSD needs {need} (the length of its annealing phase)")


def check_and_resolve(cfg, dp: int) -> BatchSchedule:
    """Every schedule flag against the others (ValueError naming them), then the iteration
    count: from ``--train-samples``, capped by ``--train-tokens``. Idempotent."""
    o, t = cfg.optimizer, cfg.training
    _check_values(cfg)
    _check_lr_units(cfg)
    _require(not (t.rampup_batch_size and t.step_batch_size_schedule),
             "--rampup-batch-size and --step-batch-size-schedule are exclusive: give one")
    if t.step_batch_size_schedule:
        _require(t.global_batch_size is None or t.global_batch_size == StepBatchSizes(
            t.step_batch_size_schedule, cfg.model.seq_length).batches[-1],
            "--step-batch-size-schedule and --global-batch-size are exclusive (the schedule's "
            "last batch is the global batch size, as in Megatron-LM)")
    batches = BatchSchedule(t, cfg.model.seq_length, dp)
    if t.step_batch_size_schedule:
        t.global_batch_size = batches.final_batch
    if t.train_samples is not None:
        t.train_iters = batches.iterations_for_samples(t.train_samples)
        _require(t.skip_train or t.train_iters > 0,
                 f"--train-samples {t.train_samples} is less than one global batch "
                 f"({batches.final_batch})")
    elif o.lr_decay_iters is None and o.lr_decay_tokens is None:
        o.lr_decay_iters = t.train_iters  # Megatron's default, before --train-tokens caps
    if t.train_tokens is not None:
        reached = batches.iteration_reaching(-(-t.train_tokens // cfg.model.seq_length))
        t.train_iters = min(t.train_iters, reached)
    if batches.kind != "constant":
        flag = ("--rampup-batch-size" if batches.kind == "rampup" else
                "--step-batch-size-schedule")
        batches.check_divisible(t.train_iters, flag)
    return batches

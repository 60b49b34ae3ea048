"""Choosing the outer optimizer and the sync schedule from what the quality benchmark measured
(``benchmarks/quality.py``; docs/RESULTS.md, "Quality on held-out text"), and the start-up
warnings for settings where it found syncing harmful.

Two quantities:

* ``outer_steps``: how many outer steps each fragment takes in the run, train_iters / H. The
  papers tune at hundreds to thousands; a 1200-step run at H=30 has 40.
* ``effective_outer_lr``: the step that momentum builds up for an outer gradient that keeps its
  direction, lr / (1 - momentum), for Nesterov and heavy ball alike. Plain averaging is 1 (the
  global parameters move to the workers' mean); the papers' 0.7 / 0.9 is 7.

Measured (two workers, 1200 steps, code and WikiText-2): plain averaging is never worse than a
worker alone; an effective outer lr of 7 was worse than not syncing at all at H=30 (40 outer
steps per fragment) and more so at H=5 (240), also with the inner lr 7x below data parallel's
best; the same step smoothed (lr 0.5, Nesterov 0.5) or a slightly larger one (1.3) gained
nothing. Smaller H is better; fragments, overlap tau=1 and FP4 as E2M1 cost under a point
each (E3M0, the paper's FP4, up to 1.3 points at 6.6M on code); the
merge's alpha 0.5 cost 0.4 % at 1.5M parameters and 1.2-3.8 % at 6.6M under plain averaging.
The scaling-law paper's protocol (``benchmarks/protocol.py``: 1.09M parameters, a code corpus
read once, M=2, H=30, P=3, tau=1, FP4): Nesterov 0.9 at the best of four outer lrs (0.4, E=4)
ended +14.7 % above data parallel at 5 tokens per parameter (44 outer steps per fragment)
where plain averaging ended +9.2 %, and +20.6 % at 20 (177 outer steps).
One worker (the papers' M=1 row, 1200 steps on code): the papers' 0.7 / 0.9 at H=30 ended 14.8 %
above data parallel, nearly the 17 % two workers lost with it; plain averaging on one worker is
data parallel itself, to the last digit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

# Effective outer lr above which the benchmark found outer momentum harmful: 7 (the papers'
# 0.7 / 0.9) at H=5 and H=30 (240 and 40 outer steps per fragment), with the inner lr at data
# parallel's best and 7x below it; 1.3 (lr 1.3, no momentum) cost 0.5 %.
SAFE_EFFECTIVE_LR = 1.5
# Outer steps per fragment the benchmark's H=30 runs had (1200 / 30); fewer, untested.
MIN_OUTER_STEPS = 40
# The most outer steps per fragment at which outer momentum was measured harmful (the quality
# benchmark's H=5: 1200 / 5); past them the start-up says it is untested instead of warning.
MEASURED_OUTER_STEPS = 240
# The H of every published result (docs/RESULTS.md): the default where a run is long enough.
DEFAULT_INNER_STEPS = 30
# The sparse exchange's outer lr where --diloco-outer-lr is not typed (no momentum): each round
# applies a few percent of the outer gradient, and a step of twice it was the best of 1, 2 and
# 3 in the protocol benchmark (1.09M parameters, H=30, 64 of 4,096, held-out loss at 5 tokens
# per parameter: M=2 4.458 / 4.296 / 4.343, M=4 4.712 / 4.564 at 1 and 2, M=2 seed 2 4.501 /
# 4.368 at 1 and 2; docs/RESULTS.md).
SPARSE_OUTER_LR = 2.0
# One worker (the papers' M=1), 0.7 / 0.9 at H=30 against data parallel, held-out loss, %.
ONE_WORKER_HARM = 14.8
ONE_WORKER_MEASURED = "1200 steps, 40 outer steps, 1.5M parameters, code"


def effective_outer_lr(lr: float, momentum: float) -> float:
    return lr / (1.0 - momentum)


def outer_steps(train_iters: Optional[int], inner_steps: int) -> Optional[int]:
    """Outer steps each fragment takes over the run (None: the run's length is unknown)."""
    return None if not train_iters else train_iters // inner_steps


@dataclass(frozen=True)
class Advice:
    """Sync settings for a run, with the reason for each."""

    inner_steps: int
    fragments: int
    overlap_steps: int
    outer_lr: float
    outer_momentum: float
    alpha: float
    quantize: str
    reasons: List[str] = field(default_factory=list)
    control_lag: int = 1
    eager: bool = False

    def flags(self) -> List[str]:
        return ["--diloco-inner-steps", str(self.inner_steps),
                "--diloco-fragments", str(self.fragments),
                "--diloco-overlap-steps", str(self.overlap_steps),
                "--diloco-outer-lr", f"{self.outer_lr:g}",
                "--diloco-outer-momentum", f"{self.outer_momentum:g}",
                "--diloco-alpha", f"{self.alpha:g}", "--diloco-quantize", self.quantize,
                "--diloco-control-lag", str(self.control_lag),
                *(["--diloco-eager"] if self.eager else [])]


def overlap_for(exchange_steps: float, interval: int):
    """(tau, control lag, eager) for an exchange that takes ``exchange_steps`` inner steps on
    the link (``plan.search.exchange_seconds`` over the step time), with one fragment sent
    every ``interval`` = H/P steps. Measured on the slow link (docs/RESULTS.md): the exchange is
    hidden when tau covers it, and the per-step stop flag, which queues behind a fragment's
    bytes, must be read later than the exchange takes (control lag > tau); past H/P steps only
    eager updates (a whole round) hide it, at a cost in loss at equal tokens."""
    steps = max(1, math.ceil(exchange_steps))
    if steps < interval:
        return steps, steps + 1 if steps > 1 else 1, False
    return 0, interval, True


def inner_steps_for(train_iters: Optional[int], cap: int = DEFAULT_INNER_STEPS) -> int:
    """H: ``cap``, lowered where the run would give a fragment fewer than ``MIN_OUTER_STEPS``
    outer steps (fewer were not measured)."""
    if train_iters and train_iters // cap < MIN_OUTER_STEPS:
        return max(1, train_iters // MIN_OUTER_STEPS)
    return cap


def fragments_for(inner_steps: int, num_layers: int) -> int:
    """P: 3 where it divides the layers and H and leaves a fragment more than one step, else 2,
    else 1."""
    return next(p for p in (3, 2, 1) if p == 1 or (
        num_layers % p == 0 and inner_steps % p == 0 and inner_steps // p > 1))


def choose_unset(cfg) -> Optional[str]:
    """H, P and tau where their flags were not typed (None in the config), as ``advise``
    chooses them for a link not described: H from ``inner_steps_for`` (kept a multiple of a
    typed P, and long enough for a typed tau), P from ``fragments_for`` (1 for one worker: no
    link to spread the exchange over), tau 1 where a fragment has more than one step between
    sends and an exchange to hide (several workers, no eager updates), else 0. Returns the
    start-up line naming what was chosen (None: everything was typed, or the sync is off)."""
    s, layers, iters = cfg.streaming, cfg.model.num_layers, cfg.training.train_iters
    unset = [flag for flag, value in (("--diloco-inner-steps", s.diloco_inner_steps),
                                      ("--diloco-fragments", s.diloco_fragments),
                                      ("--diloco-overlap-steps", s.diloco_overlap_steps))
             if value is None]
    if not unset:
        return None
    fl = s.diloco_fragment_layers
    typed_p = layers // fl if fl and fl > 0 and layers % fl == 0 else s.diloco_fragments
    if s.diloco_inner_steps is None:
        h, p = inner_steps_for(iters), typed_p or 1
        h = max(p * ((s.diloco_overlap_steps or 0) + 1), h - h % p)
        s.diloco_inner_steps = h
    if s.diloco_fragments is None:  # one worker: no link to spread, plain DiLoCo's one
        s.diloco_fragments = typed_p or (fragments_for(s.diloco_inner_steps, layers)
                                         if s.diloco_workers > 1 else 1)
    if s.diloco_overlap_steps is None:
        interval = s.diloco_inner_steps // max(1, typed_p or s.diloco_fragments)
        s.diloco_overlap_steps = int(interval > 1 and s.diloco_workers > 1 and
                                     not s.diloco_eager)
    if not s.diloco_sync:
        return None
    chosen = {"--diloco-inner-steps": f"H={s.diloco_inner_steps}",
              "--diloco-fragments": f"P={s.diloco_fragments}",
              "--diloco-overlap-steps": f"tau={s.diloco_overlap_steps}"}
    run = f"{iters} steps of {layers} layers" if iters else f"{layers} layers"
    return (f"{', '.join(unset)} not given: {', '.join(chosen[f] for f in unset)} for {run} "
            f"(docs/DESIGN.md, \"Choosing the sync settings\": H={DEFAULT_INNER_STEPS} where a "
            f"fragment still gets {MIN_OUTER_STEPS} outer steps, else train-iters / "
            f"{MIN_OUTER_STEPS}; P=3 where it divides the layers and H; tau=1 where H/P > 1)")


def choose_sparse_outer_lr(cfg, given) -> Optional[str]:
    """The sparse exchange between workers with --diloco-outer-lr and --diloco-outer-momentum
    not typed (``given``: the flags typed): outer lr ``SPARSE_OUTER_LR``. Returns the start-up
    line saying so (None: not the case)."""
    s = cfg.streaming
    if s.diloco_quantize != "sparse" or s.diloco_workers < 2 or not s.diloco_sync or \
            given & {"--diloco-outer-lr", "--diloco-outer-momentum"}:
        return None
    s.diloco_outer_lr = SPARSE_OUTER_LR
    return (f"--diloco-quantize sparse without --diloco-outer-lr: outer lr "
            f"{SPARSE_OUTER_LR:g}, no momentum (the best of 1, 2 and 3 for the sparse exchange "
            "at M=2 and 4 in the protocol benchmark; docs/RESULTS.md, \"The sparse exchange\")")


def sparse_outer_step(s) -> bool:
    """The sparse exchange's plain outer step up to ``SPARSE_OUTER_LR``: measured better than
    outer lr 1 there, so the dense exchange's warning on a larger step does not apply."""
    return s.diloco_quantize == "sparse" and s.diloco_outer_momentum == 0 and \
        s.diloco_outer_lr <= SPARSE_OUTER_LR


def advise(train_iters: int, num_layers: int, max_inner_steps: Optional[int] = None,
           exchange_steps: Optional[float] = None) -> Advice:
    """The settings the benchmark supports for a run of ``train_iters`` steps.

    ``max_inner_steps``: the H to use if the run is long enough: the smallest the link
    allows (the whole model's outer gradients cross once per H steps within the share of the
    link the sync may take; ``plan`` works it out), since loss grows with H at a fixed number
    of steps; ``DEFAULT_INNER_STEPS`` when not given.
    ``exchange_steps``: inner steps one fragment's exchange takes on the link, round trips
    included (None: within one step); sets tau, the control lag and eager (``overlap_for``)."""
    reasons = []
    h = inner_steps_for(train_iters, max_inner_steps or DEFAULT_INNER_STEPS)
    if h < (max_inner_steps or DEFAULT_INNER_STEPS):
        reasons.append(f"H={h}: at least {MIN_OUTER_STEPS} outer steps per fragment over "
                       f"{train_iters} steps (fewer were not measured)")
    else:
        reasons.append(f"H={h}: as small as the link allows (smaller H, lower loss)"
                       if max_inner_steps else f"H={h}: the H of every published result, for "
                       "a link not described")
    fragments = fragments_for(h, num_layers)
    interval = h // fragments
    lag, eager = 1, False
    if exchange_steps is None or exchange_steps <= 1:
        overlap = 1 if interval > 1 else 0
        reasons.append(f"P={fragments}, tau={overlap}, FP4 (E2M1): under 1 % of loss in the "
                       "benchmark, 1/P of the peak bandwidth, the exchange hidden behind one "
                       "step")
    else:
        overlap, lag, eager = overlap_for(exchange_steps, interval)
        reasons.append(
            f"P={fragments}, FP4; an exchange takes {exchange_steps:.1f} steps: " + (
                f"tau={overlap} hides it, control lag {lag} keeps the stop flag from queueing "
                "behind it" if not eager else
                f"longer than H/P={interval} steps, so eager updates (a whole round), control "
                f"lag {lag}; they cost loss at equal tokens (+10.4 % vs +6.9 % on the small "
                "benchmark): a smaller model share per fragment or a faster link is better"))
    reasons.append("outer lr 1, no momentum, alpha 0 (plain averaging): never worse than a "
                   "worker alone in any measured cell, and better than the papers' Nesterov "
                   f"0.9 at every outer lr tried, up to {MEASURED_OUTER_STEPS} outer steps per "
                   "fragment and 20 tokens per parameter")
    return Advice(h, fragments, overlap, 1.0, 0.0, 0.0, "fp4-e2m1", reasons, lag, eager)


def _outer_step_warning(s, what: str, inner_lr: float = 0.0) -> List[str]:
    """The line for an outer step above ``SAFE_EFFECTIVE_LR``: the flags as typed, then
    ``what`` (``{eff}``: the effective outer lr, ``{eff_lr}``: the inner lr it amounts to)."""
    eff = effective_outer_lr(s.diloco_outer_lr, s.diloco_outer_momentum)
    if eff <= SAFE_EFFECTIVE_LR:
        return []
    typed = (f"--diloco-outer-lr {s.diloco_outer_lr:g} with --diloco-outer-momentum "
             f"{s.diloco_outer_momentum:g} ")
    return [typed + what.format(eff=eff, eff_lr=f"{eff * inner_lr:.2g}")]


def past_measured(s, train_iters: Optional[int]) -> Optional[str]:
    """The note for an outer step above ``SAFE_EFFECTIVE_LR`` in a run of more outer steps per
    fragment than any where it was measured harmful (``MEASURED_OUTER_STEPS``), where the papers
    find it helps: no warning there, but what was and was not measured; None otherwise."""
    steps = outer_steps(train_iters, s.diloco_inner_steps)
    eff = effective_outer_lr(s.diloco_outer_lr, s.diloco_outer_momentum)
    if not s.diloco_sync or eff <= SAFE_EFFECTIVE_LR or not steps or \
            steps <= MEASURED_OUTER_STEPS:
        return None
    return (f"--diloco-outer-lr {s.diloco_outer_lr:g} with --diloco-outer-momentum "
            f"{s.diloco_outer_momentum:g}: {steps} outer steps per fragment, past the "
            f"{MEASURED_OUTER_STEPS} up to which the quality benchmarks found an effective outer "
            f"lr above {SAFE_EFFECTIVE_LR:g} worse than plain averaging (docs/RESULTS.md); "
            "untested here, the regime where the papers find it helps")


def warnings(s, inner_lr: float, train_iters: Optional[int] = None) -> List[str]:
    """One line per setting where the benchmark found syncing harmful; ``s`` is the
    StreamingConfig, ``inner_lr`` the peak --lr, ``train_iters`` the run's steps (outer
    momentum is not warned against past the outer steps it was measured at: ``past_measured``).
    Empty when the sync is off (the parser leaves it on for one worker only where its outer
    optimizer was asked for)."""
    if not s.diloco_sync:
        return []
    past = past_measured(s, train_iters) is not None
    if s.diloco_workers == 1:
        return one_worker_warnings(s, momentum=not past)
    out = [] if past or sparse_outer_step(s) else _outer_step_warning(
        s, "moves the global parameters up to {eff:.1f}x the workers' mean change, as if the "
        f"inner --lr {inner_lr:g} were {{eff_lr}} along their common direction; the quality "
        "benchmark found such settings worse than not syncing at all, at H=5 and H=30 and with "
        "the inner lr up to 7x lower (docs/RESULTS.md); outer lr 1 and momentum 0 (the "
        "defaults) never were", inner_lr)
    if s.diloco_alpha > 0:
        out.append(
            f"--diloco-alpha {s.diloco_alpha:g}: keeping part of the local parameters at the "
            "merge cost held-out loss in the quality benchmark, more on the larger model "
            "(alpha 0.5: +0.4 % at 1.5M parameters, +1.2 to +3.8 % at 6.6M; docs/RESULTS.md); "
            "0 (the default) replaces them with the global ones")
    return out


def one_worker_warnings(s, momentum: bool = True) -> List[str]:
    """One worker's outer optimizer (``--diloco-workers 1`` with outer-loop flags): what the
    quality benchmark measured of it (``momentum``: of its outer step), and what its loop loses
    by construction."""
    out = [] if not momentum else _outer_step_warning(
        s, "on one worker moves its parameters up to {eff:.1f}x their own change over a "
        "round; the quality benchmark's one worker with the papers' 0.7 / 0.9 at H=30 "
        f"({ONE_WORKER_MEASURED}) ended {ONE_WORKER_HARM:+.1f} % in held-out loss against the "
        "same run without it (docs/RESULTS.md); outer lr 1 and momentum 0 train as without it, "
        "bit for bit")
    tau = s.diloco_overlap_steps
    if tau and s.diloco_alpha < 1:
        lost = "are lost" if s.diloco_alpha == 0 else \
            f"are lost but for the share --diloco-alpha {s.diloco_alpha:g} keeps"
        out.append(f"--diloco-overlap-steps {tau} with one worker: there is no exchange to "
                   "hide, and each merge replaces the local parameters with global ones made "
                   f"from those {tau} step(s) before it, so the inner steps in between {lost}; "
                   "--diloco-overlap-steps 0 merges at the send")
    return out

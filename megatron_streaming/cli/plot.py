"""Runs side by side: loss against tokens, cumulative cross-worker bytes against steps.

    .venv/bin/python -m megatron_streaming.cli.plot runs/dp/tb runs/streaming/tb -o compare.png
    .venv/bin/python -m megatron_streaming.cli.plot runs/*/tb -o compare.png --labels DP DiLoCo

Reads what ``pretrain_gpt.py --tensorboard-dir`` wrote (the directory itself, or one that holds
it somewhere below), with TensorBoard's own reader, so the picture shows exactly what
TensorBoard would. Left: ``lm loss`` (line) and ``lm loss validation`` (dots), Megatron-LM's
names (``train/loss`` and ``valid/loss`` in event files written before), against
``train/tokens``. Right, on a log axis: ``streaming/cross_worker_bytes`` (the transport's own
count) for a run with the sync on, else ``traffic/data_parallel_bytes`` (the ring all-reduce
volume a data-parallel run's gradients would need, ``megatron_streaming.comm.traffic``); the legend
says which. A directory without event files or without those tags ends with a one-line error
naming it and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_streaming.errors import UsageError

PROG = "python -m megatron_streaming.cli.plot"
EVENT_FILE_PREFIX = "events.out.tfevents."
# Preferred first: a streaming run's measured traffic; a data-parallel run's computed one.
TRAFFIC_TAGS = {"streaming/cross_worker_bytes": "measured, streaming sync",
                "traffic/data_parallel_bytes": "computed, data-parallel ring all-reduce"}
Series = List[Tuple[int, float]]  # (step, value), by step
# Megatron-LM's name, then the one runs wrote before they took it.
TRAIN_LOSS_TAGS = ("lm loss", "train/loss")
VALID_LOSS_TAGS = ("lm loss validation", "valid/loss")


@dataclass
class RunCurves:
    label: str
    train_loss: Series
    valid_loss: Series
    tokens: Series
    traffic: Series
    traffic_tag: str


def event_directory(run_dir: str) -> str:
    """The one directory at or below ``run_dir`` that holds TensorBoard event files."""
    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir!r}: not a directory")
    found = sorted(root for root, _, files in os.walk(run_dir)
                   if any(f.startswith(EVENT_FILE_PREFIX) for f in files))
    if not found:
        raise UsageError(f"{run_dir!r}: no TensorBoard event files ({EVENT_FILE_PREFIX}*) in it "
                         "or below it; pass the run's --tensorboard-dir")
    if len(found) > 1:
        # Two runs' scalars merged into one line would draw nonsense: make the user choose.
        raise UsageError(f"{run_dir!r}: event files in {len(found)} directories "
                         f"({', '.join(found)}); pass one of them")
    return found[0]


def read_scalars(event_dir: str) -> Dict[str, Series]:
    """Every scalar of the directory, every step kept (TensorBoard's own reader, which also
    drops steps a resumed run wrote again)."""
    from tensorboard.backend.event_processing.event_accumulator import (SCALARS,
                                                                        EventAccumulator)

    acc = EventAccumulator(event_dir, size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag))
            for tag in acc.Tags()[SCALARS]}


def load_run(run_dir: str, label: Optional[str] = None) -> RunCurves:
    event_dir = event_directory(run_dir)
    scalars = read_scalars(event_dir)
    traffic_tag = next((t for t in TRAFFIC_TAGS if t in scalars), None)
    train_tag = next((t for t in TRAIN_LOSS_TAGS if t in scalars), None)
    valid_tag = next((t for t in VALID_LOSS_TAGS if t in scalars), None)
    missing = [] if train_tag else [" or ".join(TRAIN_LOSS_TAGS)]
    missing += [t for t in ("train/tokens",) if t not in scalars]
    if traffic_tag is None:
        missing.append(" or ".join(TRAFFIC_TAGS))
    if missing:
        raise UsageError(f"{run_dir!r}: the event files in {event_dir!r} lack "
                         f"{', '.join(missing)} (written by pretrain_gpt.py with the sync on, "
                         "or with one worker of several data-parallel ranks)")
    name = label or os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    return RunCurves(name, scalars[train_tag], scalars.get(valid_tag, []),
                     scalars["train/tokens"], scalars[traffic_tag], traffic_tag)


def tokens_at(steps: List[int], tokens: Series) -> List[float]:
    """Tokens are linear in the step (a fixed global batch), so evaluations logged between
    two progress lines still get their exact position."""
    last_step, last_tokens = tokens[-1]
    return [step * last_tokens / last_step for step in steps]


def draw(runs: List[RunCurves], output: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, bytes_ax = fig.subplots(1, 2)
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        steps, losses = zip(*run.train_loss)
        loss_ax.plot(tokens_at(steps, run.tokens), losses, color=color, label=run.label)
        if run.valid_loss:
            steps, losses = zip(*run.valid_loss)
            loss_ax.plot(tokens_at(steps, run.tokens), losses, "o", color=color,
                         markeredgecolor="black")
        # A log axis cannot show 0 (before the first exchange completes).
        points = [(step, value) for step, value in run.traffic if value > 0]
        if points:
            bytes_ax.plot(*zip(*points), color=color,
                          label=f"{run.label}: {TRAFFIC_TAGS[run.traffic_tag]}")
    loss_ax.set(xlabel="tokens (all workers)", ylabel="loss",
                title="loss vs tokens (line: train, dots: valid)")
    bytes_ax.set(xlabel="step", ylabel="cumulative cross-worker bytes", yscale="log",
                 title="cross-worker traffic vs steps")
    for ax in (loss_ax, bytes_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Plot loss vs tokens and cross-worker bytes vs steps for runs "
                               "side by side, from their TensorBoard event files.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="A run's --tensorboard-dir, or a directory holding one.")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.png",
                        help="The PNG to write.")
    parser.add_argument("--labels", nargs="+", metavar="LABEL",
                        help="One legend label per RUN_DIR (default: the directory names).")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.labels is not None and len(args.labels) != len(args.run_dirs):
            raise UsageError(f"--labels: {len(args.labels)} labels for {len(args.run_dirs)} "
                             "RUN_DIRs")
        labels = args.labels or [None] * len(args.run_dirs)
        runs = [load_run(d, label) for d, label in zip(args.run_dirs, labels)]
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    draw(runs, args.output)
    print(f"wrote {args.output} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

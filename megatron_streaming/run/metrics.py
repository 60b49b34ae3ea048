"""What a run reports: progress lines, TensorBoard scalars and the end-of-run summary.

Exactly one rule picks the rank that writes (``Topology.is_logging_rank``); everything here is
a no-op elsewhere. TensorBoard is imported only when a directory is given, wandb only with
``--wandb-project`` (and skipped with one line when it is not installed).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable, Dict, Optional

log = logging.getLogger("megatron_streaming")


# Megatron-LM's scalars that it also writes against the consumed training samples
# ("<name> vs samples", TensorBoard only: W&B gets "samples vs steps" instead).
VS_SAMPLES = frozenset((
    "lm loss", "learning-rate", "batch-size", "loss-scale", "world-size", "grad-norm",
    "num-zeros", "params-norm", "lm loss validation", "lm loss validation ppl"))
SAMPLES_VS_STEPS = "samples vs steps"
# The names written before Megatron-LM's, and the Megatron-LM name each became: the JSON
# lines keep them beside the new ones for one release (TensorBoard and W&B have the new only).
# train/step_seconds (the last step's time) has no twin: iteration-time is the mean over the
# --log-interval, with --log-timers-to-tensorboard; timers/<name>-time was in ms, <name>-time
# is in seconds, also with --log-timers-to-tensorboard only.
OLD_NAMES = {"train/loss": "lm loss", "train/lr": "learning-rate",
             "train/grad_norm": "grad-norm", "train/global_batch_size": "batch-size",
             "train/loss_scale": "loss-scale", "valid/loss": "lm loss validation",
             "test/loss": "lm loss test", "train/step_seconds": None}


def is_old_name(key: str) -> bool:
    return key in OLD_NAMES or key.startswith("timers/")


class ScalarWriter:
    """Interface: one point of scalars by name at ``step`` (the iteration). ``samples``: the
    training samples consumed by then (Megatron's second axis); ``legacy``: the names this
    project wrote before it took Megatron-LM's, for the JSON lines only (one release). The
    base class drops them."""

    def scalars(self, step: int, values: Dict[str, float], samples: Optional[int] = None,
                legacy: Optional[Dict[str, float]] = None) -> None:
        pass

    def vs_tokens(self, tokens: int, values: Dict[str, float]) -> None:
        """Megatron-DeepSpeed's second axis: ``<name> vs tokens`` at the consumed training
        tokens (TensorBoard only, as there)."""

    def close(self) -> None:
        pass


def _present(values: Dict[str, float]) -> Dict[str, float]:
    return {k: v for k, v in values.items() if v is not None}


class TensorBoardWriter(ScalarWriter):
    """Scalars as TensorBoard stores them: float32, so cumulative byte counts past 2^24 keep
    only their leading 24 bits; --log-jsonl and --summary-json keep them exact. Megatron's
    training and validation scalars also go against the consumed samples (``VS_SAMPLES``).
    The events reach the file as Megatron-LM's writer lets them: when ``queue_size``
    (--tensorboard-queue-size) are pending, every 2 minutes, and at ``close``, which the run
    calls on every way out but a killed process."""

    def __init__(self, log_dir: str, queue_size: int = 1000):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalars(self, step: int, values: Dict[str, float], samples: Optional[int] = None,
                legacy: Optional[Dict[str, float]] = None) -> None:
        for name, value in _present(values).items():
            self._writer.add_scalar(name, value, step)
            if samples is not None and name in VS_SAMPLES:
                self._writer.add_scalar(f"{name} vs samples", value, samples)

    def vs_tokens(self, tokens: int, values: Dict[str, float]) -> None:
        for name, value in _present(values).items():
            self._writer.add_scalar(f"{name} vs tokens", value, tokens)

    def close(self) -> None:
        self._writer.close()


class JsonLinesWriter(ScalarWriter):
    """One JSON object per point: machine-readable progress for scripts and tests. The keys
    are W&B's, plus the names written before Megatron-LM's (``legacy``) for one release."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a")

    def scalars(self, step: int, values: Dict[str, float], samples: Optional[int] = None,
                legacy: Optional[Dict[str, float]] = None) -> None:
        line = {"iteration": step, **values, **(legacy or {})}
        if samples is not None:
            line[SAMPLES_VS_STEPS] = samples
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbWriter(ScalarWriter):
    """The same scalars in a Weights & Biases run (Megatron's --wandb-* flags); ``mode`` and
    credentials come from wandb's own environment (``WANDB_MODE=offline``...)."""

    def __init__(self, wandb, logging_cfg, save_dir: Optional[str], config: Optional[dict]):
        options = {"project": logging_cfg.wandb_project, "name": logging_cfg.wandb_exp_name,
                   "config": config}
        if logging_cfg.wandb_entity:
            options["entity"] = logging_cfg.wandb_entity
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            options["dir"] = save_dir
        self._run = wandb.init(**options)

    def scalars(self, step: int, values: Dict[str, float], samples: Optional[int] = None,
                legacy: Optional[Dict[str, float]] = None) -> None:
        point = _present(values)
        if not point:
            return
        if samples is not None:
            point[SAMPLES_VS_STEPS] = samples
        self._run.log(point, step=step)

    def close(self) -> None:
        self._run.finish()


# The W&B release this project was checked against (its stand-in: tests/fake_wandb).
WANDB_PIN = "wandb==0.31.0"
WANDB_INSTALL = f".venv/bin/pip install {WANDB_PIN}"


def _wandb_writer(logging_cfg, cfg) -> Optional[ScalarWriter]:
    try:
        import wandb
    except ImportError:
        log.warning("--wandb-project %s: wandb is not installed, so nothing goes to W&B; "
                    "install it with: %s", logging_cfg.wandb_project, WANDB_INSTALL)
        return None
    save_dir = logging_cfg.wandb_save_dir
    if save_dir is None and cfg is not None and cfg.checkpoint.save:
        save_dir = os.path.join(cfg.checkpoint.save, "wandb")  # Megatron's default
    return WandbWriter(wandb, logging_cfg, save_dir, cfg.to_dict() if cfg is not None else None)


class Writers(ScalarWriter):
    def __init__(self, writers):
        self._writers = writers

    def scalars(self, step: int, values: Dict[str, float], samples: Optional[int] = None,
                legacy: Optional[Dict[str, float]] = None) -> None:
        for w in self._writers:
            w.scalars(step, values, samples, legacy)

    def vs_tokens(self, tokens: int, values: Dict[str, float]) -> None:
        for w in self._writers:
            w.vs_tokens(tokens, values)

    def close(self) -> None:
        for w in self._writers:
            w.close()


def make_writer(logging_cfg, is_writer: bool, cfg=None) -> ScalarWriter:
    """The logging rank's writers; ``cfg`` (the whole Config) goes to W&B as the run config."""
    writers = []
    if is_writer and logging_cfg.tensorboard_dir:
        writers.append(TensorBoardWriter(logging_cfg.tensorboard_dir,
                                         logging_cfg.tensorboard_queue_size))
    if is_writer and logging_cfg.log_jsonl:
        writers.append(JsonLinesWriter(logging_cfg.log_jsonl))
    if is_writer and logging_cfg.wandb_project:
        writers.append(_wandb_writer(logging_cfg, cfg))
    return Writers([w for w in writers if w is not None])


def setup_logging(is_logging_rank: bool) -> None:
    level = logging.INFO if is_logging_rank else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", force=True)
    from .quiet import attach_to_root_handlers

    attach_to_root_handlers()
    # Megatron's dataset builder and DeepSpeed narrate every step of their set-up at INFO.
    for name in ("megatron", "DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)


class Throughput:
    """Tokens per second over the iterations since the last report; ``tokens_through(i)`` is
    the tokens trained in iterations ``0 .. i - 1`` (the batch may ramp up). Also Megatron-LM's
    ``iteration-time``: the wall time since the last progress line per iteration, without the
    evaluations in between (``exclude``), as Megatron-LM stops its interval timer for them;
    like Megatron-LM's, none for the run's first iteration (it carries the start-up), whose
    time goes into the next interval."""

    def __init__(self, tokens_through: Callable[[int], int], start_iteration: int = 0):
        self.tokens_through = tokens_through
        self.start = time.perf_counter()
        self._last_time = self.start
        self._last_iteration = start_iteration
        self._interval_start, self._interval_iteration = self.start, start_iteration
        self._excluded = 0.0
        self.first_iteration = start_iteration + 1

    def rate(self, iteration: int) -> float:
        now = time.perf_counter()
        done = self.tokens_through(iteration) - self.tokens_through(self._last_iteration)
        elapsed = now - self._last_time
        self._last_time, self._last_iteration = now, iteration
        return done / max(elapsed, 1e-9)

    def exclude(self, seconds: float) -> None:
        """Time spent outside training steps (an evaluation) since the last interval."""
        self._excluded += seconds

    def seconds_per_iteration(self, iteration: int) -> Optional[float]:
        """Wall seconds per iteration since the last call (evaluations excluded); None when
        no iteration ran since."""
        if iteration == self.first_iteration:
            return None
        now = time.perf_counter()
        iterations = iteration - self._interval_iteration
        elapsed = now - self._interval_start - self._excluded
        self._interval_start, self._interval_iteration, self._excluded = now, iteration, 0.0
        return max(elapsed, 0.0) / iterations if iterations > 0 else None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def progress_line(iteration: int, train_iters: int, loss: Optional[float], lr: float,
                  grad_norm: Optional[float], tokens_per_s: float, elapsed: float,
                  extra: str = "") -> str:
    return (f"iteration {iteration:>6}/{train_iters} | loss {_fmt(loss, '.6f')} | "
            f"lr {lr:.3e} | grad norm {_fmt(grad_norm, '.4f')} | tokens/s {tokens_per_s:,.0f} "
            f"| elapsed {elapsed:.1f}s{extra}")


def write_summary(path: str, summary: dict) -> None:
    """Write atomically, so a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)

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


class ScalarWriter:
    """Interface: scalars by name and step. The base class drops them."""

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter(ScalarWriter):
    """Scalars as TensorBoard stores them: float32, so cumulative byte counts past 2^24 keep
    only their leading 24 bits; --log-jsonl and --summary-json keep them exact."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        for name, value in values.items():
            if value is not None:
                self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class JsonLinesWriter(ScalarWriter):
    """One JSON object per call: machine-readable progress for scripts and tests."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a")

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        self._file.write(json.dumps({"iteration": step, **values}) + "\n")
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

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        self._run.log({k: v for k, v in values.items() if v is not None}, step=step)

    def close(self) -> None:
        self._run.finish()


def _wandb_writer(logging_cfg, cfg) -> Optional[ScalarWriter]:
    try:
        import wandb
    except ImportError:
        log.warning("--wandb-project %s: wandb is not installed; not logging to W&B "
                    "(pip install wandb)", logging_cfg.wandb_project)
        return None
    save_dir = logging_cfg.wandb_save_dir
    if save_dir is None and cfg is not None and cfg.checkpoint.save:
        save_dir = os.path.join(cfg.checkpoint.save, "wandb")  # Megatron's default
    return WandbWriter(wandb, logging_cfg, save_dir, cfg.to_dict() if cfg is not None else None)


class Writers(ScalarWriter):
    def __init__(self, writers):
        self._writers = writers

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        for w in self._writers:
            w.scalars(step, values)

    def close(self) -> None:
        for w in self._writers:
            w.close()


def make_writer(logging_cfg, is_writer: bool, cfg=None) -> ScalarWriter:
    """The logging rank's writers; ``cfg`` (the whole Config) goes to W&B as the run config."""
    writers = []
    if is_writer and logging_cfg.tensorboard_dir:
        writers.append(TensorBoardWriter(logging_cfg.tensorboard_dir))
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
    the tokens trained in iterations ``0 .. i - 1`` (the batch may ramp up)."""

    def __init__(self, tokens_through: Callable[[int], int], start_iteration: int = 0):
        self.tokens_through = tokens_through
        self.start = time.perf_counter()
        self._last_time = self.start
        self._last_iteration = start_iteration

    def rate(self, iteration: int) -> float:
        now = time.perf_counter()
        done = self.tokens_through(iteration) - self.tokens_through(self._last_iteration)
        elapsed = now - self._last_time
        self._last_time, self._last_iteration = now, iteration
        return done / max(elapsed, 1e-9)

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

"""--log-progress: Megatron-LM's ``progress.txt`` in --save, line for line (core_v0.16.1,
``megatron/training/utils.py append_to_progress_log`` and ``training.py
compute_throughputs_and_append_to_progress_log``).

Each line is ``<date time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world size>\\t<event>``, the
event one of:

* ``Starting job`` (when the run has set up; a resume appends to the same file);
* after a checkpoint is saved, ``Saved checkpoint\\tIteration: N\\tJob throughput: X
  TFLOP/s/GPU\\tCumulative throughput: Y TFLOP/s/GPU\\tFloating-point operations: F\\tTokens
  (in billions): T``; with --async-save the same line, headed ``Saving async checkpoint``,
  when the save starts, and ``Saved async checkpoint\\tIteration: N`` when it is committed.

F is Megatron-LM's count of the operations of every step so far (``flops``: every worker's
samples), T the tokens trained so far (every worker's). X is this job's operations over its
time since the process started, per rank of the job; Y the same since the first ``Starting
job`` line of the latest unbroken run of lines with this world size, from the operations of
the last ``Saved checkpoint`` before it. Megatron-LM has no --keep-last: the checkpoints it
deletes leaves no line here.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Callable, Optional, Tuple

FILE = "progress.txt"
_STAMP = "%Y-%m-%d %H:%M:%S"


class ProgressLog:
    """``directory`` None: --log-progress off, or no --save (Megatron-LM writes nothing
    then either); every method is a no-op."""

    def __init__(self, directory: Optional[str], world_size: int,
                 operations_through: Callable[[int], float],
                 tokens_through: Callable[[int], int], start_iteration: int,
                 started: float, writes: Callable[[], bool] = lambda: True,
                 now: Callable[[], datetime] = datetime.now):
        self.directory, self.world_size = directory, world_size
        self.operations_through, self.tokens_through = operations_through, tokens_through
        self.start_operations = operations_through(start_iteration)
        self.started, self.writes, self.now = started, writes, now

    @classmethod
    def of(cls, run) -> "ProgressLog":
        """The run's (``train.Run`` once set up): only its reporting rank writes."""
        cfg = run.cfg
        on = cfg.logging.log_progress and cfg.checkpoint.save
        # The job's start in wall-clock time, as Megatron-LM's (the process's start).
        started = time.time() - (time.perf_counter() - run.start_time)
        return cls(cfg.checkpoint.save if on else None, run.topology.layout.world_size,
                   lambda i: run.report.operations(run.data.samples_through(i)),
                   run.data.tokens_through, run.iteration, started,
                   writes=lambda: run.reports)

    @property
    def path(self) -> Optional[str]:
        return None if self.directory is None else os.path.join(self.directory, FILE)

    def job_started(self) -> None:
        self._append("Starting job")

    def saved(self, iteration: int, background: bool = False) -> None:
        """A checkpoint of ``iteration`` was saved (``background``: a --async-save one was
        committed)."""
        if background:
            self._append(f"Saved async checkpoint\tIteration: {iteration}")
        elif self._on():
            self._append(self._throughput_line("Saved checkpoint", iteration))

    def saving_in_background(self, iteration: int) -> None:
        if self._on():
            self._append(self._throughput_line("Saving async checkpoint", iteration))

    def _on(self) -> bool:
        return self.path is not None and self.writes()

    def _throughput_line(self, event: str, iteration: int) -> str:
        operations = self.operations_through(iteration)
        job = (operations - self.start_operations) / \
            ((self.now().timestamp() - self.started) * 1e12 * self.world_size)
        first_start, start_operations = self._cumulative_start()
        # The file keeps whole seconds: a save in the first second counts one.
        elapsed = max((self.now() - first_start).total_seconds(), 1.0)
        cumulative = (operations - start_operations) / (elapsed * 1e12 * self.world_size)
        return (f"{event}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                f"Floating-point operations: {operations:.2e}\t"
                f"Tokens (in billions): {self.tokens_through(iteration) / 10**9:.2f}")

    def _cumulative_start(self) -> Tuple[datetime, float]:
        """When the jobs of this world size began (the first ``Starting job`` after the last
        line of another world size), and the operations of the last ``Saved checkpoint``
        line before it; read from the file as Megatron-LM reads it."""
        start, start_operations, latest = None, None, 0.0
        with open(self.path) as f:
            for line in f:
                fields = line.strip().split("\t")
                if len(fields) < 4:
                    continue
                if fields[3] == "Saved checkpoint":
                    latest = float(fields[7].split(": ")[1])
                if int(fields[2].split(": ")[1]) != self.world_size:
                    start, start_operations = None, None
                    continue
                if fields[3] == "Starting job" and start is None:
                    start, start_operations = datetime.strptime(fields[0], _STAMP), latest
        if start is None:  # this job's own line is in the file, unless it was edited away
            return datetime.fromtimestamp(self.started), self.start_operations
        return start, start_operations

    def _append(self, event: str) -> None:
        if not self._on():
            return
        os.makedirs(self.directory, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(f"{self.now().strftime(_STAMP)}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}"
                    f"\t# GPUs: {self.world_size}\t{event}\n")

"""``pretrain_gpt.py`` with faults injected, for tests and drills; switched on by environment
variables, through the library's step-hook extensions (nothing in the library reads them).

* ``MEGATRON_STREAMING_SLOW_WORKER=W:SECONDS[:PATH]``: worker W sleeps SECONDS after every
  step, so it runs slower than the others (the schedule must keep every worker in step
  anyway); with PATH, only while PATH exists (a test holds the job's pace until it has done
  what it does mid-run, however slow the machine, and then lets it finish at full speed).
* ``MEGATRON_STREAMING_STALL_WORKER=W:STEP``: worker W stops answering after step STEP (it
  sleeps instead of training), so its peers must end in the sync timeout, not hang.
* ``MEGATRON_STREAMING_LEAVE_WORKER=W:STEP``: worker W's ranks leave after step STEP, having
  finished the cross-worker collectives they started (exit status 0, so that a launcher
  shared with other workers lets those go on): a loss at a known point, for the exactness
  test of elastic workers.
* ``MEGATRON_STREAMING_SLOW_WRITE=ITERATION:SECONDS``: the background write of every
  checkpoint of iteration ITERATION or later (``--async-save``) sleeps SECONDS before writing
  its files (its part of the partial directory made), so a test can act while it is in
  flight.

Launch it as ``pretrain_gpt.py`` is launched (torchrun, the deepspeed launcher, python).
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SLOW = "MEGATRON_STREAMING_SLOW_WORKER"
STALL = "MEGATRON_STREAMING_STALL_WORKER"
LEAVE = "MEGATRON_STREAMING_LEAVE_WORKER"
SLOW_WRITE = "MEGATRON_STREAMING_SLOW_WRITE"


def _parse(name):
    value = os.environ.get(name)
    if not value:
        return None
    worker, amount, *_ = value.split(":")
    return int(worker), float(amount)


def _while(name):
    """The PATH of ``W:AMOUNT:PATH``, else None."""
    parts = os.environ.get(name, "").split(":", 2)
    return Path(parts[2]) if len(parts) == 3 else None


class Faults:
    """A step hook: after each optimizer step of this rank's worker, the faults asked for."""

    def __init__(self, run):
        self.run = run
        self.worker = run.topology.worker
        self.slow, self.stall, self.leave = _parse(SLOW), _parse(STALL), _parse(LEAVE)
        self.slow_while = _while(SLOW)

    def before_step(self, step: int) -> None:
        if self.leave and self.leave[0] == self.worker and step > self.leave[1]:
            self.run.stop.close()  # its stop flags and exchanges reach the others
            self.run.sync.close()
            os._exit(0)
        # Stalled after step STEP: the next step's update never comes (the run has counted
        # STEP iterations, its heartbeat says so).
        if self.stall and self.stall[0] == self.worker and step > self.stall[1]:
            # A peer that never answers again, until its launcher stops it (not 30 s later
            # with a SIGKILL: the run's own handler only records a SIGTERM between steps).
            signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
            while True:
                time.sleep(3600)

    def after_step(self) -> None:
        if self.slow and self.slow[0] == self.worker and (
                self.slow_while is None or self.slow_while.exists()):
            time.sleep(self.slow[1])


def _slow_writes() -> None:
    import re
    import threading

    from megatron_streaming.checkpoint.background import FileWrite
    from patches import megatron_checkpoint_writer as writer

    iteration, seconds = _parse(SLOW_WRITE)
    real_run, real_write = FileWrite.run, writer.write_files
    due = threading.local()  # whether the write on this thread is of a slowed checkpoint

    def run(self):
        due.slow = int(re.search(r"iter_(\d+)", self.directory).group(1)) >= iteration
        return real_run(self)

    def write_files(*args):  # its part of the partial directory made, its request planned
        if getattr(due, "slow", False):
            time.sleep(seconds)
        return real_write(*args)

    FileWrite.run, writer.write_files = run, write_files


if __name__ == "__main__":
    import pretrain_gpt

    if os.environ.get(SLOW_WRITE):
        _slow_writes()
    pretrain_gpt.entry([Faults])

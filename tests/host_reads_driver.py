"""A real training run that counts, per iteration, the host reads of tensor values (what
waits for the device on a GPU: ``.item()``, ``float()``, ``int()``, ``bool()``, ``.tolist()``,
``.cpu()``, ``.numpy()``), each attributed to the code that asked for it.

    python -m torch.distributed.run --nproc-per-node N tests/host_reads_driver.py OUT flags...

On a CPU nothing waits, so the reads are counted instead of timed; on a GPU the device's own
reports of what waited for it (``torch.cuda.set_sync_debug_mode("warn")``) are recorded
beside them, of kind ``sync``. DeepSpeed's calls of its accelerator's ``synchronize`` (a
device-wide wait on a GPU, nothing on the CPU) are of kind ``synchronize``. A read is
attributed to the first frame outside torch that asked for it: ``ours`` when that frame is
in ``megatron_streaming/`` (file:function), else ``upstream`` (DeepSpeed's, megatron-core's:
file:function, with the frame of ours that called into it). An iteration's reads are those
from the start of its ``train_step`` to the start of the next one's: the step and the loop's
work after it (logging, evaluation, saving, the stop flag). Each rank writes
``OUT.rank<R>`` (JSON): the list of ``{"iteration", "site", "origin", "kind", "caller",
"thread"}`` (iteration 0: set-up before the first step; None: after the loop), the
iterations that logged and what ``Run.train`` returned.
"""

import json
import os
import sys
import threading
import traceback
import warnings

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_streaming.cli.arguments import parse_args  # noqa: E402
from megatron_streaming.run.train import Run  # noqa: E402

OURS = os.path.join(REPO, "megatron_streaming") + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep
THIS = os.path.abspath(__file__)
# The Tensor methods that hand a value to the host (on a GPU: wait for the device first).
READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy")


def _where(frame) -> str:
    path, installed = frame.filename, "site-packages" + os.sep
    short = path.split(installed)[-1] if installed in path else os.path.relpath(path, REPO)
    return f"{short}:{frame.name}"


class HostReads:
    """Wraps ``torch.Tensor``'s reading methods; ``records`` holds one entry per read."""

    def __init__(self):
        self.iteration, self.records, self._inside = 0, [], False

    def install(self) -> None:
        for name in READS:
            setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed's device-wide waits (a no-op on the CPU, so counted by their calls).
        accelerator, synchronize = get_accelerator(), get_accelerator().synchronize

        def counted_synchronize(*args, **kwargs):
            self._record("synchronize")
            return synchronize(*args, **kwargs)

        accelerator.synchronize = counted_synchronize
        if torch.cuda.is_available():  # the device's own word on what waited for it
            warnings.simplefilter("always", UserWarning)
            shown = warnings.showwarning

            def showwarning(message, category, *args, **kwargs):
                if "synchronizing CUDA operation" in str(message):
                    self._record("sync")
                else:
                    shown(message, category, *args, **kwargs)

            warnings.showwarning = showwarning
            torch.cuda.set_sync_debug_mode("warn")

    def _counted(self, kind, method):
        def read(tensor, *args, **kwargs):
            if not self._inside:  # a read inside a read (``__format__`` -> ``item``) once
                self._inside = True
                try:
                    self._record(kind)
                finally:
                    self._inside = False
            return method(tensor, *args, **kwargs)

        return read

    def _record(self, kind) -> None:
        # Innermost first, less this file's frames (the wrapper's).
        stack = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
        outside_torch = [f for f in stack if f.filename not in (THIS, warnings.__file__)
                         and not f.filename.startswith(TORCH)]
        if not outside_torch:
            return
        first = outside_torch[0]
        ours = next((f for f in outside_torch if f.filename.startswith(OURS)), None)
        if ours is None:
            return  # the driver's own, or the launcher's
        origin = "ours" if first is ours else "upstream"
        self.records.append({"iteration": self.iteration, "kind": kind, "origin": origin,
                             "site": _where(first), "caller": _where(ours),
                             "thread": threading.current_thread().name})


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    reads = HostReads()
    logged = []
    with Run(parse_args(argv)) as run:
        train_step, log_step = run.engine.train_step, run.report.log_step

        def marked(data_iterator, iteration):
            reads.iteration = iteration + 1
            return train_step(data_iterator, iteration)

        def logging(iteration, *args, **kwargs):
            logged.append(iteration)
            return log_step(iteration, *args, **kwargs)

        run.engine.train_step, run.report.log_step = marked, logging
        reads.install()
        train_loss = run.train()
        reads.iteration = None  # after the loop
        run.stop.close()
        run.sync.close()
    with open(f"{out}.rank{run.topology.rank}", "w") as f:
        json.dump({"records": reads.records, "logged": logged, "train_loss": train_loss}, f)


if __name__ == "__main__":
    main()

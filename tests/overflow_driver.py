"""A real training run in which one worker's gradients overflow at chosen steps, as fp16 ones
do: the test seam for "a skipped optimizer step keeps the streaming schedule in lockstep".

    python -m torch.distributed.run --nproc-per-node N tests/overflow_driver.py OUT W:S1,S2 flags...

On every rank of worker ``W``, right before the DeepSpeed step of iterations ``S1, S2, ...``
(1-based), one element of one gradient becomes inf; DeepSpeed's overflow check then skips the
step there and nowhere else. Each rank writes ``OUT/rank<R>.pt``: its worker, the sync's event
list and, per iteration, the loss, whether the step was skipped and the loss scale.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_streaming.cli.arguments import parse_args  # noqa: E402
from megatron_streaming.run.train import Run  # noqa: E402


def inject_overflow(run, steps: set) -> None:
    """Wrap this rank's DeepSpeed ``step`` so that the gradient it finalizes holds an inf."""
    engine, taken = run.engine.engine, [0]
    step = engine.step

    def step_with_overflow(*args, **kwargs):
        taken[0] += 1
        if taken[0] in steps:
            grad = next(p.grad for p in run.model.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        return step(*args, **kwargs)

    engine.step = step_with_overflow


def record_steps(run) -> list:
    """Keep every StepResult the run produces."""
    results, train_step = [], run.engine.train_step

    def recording(*args, **kwargs):
        result = train_step(*args, **kwargs)
        results.append(result)
        return result

    run.engine.train_step = recording
    return results


def main():
    out_dir, spec, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    worker, steps = spec.split(":")
    with Run(parse_args(argv)) as run:
        run.sync.events = []  # what the sync did, step by step (off by default)
        if run.topology.worker == int(worker):
            inject_overflow(run, {int(s) for s in steps.split(",")})
        results = record_steps(run)
        run.train()
        run.stop.close()
        run.sync.close()
        torch.save({"worker": run.topology.worker, "events": run.sync.events,
                    "losses": [r.loss for r in results],
                    "skipped": [r.skipped for r in results],
                    "loss_scale": [r.loss_scale for r in results]},
                   os.path.join(out_dir, f"rank{run.topology.rank}.pt"))
    run.topology.cross.job_barrier()


if __name__ == "__main__":
    main()

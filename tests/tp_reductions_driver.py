"""``pretrain_gpt.py`` that also counts, per step, the all-reduces the gradient fix-ups
(``megatron_streaming.worker.grads``) issue on this rank's tensor-parallel group, and writes them to
``$TP_REDUCTIONS_DIR/rank<R>.json`` with the sequence-parallel parameters' slices that this
rank's ZeRO partition cuts (a parameter split across two data-parallel ranks).

    python -m torch.distributed.run --nproc-per-node N tests/tp_reductions_driver.py flags...
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = "TP_REDUCTIONS_DIR"


class TpReductions:
    """A step hook; its counter wraps ``torch.distributed.all_reduce`` from construction on."""

    def __init__(self, run):
        from patches import deepspeed_zero

        self.group, self.rank = run.topology.groups["tp"], run.topology.rank
        self.per_step, self.now = [], 0
        engine = run.engine
        self.cut = [[s.first, s.size, s.param.numel()]
                    for group in (deepspeed_zero.partition_layout(engine.optimizer)
                                  if engine.zero else [])
                    for s in group if getattr(s.param, "sequence_parallel", False)
                    and s.size < s.param.numel()]
        self.sequence_parallel = sum(getattr(p, "sequence_parallel", False)
                                     for p in run.model.parameters())
        all_reduce = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            group = kwargs["group"] if "group" in kwargs else (args[1] if len(args) > 1
                                                               else None)
            if group is self.group and \
                    sys._getframe(1).f_globals.get("__name__") == "megatron_streaming.worker.grads":
                self.now += 1
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting

    def before_step(self, step: int) -> None:
        pass

    def after_step(self) -> None:
        self.per_step.append(self.now)
        self.now = 0
        path = Path(os.environ[OUT]) / f"rank{self.rank}.json"
        path.write_text(json.dumps({"per_step": self.per_step, "cut": self.cut,
                                    "sequence_parallel_params": self.sequence_parallel}))


if __name__ == "__main__":
    import pretrain_gpt

    pretrain_gpt.entry([TpReductions])

"""What may differ between workers, and what follows from every worker's choice.

Each cluster launches its worker with its own command line. The model, the fragments, the
schedule and everything in ``door.fingerprint`` must be equal; the in-worker layout (TP, PP,
Ulysses SP, ZeRO stage) and the batch (micro-batch, global batch) may differ, so that each
cluster runs the layout that suits it and a slower cluster takes a smaller batch to keep pace.
So may the number of ranks (each cluster a worker of all its devices): the ranks of the
smallest worker hold the exchange's lanes, and the control collectives reach every rank of a
larger worker through a stand-in (``topology.RankLayout.control_groups``).

``WorkerShape`` is one worker's choice, published at the door; ``JobShape`` is every worker's,
the same on every rank, and answers what the others need from it:

* the data: with equal batches (and DP sizes) every global micro-step is one contiguous index
  block shared by all data-parallel ranks of all workers, as before; otherwise each step takes
  the next ``sum(global batches)`` samples and worker w reads its own contiguous block of
  them (``data.sampler.WorkerBlockSampler``);
* the exchange: workers with one layout exchange their shards directly, rank with rank; with
  different layouts they exchange by the layout-free partition (``streaming.canonical``);
* the outer mean's weights (``--diloco-weighting tokens``): a worker's outer gradient counts
  in proportion to the tokens it trained on in the round (its global batch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

LAYOUT_FIELDS = ("tp", "pp", "sp", "dp", "zero_stage")


@dataclass(frozen=True)
class WorkerShape:
    """One worker's layout and batch."""

    tp: int = 1
    pp: int = 1
    sp: int = 1
    dp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    global_batch_size: int = 1

    @classmethod
    def of(cls, cfg, layout) -> "WorkerShape":
        t, p = cfg.training, cfg.parallel
        return cls(tp=layout.tp, pp=layout.pp, sp=layout.sp, dp=layout.dp,
                   zero_stage=p.zero_stage, micro_batch_size=t.micro_batch_size,
                   global_batch_size=t.global_batch_size or t.micro_batch_size * layout.dp)

    def settings(self) -> Dict[str, int]:
        return asdict(self)

    @classmethod
    def from_settings(cls, settings: Dict[str, int]) -> "WorkerShape":
        return cls(**{k: int(v) for k, v in settings.items()})

    @property
    def ranks(self) -> int:
        """The worker's ranks (its launch's world size)."""
        return self.tp * self.pp * self.sp * self.dp

    @property
    def layout(self) -> Tuple[int, ...]:
        return tuple(getattr(self, f) for f in LAYOUT_FIELDS)

    def describe(self) -> str:
        return (f"{self.ranks} rank{'s' * (self.ranks != 1)}, TP={self.tp} PP={self.pp} "
                f"SP={self.sp} DP={self.dp} ZeRO-{self.zero_stage}, "
                f"micro-batch {self.micro_batch_size}, global batch {self.global_batch_size}")


@dataclass(frozen=True)
class JobShape:
    """Every worker's shape, in worker order (the same on every rank)."""

    workers: Tuple[WorkerShape, ...]

    @classmethod
    def uniform(cls, shape: WorkerShape, count: int) -> "JobShape":
        return cls(tuple([shape] * count))

    @property
    def same_layout(self) -> bool:
        """Every worker cut the same way: shards pair up rank by rank."""
        return len({w.layout for w in self.workers}) == 1

    @property
    def same_batches(self) -> bool:
        """Every worker reads alike: the interleaved sampler of a homogeneous job."""
        return len({(w.micro_batch_size, w.global_batch_size, w.dp)
                    for w in self.workers}) == 1

    @property
    def job_batch(self) -> int:
        """Samples all workers read in one step together."""
        return sum(w.global_batch_size for w in self.workers)

    def offset(self, worker: int) -> int:
        """Where worker ``worker``'s block starts within a step's samples."""
        return sum(w.global_batch_size for w in self.workers[:worker])

    def share(self, worker: int, members: Iterable[int], weighting: str) -> float:
        """The factor on ``worker``'s outer gradient before the plain mean over ``members``,
        so that the mean weighs each member by its tokens in the round (``tokens``) or alike
        (``uniform``). Exactly 1 when the members' batches are equal."""
        members = list(members)
        if weighting == "uniform" or worker not in members:
            return 1.0
        batches = [self.workers[w].global_batch_size for w in members]
        if len(set(batches)) == 1:
            return 1.0
        return len(members) * self.workers[worker].global_batch_size / sum(batches)

    def describe(self) -> List[str]:
        return [f"worker {w}: {s.describe()}" for w, s in enumerate(self.workers)]


def check(job: JobShape, cfg) -> None:
    """What heterogeneous workers do not support yet; raise ConfigError naming the flag."""
    from ..errors import ConfigError

    t = cfg.training
    if not job.same_batches:
        for name, flag in (("rampup_batch_size", "--rampup-batch-size"),
                           ("step_batch_size_schedule", "--step-batch-size-schedule"),
                           ("train_samples", "--train-samples"),
                           ("train_tokens", "--train-tokens")):
            if getattr(t, name, None):
                raise ConfigError(
                    f"{flag} with workers of different batches ({_batches(job)}): give each "
                    "worker a fixed --global-batch-size and the job a --train-iters")


def _batches(job: JobShape) -> str:
    return ", ".join(f"worker {w}: {s.global_batch_size}" for w, s in enumerate(job.workers))


def from_records(settings: Sequence[Dict[str, int]]) -> JobShape:
    return JobShape(tuple(WorkerShape.from_settings(s) for s in settings))

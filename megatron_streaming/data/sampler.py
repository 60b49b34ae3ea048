"""Sample indices -> micro-batches, the last stage of the data flow.

raw text -> tokenizer -> indexed dataset -> GPTDataset -> **sampler -> batches**.

Sample order is already shuffled inside megatron's ``GPTDataset``, so the sampler walks the
index range in order, as Megatron's pretraining sampler does: every global micro-step takes the
next ``micro_batch_size * data_parallel_size`` indices and data-parallel rank ``r`` takes the
``r``-th contiguous slice. Position in the stream is a single number, ``consumed_samples``
(counted over all ranks), so a restart from a checkpoint continues exactly where it stopped.

For Streaming DiLoCo the data-parallel axis spans the workers: pass
``data_parallel_rank = worker * DP + dp`` and ``data_parallel_size = M * DP`` and the M workers
read disjoint samples while each global micro-step still covers one contiguous index block.
"""

from megatron_streaming.errors import UsageError
from typing import Dict, Iterator, List, Optional


class MicroBatchSampler:
    """Yields this rank's sample indices, one list of ``micro_batch_size`` per micro-step.

    The last global micro-step is dropped when incomplete: every rank must run the same
    number of steps or the collectives of the short ranks would wait forever.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples <= 0:
            raise UsageError(f"total_samples={total_samples}: must be positive")
        if not 0 <= consumed_samples <= total_samples:
            raise UsageError(f"consumed_samples={consumed_samples}: must be in "
                             f"[0, total_samples={total_samples}]")
        if micro_batch_size <= 0:
            raise UsageError(f"--micro-batch-size {micro_batch_size}: must be positive")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise UsageError(f"data_parallel_rank={data_parallel_rank}, data_parallel_size="
                             f"{data_parallel_size}: need 0 <= rank < size")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    @property
    def global_micro_batch(self) -> int:
        """Samples consumed by all ranks together in one micro-step."""
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_micro_batch

    def __iter__(self) -> Iterator[List[int]]:
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for step in range(len(self)):
            start = first + step * self.global_micro_batch
            yield list(range(start, start + self.micro_batch_size))


class WorkerBlockSampler:
    """This rank's sample indices when workers read different batches (``workers``): each
    step takes the next ``job_batch`` indices, worker w reads its contiguous block of
    ``worker_batch`` from ``worker_offset`` on, and within it every micro-step takes the next
    ``micro_batch_size * data_parallel_size`` indices, data-parallel rank r the r-th slice.
    ``consumed_samples`` is counted over all workers (a multiple of ``job_batch``)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, worker_offset: int,
                 worker_batch: int, job_batch: int):
        per_micro_step = micro_batch_size * data_parallel_size
        if worker_batch % per_micro_step:
            raise UsageError(f"--global-batch-size {worker_batch} is not divisible by "
                             f"--micro-batch-size {micro_batch_size} x data-parallel size "
                             f"{data_parallel_size}")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.per_micro_step, self.micro_steps = per_micro_step, worker_batch // per_micro_step
        self.worker_offset, self.job_batch = worker_offset, job_batch

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.job_batch * self.micro_steps

    def __iter__(self) -> Iterator[List[int]]:
        for i in range(len(self)):
            step, micro = divmod(i, self.micro_steps)
            start = (self.consumed_samples + step * self.job_batch + self.worker_offset
                     + micro * self.per_micro_step + self.data_parallel_rank
                     * self.micro_batch_size)
            yield list(range(start, start + self.micro_batch_size))


def collate_micro_batch(samples: List[Dict]) -> Dict[str, Optional["torch.Tensor"]]:
    """Stack GPTDataset samples into [b, s] tensors plus one [1, 1, s, s] causal mask.

    The mask is the same for every sample (no per-document reset), so one copy broadcasts
    over the batch instead of b copies of an s x s tensor. True means "masked out".
    """
    import torch

    batch = {key: torch.stack([sample[key] for sample in samples])
             for key in ("tokens", "labels", "loss_mask", "position_ids")}
    mask = samples[0].get("attention_mask")
    batch["attention_mask"] = None if mask is None else mask.reshape(1, 1, *mask.shape[-2:])
    return batch


def build_iterator(dataset, sampler: MicroBatchSampler) -> Iterator[Dict]:
    """Micro-batches of ``dataset`` in ``sampler`` order, as dicts of tensors.

    Loading happens in this process (``num_workers=0``): samples are memory-mapped slices,
    cheaper to read than to ship from a worker process.
    """
    import torch

    if sampler.total_samples > len(dataset):
        raise UsageError(f"total_samples={sampler.total_samples}: the dataset has only "
                         f"{len(dataset)} samples")
    # Pinned on a GPU host, as Megatron-LM's loader pins: the step's copy to the GPU
    # (non-blocking) then does not wait for the host.
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0,
                                         collate_fn=collate_micro_batch,
                                         pin_memory=torch.cuda.is_available())
    return iter(loader)

"""Wires the data pipeline to the training loop: which samples each rank reads, when.

Training samples are sharded over every data-parallel rank of every worker (``worker * DP +
dp`` of ``M * DP``), so workers read disjoint data; workers of different batches each read
their own block of every step's samples (``workers.JobShape``). Evaluation reads the same fixed
samples at every evaluation, sharded over the worker's DP ranks only: each worker evaluates the
same data, so the reported loss needs no cross-worker traffic, and evaluations at different
iterations (or after a resume) are comparable.
"""

from __future__ import annotations

from typing import Iterator, Optional

from ..config import Config
from . import MicroBatchSampler, MockTokenizer, build_datasets, build_iterator
from .sampler import WorkerBlockSampler
from .tokenizers import TokenizerSpec, build_tokenizer
from ..worker.model import loader_makes_mask
from ..config.schedules import BatchSchedule
from ..parallel.topology import Topology


MOCK_VOCAB_SIZE = 256


def load_run_tokenizer(cfg: Config):
    """--mock-data without --tokenizer-type: ids only; else the tokenizer the flags name."""
    d = cfg.data
    if d.mock_data and d.tokenizer_type is None:
        return MockTokenizer(d.vocab_size or MOCK_VOCAB_SIZE)
    return build_tokenizer(TokenizerSpec.of(d))


class RunData:
    """The train/valid/test datasets of a run, and iterators positioned by iteration."""

    def __init__(self, cfg: Config, topology: Topology, tokenizer, job=None):
        self.cfg, self.topology = cfg, topology
        self.job = None if job is None or job.same_batches else job  # None: workers alike
        layout, t, d = topology.layout, cfg.training, cfg.data
        # Each worker's batch per step (ramp-up included); evaluation uses the full batch.
        self.batches = BatchSchedule(t, cfg.model.seq_length, layout.dp)
        self.workers = layout.workers
        eval_samples = t.eval_iters * self.batches.final_batch
        self.train, self.valid, self.test = build_datasets(
            tokenizer=tokenizer, seq_length=cfg.model.seq_length, seed=t.seed,
            train_samples=0 if t.skip_train else self.samples_through(t.train_iters),
            valid_samples=eval_samples, test_samples=eval_samples,
            data_path=d.data_path or None, split=d.split,
            train_data_path=d.train_data_path or None,
            valid_data_path=d.valid_data_path or None,
            test_data_path=d.test_data_path or None,
            mock=d.mock_data, data_cache_path=d.data_cache_path,
            create_attention_mask=loader_makes_mask(cfg.model, layout.sp))

    def samples_through(self, iteration: int) -> int:
        """Training samples all workers consumed in iterations ``0 .. iteration - 1``: a
        function of the iteration alone, so a resume needs no other state."""
        if self.job is not None:
            return iteration * self.job.job_batch
        return self.batches.consumed(iteration) * self.workers

    def tokens_through(self, iteration: int) -> int:
        return self.samples_through(iteration) * self.cfg.model.seq_length

    def train_iterator(self, start_iteration: int) -> Iterator:
        # Every micro-step of every rank takes the next micro-batch of one stream, so a step
        # with more micro-batches (ramp-up) simply reads further: only the start depends on
        # the batch schedule.
        if self.job is not None:
            topo = self.topology
            sampler = WorkerBlockSampler(
                len(self.train), self.samples_through(start_iteration),
                self.cfg.training.micro_batch_size, topo.dp_rank, topo.layout.dp,
                self.job.offset(topo.worker), self.job.workers[topo.worker].global_batch_size,
                self.job.job_batch)
            return build_iterator(self.train, sampler)
        index, count = self.topology.data_shard
        sampler = MicroBatchSampler(len(self.train), self.samples_through(start_iteration),
                                    self.cfg.training.micro_batch_size, index, count)
        return build_iterator(self.train, sampler)

    def eval_iterator(self, split: str) -> Optional[Iterator]:
        dataset = getattr(self, split)
        if dataset is None or self.cfg.training.eval_iters == 0:
            return None
        sampler = MicroBatchSampler(len(dataset), 0, self.cfg.training.micro_batch_size,
                                    self.topology.dp_rank, self.topology.layout.dp)
        return build_iterator(dataset, sampler)

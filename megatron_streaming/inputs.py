"""Wires the data pipeline to the training loop: which samples each rank reads, when.

Training samples are sharded over every data-parallel rank of every worker
(``worker * DP + dp`` of ``M * DP``), so workers read disjoint data. Evaluation reads the
same fixed samples at every evaluation, sharded over the worker's DP ranks only: each worker
evaluates the same data, so the reported loss needs no cross-worker traffic, and evaluations
at different iterations (or after a resume) are comparable.
"""

from __future__ import annotations

from typing import Iterator, Optional

from .config import Config
from .data import MicroBatchSampler, MockTokenizer, build_datasets, build_iterator, load_tokenizer
from .engine import num_microbatches
from .topology import Topology


def load_run_tokenizer(cfg: Config):
    if cfg.data.mock_data:
        return MockTokenizer(cfg.data.vocab_size)
    return load_tokenizer(cfg.data.tokenizer_model)


class RunData:
    """The train/valid/test datasets of a run, and iterators positioned by iteration."""

    def __init__(self, cfg: Config, topology: Topology, tokenizer):
        self.cfg, self.topology = cfg, topology
        layout, t, d = topology.layout, cfg.training, cfg.data
        self.micro_batches = num_microbatches(cfg, layout.dp)
        # Samples one iteration consumes across all workers.
        self.samples_per_iteration = (t.micro_batch_size * self.micro_batches * layout.dp
                                      * layout.workers)
        eval_samples = t.eval_iters * t.micro_batch_size * self.micro_batches * layout.dp
        self.train, self.valid, self.test = build_datasets(
            tokenizer=tokenizer, seq_length=cfg.model.seq_length, seed=t.seed,
            train_samples=0 if t.skip_train else t.train_iters * self.samples_per_iteration,
            valid_samples=eval_samples, test_samples=eval_samples,
            data_path=d.data_path or None, split=d.split,
            train_data_path=d.train_data_path or None,
            valid_data_path=d.valid_data_path or None,
            test_data_path=d.test_data_path or None,
            mock=d.mock_data, data_cache_path=d.data_cache_path)

    def train_iterator(self, start_iteration: int) -> Iterator:
        index, count = self.topology.data_shard
        sampler = MicroBatchSampler(len(self.train), start_iteration * self.samples_per_iteration,
                                    self.cfg.training.micro_batch_size, index, count)
        return build_iterator(self.train, sampler)

    def eval_iterator(self, split: str) -> Optional[Iterator]:
        dataset = getattr(self, split)
        if dataset is None or self.cfg.training.eval_iters == 0:
            return None
        sampler = MicroBatchSampler(len(dataset), 0, self.cfg.training.micro_batch_size,
                                    self.topology.dp_rank, self.topology.layout.dp)
        return build_iterator(dataset, sampler)

"""Data: raw text -> sentencepiece tokenizer -> Megatron indexed dataset (.bin/.idx) ->
Megatron ``GPTDataset`` (or ``MockGPTDataset``) -> sampler -> micro-batches.

* ``python -m megatron_streaming.data`` (``__main__``): text files -> PREFIX.bin/.idx.
* ``tokenizer``: ``load_tokenizer``, ``train_tokenizer``, ``MockTokenizer``.
* ``datasets``: ``build_datasets`` over megatron-core's ``BlendedMegatronDatasetBuilder``.
* ``sampler``: ``MicroBatchSampler`` and ``build_iterator``; the data-parallel index spans the
  workers (``worker * DP + dp`` over ``M * DP``), so workers read disjoint data.

Importing this package imports neither torch nor megatron; they load on first use.
"""

from megatron_streaming.data.datasets import build_datasets
from megatron_streaming.data.sampler import MicroBatchSampler, build_iterator
from megatron_streaming.data.tokenizer import (MockTokenizer, SentencePieceTokenizer,
                                               load_tokenizer, train_tokenizer)

__all__ = ["build_datasets", "MicroBatchSampler", "build_iterator", "MockTokenizer",
           "SentencePieceTokenizer", "load_tokenizer", "train_tokenizer"]

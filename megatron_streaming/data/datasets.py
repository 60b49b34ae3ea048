"""Indexed datasets -> megatron train/valid/test GPT datasets, the third stage.

raw text -> tokenizer -> indexed dataset -> **GPTDataset** -> sampler -> batches.

``build_datasets`` is a thin front for megatron-core's ``BlendedMegatronDatasetBuilder`` with
``GPTDatasetConfig``/``GPTDataset`` (``MockGPTDataset`` for ``--mock-data``). It adds what the
builder lacks: every flag is checked, with errors naming the flag and the value, *before* the
builder's first barrier (a rank that raises after it leaves the others hanging), and two traps
in megatron are avoided: a split that rounds to zero documents makes ``GPTDataset`` loop forever
while counting epochs, and ``BlendedDataset`` calls ``torch.distributed.get_rank()`` without a
process group when it misses its cache.
"""

from megatron_streaming.errors import UsageError
import os
import re
import struct
from typing import Callable, List, Optional, Sequence, Tuple

from megatron_streaming.data.cache import NO_CACHE, build_lock, resolve_cache_path

Blend = Tuple[List[str], Optional[List[float]]]
SPLIT_NAMES = ("train", "valid", "test")
SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
_IDX_MAGIC = b"MMIDIDX\x00\x00"


def parse_blend(spec: Optional[Sequence[str]], flag: str) -> Optional[Blend]:
    """``["a"]``, ``["a", "b"]`` or ``["0.3", "a", "0.7", "b"]`` -> (prefixes, weights or None)."""
    if not spec:
        return None
    spec = [str(item) for item in spec]
    if len(spec) % 2 == 0:
        weights = [_as_float(item) for item in spec[::2]]
        if all(w is not None for w in weights):
            if any(w <= 0 for w in weights):
                raise UsageError(f"{flag} {' '.join(spec)}: weights must be positive")
            return list(spec[1::2]), weights
        if any(w is not None for w in weights):
            raise UsageError(f"{flag} {' '.join(spec)}: give a weight before every prefix "
                             "or before none")
    return list(spec), None


def _as_float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_split(split: str) -> List[float]:
    """``"969,30,1"`` -> normalized train/valid/test fractions; missing parts are 0."""
    parts = [p for p in re.split(r"[,/\s]+", split.strip()) if p]
    values = [_as_float(p) for p in parts]
    if not 1 <= len(values) <= 3 or any(v is None or v < 0 for v in values) or not sum(values):
        raise UsageError(f"--split {split!r}: expected up to three non-negative numbers "
                         "with a positive sum, e.g. '969,30,1'")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def document_count(prefix: str, flag: str) -> int:
    """Documents (sequences) in an indexed dataset, read from the .idx header alone."""
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise UsageError(f"{flag} {prefix!r}: {prefix + suffix} not found")
    with open(prefix + ".idx", "rb") as f:
        header = f.read(34)  # magic, version, dtype code, sequence count, document count
    if len(header) < 34 or not header.startswith(_IDX_MAGIC):
        raise UsageError(f"{flag} {prefix!r}: {prefix}.idx is not a megatron index file")
    return struct.unpack("<Q", header[18:26])[0]


def _check_split_documents(prefixes: Sequence[str], split: str,
                           sizes: Sequence[Optional[int]]) -> None:
    """Every prefix exists and gives each split we must build at least one document.

    Rounds split fractions into document ranges the way megatron's builder does.
    """
    fractions = parse_split(split)
    bounds = [sum(fractions[:i]) for i in range(4)]
    for prefix in prefixes:
        n = document_count(prefix, "--data-path")
        for i, name in enumerate(SPLIT_NAMES):
            if sizes[i] == 0 or fractions[i] == 0:
                continue
            if int(round(bounds[i + 1] * n)) <= int(round(bounds[i] * n)):
                raise UsageError(f"--split {split!r}: the {name} split of --data-path "
                                 f"{prefix!r} gets none of its {n} documents; use more "
                                 "documents or a larger share for that split")


def _check_sizes(seq_length: int, sizes: Sequence[Optional[int]]) -> None:
    if seq_length <= 0:
        raise UsageError(f"--seq-length {seq_length}: must be positive")
    for name, size in zip(SPLIT_NAMES, sizes):
        if size is not None and size < 0:
            raise UsageError(f"{name}_samples={size}: must be >= 0 (or None for one epoch)")


def _blends(data_path, split, per_split, sizes) -> Tuple[Optional[Blend], Optional[list]]:
    """Validate the data flags; return megatron's ``blend`` or ``blend_per_split``."""
    blend = parse_blend(data_path, "--data-path")
    per_split_blends = [parse_blend(p, f) for p, f in zip(per_split, SPLIT_FLAGS)]
    if blend and any(per_split_blends):
        raise UsageError(f"--data-path {' '.join(data_path)}: not together with "
                         "--train-data-path/--valid-data-path/--test-data-path")
    if blend:
        _check_split_documents(blend[0], split, sizes)
        if blend[1] is not None and None in sizes:
            raise UsageError(f"--data-path {' '.join(data_path)}: weighted blends need a "
                             "number of samples for every split")
        return blend, None
    if not any(per_split_blends):
        values = [data_path] + list(per_split)
        raise UsageError(f"no data: --data-path / --train-data-path / --valid-data-path / "
                         f"--test-data-path are {values}; give one, or use --mock-data")
    for i, (b, flag) in enumerate(zip(per_split_blends, SPLIT_FLAGS)):
        if b is None:
            continue
        for prefix in b[0]:
            if document_count(prefix, flag) == 0:
                raise UsageError(f"{flag} {prefix!r}: the dataset has no documents")
        if b[1] is not None and sizes[i] is None:
            raise UsageError(f"{flag} {' '.join(per_split[i])}: weighted blends need a "
                             "number of samples")
    return None, [b if sizes[i] != 0 else None for i, b in enumerate(per_split_blends)]


def build_datasets(*, tokenizer, seq_length: int, seed: int, train_samples: Optional[int],
                   valid_samples: Optional[int], test_samples: Optional[int],
                   data_path: Optional[Sequence[str]] = None, split: str = "969,30,1",
                   train_data_path: Optional[Sequence[str]] = None,
                   valid_data_path: Optional[Sequence[str]] = None,
                   test_data_path: Optional[Sequence[str]] = None, mock: bool = False,
                   data_cache_path: Optional[str] = None, create_attention_mask: bool = True,
                   is_built_on_rank: Optional[Callable[[], bool]] = None) -> tuple:
    """Build the (train, valid, test) datasets; a split is None when it has no data or 0
    samples are asked of it. ``*_samples=None`` means one epoch of that split.

    Either ``data_path`` (prefixes, optionally weighted) cut by ``split``, or separate
    ``*_data_path`` prefixes, or ``mock``. With a process group initialized this is collective
    over the *default* group (megatron's builder barriers on it): call it on every rank of every
    worker. ``is_built_on_rank`` defaults to every rank (each rank reads its own batches);
    megatron requires it to be True on global rank 0.
    """
    sizes = [train_samples, valid_samples, test_samples]
    _check_sizes(seq_length, sizes)
    if all(size == 0 for size in sizes):
        return None, None, None
    per_split = [train_data_path, valid_data_path, test_data_path]
    blend = blend_per_split = None
    if not mock:
        blend, blend_per_split = _blends(data_path, split, per_split, sizes)
        if blend_per_split is not None and not any(blend_per_split):
            return None, None, None  # only splits without data were asked for
    prefixes = blend[0] if blend else [p for b in blend_per_split or [] if b for p in b[0]]
    if mock:
        cache_path = None  # regenerated on the fly; megatron keeps mock data out of caches
    elif _blended_without_process_group(blend, blend_per_split):
        cache_path = NO_CACHE
    else:
        cache_path = resolve_cache_path(data_cache_path, prefixes)
    return _build(tokenizer, seq_length, seed, sizes, blend, blend_per_split,
                  None if blend_per_split else split, cache_path, create_attention_mask,
                  is_built_on_rank or (lambda: True), mock)


def _blended_without_process_group(blend, blend_per_split) -> bool:
    """BlendedDataset asks torch.distributed for the rank on a cache miss, even without a
    process group; megatron skips that question only when there is no cache path."""
    import torch.distributed as dist

    blends = [blend] if blend else [b for b in blend_per_split or [] if b]
    return not dist.is_initialized() and any(len(b[0]) > 1 for b in blends)


def _build(tokenizer, seq_length, seed, sizes, blend, blend_per_split, split, cache_path,
           create_attention_mask, is_built_on_rank, mock) -> tuple:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend,
        blend_per_split=blend_per_split, split=split, path_to_cache=cache_path,
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=create_attention_mask)
    if config.split_matrix is not None:
        # Not building what nobody asked for also keeps megatron away from empty splits.
        config.split_matrix = [None if size == 0 else bounds
                               for size, bounds in zip(sizes, config.split_matrix)]
    builder = BlendedMegatronDatasetBuilder(
        MockGPTDataset if mock else GPTDataset, sizes, is_built_on_rank, config)
    with build_lock(cache_path):  # the workers of a job share the cache directory
        return tuple(builder.build())

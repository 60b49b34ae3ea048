"""Raw text -> Megatron indexed dataset (PREFIX.bin / PREFIX.idx), the second stage.

raw text -> tokenizer -> **indexed dataset** -> GPTDataset -> sampler -> batches.

A document is a paragraph: a run of non-blank lines, ended by a blank (or whitespace-only) line
or the end of a file. Plays, books and wikitext all keep paragraphs apart with blank lines, and a
paragraph is a natural unit for the train/valid/test split, which Megatron draws over documents.
Corpora with one document per line use ``boundary="line"``. Each document is stored as one
sequence (Megatron's ``GPTDataset`` splits by sequence), its line breaks kept inside it.
"""

from megatron_streaming.errors import UsageError
import os
import time
from dataclasses import dataclass
from typing import Iterator, List, Sequence

BOUNDARIES = ("blank-line", "line")
# Documents are tokenized in batches so sentencepiece can use several threads.
ENCODE_BATCH = 1024


def _lines(path: str) -> Iterator[str]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            yield from f
    except UnicodeDecodeError as err:
        raise UsageError(f"--input {path!r}: not UTF-8 text ({err.reason} at byte "
                         f"{err.start})") from None
    except OSError as err:
        raise UsageError(f"--input {path!r}: cannot read it ({err.strerror or err})") from None


def iter_documents(paths: Sequence[str], boundary: str = "blank-line") -> Iterator[str]:
    """Yield the documents of ``paths`` in order, without their trailing newline."""
    if boundary not in BOUNDARIES:
        raise UsageError(f"--document-boundary {boundary!r}: expected one of {BOUNDARIES}")
    for path in paths:
        paragraph: List[str] = []
        for line in _lines(path):
            if not line.strip():
                if paragraph:
                    yield "".join(paragraph).rstrip("\r\n")
                    paragraph = []
            elif boundary == "line":
                yield line.rstrip("\r\n")
            else:
                paragraph.append(line)
        if paragraph:
            yield "".join(paragraph).rstrip("\r\n")


JSON_SUFFIXES = (".json", ".jsonl")


def is_json_lines(path: str) -> bool:
    """Megatron's preprocessing input: one JSON object per line (``.json`` / ``.jsonl``)."""
    return path.endswith(JSON_SUFFIXES)


def iter_json_documents(paths: Sequence[str], key: str) -> Iterator[str]:
    """Field ``key`` of every JSON line of ``paths`` (Megatron's ``--json-keys``); blank lines
    are skipped, a malformed line stops with one line naming the file and line number."""
    import json

    for path in paths:
        for number, line in enumerate(_lines(path), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise UsageError(f"--input {path} line {number}: not a JSON object ({err})") \
                    from None
            if not isinstance(record, dict):
                raise UsageError(f"--input {path} line {number}: not a JSON object (a "
                                 f"{type(record).__name__})")
            if key not in record:
                keys = ", ".join(sorted(record)[:8]) or "none"
                raise UsageError(f"--input {path} line {number}: no key {key!r} (--json-keys); "
                                 f"its keys: {keys}")
            text = record[key]
            if not isinstance(text, str):
                raise UsageError(f"--input {path} line {number}: {key!r} is a "
                                 f"{type(text).__name__}, not text")
            yield text


def iter_training_lines(paths: Sequence[str]) -> Iterator[str]:
    """Non-blank lines, the sentences sentencepiece trains on (it skips overlong sentences,
    so whole paragraphs would be lost)."""
    for path in paths:
        for line in _lines(path):
            if line.strip():
                yield line.rstrip("\r\n")


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    seconds: float


def _batches(documents: Iterator[str], size: int) -> Iterator[List[str]]:
    batch: List[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def encoder(tokenizer):
    """Documents -> id lists: the tokenizer's batch call when it has one."""
    return getattr(tokenizer, "tokenize_batch", None) or (
        lambda texts: [tokenizer.tokenize(t) for t in texts])


# --workers: each process builds the tokenizer once (from its picklable spec), then encodes
# batches of documents handed to it in order by Pool.imap.
_process_encode = None


def init_encoder_process(spec) -> None:
    import warnings

    from megatron_streaming.data.tokenizers import build_tokenizer

    global _process_encode
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    _process_encode = encoder(build_tokenizer(spec))


def encode_in_process(batch: List[str]) -> List[List[int]]:
    return [list(ids) for ids in _process_encode(batch)]


def write_indexed_dataset(documents: Iterator[str], tokenizer, output_prefix: str,
                          append_eod: bool = False, encode_batches=None,
                          progress=None) -> PreprocessStats:
    """Tokenize ``documents`` into ``output_prefix``.bin/.idx through megatron's builder.

    ``encode_batches`` (optional) maps an iterator of document batches to an iterator of
    their id lists, in order (``--workers`` processes); ``progress(documents, tokens)`` is
    called after every batch. Files are written under temporary names and renamed at the
    end, so a failed run never leaves a half-written dataset that a later training run would
    read.
    """
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    t0 = time.time()
    # uint16 below 65500 ids: half the disk of int32, and what megatron's own tool writes.
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp_bin, tmp_idx = output_prefix + ".bin.tmp", output_prefix + ".idx.tmp"
    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
    n_docs = n_tokens = 0
    try:
        if encode_batches is None:
            encode = encoder(tokenizer)
            encode_batches = lambda batches: map(encode, batches)  # noqa: E731
        for encoded in encode_batches(_batches(documents, ENCODE_BATCH)):
            for ids in encoded:
                if append_eod:
                    ids = list(ids) + [tokenizer.eod]
                if not ids:
                    continue
                builder.add_item(torch.from_numpy(numpy.asarray(ids, dtype=numpy.int64)))
                builder.end_document()
                n_docs += 1
                n_tokens += len(ids)
            if progress is not None:
                progress(n_docs, n_tokens)
        if n_docs == 0:
            raise UsageError("--input: the files hold no text, so there are no documents")
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, output_prefix + ".bin")
        os.replace(tmp_idx, output_prefix + ".idx")
    finally:
        builder.data_file.close()
        for path in (tmp_bin, tmp_idx):
            if os.path.exists(path):
                os.remove(path)
    return PreprocessStats(n_docs, n_tokens, time.time() - t0)

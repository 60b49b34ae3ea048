"""Command line: text or JSON-lines files -> tokenizer -> Megatron indexed dataset(s).

    python -m megatron_streaming.data --input corpus.txt --output-prefix data/corpus \\
        --vocab-size 8000 --append-eod
    python -m megatron_streaming.data --input a.txt b.txt --output-prefix data/ab \\
        --tokenizer-model data/corpus.model --append-eod
    python -m megatron_streaming.data --input pile.jsonl --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --output-prefix data/pile --append-eod --workers 2

Text files (``PREFIX.bin/.idx``): documents are paragraphs separated by blank lines
(``--document-boundary line`` for one document per line). JSON-lines files (``.json`` /
``.jsonl``, as Megatron's ``tools/preprocess_data.py`` takes them): one document per line, the
text under each ``--json-keys`` key, written to ``PREFIX_<key>_document.bin/.idx`` as Megatron
names them. The tokenizer: ``--tokenizer-type`` with its files, as ``pretrain_gpt.py`` takes
them (``megatron_streaming.data.tokenizers``), or a sentencepiece model trained here with
``--vocab-size`` (``PREFIX.model``). The output prefix is what ``pretrain_gpt.py --data-path``
takes. Bad flags and malformed input end with one line naming the flag (or file and line) and
exit status 2.
"""

import argparse
import multiprocessing
import os
import sys
import time
import warnings
from typing import List, Optional

from megatron_streaming.data.preprocess import (BOUNDARIES, encode_in_process,
                                                init_encoder_process, is_json_lines,
                                                iter_documents, iter_json_documents,
                                                iter_training_lines, write_indexed_dataset)
from megatron_streaming.data.tokenizer import train_tokenizer
from megatron_streaming.data.tokenizers import TOKENIZER_TYPES, TokenizerSpec, build_tokenizer
from megatron_streaming.errors import UsageError

PROG = "python -m megatron_streaming.data"
SENTENCEPIECE_ALGORITHMS = ("bpe", "unigram")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tokenize text or JSON-lines files into Megatron indexed "
        "datasets.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="UTF-8 text files, or JSON-lines files (.json/.jsonl), read in "
                             "order.")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="Writes PREFIX.bin/.idx (text) or PREFIX_<key>_document.bin/.idx "
                             "(JSON lines), and PREFIX.model when training a tokenizer.")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="JSON lines: the keys whose text to tokenize, one dataset each "
                             "(default: text).")
    parser.add_argument("--tokenizer-type", metavar="NAME",
                        help=f"Megatron's tokenizer name ({', '.join(TOKENIZER_TYPES)}); "
                             "without it: a sentencepiece --tokenizer-model, or train one "
                             "with --vocab-size.")
    parser.add_argument("--tokenizer-model", metavar="PATH",
                        help="Sentencepiece model, Hugging Face tokenizer directory or "
                             "tiktoken vocabulary.")
    parser.add_argument("--vocab-file", metavar="PATH", help="GPT2BPETokenizer's vocab.json.")
    parser.add_argument("--merge-file", metavar="PATH", help="GPT2BPETokenizer's merges.txt.")
    parser.add_argument("--vocab-size", type=int, metavar="N",
                        help="Without --tokenizer-type/--tokenizer-model: train a sentencepiece "
                             "tokenizer of N pieces on the inputs; NullTokenizer's vocabulary.")
    parser.add_argument("--tiktoken-pattern", choices=("v1", "v2"),
                        help="TikTokenizer's split pattern.")
    parser.add_argument("--sentencepiece-algorithm", choices=SENTENCEPIECE_ALGORITHMS,
                        default="bpe", help="Algorithm when training (default: bpe).")
    parser.add_argument("--document-boundary", choices=BOUNDARIES, default="blank-line",
                        help="Text files: what ends a document, a blank line (paragraphs, "
                             "default) or every line.")
    parser.add_argument("--append-eod", action="store_true",
                        help="End every document with the end-of-document token, so samples "
                             "that span documents show where one ends.")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="Processes that tokenize (Megatron's flag; default 1).")
    parser.add_argument("--log-interval", type=int, default=10000, metavar="N",
                        help="Print progress every N documents (default 10000).")
    # Megatron's preprocess_data.py flags that change nothing here.
    parser.add_argument("--keep-newlines", action="store_true",
                        help="Accepted: line breaks inside a document are always kept.")
    parser.add_argument("--partitions", type=int, default=1, metavar="N",
                        help="Accepted: the inputs are read in one pass by --workers processes.")
    parser.add_argument("--lang", default="english", help=argparse.SUPPRESS)
    parser.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Fail on bad flags and paths before spending minutes on tokenizing."""
    if args.split_sentences:
        raise UsageError("--split-sentences: sentence splitting (nltk) is not supported; "
                         "documents are tokenized whole, as Megatron does without the flag")
    for path in args.input:
        if not os.path.exists(path):
            raise UsageError(f"--input {path!r}: file not found")
        if not os.path.isfile(path):
            raise UsageError(f"--input {path!r}: not a regular file")
    kinds = {is_json_lines(p) for p in args.input}
    if len(kinds) > 1:
        raise UsageError("--input: mixes JSON-lines (.json/.jsonl) and text files; give one "
                         "kind per run")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--output-prefix {args.output_prefix!r}: directory {out_dir!r} "
                         "does not exist")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        raise UsageError(f"--log-interval must be >= 1, got {args.log_interval}")
    if _trains(args):
        if args.vocab_size is None:
            raise UsageError("give the tokenizer: --tokenizer-type (with its files), "
                             "--tokenizer-model, or --vocab-size to train one")
        if args.vocab_size < 8:
            raise UsageError(f"--vocab-size {args.vocab_size}: must be at least 8 (4 special "
                             "pieces, the newline piece and some text)")


def _trains(args) -> bool:
    return (args.tokenizer_type is None and args.tokenizer_model is None
            and not (args.vocab_file and args.merge_file))


def _spec(args) -> TokenizerSpec:
    return TokenizerSpec(tokenizer_type=args.tokenizer_type,
                         tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                         merge_file=args.merge_file, vocab_size=args.vocab_size,
                         tiktoken_pattern=args.tiktoken_pattern)


class _Progress:
    def __init__(self, interval: int, label: str):
        self.interval, self.label, self.start, self._next = interval, label, time.time(), interval

    def __call__(self, documents: int, tokens: int) -> None:
        if documents < self._next:
            return
        self._next = (documents // self.interval + 1) * self.interval
        rate = documents / max(time.time() - self.start, 1e-9)
        print(f"{self.label}: {documents} documents, {tokens} tokens ({rate:.0f} docs/s)",
              file=sys.stderr, flush=True)


def _outputs(args) -> List[tuple]:
    """(output prefix, documents iterator factory, label) per dataset to write."""
    if is_json_lines(args.input[0]):
        return [(f"{args.output_prefix}_{key}_document",
                 lambda key=key: iter_json_documents(args.input, key), key)
                for key in args.json_keys]
    return [(args.output_prefix, lambda: iter_documents(args.input, args.document_boundary),
             "text")]


def run(args: argparse.Namespace) -> str:
    """Do the work; return the summary (one line per dataset written)."""
    t0 = time.time()
    check_args(args)
    if _trains(args):
        lines = (iter_training_lines(args.input) if not is_json_lines(args.input[0]) else
                 (line for key in args.json_keys
                  for doc in iter_json_documents(args.input, key)
                  for line in doc.splitlines() if line.strip()))
        tokenizer = train_tokenizer(lines, args.output_prefix + ".model", args.vocab_size,
                                    args.sentencepiece_algorithm)
        spec = TokenizerSpec(tokenizer_model=args.output_prefix + ".model")
    else:
        spec = _spec(args)
        tokenizer = build_tokenizer(spec)
    pool = None
    if args.workers > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        pool = multiprocessing.get_context("spawn").Pool(args.workers, init_encoder_process,
                                                         (spec,))
    summary = []
    try:
        for prefix, documents, label in _outputs(args):
            encode_batches = (lambda batches: pool.imap(encode_in_process, batches)) \
                if pool is not None else None
            stats = write_indexed_dataset(documents(), tokenizer, prefix, args.append_eod,
                                          encode_batches, _Progress(args.log_interval, label))
            summary.append(f"{prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} "
                           f"tokens, vocab size {tokenizer.vocab_size}, "
                           f"{time.time() - t0:.2f} s")
    finally:
        if pool is not None:
            pool.terminate()
    return "\n".join(summary)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # megatron-core warns on import about optional CUDA kernels this tool never uses.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    try:
        summary = run(args)
    except ValueError as err:
        # Our own errors already name the flag and the value: one line each, no traceback.
        for line in str(err).splitlines():
            print(f"{PROG}: error: {line}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

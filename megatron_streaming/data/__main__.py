"""Command line: raw text files -> (trained) sentencepiece tokenizer -> PREFIX.bin / PREFIX.idx.

    python -m megatron_streaming.data --input corpus.txt --output-prefix data/corpus \\
        --vocab-size 8000 --append-eod
    python -m megatron_streaming.data --input a.txt b.txt --output-prefix data/ab \\
        --tokenizer-model data/corpus.model --append-eod

The output prefix is what ``pretrain_gpt.py --data-path`` takes, and with ``--vocab-size`` the
trained ``PREFIX.model`` is what it takes as ``--tokenizer-model``. Documents are paragraphs
separated by blank lines (``--document-boundary line`` for one document per line). Bad flags
end with a one-line error naming the flag and exit status 2.
"""

from megatron_streaming.errors import UsageError
import argparse
import os
import sys
import time
import warnings
from typing import List, Optional

from megatron_streaming.data.preprocess import (BOUNDARIES, iter_documents, iter_training_lines,
                                                write_indexed_dataset)
from megatron_streaming.data.tokenizer import load_tokenizer, train_tokenizer

PROG = "python -m megatron_streaming.data"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tokenize text files into a Megatron indexed dataset.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="UTF-8 text files, read in order.")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="Writes PREFIX.bin and PREFIX.idx (and PREFIX.model when training).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer-model", metavar="PATH",
                        help="An existing sentencepiece model.")
    source.add_argument("--vocab-size", type=int, metavar="N",
                        help="Train a sentencepiece tokenizer of N pieces on the inputs.")
    parser.add_argument("--tokenizer-type", choices=("bpe", "unigram"), default="bpe",
                        help="Sentencepiece algorithm when training (default: bpe).")
    parser.add_argument("--document-boundary", choices=BOUNDARIES, default="blank-line",
                        help="What ends a document: a blank line (paragraphs, default) or "
                             "every line.")
    parser.add_argument("--append-eod", action="store_true",
                        help="End every document with the end-of-document token, so samples "
                             "that span documents show where one ends.")
    return parser


def check_paths(args: argparse.Namespace) -> None:
    """Fail on bad paths before spending minutes on tokenizer training."""
    for path in args.input:
        if not os.path.exists(path):
            raise UsageError(f"--input {path!r}: file not found")
        if not os.path.isfile(path):
            raise UsageError(f"--input {path!r}: not a regular file")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--output-prefix {args.output_prefix!r}: directory {out_dir!r} "
                         "does not exist")
    if args.vocab_size is not None and args.vocab_size < 8:
        raise UsageError(f"--vocab-size {args.vocab_size}: must be at least 8 (4 special "
                         "pieces, the newline piece and some text)")


def run(args: argparse.Namespace) -> str:
    """Do the work; return the summary line."""
    t0 = time.time()
    check_paths(args)
    if args.vocab_size is not None:
        tokenizer = train_tokenizer(iter_training_lines(args.input),
                                    args.output_prefix + ".model", args.vocab_size,
                                    args.tokenizer_type)
    else:
        tokenizer = load_tokenizer(args.tokenizer_model)
    stats = write_indexed_dataset(iter_documents(args.input, args.document_boundary),
                                  tokenizer, args.output_prefix, args.append_eod)
    return (f"{args.output_prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} "
            f"tokens, vocab size {tokenizer.vocab_size}, {time.time() - t0:.2f} s")


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # megatron-core warns on import about optional CUDA kernels this tool never uses.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    try:
        summary = run(args)
    except ValueError as err:
        # Our own errors already name the flag and the value: one line, no traceback.
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

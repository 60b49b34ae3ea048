"""Megatron's ``--tokenizer-type`` names -> a tokenizer the GPT datasets can use.

Megatron-LM and Megatron-DeepSpeed scripts name their tokenizer with ``--tokenizer-type`` and its
files with ``--tokenizer-model``, ``--vocab-file`` and ``--merge-file``. The same names work
here, with the same ids:

=========================== ==========================================================
``SentencePieceTokenizer``, our ``SentencePieceTokenizer`` (``tokenizer.py``) over
``GPTSentencePieceTokenizer`` ``--tokenizer-model``: end of document = the model's eos
``Llama2Tokenizer``         the same, with a bos id in front of each document, as
                            Megatron-LM's Llama-2 tokenizer
``GPT2BPETokenizer``        GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and
                            ``--merge-file`` (merges.txt), by ``transformers``'
                            ``GPT2TokenizerFast``; end of document = ``<|endoftext|>``
``HuggingFaceTokenizer``    megatron-core's ``huggingface`` library (``AutoTokenizer``) over
                            the local directory ``--tokenizer-model``; a bare
                            ``tokenizer.json`` through ``PreTrainedTokenizerFast``
``TikTokenizer``            megatron-core's ``tiktoken`` library over ``--tokenizer-model``
                            (``--tiktoken-pattern``, ``--tiktoken-num-special-tokens``,
                            ``--vocab-size``)
``NullTokenizer``           megatron-core's: ids are written as integers, vocabulary
                            ``--vocab-size`` + 1 (the last id ends a document)
=========================== ==========================================================

Why not megatron-core for GPT-2's BPE too: megatron-core 0.16.1's ``GPT2BPETokenizer`` passes
the vocab file where the merges file belongs and asks the Hugging Face hub for ``gpt2``'s
config, so it cannot load local files on a machine without network; ``GPT2TokenizerFast`` over
the two files is the same tokenizer offline. Nothing here downloads: ``HuggingFaceTokenizer``
reads a local directory only (``HF_HUB_OFFLINE``).

Every failure is a ``UsageError`` naming the flag and its value.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from megatron_streaming.errors import UsageError, first_line

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (*SENTENCEPIECE_TYPES, "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "TikTokenizer", "NullTokenizer")
# Megatron's other tokenizers, and what to use instead.
REFUSED_TYPES = {
    "BertWordPieceLowerCase": "a BERT tokenizer; GPT pretraining here takes GPT2BPETokenizer, "
    "HuggingFaceTokenizer or a sentencepiece type",
    "BertWordPieceCase": "a BERT tokenizer; GPT pretraining here takes GPT2BPETokenizer, "
    "HuggingFaceTokenizer or a sentencepiece type",
    "MultimodalTokenizer": "multimodal training is not supported",
    "Llama3Tokenizer": "removed from Megatron-LM; use HuggingFaceTokenizer with the Llama 3 "
    "tokenizer directory, or TikTokenizer",
}
TIKTOKEN_PATTERNS = ("v1", "v2")


@dataclass
class TokenizerSpec:
    """The tokenizer flags (``DataConfig`` holds the same fields)."""

    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = 1000

    @classmethod
    def of(cls, cfg) -> "TokenizerSpec":
        return cls(**{f: getattr(cfg, f) for f in cls.__dataclass_fields__})

    @property
    def kind(self) -> str:
        """The type in use: ``--tokenizer-type``; without it GPT2BPETokenizer when both of its
        files are given (Megatron's GPT-3 scripts pass only them), else a sentencepiece
        model."""
        if self.tokenizer_type:
            return self.tokenizer_type
        if self.vocab_file and self.merge_file:
            return "GPT2BPETokenizer"
        return "SentencePieceTokenizer"


def problems(spec: TokenizerSpec) -> List[str]:
    """Flag checks that need no file contents; one line each (empty when fine)."""
    kind, out = spec.kind, []
    if kind in REFUSED_TYPES:
        return [f"--tokenizer-type {kind}: {REFUSED_TYPES[kind]}"]
    if kind not in TOKENIZER_TYPES:
        return [f"--tokenizer-type {kind}: not a tokenizer type; choose from "
                f"{', '.join(TOKENIZER_TYPES)}"]
    needs = {"GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
             "NullTokenizer": ("--vocab-size",)}.get(kind, ("--tokenizer-model",))
    given = {"--vocab-file": spec.vocab_file, "--merge-file": spec.merge_file,
             "--vocab-size": spec.vocab_size, "--tokenizer-model": spec.tokenizer_model}
    for flag in needs:
        if given[flag] is None:
            out.append(f"--tokenizer-type {kind} needs {flag}")
        elif flag != "--vocab-size":
            path = given[flag]
            either = kind == "HuggingFaceTokenizer"  # a directory or a tokenizer.json
            ok = os.path.exists(path) if either else os.path.isfile(path)
            if not ok or not os.access(path, os.R_OK):
                out.append(f"{flag} {path}: not a readable "
                           f"{'directory or tokenizer.json' if either else 'file'}")
    if spec.vocab_size is not None and spec.vocab_size < 2:
        out.append(f"--vocab-size must be > 1, got {spec.vocab_size}")
    # --tiktoken-pattern with another type is ignored, as by Megatron-LM (its Llama 3
    # script passes it with NullTokenizer).
    return out


def build_tokenizer(spec: TokenizerSpec):
    """The tokenizer ``spec`` names; raises UsageError (one line per problem)."""
    found = problems(spec)
    if found:
        raise UsageError("\n".join(found))
    kind = spec.kind
    if kind in SENTENCEPIECE_TYPES:
        from megatron_streaming.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(spec.tokenizer_model)
        if kind == "Llama2Tokenizer":
            tokenizer.prepend_bos = True
        return tokenizer
    if kind == "GPT2BPETokenizer":
        return TransformersTokenizer.gpt2_bpe(spec.vocab_file, spec.merge_file)
    if kind == "HuggingFaceTokenizer" and os.path.isfile(spec.tokenizer_model):
        return TransformersTokenizer.tokenizer_json(spec.tokenizer_model)
    return _megatron_core_tokenizer(spec)


def _megatron_core_tokenizer(spec: TokenizerSpec):
    kind = spec.kind
    try:
        from megatron.core.tokenizers import MegatronTokenizer
    except ImportError as err:  # pragma: no cover - megatron-core is pinned
        raise UsageError(f"--tokenizer-type {kind}: megatron-core's tokenizers do not import "
                         f"({err})") from None
    if kind == "NullTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"},
                                                 vocab_size=spec.vocab_size)
    library, kwargs = {"HuggingFaceTokenizer": ("huggingface", {}),
                       "TikTokenizer": ("tiktoken", {
                           "pattern": spec.tiktoken_pattern or "v2",
                           "num_special_tokens": spec.tiktoken_num_special_tokens})}[kind]
    if kind == "TikTokenizer" and spec.vocab_size is not None:
        kwargs["vocab_size"] = spec.vocab_size
    module = {"huggingface": "transformers", "tiktoken": "tiktoken"}[library]
    try:
        __import__(module)
    except ImportError:
        raise UsageError(f"--tokenizer-type {kind} needs the {module} package (pinned in "
                         "requirements.txt; bash launch/setup.sh installs it)") from None
    if library == "huggingface":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory, never the hub
    try:
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=spec.tokenizer_model, metadata_path={"library": library}, **kwargs)
    except Exception as err:  # the libraries raise ValueError/OSError/KeyError by version
        raise UsageError(f"--tokenizer-model {spec.tokenizer_model}: {kind} cannot load it "
                         f"({first_line(err)[:300]})") from None


_TRANSFORMERS_NEEDED = ("--tokenizer-type {kind} needs the transformers package (pinned in "
                        "requirements.txt; bash launch/setup.sh installs it)")
# End-of-document tokens looked for in a bare tokenizer.json, in order.
END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def _transformers(kind: str):
    try:
        import transformers
    except ImportError:
        raise UsageError(_TRANSFORMERS_NEEDED.format(kind=kind)) from None
    return transformers


def _md5(paths: Sequence[str]) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


class TransformersTokenizer:
    """A ``transformers`` fast tokenizer built from local files, with the attributes
    megatron's GPT datasets read; the cache key is the files' hash."""

    def __init__(self, tok, eod: int, name: str, files: Sequence[str]):
        self._tok, self._eod = tok, eod
        self.unique_identifiers = OrderedDict([("class", name), ("md5", _md5(files))])

    @classmethod
    def gpt2_bpe(cls, vocab_file: str, merge_file: str) -> "TransformersTokenizer":
        """GPT-2's byte-level BPE from a vocab.json and a merges.txt; ids are GPT-2's
        (``<|endoftext|>`` = 50256 in GPT-2's own files)."""
        transformers = _transformers("GPT2BPETokenizer")
        try:
            tok = transformers.GPT2TokenizerFast(vocab=vocab_file, merges=merge_file)
        except Exception as err:
            raise UsageError(f"--vocab-file {vocab_file} --merge-file {merge_file}: not GPT-2 "
                             f"BPE files ({str(err).strip()[:200] or type(err).__name__})") \
                from None
        eod = tok.get_vocab().get(END_TOKENS[0])
        if eod is None:
            raise UsageError(f"--vocab-file {vocab_file}: has no {END_TOKENS[0]} token, the "
                             "end-of-document token of GPT2BPETokenizer")
        return cls(tok, eod, "GPT2BPETokenizer", (vocab_file, merge_file))

    @classmethod
    def tokenizer_json(cls, path: str) -> "TransformersTokenizer":
        """HuggingFaceTokenizer from a bare ``tokenizer.json`` (no tokenizer_config.json to
        name its eos): the end of document is the first of END_TOKENS it holds."""
        transformers = _transformers("HuggingFaceTokenizer")
        try:
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        except Exception as err:
            raise UsageError(f"--tokenizer-model {path}: not a Hugging Face tokenizer.json "
                             f"({str(err).strip()[:200] or type(err).__name__})") from None
        vocab = tok.get_vocab()
        eod = next((vocab[t] for t in END_TOKENS if t in vocab), None)
        if eod is None:
            raise UsageError(f"--tokenizer-model {path}: has none of {', '.join(END_TOKENS)} "
                             "to end documents; give its directory (with "
                             "tokenizer_config.json naming eos_token) instead")
        return cls(tok, eod, "HuggingFaceTokenizer", (path,))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def vocab(self) -> dict:
        return self._tok.get_vocab()

    @property
    def inv_vocab(self) -> dict:
        return {i: t for t, i in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._tok(list(texts))["input_ids"]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def eod(self) -> int:
        return self._eod

    eos = eod

    @property
    def pad(self) -> int:
        return -1

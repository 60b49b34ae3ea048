"""Tokenizers: text <-> token ids, the first stage of the data flow.

raw text -> **tokenizer** -> indexed dataset (.bin/.idx) -> GPTDataset -> sampler -> batches.

Megatron's ``GPTDataset``/``MockGPTDataset`` only duck-type their tokenizer: they read
``vocab_size`` (to pick the token dtype), ``eod`` (end-of-document id, for masks),
``pad``/``eos`` (pad handling) and ``unique_identifiers`` (hashed into the index-cache file
names, so a different tokenizer never reuses a stale cache). Both classes here provide exactly
that plus ``tokenize``/``detokenize``, without inheriting from megatron's deprecated legacy base
class, so importing this module does not import megatron.
"""

from megatron_streaming.errors import UsageError, first_line
import hashlib
import io
from collections import OrderedDict
from typing import Iterable, List, Optional, Sequence

# Special pieces reserved by `train_tokenizer`; pad gets its own id so megatron never confuses a
# padding position with a real end-of-document token.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
NEWLINE = "\n"
# Below this size the 256 byte pieces of byte fallback would crowd out real subwords.
MIN_VOCAB_FOR_BYTE_FALLBACK = 512


class SentencePieceTokenizer:
    """A sentencepiece model with the attributes megatron's GPT datasets read.

    ``prepend_bos`` (Megatron's ``Llama2Tokenizer``) puts the bos id before every text."""

    prepend_bos = False

    def __init__(self, model_proto: bytes, path: str):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.path = path
        # The model's hash, not its path, keys the caches: the same model copied elsewhere
        # reuses them, a retrained model at the same path does not.
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__),
             ("md5", hashlib.md5(model_proto, usedforsecurity=False).hexdigest())])
        self._vocab: Optional[dict] = None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> dict:
        if self._vocab is None:
            self._vocab = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return {i: piece for piece, i in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text, add_bos=self.prepend_bos)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Many documents at once; sentencepiece spreads a batch over threads."""
        return self._sp.encode(list(texts), add_bos=self.prepend_bos)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        # -1 when the model has no pad piece: megatron's own "no pad" value, never a real id.
        return self._sp.pad_id()


class MockTokenizer:
    """Token ids are written as integers: "5 17 3" <-> [5, 17, 3]. For ``--mock-data``.

    ``MockGPTDataset`` generates its own ids, but still asks a tokenizer for ``vocab_size`` and
    ``eod``; the last id is the end-of-document token and there is no pad token.
    """

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise UsageError(f"--vocab-size {vocab_size}: the mock tokenizer needs at least 2 "
                             "ids (one of them is the end-of-document token)")
        self._vocab_size = vocab_size
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", vocab_size)])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict:
        return {str(i): i for i in range(self._vocab_size)}

    @property
    def inv_vocab(self) -> dict:
        return {i: str(i) for i in range(self._vocab_size)}

    def tokenize(self, text: str) -> List[int]:
        return [int(word) for word in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    eos = eod

    @property
    def pad(self) -> int:
        return -1


def load_tokenizer(path: str) -> SentencePieceTokenizer:
    """Load a sentencepiece model; every failure is a ValueError naming ``--tokenizer-model``."""
    flag = f"--tokenizer-model {path!r}"
    try:
        with open(path, "rb") as f:
            proto = f.read()
    except FileNotFoundError:
        raise UsageError(f"{flag}: file not found") from None
    except OSError as err:
        raise UsageError(f"{flag}: cannot read it ({err.strerror or err})") from None
    try:
        tokenizer = SentencePieceTokenizer(proto, path)
    except Exception as err:  # sentencepiece raises RuntimeError/OSError/TypeError by version
        raise UsageError(
            f"{flag}: not a valid sentencepiece model ({first_line(err)})") from None
    if tokenizer.eod < 0:
        raise UsageError(f"{flag}: the model has no end-of-sentence piece, which is needed as "
                         "the end-of-document token")
    return tokenizer


def train_tokenizer(lines: Iterable[str], model_path: str, vocab_size: int,
                    model_type: str = "bpe") -> SentencePieceTokenizer:
    """Train a sentencepiece model on ``lines`` and write it to ``model_path``.

    Normalization is off and newlines are a piece of their own, so ``detokenize(tokenize(t))``
    gives back ``t`` exactly, multi-line documents included (the default NFKC normalization
    folds whitespace). Byte fallback, when the vocabulary is big enough, makes characters
    unseen in training round-trip too instead of becoming <unk>.
    """
    import sentencepiece

    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, normalization_rule_name="identity",
            remove_extra_whitespaces=False, user_defined_symbols=[NEWLINE],
            character_coverage=1.0, byte_fallback=vocab_size >= MIN_VOCAB_FOR_BYTE_FALLBACK,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            input_sentence_size=2_000_000, shuffle_input_sentence=True, minloglevel=2)
    except RuntimeError as err:
        raise UsageError(f"--vocab-size {vocab_size}: sentencepiece could not train a "
                         f"tokenizer ({first_line(err)})") from None
    proto = model.getvalue()
    with open(model_path, "wb") as f:
        f.write(proto)
    return SentencePieceTokenizer(proto, model_path)

"""Tokenizer files built locally for the tests (nothing is downloaded): a GPT-2 style
byte-level BPE (vocab.json + merges.txt, with GPT-2's ``<|endoftext|>``), trained by the
``tokenizers`` package on the texts given, and the same tokenizer as a Hugging Face directory.
"""

import json
from pathlib import Path
from typing import Iterable, Tuple


def gpt2_bpe(root: Path, texts: Iterable[str], vocab_size: int) -> Tuple[str, str]:
    """Train on ``texts``; returns the paths of vocab.json and merges.txt under ``root``."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(texts), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"])
    bpe.save_model(str(root))
    return str(root / "vocab.json"), str(root / "merges.txt")


def hugging_face_dir(directory: Path, vocab: str, merges: str) -> str:
    """The same tokenizer saved as transformers saves it (tokenizer.json and its config)."""
    from transformers import GPT2TokenizerFast

    GPT2TokenizerFast(vocab=vocab, merges=merges).save_pretrained(str(directory))
    return str(directory)


def write_jsonl(path: Path, texts: Iterable[str]) -> str:
    """One ``{"id", "text", "title"}`` object per line, as Megatron's preprocessing reads."""
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text, "title": text[:20]}) + "\n")
    return str(path)

"""Megatron's --tokenizer-type names, JSON-lines preprocessing, and a toy Llama trained on the
result through pretrain_gpt.py.

Every tokenizer file is built here from ../shared/data (nothing is downloaded): a GPT-2
byte-level BPE and the same tokenizer as a Hugging Face directory (tests/local_tokenizers.py),
a tiktoken vocabulary and a sentencepiece model.
"""

import base64
import json
import re
import subprocess

import pytest

from harness import REPO, SHARED_DATA, command, env, train_losses
from local_tokenizers import gpt2_bpe, hugging_face_dir, write_jsonl
from megatron_streaming.data.tokenizers import TokenizerSpec, build_tokenizer, problems
from megatron_streaming.errors import UsageError

TEXT = (SHARED_DATA / "wikitext2-valid.txt").read_text(encoding="utf-8")[:60_000]
PARAGRAPHS = [p.strip() for p in TEXT.split("\n \n") if len(p.strip()) > 40][:120]
SAMPLE = "The Kingdom of the Isles , 1156 – 1266 , was a Norse @-@ Gaelic realm ."


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    vocab, merges = gpt2_bpe(root, PARAGRAPHS, 600)
    hf_dir = hugging_face_dir(root / "hf", vocab, merges)
    # tiktoken: the 256 single bytes, then a few merges, as megatron-core reads them.
    pieces = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"in", b"an"]
    tik = root / "tiktoken.json"
    tik.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(p).decode(),
                                "token_str": p.decode("latin-1")}
                               for i, p in enumerate(pieces)]))
    jsonl = write_jsonl(root / "corpus.jsonl", PARAGRAPHS)
    with open(jsonl) as f:
        lines = f.readlines()
    lines.insert(4, "\n")  # blank lines are skipped, as in Megatron's tool
    with open(jsonl, "w") as f:
        f.writelines(lines)
    return {"root": root, "vocab": vocab, "merges": merges, "hf": hf_dir,
            "tiktoken": str(tik), "jsonl": jsonl, "tiktoken_vocab": len(pieces) + 16}


def test_gpt2_bpe_and_its_hugging_face_files_give_the_same_ids(files):
    gpt2 = build_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file=files["vocab"],
                                         merge_file=files["merges"]))
    hf = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=files["hf"]))
    bare = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer",
                                         tokenizer_model=files["hf"] + "/tokenizer.json"))
    ids = gpt2.tokenize(SAMPLE)
    assert len(ids) < 0.6 * len(SAMPLE.encode())  # merges were applied
    assert gpt2.detokenize(ids) == SAMPLE
    vocab = json.load(open(files["vocab"]))
    for tok in (hf, bare):
        assert tok.tokenize(SAMPLE) == ids and tok.detokenize(ids) == SAMPLE
        assert tok.eod == gpt2.eod == vocab["<|endoftext|>"]
        assert tok.vocab_size == gpt2.vocab_size == len(vocab)


def test_tiktoken_null_and_llama2_tokenizers(files, tmp_path):
    tik = build_tokenizer(TokenizerSpec("TikTokenizer", tokenizer_model=files["tiktoken"],
                                        vocab_size=files["tiktoken_vocab"],
                                        tiktoken_num_special_tokens=16))
    ids = tik.tokenize("the theme")
    assert tik.detokenize(ids) == "the theme"
    assert 16 + 258 in ids  # " the" is rank 258, shifted past the 16 special ids
    null = build_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=100))
    assert (null.vocab_size, null.eod) == (101, 100)  # Megatron's: one id past --vocab-size

    from megatron_streaming.data import train_tokenizer

    model = str(tmp_path / "sp.model")
    train_tokenizer(PARAGRAPHS, model, 300)
    plain = build_tokenizer(TokenizerSpec(tokenizer_model=model))
    llama2 = build_tokenizer(TokenizerSpec("Llama2Tokenizer", tokenizer_model=model))
    assert llama2.tokenize(SAMPLE) == [plain.bos] + plain.tokenize(SAMPLE)


@pytest.mark.parametrize("spec, line", [
    (TokenizerSpec("GPT2BPETokenizer", vocab_file="/no/v.json"),
     "--vocab-file /no/v.json: not a readable file"),
    (TokenizerSpec("BertWordPieceCase"), "--tokenizer-type BertWordPieceCase: a BERT tokenizer"),
    (TokenizerSpec("GPT2BPE"), "--tokenizer-type GPT2BPE: not a tokenizer type; choose from"),
    (TokenizerSpec("HuggingFaceTokenizer", tokenizer_model="/no/such/dir"),
     "--tokenizer-model /no/such/dir: not a readable directory or tokenizer.json"),
    (TokenizerSpec("NullTokenizer"), "--tokenizer-type NullTokenizer needs --vocab-size"),
])
def test_tokenizer_flag_problems_are_one_line(spec, line):
    found = problems(spec)
    assert found[0].startswith(line), found
    with pytest.raises(UsageError):
        build_tokenizer(spec)


def _preprocess(*args):
    return subprocess.run(command(1, ["megatron_streaming.data", *args], "-m"),
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)


@pytest.mark.timeout(300)
def test_jsonl_preprocessing_as_megatron_names_it(files, tmp_path):
    """--json-keys writes one PREFIX_<key>_document dataset per key; --workers 2 gives the
    same bytes as one process; progress lines on stderr."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"],
            "--merge-file", files["merges"], "--append-eod"]
    one = _preprocess("--input", files["jsonl"], "--output-prefix", str(tmp_path / "one"),
                      "--json-keys", "text", "title", *gpt2, "--log-interval", "10")
    assert one.returncode == 0, one.stderr
    assert re.search(rf"text: {len(PARAGRAPHS)} documents, \d+ tokens", one.stderr), one.stderr
    two = _preprocess("--input", files["jsonl"], "--output-prefix", str(tmp_path / "two"),
                      "--workers", "2", *gpt2)
    assert two.returncode == 0, two.stderr
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one_text_document{suffix}").read_bytes() == \
            (tmp_path / f"two_text_document{suffix}").read_bytes()
    data = IndexedDataset(str(tmp_path / "one_text_document"))
    tok = build_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file=files["vocab"],
                                        merge_file=files["merges"]))
    assert len(data) == len(PARAGRAPHS)
    assert list(data[5]) == tok.tokenize(PARAGRAPHS[5]) + [tok.eod]
    titles = IndexedDataset(str(tmp_path / "one_title_document"))
    assert list(titles[0]) == tok.tokenize(PARAGRAPHS[0][:20]) + [tok.eod]


@pytest.mark.timeout(120)
def test_malformed_jsonl_is_one_line_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "cut off\n')
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    for path, words in ((bad, [f"--input {bad} line 2: not a JSON object"]),
                        (missing, [f"--input {missing} line 2: no key 'text'", "body"])):
        proc = _preprocess("--input", str(path), "--output-prefix", str(tmp_path / "out"),
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr
        assert not (tmp_path / "out_text_document.bin").exists()


@pytest.mark.timeout(420)
def test_toy_llama_trains_on_gpt2_bpe_jsonl_data(files, tmp_path):
    """The data path a Megatron user has (JSON lines -> GPT2BPETokenizer -> *_text_document),
    trained through pretrain_gpt.py with Llama flags and Megatron's tokenizer flags."""
    prefix = tmp_path / "wiki"
    proc = _preprocess("--input", files["jsonl"], "--output-prefix", str(prefix),
                       "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"],
                       "--merge-file", files["merges"], "--append-eod")
    assert proc.returncode == 0, proc.stderr
    train = train_losses(1, ["--data-path", f"{prefix}_text_document", "--split", "90,8,2",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"],
            "--merge-file", files["merges"], "--swiglu", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--group-query-attention",
            "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--train-iters", "12", "--lr", "3e-3",
            "--eval-iters", "1", "--eval-interval", "12", "--log-interval", "1",
            "--data-cache-path", str(tmp_path / "cache")], tmp_path)
    assert len(train) == 12
    assert sum(train[-3:]) / 3 < train[0] - 0.5, train  # it learns

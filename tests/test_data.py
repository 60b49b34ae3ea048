"""Data pipeline: text -> tokenizer -> indexed dataset -> GPTDataset -> sampler -> batches."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_streaming.data import (MicroBatchSampler, MockTokenizer, build_datasets,
                                     build_iterator, load_tokenizer)
from megatron_streaming.data.__main__ import main as preprocess_main
from megatron_streaming.data.preprocess import iter_documents, write_indexed_dataset

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / ".." / "shared" / "data"
SEQ = 64
pytestmark = pytest.mark.filterwarnings(
    "ignore:Transformer Engine and Apex are not installed:UserWarning",
    "ignore:The pad token id in the tokenizer collides")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """First 50 KB of tinyshakespeare -> 512-piece tokenizer -> PREFIX.bin/.idx."""
    root = tmp_path_factory.mktemp("corpus")
    text = (DATA / "tinyshakespeare.txt").read_bytes()[:50_000].decode("utf-8", "ignore")
    (root / "shakespeare.txt").write_text(text, encoding="utf-8")
    prefix = str(root / "shakespeare")
    assert preprocess_main(["--input", str(root / "shakespeare.txt"), "--output-prefix", prefix,
                            "--vocab-size", "512", "--append-eod"]) == 0
    return {"root": root, "text": root / "shakespeare.txt", "prefix": prefix,
            "model": prefix + ".model", "tokenizer": load_tokenizer(prefix + ".model")}


def _datasets(corpus, **kwargs):
    args = dict(tokenizer=corpus["tokenizer"], seq_length=SEQ, seed=1234, train_samples=64,
                valid_samples=8, test_samples=0, data_path=[corpus["prefix"]])
    args.update(kwargs)
    return build_datasets(**args)


def _run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "megatron_streaming.data", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=110)


# --- tokenizer and indexed dataset -------------------------------------------------------------

def test_round_trip_text_to_samples(corpus):
    tok = corpus["tokenizer"]
    docs = list(iter_documents([str(corpus["text"])]))
    assert len(docs) > 300 and all(tok.detokenize(tok.tokenize(d)) == d for d in docs)
    ids = [tok.tokenize(d) + [tok.eod] for d in docs]

    train, valid, test = _datasets(corpus, split="1,0,0", train_samples=None, valid_samples=0)
    assert valid is None and test is None
    # One epoch visits every document once, in the order of the (shuffled) document index.
    assert sorted(train.document_index.tolist()) == list(range(len(docs)))
    stream = np.concatenate([ids[d] for d in train.document_index])
    # Sample i covers stream[i*SEQ : (i+1)*SEQ + 1]: tokens, plus one extra token for labels.
    order = np.argsort(train.shuffle_index)
    samples = [train[int(j)] for j in order]
    got = torch.cat([s["tokens"] for s in samples] + [samples[-1]["labels"][-1:]]).numpy()
    assert len(samples) == (len(stream) - 1) // SEQ
    np.testing.assert_array_equal(got, stream[:len(got)])
    for s in samples[:5]:
        assert torch.equal(s["labels"][:-1], s["tokens"][1:])


def test_existing_tokenizer_model(corpus, tmp_path, capsys):
    text = (DATA / "wikitext2-valid.txt").read_text(encoding="utf-8")[:20_000]
    (tmp_path / "wiki.txt").write_text(text, encoding="utf-8")
    prefix = str(tmp_path / "wiki")
    assert preprocess_main(["--input", str(tmp_path / "wiki.txt"), "--output-prefix", prefix,
                            "--tokenizer-model", corpus["model"]]) == 0
    docs = list(iter_documents([str(tmp_path / "wiki.txt")]))
    assert f"{len(docs)} documents" in capsys.readouterr().out
    assert not os.path.exists(prefix + ".model")

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    stored, tok = IndexedDataset(prefix), corpus["tokenizer"]
    assert len(stored) == len(docs)
    for i in (0, len(docs) // 2, len(docs) - 1):
        # Byte fallback: even text unlike the training text comes back exactly.
        assert tok.detokenize(stored[i]) == docs[i]


def test_line_boundary_and_eod(tmp_path, corpus):
    (tmp_path / "t.txt").write_text("a b\nc\n\n\nd e f\n", encoding="utf-8")
    assert list(iter_documents([str(tmp_path / "t.txt")])) == ["a b\nc", "d e f"]
    assert list(iter_documents([str(tmp_path / "t.txt")], "line")) == ["a b", "c", "d e f"]
    stats = write_indexed_dataset(iter(["1 2", "3"]), MockTokenizer(10), str(tmp_path / "m"),
                                  append_eod=True)
    assert (stats.documents, stats.tokens) == (2, 5)


# --- datasets --------------------------------------------------------------------------------

def test_default_split_and_batches(corpus):
    train, valid, test = _datasets(corpus, split="969,30,1")
    assert len(train) >= 64 and len(valid) >= 8 and test is None
    batch = next(build_iterator(valid, MicroBatchSampler(8, 0, 4, 0, 1)))
    assert batch["tokens"].shape == batch["labels"].shape == (4, SEQ)
    assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == \
        torch.int64
    assert batch["loss_mask"].dtype == torch.float32 and bool(batch["loss_mask"].all())
    assert torch.equal(batch["position_ids"][1], torch.arange(SEQ))
    mask = batch["attention_mask"]
    assert mask.shape == (1, 1, SEQ, SEQ) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1))


def test_separate_split_paths(corpus, tmp_path):
    tok = corpus["tokenizer"]
    docs = list(iter_documents([str(corpus["text"])]))
    parts = {"train": docs[:250], "valid": docs[250:300], "test": docs[300:]}
    for name, part in parts.items():
        write_indexed_dataset(iter(part), tok, str(tmp_path / name), append_eod=True)
    train, valid, test = build_datasets(
        tokenizer=tok, seq_length=SEQ, seed=1, train_samples=32, valid_samples=4,
        test_samples=4, train_data_path=[str(tmp_path / "train")],
        valid_data_path=[str(tmp_path / "valid")], test_data_path=[str(tmp_path / "test")],
        data_cache_path=str(tmp_path / "cache"), create_attention_mask=False)
    assert len(train) >= 32 and len(valid) >= 4 and len(test) >= 4
    assert sorted(valid.document_index.tolist()) == list(range(50))
    assert next(build_iterator(test, MicroBatchSampler(4, 0, 2, 0, 2)))["attention_mask"] is None
    assert os.listdir(tmp_path / "cache")


def test_weighted_blend_without_process_group(corpus, tmp_path):
    blend = ["0.3", corpus["prefix"], "0.7", corpus["prefix"]]
    train, valid, _ = _datasets(corpus, data_path=blend, split="90,10,0")
    assert len(train) >= 64 and len(valid) >= 8
    assert train[3]["tokens"].shape == (SEQ,)


def test_mock_data():
    train, valid, test = build_datasets(tokenizer=MockTokenizer(128), seq_length=16, seed=3,
                                        train_samples=32, valid_samples=8, test_samples=0,
                                        mock=True)
    assert test is None
    batch = next(build_iterator(train, MicroBatchSampler(32, 0, 4, 1, 2)))
    assert batch["tokens"].shape == (4, 16) and int(batch["tokens"].max()) < 128


def test_read_only_data_dir_falls_back_to_tmp(corpus, tmp_path, monkeypatch):
    # A plain file named "cache" blocks <data dir>/cache even for root, unlike chmod.
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for suffix in (".bin", ".idx"):
        (data_dir / ("c" + suffix)).write_bytes(Path(corpus["prefix"] + suffix).read_bytes())
    (data_dir / "cache").write_text("not a directory")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.mkdir(tmp_path / "tmp")
    train, _, _ = _datasets(corpus, data_path=[str(data_dir / "c")])
    assert len(train) >= 64
    assert os.listdir(tmp_path / "tmp" / f"megatron_streaming_cache_{os.getuid()}")


# --- sampler ---------------------------------------------------------------------------------

def test_workers_read_disjoint_samples(corpus):
    train, _, _ = _datasets(corpus)
    workers, dp, mbs, steps = 2, 2, 2, 8
    total = steps * workers * dp * mbs
    seen = {}
    for w in range(workers):
        for d in range(dp):
            sampler = MicroBatchSampler(total, 0, mbs, w * dp + d, workers * dp)
            indices = [i for batch in sampler for i in batch]
            tokens = [tuple(t.tolist()) for b in build_iterator(train, sampler)
                      for t in b["tokens"]]
            assert len(indices) == len(tokens) == steps * mbs
            assert tokens[0] == tuple(train[indices[0]]["tokens"].tolist())
            seen[w, d] = (set(indices), set(tokens))
    ranks = list(seen)
    for a in ranks:
        for b in ranks:
            if a < b:
                assert not seen[a][0] & seen[b][0] and not seen[a][1] & seen[b][1]
    assert set().union(*(s[0] for s in seen.values())) == set(range(total))


def test_resume_from_consumed_samples(corpus):
    train, _, _ = _datasets(corpus)
    mbs, size, total = 2, 4, 64
    for rank in range(size):
        full = list(MicroBatchSampler(total, 0, mbs, rank, size))
        for step in (0, 3, 7):
            resumed = list(MicroBatchSampler(total, step * mbs * size, mbs, rank, size))
            assert resumed == full[step:]
    uninterrupted = list(build_iterator(train, MicroBatchSampler(total, 0, mbs, 1, size)))
    resumed = list(build_iterator(train, MicroBatchSampler(total, 5 * mbs * size, mbs, 1, size)))
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(uninterrupted[5:], resumed))
    # Any offset: all ranks' batches of a step are the next contiguous block of indices.
    steps = zip(*(MicroBatchSampler(total, 5, mbs, r, size) for r in range(size)))
    assert [i for step in steps for batch in step for i in batch] == list(range(5, 5 + 56))


def test_sampler_drops_incomplete_last_step():
    assert len(MicroBatchSampler(10, 0, 2, 0, 4)) == 1
    assert list(MicroBatchSampler(10, 8, 2, 0, 4)) == []


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["missing-input", "garbage-tokenizer", "missing-tokenizer"])
def test_cli_errors(case, tmp_path):
    (tmp_path / "in.txt").write_text("hello world\n")
    (tmp_path / "junk.model").write_bytes(b"\x00\xffnot a sentencepiece model" * 10)
    inputs, model = {
        "missing-input": (tmp_path / "nope.txt", tmp_path / "junk.model"),
        "garbage-tokenizer": (tmp_path / "in.txt", tmp_path / "junk.model"),
        "missing-tokenizer": (tmp_path / "in.txt", tmp_path / "nope.model"),
    }[case]
    result = _run_cli("--input", str(inputs), "--output-prefix", str(tmp_path / "out"),
                      "--tokenizer-model", str(model))
    flag, value = ("--input", inputs) if case == "missing-input" else ("--tokenizer-model", model)
    assert result.returncode == 2
    assert flag in result.stderr and str(value) in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.bin").exists()


def test_load_tokenizer_errors(tmp_path):
    (tmp_path / "junk.model").write_bytes(b"garbage")
    for path, why in ((tmp_path / "junk.model", "not a valid"), (tmp_path / "no", "not found"),
                      (tmp_path, "cannot read")):
        with pytest.raises(ValueError, match=why) as err:
            load_tokenizer(str(path))
        assert "--tokenizer-model" in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(data_path=["/no/such/prefix"]), "--data-path"),
    (dict(data_path=None, train_data_path=["/no/such/prefix"]), "--train-data-path"),
    (dict(data_path=None), "no data"),
    (dict(split="nine,one"), "--split"),
    (dict(test_samples=8, split="969,30,1"), "--split"),  # 344 documents: none go to test
    (dict(data_path=["0.5", "a", "b", "c"]), "--data-path"),
    (dict(seq_length=0), "--seq-length"),
])
def test_build_datasets_errors(corpus, kwargs, flag):
    with pytest.raises(ValueError, match=flag) as err:
        _datasets(corpus, **kwargs)
    if kwargs.get("data_path"):
        assert kwargs["data_path"][-1] in str(err.value)


def test_explicit_cache_path_must_be_writable(corpus, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--data-cache-path"):
        _datasets(corpus, data_cache_path=str(tmp_path / "file" / "cache"))


def test_workers_rank_0s_build_the_shared_cache_one_at_a_time(corpus, tmp_path):
    """Each worker is its own world with its own rank 0, and the workers share the cache
    directory: a second rank 0 waits until the first has written every file, then finds them
    whole (a rank of one worker once loaded a file the other's rank 0 was still writing)."""
    import threading

    from megatron_streaming.data.cache import build_lock

    cache = str(tmp_path / "cache")
    first = _datasets(corpus, data_cache_path=cache)  # writes the cache under the lock
    assert os.path.isfile(os.path.join(cache, ".build.lock"))
    order, entered = [], threading.Event()

    def other_worker():
        entered.wait()
        with build_lock(cache):
            order.append("second")

    thread = threading.Thread(target=other_worker)
    thread.start()
    with build_lock(cache):
        entered.set()
        thread.join(timeout=0.5)  # blocked on the lock meanwhile
        order.append("first")
    thread.join(timeout=30)
    assert order == ["first", "second"]
    again = _datasets(corpus, data_cache_path=cache)  # a cache hit, the same samples
    assert [int(x) for x in again[0][0]["tokens"][:8]] == \
        [int(x) for x in first[0][0]["tokens"][:8]]
    with build_lock(None):  # nothing to guard without a cache
        pass


def test_import_is_cheap():
    code = ("import sys, megatron_streaming.data; "
            "assert not {'torch', 'megatron', 'sentencepiece'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))


# --- many ranks --------------------------------------------------------------------------------

def _rank_main(rank, world, store, prefix, model, cache):
    import torch.distributed as dist

    from megatron_streaming.data import cache as cache_module

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    workers, dp, mbs = 2, 2, 2
    tok = load_tokenizer(model)
    args = dict(tokenizer=tok, seq_length=SEQ, seed=7, train_samples=8 * world * mbs,
                valid_samples=4, test_samples=0, data_path=[prefix])
    train, _, _ = build_datasets(data_cache_path=cache, **args)
    # Ranks that cannot see rank 0's cache (no shared file system) must not crash or hang.
    if rank > 0:
        cache_module.sees_probe = lambda path: False
    blind, _, _ = build_datasets(data_cache_path=cache + "-blind", **args)
    w, d = divmod(rank, dp)
    sampler = MicroBatchSampler(8 * world * mbs, 0, mbs, w * dp + d, workers * dp)
    mine = [[int(i) for i in batch] for batch in sampler]
    got = [None] * world
    dist.all_gather_object(got, (train.shuffle_index.tolist(), blind.shuffle_index.tolist(),
                                 mine))
    assert all(g[0] == got[0][0] == g[1] for g in got)
    flat = [i for g in got for batch in g[2] for i in batch]
    assert sorted(flat) == list(range(8 * world * mbs))
    if rank == 0:
        assert os.listdir(cache) and not os.listdir(cache + "-blind")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_many_ranks_two_workers(corpus, tmp_path):
    world = 4  # M=2 workers x DP=2
    # Fork: the children inherit this process's torch and megatron imports (seconds each).
    torch.multiprocessing.start_processes(
        _rank_main, args=(world, tmp_path / "store", corpus["prefix"], corpus["model"],
                          str(tmp_path / "cache")), nprocs=world, join=True,
        start_method="fork")

"""Agreement at the door: separately launched workers that differ stop at once, every one with
the same line naming each differing flag and both values.

The launch test starts real workers, one launch per worker against a common
--master-addr/--master-port (the multi-cluster form), three mismatched jobs at once; the rest
drive ``Door`` on a real TCPStore in threads, and check the parameter-count formula against
built models.
"""

import datetime
import threading

import pytest
import torch

from harness import TINY, free_port, start
from megatron_streaming.cli.arguments import ConfigError, parse_args
from megatron_streaming.config.shape import parameter_count
from megatron_streaming.job.door import Door, differences, fingerprint
from megatron_streaming.parallel.topology import RankLayout


class _Vocab:
    def __init__(self, size):
        self.vocab_size = size


def _fingerprint(*flags, vocab=512):
    cfg = parse_args([*TINY, "--diloco-workers", "2", *flags])
    return fingerprint(cfg, RankLayout(2, 2), _Vocab(vocab))


def test_the_source_digest_reads_the_package_and_its_patches():
    import hashlib

    from megatron_streaming.job.door import source_digest

    # The digest of no file at all is what a wrong root (the package's own folder) gives.
    assert source_digest() != hashlib.sha256().hexdigest()[:16]
    assert source_digest() == source_digest()


def test_each_difference_is_named_with_both_values():
    base = _fingerprint()
    assert differences([{"fingerprint": base}, {"fingerprint": _fingerprint()}]) == []
    other = _fingerprint("--diloco-inner-steps", "30", "--hidden-size", "128",
                         "--diloco-worker-index", "1", "--diloco-timeout", "5")
    (line,) = differences([{"fingerprint": base}, {"fingerprint": other}])
    # The worker's own index and its timeout may differ; the rest is named, sorted, as
    # resolved (20 steps: H=1, P=1, tau=0 where not typed; H=30 typed: P=2, tau=1).
    assert line == ("worker 0 and worker 1 differ: --diloco-fragments 1 vs 2; "
                    "--diloco-inner-steps 1 vs 30; --diloco-overlap-steps 0 vs 1; "
                    "--hidden-size 64 vs 128; parameters (from the model flags) "
                    f"{base['parameters (from the model flags)']} vs "
                    f"{other['parameters (from the model flags)']}")
    assert "vocabulary size 512 vs 640" in differences(
        [{"fingerprint": base}, {"fingerprint": _fingerprint(vocab=640)}])[0]


@pytest.mark.parametrize("flags", [
    [],
    ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
     "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
     "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96"],
])
def test_parameter_formula_matches_the_built_model(megatron_world, flags):
    from megatron_streaming.parallel import distributed
    from megatron_streaming.worker.model import build_model

    cfg = parse_args([*TINY, "--num-layers", "2", *flags])
    distributed.seed_everything(1, 0)
    model = build_model(cfg.model, cfg.parallel, megatron_world, 500, None, cfg.precision)
    built = sum(p.numel() for p in model.parameters())
    assert parameter_count(cfg.model, 500) == built


def _pass(store, worker, rank_in_worker, fp, out, timeout_s=20, secret=""):
    try:
        Door(store, worker, 2, rank_in_worker, datetime.timedelta(seconds=timeout_s),
             secret).agree(fp)
        out[(worker, rank_in_worker)] = None
    except ConfigError as e:
        out[(worker, rank_in_worker)] = str(e)


def _store():
    return torch.distributed.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=20))


def test_door_on_a_store_agrees_refuses_a_difference_and_a_taken_index(monkeypatch):
    monkeypatch.setenv("RANK", "1")  # none of the threads hosts the store: no lingering
    fp = _fingerprint()
    store, out = _store(), {}
    threads = [threading.Thread(target=_pass, args=(store, w, r, fp, out))
               for w in range(2) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {(0, 0): None, (0, 1): None, (1, 0): None, (1, 1): None}

    store, out = _store(), {}
    other = _fingerprint("--diloco-quantize", "int8")
    threads = [threading.Thread(target=_pass, args=(store, w, 0, f, out))
               for w, f in ((0, fp), (1, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[(0, 0)] == out[(1, 0)] == (
        "workers launched with different settings (every worker stops here): worker 0 and "
        "worker 1 differ: --diloco-quantize fp4-e2m1 vs int8")

    # A second launch claiming worker 1's index, then a worker that never comes.
    with pytest.raises(ConfigError, match=r"--diloco-worker-index 1: another launch \(.+\) "
                                          "already joined as worker 1"):
        Door(store, 1, 2, 0, datetime.timedelta(seconds=5)).agree(fp)
    with pytest.raises(ConfigError, match="worker 1 did not arrive within 1 s"):
        Door(_store(), 0, 2, 0, datetime.timedelta(seconds=1)).agree(fp)


def test_only_launches_with_the_join_secret_get_in(monkeypatch):
    """Each worker's claim carries an HMAC under the secret; every rank checks all of them.
    The same secret: in. Another secret, or none against one: every rank refuses, naming the
    worker; the secret itself is published nowhere."""
    monkeypatch.setenv("RANK", "1")  # none of the threads hosts the store: no lingering
    fp = _fingerprint()
    for secrets, refused in ((("s3cret", "s3cret"), False), (("s3cret", "guess"), True),
                             (("s3cret", ""), True), (("", ""), False)):
        store, out = _store(), {}
        threads = [threading.Thread(target=_pass, args=(store, w, 0, fp, out),
                                    kwargs={"secret": secrets[w]}) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if not refused:
            assert out == {(0, 0): None, (1, 0): None}, (secrets, out)
            continue
        assert "worker 1 (" in out[(0, 0)] and "worker 0 (" in out[(1, 0)], out
        for message in out.values():
            assert "joined with another join secret than this launch's " \
                   "(MEGATRON_STREAMING_AUTH_TOKEN" in message and "refused" in message
        records = [store.get(f"megatron_streaming/door/worker{w}").decode() for w in range(2)]
        assert not any(secret and secret in r for secret in secrets for r in records)


def test_a_rejoin_claim_is_taken_over_only_from_a_launch_that_is_gone(monkeypatch):
    """Two launches cannot both rejoin as worker 1 in one membership epoch, unless the first
    is gone (its heartbeat stopped before it was admitted): a second relaunch then gets in.
    ``lifecycle.beating`` tells a moving heartbeat from a frozen one."""
    from megatron_streaming.job.lifecycle import beating

    monkeypatch.setenv("RANK", "1")
    fp, store = _fingerprint(), _store()
    t = datetime.timedelta(seconds=5)
    for w in (0, 2):
        Door(store, w, 3, 0, t)._claim(fp)
    Door(store, 1, 3, 0, t).rejoin(fp, 1, [0, 2], holder_gone=lambda: False)
    first = store.get("megatron_streaming/door/worker1.rejoin1")
    with pytest.raises(ConfigError, match="another launch .+ already joined as worker 1"):
        Door(store, 1, 3, 0, t).rejoin(fp, 1, [0, 2], holder_gone=lambda: False)
    assert store.get("megatron_streaming/door/worker1.rejoin1") == first
    Door(store, 1, 3, 0, t).rejoin(fp, 1, [0, 2], holder_gone=lambda: True)
    assert store.get("megatron_streaming/door/worker1.rejoin1") != first

    key = "megatron_streaming/liveness/0/beat/3"
    assert not beating(store, 3, seconds=0.3)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            store.add(key, 1)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        assert beating(store, 3, seconds=0.3)
    finally:
        stop.set()
        thread.join()


@pytest.mark.timeout(300)
def test_mismatched_launches_stop_every_worker_naming_the_flags(tmp_path):
    """One launch per worker (one rank each), four mismatched jobs at once (the fourth: the
    same flags, another join secret)."""
    from local_tokenizers import gpt2_bpe

    tok = []
    for name, word in (("a", "return"), ("b", "yield")):
        texts = [f"def f{i}(x):\n    {word} x * {i} + {i * i}\n" for i in range(300)]
        (tmp_path / name).mkdir()
        vocab, merges = gpt2_bpe(tmp_path / name, texts, 300)
        tok.append(["--vocab-file", vocab, "--merge-file", merges])
    cases = {  # three jobs: two sync flags in one, the model's width, the tokenizer
        "sync": (["--diloco-inner-steps", "4"],
                 ["--diloco-inner-steps", "8", "--diloco-quantize", "int8"],
                 "--diloco-inner-steps 4 vs 8; --diloco-quantize fp4-e2m1 vs int8"),
        "width": ([], ["--hidden-size", "128"], "--hidden-size 64 vs 128; parameters "),
        "tokenizer": (tok[0], tok[1], "--vocab-file (sha256 of its contents) "),
        # The same flags, another join secret in worker 1's environment.
        "secret": ([], [], "joined with another join secret than this launch's"),
    }
    secrets = {("secret", 0): "s3cret", ("secret", 1): "guess"}
    common = [*TINY, "--num-layers", "2", "--train-iters", "4", "--diloco-workers", "2",
              "--diloco-inner-steps", "4", "--master-addr", "127.0.0.1"]
    procs = {}
    for case, (flags0, flags1, _) in cases.items():
        port = str(free_port())
        for w, flags in enumerate((flags0, flags1)):
            log = tmp_path / f"{case}{w}.log"
            secret = {"MEGATRON_STREAMING_AUTH_TOKEN": secrets[case, w]} \
                if (case, w) in secrets else None
            procs[case, w] = (start(1, [*common, "--master-port", port,
                                        "--diloco-worker-index", str(w), *flags], log,
                                    secret), log)
    try:
        codes = {key: p.wait(timeout=240) for key, (p, _) in procs.items()}
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
    for (case, w), (_, log) in procs.items():
        out = log.read_text()
        assert codes[case, w] == 2, f"{case} worker {w}:\n{out[-3000:]}"
        errors = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error")]
        assert len(errors) == 1, out[-3000:]
        assert errors[0].startswith("pretrain_gpt.py: error: workers launched with different "
                                    "settings (every worker stops here): " + (
                                        f"worker {1 - w} (" if case == "secret" else
                                        "worker 0 and worker 1 differ: ")), errors[0]
        assert cases[case][2] in errors[0], errors[0]
        assert "s3cret" not in out and "guess" not in out
        print(errors[0])

"""Training-loop pieces: the learning-rate schedule, Python's garbage collector in training
(--manual-gc), and a run on separate split datasets."""

import gc
import json
import math
import weakref

import pytest

from harness import SHARED_DATA, run
from megatron_streaming.cli.arguments import ConfigError, parse_args, validate
from megatron_streaming.run.collector import GarbageCollection
from seams import lr_at


def test_warmup_then_cosine_and_linear_decay():
    cfg = parse_args(["--mock-data", "--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters", "4",
                      "--train-iters", "14", "--lr-decay-style", "cosine"])
    # Megatron's scheduler: step i runs at the lr of the samples before it, so the first
    # warmup step runs at --lr-warmup-init (0) and the peak is reached at step 4.
    assert [lr_at(i, cfg) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)
    cfg.optimizer.lr_decay_style = "linear"
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    cfg.optimizer.lr_decay_style = "constant"
    assert lr_at(9, cfg) == 1.0


class _Cycle:
    def __init__(self):
        self.me = self


def _collector_state():
    return gc.isenabled(), gc.get_freeze_count()


@pytest.fixture
def collector_restored():
    """The process's collector as each test found it (the test process may have frozen)."""
    before = _collector_state()
    yield before
    if gc.get_freeze_count() and not before[1]:
        gc.unfreeze()
    gc.enable() if before[0] else gc.disable()


def test_training_starts_with_the_set_up_frozen_and_the_collector_automatic(collector_restored):
    """By default a full collection in training walks only what training made: the objects
    alive at the start are collected once and frozen; ``stop`` gives the process back its
    collector as found."""
    enabled, frozen = collector_restored
    kept = [_Cycle() for _ in range(10_000)]  # alive at the start: frozen
    _Cycle()  # garbage at the start: collected, not frozen
    collector = GarbageCollection.from_config(parse_args(["--mock-data"]).training)
    collector.start()
    assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
    for step in range(1, 7):
        collector.after_step(step)
    collector.before_eval()
    collector.after_eval()
    assert collector.collections == 0  # automatic: nothing collects on a schedule
    # A cycle alive at the start and dropped later is out of reach of gc.collect();
    # collect_everything (what a lost worker's groups get) frees it and freezes again.
    cycle = weakref.ref(kept.pop())
    gc.collect()
    assert cycle() is not None
    collector.collect_everything()
    assert cycle() is None and gc.get_freeze_count() >= frozen + len(kept)
    collector.stop()
    collector.stop()  # idempotent
    assert _collector_state() == (enabled, frozen if frozen else 0)


def test_manual_gc_collects_every_interval_and_around_evaluations(collector_restored):
    """--manual-gc, Megatron-LM's: the automatic collector off during training; a collection
    every --manual-gc-interval iterations, before each evaluation and after it (generation 0),
    unless --no-manual-gc-eval; the flags validated."""
    enabled, frozen = collector_restored
    cfg = parse_args(["--mock-data", "--manual-gc", "--manual-gc-interval", "3"])
    assert (cfg.training.manual_gc, cfg.training.manual_gc_interval,
            cfg.training.manual_gc_eval) == (True, 3, True)
    collector = GarbageCollection.from_config(cfg.training)
    collector.start()
    assert not gc.isenabled() and gc.get_freeze_count() > frozen
    generations = []
    gc.callbacks.append(lambda phase, info: phase == "start" and
                        generations.append(info["generation"]))
    try:
        for step in range(1, 8):
            _Cycle()
            collector.after_step(step)
        assert generations == [2, 2]  # after iterations 3 and 6
        collector.before_eval()
        collector.after_eval()
        assert generations == [2, 2, 2, 0] and collector.collections == 4
    finally:
        gc.callbacks.pop()
    collector.stop()
    assert _collector_state() == (enabled, frozen if frozen else 0)

    quiet = GarbageCollection.from_config(parse_args(
        ["--mock-data", "--manual-gc", "--no-manual-gc-eval"]).training)
    quiet.start()
    for step in range(1, 5):
        quiet.after_step(step)  # interval 0: never in the step loop
    quiet.before_eval()
    quiet.after_eval()
    quiet.stop()
    assert quiet.collections == 0 and _collector_state() == (enabled, frozen if frozen else 0)
    with pytest.raises(ConfigError, match="--manual-gc-interval must be >= 0, got -1"):
        validate(parse_args(["--mock-data", "--manual-gc", "--manual-gc-interval", "-1"]), 1)


@pytest.mark.timeout(300)
def test_train_valid_test_from_separate_datasets(tmp_path):
    """--train-data-path/--valid-data-path/--test-data-path, built by the data command."""
    from megatron_streaming.data.__main__ import main as preprocess

    text = (SHARED_DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")
    parts = {"train": text[:60_000], "valid": text[60_000:70_000], "test": text[70_000:80_000]}
    model = None
    for name, part in parts.items():
        (tmp_path / f"{name}.txt").write_text(part, encoding="utf-8")
        tokenizer = ["--tokenizer-model", model] if model else ["--vocab-size", "256"]
        assert preprocess(["--input", str(tmp_path / f"{name}.txt"), "--output-prefix",
                           str(tmp_path / name), *tokenizer]) == 0
        model = model or str(tmp_path / "train.model")
    summary = tmp_path / "summary.json"
    run(2, ["--train-data-path", str(tmp_path / "train"), "--valid-data-path",
            str(tmp_path / "valid"), "--test-data-path", str(tmp_path / "test"),
            "--tokenizer-model", model, "--tensor-model-parallel-size", "2", "--seq-length",
            "32", "--micro-batch-size", "8", "--train-iters", "40", "--lr", "5e-3", "--eval-iters", "2",
            "--summary-json", str(summary)])
    result = json.loads(summary.read_text())
    assert result["iteration"] == 40
    # Trained on real text: both held-out losses are well below ln(256) = 5.55.
    assert result["valid_loss"] < 5.2 and result["test_loss"] < 5.2

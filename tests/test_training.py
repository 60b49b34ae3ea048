"""Training-loop pieces: the learning-rate schedule, and a run on separate split datasets."""

import json
import math

import pytest

from harness import SHARED_DATA, run
from megatron_streaming.cli.arguments import parse_args
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

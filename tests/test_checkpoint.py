"""Checkpoints resume exactly, and a crash mid-save never leaves one that loads as valid."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from harness import TINY, read_jsonl, run
from megatron_streaming import checkpoint
from megatron_streaming.topology import RankLayout

RESUME = [*TINY, "--train-iters", "6", "--eval-iters", "1", "--zero-stage", "2", "--bf16"]


@pytest.mark.timeout(400)
def test_resume_continues_the_uninterrupted_run_exactly(tmp_path):
    """ZeRO-2, bf16, DP=2: fp32 master partitions, AdamW moments, RNG and data position."""
    run(2, [*RESUME, "--log-jsonl", str(tmp_path / "full.jsonl")])
    ckpt = tmp_path / "ckpt"
    run(2, [*RESUME, "--save", str(ckpt), "--exit-interval", "3",
            "--log-jsonl", str(tmp_path / "first.jsonl")])
    run(2, [*RESUME, "--load", str(ckpt), "--log-jsonl", str(tmp_path / "second.jsonl")])
    full = read_jsonl(tmp_path / "full.jsonl")
    first = read_jsonl(tmp_path / "first.jsonl")
    second = read_jsonl(tmp_path / "second.jsonl")

    def train(records):
        return [(r["iteration"], r["train/loss"]) for r in records if "train/loss" in r]

    assert train(first) == train(full)[:3]
    assert train(second) == train(full)[3:]  # bit for bit, not approximately
    assert [r for r in second if "valid/loss" in r] == [r for r in full if "valid/loss" in r]

    # --skip-train --load only evaluates: the loss of the checkpoint's weights.
    summary = tmp_path / "eval.json"
    run(2, [*RESUME, "--load", str(ckpt), "--skip-train", "--summary-json", str(summary)])
    result = json.loads(summary.read_text())
    saved_valid = [r["valid/loss"] for r in first if "valid/loss" in r][-1]
    assert result["iteration"] == 3 and result["train_loss"] is None
    assert result["valid_loss"] == saved_valid


def _checkpointer(tmp_path):
    topo = SimpleNamespace(rank=0, layout=RankLayout(world_size=1))
    return checkpoint.Checkpointer(topo, barrier=lambda: None)


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_crash_before_commit_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    model, opt = _model_and_optimizer(0)
    root = str(tmp_path / "ckpt")
    ckpt.save(root, 1, model, opt, {"iteration": 1})
    saved = model.weight.detach().clone()

    model2, opt2 = _model_and_optimizer(1)
    real_replace = os.replace

    def crash_on_directory_rename(src, dst):
        if src.endswith(".partial"):
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_directory_rename)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.save(root, 2, model2, opt2, {"iteration": 2})
    monkeypatch.setattr(os, "replace", real_replace)

    assert os.path.isdir(os.path.join(root, "iter_0000002.partial"))  # written, not committed
    directory, meta = checkpoint.find_checkpoint(root)
    assert meta["iteration"] == 1
    model3, opt3 = _model_and_optimizer(2)
    assert ckpt.load(root, model3, opt3) == {"iteration": 1}
    assert torch.equal(model3.weight, saved)

    # The next save of iteration 2 clears the stale partial directory and commits.
    ckpt.save(root, 2, model2, opt2, {"iteration": 2})
    assert checkpoint.find_checkpoint(root)[1]["iteration"] == 2
    assert not os.path.exists(os.path.join(root, "iter_0000002.partial"))


def test_crash_mid_rank_file_write_leaves_no_rank_file(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    model, opt = _model_and_optimizer(0)
    root = str(tmp_path / "ckpt")

    def crash(obj, f):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        ckpt.save(root, 1, model, opt, {"iteration": 1})
    with pytest.raises(checkpoint.CheckpointError, match="--load .*no checkpoint"):
        checkpoint.find_checkpoint(root)
    partial = os.path.join(root, "iter_0000001.partial")
    assert not os.path.exists(checkpoint.rank_file(partial, 0))  # only the .tmp exists

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
    return checkpoint.Checkpointer(topo, failed_ranks=lambda failed: [0] if failed else [])


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
    with pytest.raises(checkpoint.CheckpointWriteError) as failure:
        ckpt.save(root, 2, model2, opt2, {"iteration": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    assert str(failure.value) == (
        f"--save {root}: writing the checkpoint of iteration 2 failed on rank(s) [0]: "
        f"simulated crash; the latest checkpoint is still {root}/iter_0000001")

    assert not os.path.exists(os.path.join(root, "iter_0000002.partial"))  # space given back
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
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match="failed on rank.*disk full; no earlier checkpoint exists there"):
        ckpt.save(root, 1, model, opt, {"iteration": 1})
    with pytest.raises(checkpoint.CheckpointError, match="--load .*no checkpoint"):
        checkpoint.find_checkpoint(root)
    assert os.listdir(root) == []  # the half-written partial directory is gone


STREAMING = [*TINY, "--num-layers", "2", "--train-iters", "12", "--eval-iters", "1",
             "--diloco-workers", "2", "--diloco-inner-steps", "6", "--diloco-fragments", "2",
             "--diloco-overlap-steps", "2", "--diloco-quantize", "fp4",
             "--diloco-error-feedback"]


@pytest.mark.timeout(400)
def test_resume_with_a_fragment_in_flight_continues_exactly(tmp_path):
    """H=6, P=2, tau=2: fragment 0 is sent after step 6 and merged after step 8, so a
    checkpoint after step 7 holds an exchange in flight (and the FP4 error-feedback residual,
    the outer momentum and the global copy)."""
    full_summary, resumed_summary = tmp_path / "full.json", tmp_path / "resumed.json"
    run(2, [*STREAMING, "--log-jsonl", str(tmp_path / "full.jsonl"),
            "--summary-json", str(full_summary)])
    ckpt = tmp_path / "ckpt"
    run(2, [*STREAMING, "--save", str(ckpt), "--exit-interval", "7",
            "--log-jsonl", str(tmp_path / "first.jsonl")])
    payload = torch.load(ckpt / "iter_0000007" / "rank_00000.pt", weights_only=False)
    pending = payload["extra"]["streaming"]["pending"]
    assert pending and {p["step"] for p in pending.values()} == {6}
    run(2, [*STREAMING, "--load", str(ckpt), "--log-jsonl", str(tmp_path / "second.jsonl"),
            "--summary-json", str(resumed_summary)])

    def records(name, key):
        return [(r["iteration"], r[key]) for r in read_jsonl(tmp_path / name) if key in r]

    full_train = records("full.jsonl", "train/loss")
    assert records("first.jsonl", "train/loss") == full_train[:7]
    assert records("second.jsonl", "train/loss") == full_train[7:]
    assert records("second.jsonl", "valid/loss") == records("full.jsonl", "valid/loss")
    assert records("second.jsonl", "streaming/drift") == records("full.jsonl",
                                                                  "streaming/drift")[7:]
    full, resumed = json.loads(full_summary.read_text()), json.loads(resumed_summary.read_text())
    assert resumed["cross_worker_bytes"] == full["cross_worker_bytes"] > 0

"""Checkpoints resume exactly, and a crash mid-save never leaves one that loads as valid."""

import json
import os
import re
import threading
from types import SimpleNamespace

import pytest
import torch

from harness import TINY, read_jsonl, run
from megatron_streaming import checkpoint
from megatron_streaming.checkpoint import save_load  # where a save checks the free space

RESUME = [*TINY, "--train-iters", "6", "--eval-iters", "1", "--zero-stage", "2", "--bf16"]


@pytest.mark.timeout(400)
def test_resume_continues_the_uninterrupted_run_exactly(tmp_path):
    """ZeRO-2, bf16, DP=2: fp32 master partitions, AdamW moments, RNG and data position,
    saved by --async-save."""
    run(2, [*RESUME, "--log-jsonl", str(tmp_path / "full.jsonl")])
    ckpt = tmp_path / "ckpt"
    # Saved in the background (--async-save), committed on the way out.
    saving = run(2, [*RESUME, "--save", str(ckpt), "--exit-interval", "3", "--async-save",
                     "--save-interval", "3", "--log-jsonl", str(tmp_path / "first.jsonl")])
    # The host buffer of the copies was made at the start, beside training, not in the save.
    assert re.search(r"--async-save: [0-9.]+ GiB of host memory", saving.stderr), saving.stderr
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


class LinearState:
    """The smallest state a Checkpointer saves: one Linear layer's weight (test seam)."""

    def __init__(self, seed):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)

    def sharded_state_dict(self):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        return {"w": ShardedTensor.from_rank_offsets("w", self.model.weight.detach(),
                                                     replica_id=0)}

    def rank_info(self):
        return {"rank": 0, "worker": 0}

    def describe(self, infos):
        return {"ranks": infos, "workers": {"0": {}}}

    def load(self, directory, meta, plan, part):
        from megatron.core.dist_checkpointing import load
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        request = {"w": ShardedTensor.from_rank_offsets(
            "w", torch.empty_like(self.model.weight), replica_id=0)}
        with torch.no_grad():
            self.model.weight.copy_(load(request, os.path.join(directory, part))["w"])


WORKER_0 = SimpleNamespace(part_worker=0)  # the resume plan: worker 0 reads its own part


def _checkpointer():
    return checkpoint.Checkpointer(0, failed_ranks=lambda failed: [0] if failed else [],
                                   gather=lambda obj: [obj])


def test_crash_before_commit_keeps_previous_checkpoint(tmp_path, monkeypatch, megatron_world):
    ckpt = _checkpointer()
    state = LinearState(0)
    root = str(tmp_path / "ckpt")
    ckpt.save(root, 1, state, {"iteration": 1})
    saved = state.model.weight.detach().clone()

    state2 = LinearState(1)
    real_replace = os.replace

    def crash_on_directory_rename(src, dst):
        if src.endswith(".partial"):
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_directory_rename)
    with pytest.raises(checkpoint.CheckpointWriteError) as failure:
        ckpt.save(root, 2, state2, {"iteration": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    assert str(failure.value) == (
        f"--save {root}: writing the checkpoint of iteration 2 failed on rank(s) [0]: "
        f"simulated crash; the latest checkpoint is still {root}/iter_0000001")

    assert not os.path.exists(os.path.join(root, "iter_0000002.partial"))  # space given back
    directory, meta = checkpoint.find_checkpoint(root)
    assert meta["iteration"] == 1
    state3 = LinearState(2)
    assert ckpt.load(root, state3, WORKER_0) == {"iteration": 1}
    assert torch.equal(state3.model.weight, saved)

    # A crash that left files in the partial directory (a rank's file of another layout, a
    # worker that is no more): the next save of iteration 2 commits without them.
    stale = os.path.join(root, "iter_0000002.partial")
    os.makedirs(os.path.join(stale, "worker0"))
    os.makedirs(os.path.join(stale, "worker3"))
    for name in ("worker0/__7_0.distcp", "worker3/__0_0.distcp"):
        with open(os.path.join(stale, name), "wb") as f:
            f.write(b"stale")
    ckpt.save(root, 2, state2, {"iteration": 2})
    directory, meta = checkpoint.find_checkpoint(root)
    assert meta["iteration"] == 2 and not os.path.exists(stale)
    assert sorted(os.listdir(directory)) == ["checkpoint.json", "worker0"]
    assert sorted(os.listdir(os.path.join(directory, "worker0"))) == sorted(
        name.split("/", 1)[1] for name in meta["files"])


def test_async_save_commits_once_written_and_holds_the_state_of_its_step(
        tmp_path, monkeypatch, megatron_world):
    """--async-save: the write goes on beside training; until it is committed the previous
    checkpoint stays the latest (a crash meanwhile resumes from it), and what is committed is
    the state when the save started, not the weights the steps since then changed."""
    import threading

    ckpt, state = _checkpointer(), LinearState(0)
    root = str(tmp_path / "ckpt")
    ckpt.save(root, 1, state, {"iteration": 1})
    with torch.no_grad():
        state.model.weight.add_(1.0)
    at_save = state.model.weight.detach().clone()
    from patches import megatron_checkpoint_writer

    release, writing = threading.Event(), threading.Event()
    real_write = megatron_checkpoint_writer.write_files

    def held_write(*args):  # the write blocks until the test lets it go
        writing.set()
        release.wait(60)
        return real_write(*args)

    monkeypatch.setattr(megatron_checkpoint_writer, "write_files", held_write)
    pending = ckpt.start_save(root, 2, state, {"iteration": 2}, background=True)
    with torch.no_grad():
        state.model.weight.mul_(-3.0)  # the next steps, while the files are written
    assert not pending.written()
    assert writing.wait(60)  # its part of the partial directory made on the write's thread
    assert checkpoint.find_checkpoint(root)[1]["iteration"] == 1
    assert os.path.isdir(os.path.join(root, "iter_0000002.partial"))
    release.set()
    assert ckpt.finish_save(pending, keep_last=1) == os.path.join(root, "iter_0000002")
    assert torch.serialization.get_crc32_options()  # left out of our files only
    assert checkpoint.find_checkpoint(root)[1]["iteration"] == 2
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    loaded = LinearState(1)
    assert ckpt.load(root, loaded, WORKER_0) == {"iteration": 2}
    assert torch.equal(loaded.model.weight, at_save)


def sharded(*tensors) -> dict:
    """A sharded state dict of ``tensors``, each whole (``t0``, ``t1``...), this rank's."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, replica_id=0)
            for i, t in enumerate(tensors)}


def test_staging_copies_each_save_into_the_same_memory_until_the_layout_changes():
    """--async-save's copies: a save's host tensors are copied into the staging buffer, each
    over memory of exactly its bytes (written in place by the writer); the next save of the
    same dtypes and shapes copies its own values into the same memory; another shape lays the
    buffer out again."""
    from megatron_streaming.checkpoint.background import Staging

    staging = Staging()
    live = [torch.arange(6.0).view(2, 3), torch.ones(5, dtype=torch.bfloat16)]
    first = staging.snapshot(sharded(*live))
    copies = [first[k].data for k in ("t0", "t1")]
    for copy, t in zip(copies, live):
        assert torch.equal(copy, t) and copy.data_ptr() != t.data_ptr()
        assert copy.untyped_storage().nbytes() == t.numel() * t.element_size()
    live[0].mul_(-1.0)  # the steps after the save: its copy keeps the values it had
    assert torch.equal(copies[0], torch.arange(6.0).view(2, 3))
    second = staging.snapshot(sharded(*live))
    assert [second[k].data.data_ptr() for k in ("t0", "t1")] == [c.data_ptr() for c in copies]
    assert torch.equal(second["t0"].data, live[0])
    wider = staging.snapshot(sharded(torch.full((3, 3), 2.0), live[1]))
    assert wider["t0"].data.shape == (3, 3) and torch.equal(wider["t0"].data,
                                                           torch.full((3, 3), 2.0))
    assert torch.equal(wider["t1"].data, live[1])


def test_async_commit_goes_a_stage_per_flag_without_a_collective(tmp_path, monkeypatch,
                                                                   megatron_world):
    """--async-save's commit in the step loop (``advance``): each stage (every rank's files
    written, the worker's part finalised, the job's checkpoint committed) begins once every
    rank's flags say the one before is done, on a thread, with no collective within the worker
    or across workers; what it commits is what ``finish_save`` commits. A failure flagged by
    a rank fails the save on every rank at the next ``advance``, the previous checkpoint
    kept."""
    from megatron_streaming.checkpoint import background

    calls = []

    def counted(name, result):
        def call(obj):
            calls.append(name)
            return result(obj)
        return call

    ckpt = checkpoint.Checkpointer(0, failed_ranks=counted("agreed", lambda f: [0] if f else []),
                                   gather=counted("gathered", lambda obj: [obj]),
                                   gather_workers=counted("across", lambda obj: [obj]))
    state = LinearState(0)
    root = str(tmp_path / "ckpt")
    ckpt.reserve_staging(state)
    ckpt.save(root, 1, state, {"iteration": 1})  # through ``finish_save``, to compare
    synchronous = checkpoint.find_checkpoint(root)[1]

    with torch.no_grad():
        state.model.weight.add_(1.0)
    at_save = state.model.weight.detach().clone()
    calls.clear()
    # A save of the kept plan's structure makes its request (megatron-core's) on the write's
    # thread, which is kept from one save to the next.
    threads, request = [], ckpt.plans.request
    monkeypatch.setattr(ckpt.plans, "request", lambda *args: threads.append(
        threading.current_thread()) or request(*args))
    pending = ckpt.start_save(root, 2, state, {"iteration": 1}, background=True)
    assert calls == ["gathered"]  # the start's, within the worker
    with torch.no_grad():
        state.model.weight.mul_(-3.0)  # the next steps
    pending.write.wait()
    stages, flags = [], []
    while True:  # one rank is the whole job: its flags are everyone's
        flags.append(ckpt.progress(pending))
        path = ckpt.advance(pending, flags[-1])
        stages.append(pending.stage)
        if path is not None:
            break
        if pending.task is not None:
            pending.task.wait()
    assert calls == ["gathered"]  # nothing since: no collective
    assert flags == [[2, 0, 0, 0], [2, 2, 0, 0], [2, 2, 2, 0]]
    assert stages == [background.FINALISING, background.COMMITTING, background.DONE]
    assert path == os.path.join(root, "iter_0000002")
    directory, meta = checkpoint.find_checkpoint(root)
    assert meta["iteration"] == 2
    assert sorted(os.listdir(directory)) == ["checkpoint.json", "worker0"]  # no .commit
    # The synchronous save's document, but for the iteration and the files' hashes.
    assert sorted(meta["files"]) == sorted(synchronous["files"])

    def rest(m):
        return {k: v for k, v in m.items() if k not in ("files", "size_bytes", "iteration")}

    assert rest(meta) == rest(synchronous)
    loaded = LinearState(1)
    assert ckpt.load(root, loaded, WORKER_0) == {"iteration": 1}
    assert torch.equal(loaded.model.weight, at_save)

    # A save in flight finished at once (the next is due, training ends) from either stage
    # ``advance`` left it in: the worker's part being finalised, the job's commit begun.
    for iteration, stage in ((3, background.FINALISING), (4, background.COMMITTING)):
        pending = ckpt.start_save(root, iteration, state, {"iteration": iteration},
                                  background=True)
        pending.write.wait()
        while pending.stage != stage:
            ckpt.advance(pending, ckpt.progress(pending))
        calls.clear()
        assert ckpt.finish_save(pending) == os.path.join(root, f"iter_{iteration:07d}")
        assert calls == (["gathered", "across", "agreed"] if stage == background.FINALISING
                         else ["agreed"])
        assert checkpoint.find_checkpoint(root)[1]["iteration"] == iteration
    assert len(threads) == 3 and threads[0] is not threading.main_thread()
    assert all(t is threads[0] for t in threads)

    # A write that fails: the rank's flag says so, and the next ``advance`` fails the save on
    # every rank (collective: each learns where and why).
    from patches import megatron_checkpoint_writer

    def full(*args):
        raise OSError(28, "No space left on device")

    real_write = megatron_checkpoint_writer.write_files
    monkeypatch.setattr(megatron_checkpoint_writer, "write_files", full)
    calls.clear()
    pending = ckpt.start_save(root, 5, state, {"iteration": 5}, background=True)
    pending.write.wait()
    assert ckpt.progress(pending) == [0, 0, 0, 5]
    with pytest.raises(checkpoint.CheckpointWriteError) as failure:
        ckpt.advance(pending, ckpt.progress(pending))
    assert str(failure.value) == (
        f"--save {root}: writing the checkpoint of iteration 5 failed on rank(s) [0]: "
        f"[Errno 28] No space left on device; the latest checkpoint is still "
        f"{root}/iter_0000004")
    assert calls == ["gathered", "gathered", "across"]
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "iter_0000003",
                                        "iter_0000004", "latest_checkpointed_iteration.txt"]

    # The worker's first rank failing to write torch's index fails the save the same way,
    # whether its commit goes by the flags or at once (every rank of the worker learns it:
    # megatron-core's own finalisation left the other ranks in its broadcast).
    monkeypatch.setattr(megatron_checkpoint_writer, "write_files", real_write)

    def unwritable(results):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt.plans, "finish", unwritable)
    pending = ckpt.start_save(root, 6, state, {"iteration": 6}, background=True)
    pending.write.wait()
    ckpt.advance(pending, ckpt.progress(pending))
    pending.task.wait()
    assert pending.stage == background.FINALISING and ckpt.progress(pending) == [0, 0, 0, 6]
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"iteration 6 failed on rank\(s\)"
                       r" \[0\]: \[Errno 5\] Input/output error; the latest checkpoint is "
                       r"still \S+/iter_0000004"):
        ckpt.advance(pending, ckpt.progress(pending))
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"iteration 7 failed on rank\(s\)"
                       r" \[0\]: \[Errno 5\] Input/output error"):
        ckpt.save(root, 7, state, {"iteration": 7})

    # The free space, checked on the write's thread, is flagged as a failed write is.
    def no_space(directory, tensor_bytes):
        raise OSError(28, f"No space left on device: {tensor_bytes} bytes")

    monkeypatch.setattr(save_load, "_check_space", no_space)
    pending = ckpt.start_save(root, 8, state, {"iteration": 8}, background=True)
    pending.write.wait()
    assert pending.error is None and isinstance(pending.write.error, OSError)  # the thread's
    assert ckpt.progress(pending) == [0, 0, 0, 8]
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"iteration 8 failed on rank\(s\)"
                       r" \[0\]: \[Errno 28\] No space left on device: \d+ bytes; the latest"):
        ckpt.advance(pending, ckpt.progress(pending))
    assert checkpoint.find_checkpoint(root)[1]["iteration"] == 4
    assert checkpoint.find_checkpoint(root)[1]["iteration"] == 4


def test_saves_of_one_structure_are_planned_once(tmp_path, monkeypatch, megatron_world):
    """The plan of a save (megatron-core's check that every shard is written once, every
    rank's plan gathered for the global metadata) is made once, ahead of the first
    --async-save save, and reused by every save of the same structure, each writing its own
    values; a change of shape plans afresh. A failure of a save that planned alone (here the
    free space) fails it at the commit, the previous checkpoint kept."""
    from megatron.core.dist_checkpointing import state_dict_utils
    from torch.distributed.checkpoint import utils
    from torch.distributed.checkpoint.planner import SavePlan

    planned = []
    validate, gather = state_dict_utils.validate_sharding_integrity, \
        utils._DistWrapper.gather_object

    def validating(*args, **kwargs):
        planned.append("validated")
        return validate(*args, **kwargs)

    def gathering(self, obj):
        if isinstance(obj, SavePlan):  # not the write results the finalisation gathers
            planned.append("gathered")
        return gather(self, obj)

    monkeypatch.setattr(state_dict_utils, "validate_sharding_integrity", validating)
    monkeypatch.setattr(utils._DistWrapper, "gather_object", gathering)
    crossed = []  # the collectives across workers (round trips over the slow link)

    def failed_ranks(failed):
        crossed.append("agreed")
        return [0] if failed else []

    def gather_workers(obj):
        crossed.append("gathered")
        return [obj]

    ckpt = checkpoint.Checkpointer(0, failed_ranks=failed_ranks, gather=lambda obj: [obj],
                                   gather_workers=gather_workers)
    state = LinearState(0)
    root = str(tmp_path / "ckpt")
    ckpt.plan_ahead(state.sharded_state_dict())
    assert planned == ["validated", "gathered"] and crossed == []
    for iteration in (1, 2):
        with torch.no_grad():
            state.model.weight.add_(1.0)
        ckpt.finish_save(ckpt.start_save(root, iteration, state, {"iteration": iteration},
                                         background=True))
        loaded = LinearState(9)
        assert ckpt.load(root, loaded, WORKER_0) == {"iteration": iteration}
        assert torch.equal(loaded.model.weight, state.model.weight)
    assert planned == ["validated", "gathered"]  # nothing more
    # Each save crosses twice, both at its commit: every worker's files and failures, then
    # the commit's agreement; then the load's verification agrees once.
    assert crossed == ["gathered", "agreed", "agreed"] * 2

    crossed.clear()
    wider = LinearState(1)
    wider.model = torch.nn.Linear(4, 5)
    ckpt.save(root, 3, wider, {"iteration": 3})
    assert planned == ["validated", "gathered"] * 2
    assert crossed == ["gathered", "agreed"]  # planned afresh: the same
    loaded = LinearState(9)
    loaded.model = torch.nn.Linear(4, 5)
    ckpt.load(root, loaded, WORKER_0)
    assert torch.equal(loaded.model.weight, wider.model.weight)

    def full(*args):
        raise OSError(28, "No space left on device for the checkpoint")

    monkeypatch.setattr(save_load, "_check_space", full)
    with pytest.raises(checkpoint.CheckpointWriteError) as failure:
        ckpt.save(root, 4, wider, {"iteration": 4})
    assert str(failure.value) == (
        f"--save {root}: writing the checkpoint of iteration 4 failed on rank(s) [0]: "
        f"[Errno 28] No space left on device for the checkpoint; the latest checkpoint is "
        f"still {root}/iter_0000003")
    assert planned == ["validated", "gathered"] * 2  # planned alone: the commit learnt it
    with pytest.raises(checkpoint.CheckpointWriteError, match="iteration 4 failed on rank"
                       r"\(s\) \[0\]: \[Errno 28\] No space left on device for the checkpoint"):
        _checkpointer().save(root, 4, wider, {"iteration": 4})  # to plan afresh: not planned
    assert planned == ["validated", "gathered"] * 2
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]


def test_keep_last_deletes_only_older_committed_checkpoints(tmp_path):
    from megatron_streaming.checkpoint import store

    root = tmp_path / "ckpt"
    for i in range(1, 6):
        (root / f"iter_{i:07d}").mkdir(parents=True)
        (root / f"iter_{i:07d}" / "checkpoint.json").write_text("{}")
    (root / "iter_0000006.partial").mkdir()  # being written: not committed
    (root / "iter_0000007").mkdir()  # no checkpoint.json: not a committed checkpoint
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")  # resumed from 3
    assert store.prune(str(root), 2) == [str(root / "iter_0000001"), str(root / "iter_0000002")]
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000004", "iter_0000005",
                                        "iter_0000006.partial", "iter_0000007",
                                        "latest_checkpointed_iteration.txt"]
    assert store.prune(str(root), 0) == []
    (root / "latest_checkpointed_iteration.txt").unlink()
    assert store.prune(str(root), 1) == []  # nothing a resume would find: nothing deleted


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_crash_mid_file_write_leaves_nothing(tmp_path, monkeypatch, megatron_world,
                                            background):
    """A tensor file that cannot be completed (disk full) fails the save cleanly; written in
    the background, at the commit."""
    import builtins

    ckpt = _checkpointer()
    root = str(tmp_path / "ckpt")
    real_open = builtins.open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(data)[:10])
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_disk_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if str(path).endswith(".distcp") and "w" in mode else f

    monkeypatch.setattr(builtins, "open", full_disk_open)
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match="failed on rank.*No space left on device.*no earlier checkpoint"):
        ckpt.finish_save(ckpt.start_save(root, 1, LinearState(0), {"iteration": 1},
                                         background=background))
    monkeypatch.setattr(builtins, "open", real_open)
    with pytest.raises(checkpoint.CheckpointError, match="--load .*no checkpoint"):
        checkpoint.find_checkpoint(root)
    assert os.listdir(root) == []  # the half-written partial directory is gone


def test_tampered_or_truncated_files_are_refused_naming_the_file(tmp_path, megatron_world):
    import pickle

    from megatron_streaming.checkpoint import store

    ckpt = _checkpointer()
    root = str(tmp_path / "ckpt")
    ckpt.save(root, 1, LinearState(0), {"iteration": 1})
    meta_path = os.path.join(root, "iter_0000001", "checkpoint.json")
    directory = os.path.join(root, "iter_0000001", "worker0")  # worker 0's part
    original = open(meta_path).read()

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/pwned",))

    # 1. .metadata replaced by a pickle that would run code: refused by its hash ...
    evil = pickle.dumps(RunsCode())
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(evil)
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata is truncated or altered"):
        ckpt.load(root, LinearState(1), WORKER_0)
    # ... and, with checkpoint.json rewritten to match it, by the restricted unpickler.
    meta = json.loads(original)
    meta["files"]["worker0/.metadata"] = {"size": len(evil), store.HASH: store.file_hash(
        os.path.join(directory, ".metadata"))}
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"\.metadata is not checkpoint metadata .*posix.system"):
        ckpt.load(root, LinearState(1), WORKER_0)
    assert not os.path.exists(tmp_path / "pwned")

    # 2. A truncated tensor file: refused before any collective (check_loadable's check).
    ckpt.save(root, 2, LinearState(0), {"iteration": 2})
    directory = os.path.join(root, "iter_0000002")
    part = os.path.join(directory, "worker0")
    tensors = next(n for n in os.listdir(part) if n.endswith(".distcp"))
    path = os.path.join(part, tensors)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(checkpoint.CheckpointError, match=f"{path} is truncated or altered"):
        store.check_files(root, directory, checkpoint.find_checkpoint(root)[1], hashes=False)


STREAMING = [*TINY, "--num-layers", "2", "--train-iters", "12", "--eval-iters", "1",
             "--diloco-workers", "2", "--diloco-inner-steps", "6", "--diloco-fragments", "2",
             "--diloco-overlap-steps", "2", "--diloco-quantize", "fp4",
             "--diloco-error-feedback"]


_TAU = STREAMING.index("--diloco-overlap-steps")
EAGER = STREAMING[:_TAU] + STREAMING[_TAU + 2:] + [
    "--diloco-eager", "--diloco-outer-lr", "0.7", "--diloco-outer-momentum", "0.9"]
# The sparse exchange: each worker's accumulator is saved per worker and resumed.
SPARSE = [*STREAMING, "--diloco-quantize", "sparse", "--diloco-sparse-chunk", "256",
          "--diloco-sparse-k", "8"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("eager", [False, True, "sparse"], ids=["tau2", "eager", "sparse"])
def test_resume_with_a_fragment_in_flight_continues_exactly(tmp_path, eager):
    """H=6, P=2, tau=2: fragment 0 is sent after step 6 and merged after step 8, so a
    checkpoint after step 7 holds an exchange in flight (and the FP4 error-feedback residual,
    the outer momentum and the global copy). Eager (outer momentum on, so each worker's global
    copy and momentum are its own): fragment 1 sent after step 3 and fragment 0 after step 6
    are both in flight, applied at their next sends, 9 and 12. tau2 saves with --async-save
    while training goes on."""
    if eager == "sparse":
        resumes_in_flight_exactly(tmp_path, SPARSE)
    elif eager:
        resumes_in_flight_exactly(tmp_path, EAGER)
    else:
        resumes_async_save_in_flight_exactly(tmp_path, STREAMING)


def resumes_async_save_in_flight_exactly(tmp_path, args, extra_env=None):
    """The run that saves goes on to the end while its checkpoint of step 7 is written in the
    background; resumed from that checkpoint, a run trains as that run did after step 7."""
    import re
    import shutil

    ckpt, older = tmp_path / "ckpt", tmp_path / "older"
    full_summary, resumed_summary = tmp_path / "full.json", tmp_path / "resumed.json"
    out = run(2, [*args, "--save", str(ckpt), "--save-interval", "7", "--async-save",
                  "--keep-last", "2", "--log-jsonl", str(tmp_path / "full.jsonl"),
                  "--summary-json", str(full_summary)], extra_env=extra_env).stderr
    committed = re.search(r"saved checkpoint \S+/iter_0000007 at iteration (\d+)", out)
    assert committed and int(committed.group(1)) > 7, out[-3000:]  # after steps went on
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000007", "iter_0000012", "latest_checkpointed_iteration.txt"]
    meta = json.loads((ckpt / "iter_0000007" / "checkpoint.json").read_text())
    assert meta["pending"] == [{"fragment": 0, "step": 6, "all_finite": True}]
    # Back to step 7, as a user rolls back: the tracker pointed at it.
    shutil.copytree(ckpt / "iter_0000007", older / "iter_0000007")
    (older / "latest_checkpointed_iteration.txt").write_text("7\n")
    run(2, [*args, "--load", str(older), "--log-jsonl", str(tmp_path / "second.jsonl"),
            "--summary-json", str(resumed_summary)], extra_env=extra_env)
    _same_after_step_7(tmp_path, full_summary, resumed_summary)


def resumes_in_flight_exactly(tmp_path, args, extra_env=None):
    """The body of the test above, for any flags that keep its schedule (the CUDA variant)."""
    eager = "--diloco-eager" in args  # (sparse: its accumulators, one per worker and shard)
    full_summary, resumed_summary = tmp_path / "full.json", tmp_path / "resumed.json"
    run(2, [*args, "--log-jsonl", str(tmp_path / "full.jsonl"),
            "--summary-json", str(full_summary)], extra_env=extra_env)
    ckpt = tmp_path / "ckpt"
    run(2, [*args, "--save", str(ckpt), "--exit-interval", "7",
            "--log-jsonl", str(tmp_path / "first.jsonl")], extra_env=extra_env)
    meta = json.loads((ckpt / "iter_0000007" / "checkpoint.json").read_text())
    assert meta["pending"] == [{"fragment": 0, "step": 6, "all_finite": True}] + (
        [{"fragment": 1, "step": 3, "all_finite": True}] if eager else [])
    if eager:
        assert {"worker1.outer.theta_g", "worker1.outer.momentum", "worker0.outer.own",
                "worker1.outer.own"} <= set(meta["kinds"]["prefixes"])
    run(2, [*args, "--load", str(ckpt), "--log-jsonl", str(tmp_path / "second.jsonl"),
            "--summary-json", str(resumed_summary)], extra_env=extra_env)

    assert _records(tmp_path / "first.jsonl", "train/loss") == \
        _records(tmp_path / "full.jsonl", "train/loss")[:7]
    _same_after_step_7(tmp_path, full_summary, resumed_summary)


def _records(path, key):
    return [(r["iteration"], r[key]) for r in read_jsonl(path) if key in r]


def _same_after_step_7(tmp_path, full_summary, resumed_summary):
    """second.jsonl (resumed at step 7) against full.jsonl, bit for bit."""
    def records(name, key):
        return _records(tmp_path / name, key)

    full_train = records("full.jsonl", "train/loss")
    assert records("second.jsonl", "train/loss") == full_train[7:]
    assert records("second.jsonl", "valid/loss") == records("full.jsonl", "valid/loss")
    assert records("second.jsonl", "streaming/drift") == records("full.jsonl",
                                                                  "streaming/drift")[7:]
    full, resumed = json.loads(full_summary.read_text()), json.loads(resumed_summary.read_text())
    assert resumed["cross_worker_bytes"] == full["cross_worker_bytes"] > 0


def test_restored_adam_step_count_lives_where_torch_keeps_it():
    """Fused Adam (what a GPU run uses) wants its step counts on the parameters' device; a
    CPU step count there fails the first step after a resume ("meta" stands in for CUDA)."""
    from megatron_streaming.worker.optimizer_state import step_tensor

    param = torch.empty(3, device="meta")
    assert step_tensor(7, param, {"fused": True}).device.type == "meta"
    assert step_tensor(7, param, {"capturable": True}).device.type == "meta"
    assert step_tensor(7, param, {"fused": None, "capturable": False}).device.type == "cpu"
    assert float(step_tensor(7, torch.empty(3), {"fused": True})) == 7.0


"""Failing cleanly: a killed rank, SIGTERM, a full or read-only --save.

Each test runs real launches of pretrain_gpt.py (torchrun, gloo) and, where it matters, one
launch per worker (the multi-cluster form: --diloco-worker-index against a common
--master-addr/--master-port), then checks what a user would see: exit status, the one-line
error, the checkpoint left behind, and that a relaunch resumes from it.
"""

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest
import torch

import harness
import netns
from harness import FAULTS, TINY, free_port, read_jsonl, run, start, wait_for_line


@pytest.fixture
def ranks_under_their_launcher(monkeypatch):
    """For a test that finds a launch's ranks among its child processes (``_rank_of``): its
    launcher starts them, not the session's zygote."""
    monkeypatch.setattr(harness, "FORKED", False)


@pytest.fixture
def torchrun(monkeypatch):
    """Launches by torchrun itself: a test of what its ranks do (their sessions, a killed
    agent); the others start their ranks from tests/preloaded_launcher.py."""
    monkeypatch.setattr(harness, "PRELOADED", False)

STREAMING = [*TINY, "--num-layers", "2", "--eval-iters", "0", "--diloco-workers", "2",
             "--diloco-inner-steps", "4", "--diloco-fragments", "2",
             "--diloco-overlap-steps", "1"]
SLOW = {"MEGATRON_STREAMING_SLOW_WORKER": "0:0.2"}  # paces the run so a test can act mid-way


def _rank_of(launcher: subprocess.Popen, local_rank: int) -> psutil.Process:
    """The rank process that the launcher started with LOCAL_RANK=local_rank (torchrun's in
    its environment; tests/preloaded_launcher.py's named by it)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.name() == f"rank{local_rank}" or (
                    child.environ().get("LOCAL_RANK") == str(local_rank) and
                    ("pretrain_gpt.py" in " ".join(child.cmdline()) or
                     FAULTS in " ".join(child.cmdline()))):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no rank with LOCAL_RANK={local_rank} under {launcher.pid}")


def _tracker(ckpt) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


@pytest.mark.timeout(420)
@pytest.mark.usefixtures("ranks_under_their_launcher")
def test_killed_rank_is_named_and_the_job_resumes_from_the_last_checkpoint(tmp_path):
    """Saved with --async-save --keep-last 1, each checkpoint committed in the background
    while training goes on; the rank is killed while the checkpoint of iteration 30 is being
    written: the job resumes from the one of iteration 20."""
    ckpt = tmp_path / "ckpt"
    port = free_port()
    common = [*STREAMING, "--tensor-model-parallel-size", "2", "--train-iters", "400",
              "--save", str(ckpt), "--save-interval", "10", "--diloco-timeout", "120",
              "--async-save", "--keep-last", "1",
              "--master-addr", "127.0.0.1", "--master-port", str(port)]
    logs = [tmp_path / "worker0.log", tmp_path / "worker1.log"]
    slow_write = {**SLOW, "MEGATRON_STREAMING_SLOW_WRITE": "30:600"}
    workers = [start(2, [*common, "--diloco-worker-index", str(w)], logs[w], slow_write,
                     FAULTS) for w in range(2)]
    try:
        wait_for_line(logs[0], r"checkpoint of iteration 30: writing in the background",
                      workers[0])
        deadline = time.monotonic() + 60  # its part made on the write's thread, then held
        while not (ckpt / "iter_0000030.partial").is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "iter_0000020", "iter_0000030.partial", "latest_checkpointed_iteration.txt"]
        victim = _rank_of(workers[1], local_rank=1)  # global rank 3: worker 1, tp 1
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        codes = [w.wait(timeout=180) for w in workers]
        detected = time.monotonic() - killed
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    out0 = logs[0].read_text()
    print(f"all ranks gone {detected:.1f} s after the kill")
    assert codes[0] != 0 and codes[1] != 0
    last = _tracker(ckpt)
    assert last == 20  # not the one being written when the rank died
    # Committed by the step loop's flags, a stage a step, before the next save was due (the
    # steps of worker 0 take 0.2 s here; a commit takes a few).
    assert re.search(r"saved checkpoint \S+/iter_0000010 at iteration 1\d \(written and "
                     r"hashed in the background in [0-9.]+ s, committed in the background",
                     out0), out0[-3000:]
    # Both survivors of worker 0 name the lost rank and the checkpoint to resume from.
    assert out0.count("pretrain_gpt.py: error: lost rank 3 (worker 1, tp 1).") == 2, out0[-3000:]
    assert (f"Last good checkpoint: {ckpt}/iter_{last:07d} (iteration {last}); resume with "
            f"--load {ckpt}.") in out0

    # The whole job resumes from it (same flags, --load added), worker by worker again.
    port = free_port()
    resume = [*STREAMING, "--tensor-model-parallel-size", "2", "--train-iters", str(last + 3),
              "--load", str(ckpt), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    logs = [tmp_path / "resume0.log", tmp_path / "resume1.log"]
    workers = [start(2, [*resume, "--diloco-worker-index", str(w),
                         "--summary-json", str(tmp_path / f"resume{w}.json")], logs[w])
               for w in range(2)]
    assert [w.wait(timeout=180) for w in workers] == [0, 0], logs[0].read_text()[-3000:]
    assert f"resumed from {ckpt} at iteration {last}" in logs[0].read_text()
    assert json.loads((tmp_path / "resume0.json").read_text())["iteration"] == last + 3


@pytest.mark.timeout(420)
@pytest.mark.usefixtures("ranks_under_their_launcher")
def test_sigterm_to_one_worker_checkpoints_everyone_exits_zero_and_resumes_exactly(tmp_path):
    """SLURM sends SIGTERM at the time limit; with one job per cluster only one worker gets
    it. Every rank must stop after the same step, checkpoint, exit 0; the requeued command
    (--load == --save) resumes and trains exactly like a run that was never stopped."""
    ckpt = tmp_path / "ckpt"
    flags = [*STREAMING, "--train-iters", "24", "--save", str(ckpt), "--load", str(ckpt)]

    def launch(name, extra_env=None):
        return start(2, [*flags, "--log-jsonl", str(tmp_path / f"{name}.jsonl"),
                         "--summary-json", str(tmp_path / f"{name}.json")],
                     tmp_path / f"{name}.log", extra_env, FAULTS if extra_env else
                     "pretrain_gpt.py")

    first = launch("first", SLOW)
    try:
        wait_for_line(tmp_path / "first.log", r"iteration +4/24", first)
        _rank_of(first, local_rank=1).send_signal(signal.SIGTERM)  # worker 1's only rank
        assert first.wait(timeout=180) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    stopped = json.loads((tmp_path / "first.json").read_text())
    k = stopped["iteration"]
    assert stopped["stopped_by"] == "SIGTERM" and 4 <= k < 24
    assert stopped["checkpoint_iteration"] == k and _tracker(ckpt) == k
    assert "stopping after iteration" in (tmp_path / "first.log").read_text()

    second = launch("second")
    assert second.wait(timeout=180) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert f"resumed from {ckpt} at iteration {k}" in (tmp_path / "second.log").read_text()
    assert json.loads((tmp_path / "second.json").read_text())["iteration"] == 24

    whole = tmp_path / "whole.jsonl"
    run(2, [*STREAMING, "--train-iters", "24", "--log-jsonl", str(whole)], timeout=240)

    def losses(path):
        return [(r["iteration"], r["train/loss"]) for r in read_jsonl(path) if "train/loss" in r]

    assert losses(tmp_path / "first.jsonl") + losses(tmp_path / "second.jsonl") == losses(whole)


@pytest.mark.timeout(300)
def test_ranks_whose_launcher_is_killed_stop_with_a_checkpoint(tmp_path, torchrun):
    """torchrun starts its ranks in sessions of their own, so a SIGKILL of the launcher (an
    agent killed by OOM, a node's supervisor gone) left them training, orphaned, with nobody
    to collect them. Each rank now notices within a heartbeat that it was re-parented, and
    the job stops after the same iteration on every rank, with a checkpoint."""
    ckpt = tmp_path / "ckpt"
    launcher = start(2, [*STREAMING, "--train-iters", "100000", "--save", str(ckpt),
                         "--summary-json", str(tmp_path / "summary.json")],
                     tmp_path / "run.log", SLOW, FAULTS)
    ranks = []
    try:
        wait_for_line(tmp_path / "run.log", r"iteration +3/100000", launcher)
        ranks = [_rank_of(launcher, r) for r in (0, 1)]
        launcher.kill()  # SIGKILL: the ranks are not told
        launcher.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=120)
        assert not alive, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        for p in ranks:
            if p.is_running():
                p.kill()
    log = (tmp_path / "run.log").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    k = summary["iteration"]
    assert summary["stopped_by"] == "launcher-gone" and 3 <= k < 100000, log[-3000:]
    assert summary["checkpoint_iteration"] == k == _tracker(ckpt)
    assert "is gone: stopping after the current iteration, with a checkpoint" in log


@pytest.mark.timeout(300)
@pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")
def test_a_link_cut_between_two_clusters_stops_both_sides_within_the_timeout(tmp_path):
    """Each worker in its own network namespace, joined by a veth pair; the link goes down
    mid-run (packets dropped, no connection reset, as when a WAN path fails). Worker 0, which
    hosts the store, names worker 1 as lost; worker 1, cut off from the store too, says so;
    both exit 3 soon after --diloco-timeout rather than waiting for TCP to give up
    (~15 min). (Two workers cannot go on without each other: a half is not a majority, so
    --diloco-min-workers could not help; the elastic case, three workers, is the next test.)"""
    with netns.two_namespaces() as link:
        port = free_port()
        common = [*STREAMING, "--train-iters", "100000", "--diloco-timeout", "5",
                  "--distributed-timeout-minutes", "0.5", "--master-addr", link.addresses[0],
                  "--master-port", str(port)]
        logs = [tmp_path / "worker0.log", tmp_path / "worker1.log"]
        workers = [start(1, [*common, "--diloco-worker-index", str(w)], logs[w],
                         {**SLOW, "GLOO_SOCKET_IFNAME": link.devices[w]}, FAULTS,
                         wrap=lambda cmd, w=w: link.run_in(w, cmd))
                   for w in range(2)]
        try:
            wait_for_line(logs[0], r"iteration +8/", workers[0], timeout=180)
            link.cut()
            cut = time.monotonic()
            codes = [w.wait(timeout=120) for w in workers]
            print(f"both workers gone {time.monotonic() - cut:.1f} s after the cut")
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
    out0, out1 = (log.read_text() for log in logs)
    assert codes == [3, 3], (out0[-2000:], out1[-2000:])
    assert "pretrain_gpt.py: error: lost rank 1 (worker 1). rank 0 (worker 0) stopped at " \
        "iteration" in out0, out0[-2000:]
    assert (f"pretrain_gpt.py: error: cannot tell which rank was lost: rendezvous store "
            f"{link.addresses[0]}:{port} unreachable: no answer within") in out1, out1[-2000:]
    assert "or the link to it is down" in out1


@pytest.mark.timeout(300)
@pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")
def test_an_elastic_job_goes_on_across_a_link_cut_and_heals_when_the_link_comes_back(
        tmp_path):
    """Three workers, --diloco-min-workers 2: workers 0 and 1 (and the store) in one network
    namespace, worker 2 in the other. The link goes down mid-run: workers 0 and 1 (a
    majority) name worker 2 as lost and go on; worker 2, cut off from the store, waits for
    it. The link comes back: worker 2 restarts its own process, rejoins through the door and
    is admitted. A SIGTERM then stops all three after the same step with a checkpoint, whose
    three parts hold the same global parameters."""
    from megatron_streaming.checkpoint.offline import read_tensors

    sides = (0, 0, 1)
    with netns.two_namespaces() as link:
        port = free_port()
        ckpt = tmp_path / "ckpt"
        common = [*STREAMING, "--diloco-workers", "3", "--diloco-min-workers", "2",
                  "--train-iters", "100000", "--diloco-timeout", "5",
                  "--distributed-timeout-minutes", "1", "--master-addr", link.addresses[0],
                  "--master-port", str(port), "--save", str(ckpt)]
        logs = [tmp_path / f"worker{w}.log" for w in range(3)]
        workers = [start(1, [*common, "--diloco-worker-index", str(w)], logs[w],
                         {**SLOW, "GLOO_SOCKET_IFNAME": link.devices[sides[w]]}, FAULTS,
                         wrap=lambda cmd, w=w: link.run_in(sides[w], cmd))
                   for w in range(3)]
        try:
            wait_for_line(logs[0], r"iteration +8/", workers[0], timeout=180)
            link.cut()
            cut = time.monotonic()
            wait_for_line(logs[0], r"membership epoch 1: workers \[0, 1\]", workers[0])
            print(f"workers 0 and 1 went on {time.monotonic() - cut:.1f} s after the cut")
            wait_for_line(logs[2], "rejoining as a restarted worker", workers[2])
            link.restore()
            back = time.monotonic()
            wait_for_line(logs[2], r"worker 2 rejoined after step", workers[2], timeout=180)
            print(f"worker 2 rejoined {time.monotonic() - back:.1f} s after the link came back")
            line = wait_for_line(logs[0], r"membership epoch 2: workers \[0, 1, 2\]",
                                 workers[0])
            joined = int(re.search(r"rejoined after step (\d+)", line).group(1))
            wait_for_line(logs[0], rf"iteration +{joined + 6}/", workers[0])
            workers[0].send_signal(signal.SIGTERM)
            codes = [w.wait(timeout=120) for w in workers]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
    out = [log.read_text() for log in logs]
    assert codes == [0, 0, 0], [o[-2000:] for o in out]
    assert "membership epoch 1: workers [0, 1] (lost worker(s) [2] after step" in out[0]
    assert "cannot reach the rendezvous store" in out[2], out[2][-3000:]
    assert "restarting this rank to rejoin" in out[2]
    last = _tracker(ckpt)
    assert last > joined
    final = ckpt / f"iter_{last:07d}"
    meta = json.loads((final / "checkpoint.json").read_text())
    keys = [k for k in meta["kinds"]["keys_by_part"]["worker0"] if k.startswith("outer.theta_g")]
    parts = [read_tensors(str(final / f"worker{w}"), keys) for w in range(3)]
    assert keys and all(torch.equal(parts[0][k], p[k]) for p in parts[1:] for k in keys)


def _liveness_on_own_store(store_timeout: float):
    """A one-rank Liveness (heartbeat every 0.1 s) on a store this process hosts."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_streaming.job import lifecycle
    from megatron_streaming.parallel.distributed import StoreAddress

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    topology = SimpleNamespace(rank=0, layout=SimpleNamespace(world_size=1), worker=0,
                               cross=None)
    stop = lifecycle.StopRequest(signals=())
    return store, stop, lifecycle.Liveness(topology, StoreAddress("127.0.0.1", port),
                                           interval=0.1, stop=stop,
                                           store_timeout=store_timeout)


def test_liveness_asks_to_stop_when_the_launcher_or_the_store_is_gone():
    """The heartbeat thread's two orphan checks, in one process: the store (hosted here)
    goes away and stays away past the timeout; the rank is re-parented (its launcher died)."""
    import gc

    from megatron_streaming.job import lifecycle

    store, stop, liveness = _liveness_on_own_store(store_timeout=0.5)
    try:
        time.sleep(0.8)
        assert stop.received is None  # beating fine, past the timeout
        del store
        gc.collect()
        deadline = time.monotonic() + 20
        while stop.received is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lifecycle._signal_name(stop.received) == "rendezvous-unreachable"
    finally:
        liveness.close()
    stop = lifecycle.StopRequest(signals=())
    liveness.stop_request, liveness.launcher = stop, os.getppid()
    assert not liveness.check_orphaned() and stop.received is None
    liveness.launcher = os.getppid() + 1  # as if started by a process that is gone
    assert liveness.check_orphaned()
    assert lifecycle._signal_name(stop.received) == "launcher-gone"


def test_a_store_that_stops_answering_counts_as_unreachable(monkeypatch):
    """Over a link that went down a store call blocks (until TCP gives up, ~15 min) instead
    of failing: the heartbeat and the failure survey give up after STORE_CALL_SECONDS, the
    orphan check stops the rank, and the calls queued meanwhile are dropped, not run late."""
    import threading

    from megatron_streaming.job import lifecycle

    monkeypatch.setattr(lifecycle, "STORE_CALL_SECONDS", 0.3)
    store, stop, liveness = _liveness_on_own_store(store_timeout=1.0)
    link_back, calls = threading.Event(), []

    class Partitioned:  # every call hangs until the link is back
        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                link_back.wait(30)
                return getattr(store, name)(*args)
            return call

    liveness.store = Partitioned()
    liveness._connect = lambda seconds=10.0: liveness.store  # reconnecting hangs as well
    try:
        began = time.monotonic()
        with pytest.raises(ConnectionError, match="no answer within 0.3 s"):
            liveness.survey()
        assert time.monotonic() - began < 5
        deadline = time.monotonic() + 20
        while stop.received is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lifecycle._signal_name(stop.received) == "rendezvous-unreachable"
        assert len(calls) == 1  # one call hangs; the rest gave up before they started
        liveness.mark_exiting("bye")  # bounded too
    finally:
        link_back.set()
        liveness.close()


@pytest.mark.timeout(300)
def test_a_standalone_rendezvous_and_worker_0_can_be_lost_without_stopping_training(
        tmp_path):
    """Three workers (one launch each, --diloco-min-workers 2) meet at a rendezvous served by
    its own process (--rendezvous-external). Killed mid-run and restarted on the same port, it
    does not stop training. Then every process of worker 0 (the first launched) is killed:
    workers 1 and 2 go on over a new membership epoch, with the same global parameters in
    their parts of the next checkpoint. Then worker 2 is killed: worker 1 alone is below
    --diloco-min-workers and no majority, so it stops with a checkpoint and the reason. A
    launch whose rendezvous is not there fails with one line naming it and how to start it."""
    import sys

    from megatron_streaming.checkpoint.offline import read_tensors

    def serve(port, name):
        return subprocess.Popen([sys.executable, "-m", "megatron_streaming.job.rendezvous",
                                 "--host", "127.0.0.1", "--port", str(port)],
                                stdout=open(tmp_path / name, "w"), stderr=subprocess.STDOUT)

    def kill(launch):  # the launcher and its rank: every process of a worker
        for p in [*psutil.Process(launch.pid).children(recursive=True), launch]:
            p.kill()

    port = free_port()
    ckpt = tmp_path / "ckpt"
    common = [*STREAMING, "--diloco-workers", "3", "--diloco-min-workers", "2",
              "--train-iters", "40", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--rendezvous-external", "--diloco-timeout", "60", "--save", str(ckpt),
              "--save-interval", "10"]
    store = serve(port, "store1.log")
    workers = []
    # Worker 0 (and so the job) one step a second while HOLD exists: from the store's restart
    # to worker 0's loss, however long the new store takes to start on a busy machine, so
    # that worker 0 is lost well before the checkpoint of step 20.
    hold = tmp_path / "hold"
    paced = {"MEGATRON_STREAMING_SLOW_WORKER": f"0:1.0:{hold}"}
    try:
        wait_for_line(tmp_path / "store1.log", "listening", store, timeout=60)
        for w in range(3):
            workers.append(start(1, [*common, "--diloco-worker-index", str(w), "--log-jsonl",
                                     str(tmp_path / f"w{w}.jsonl")],
                                 tmp_path / f"w{w}.log", paced, FAULTS))
        wait_for_line(tmp_path / "w0.log", r"iteration +5/40", workers[0])
        hold.touch()
        store.kill()
        store.wait(timeout=30)
        time.sleep(2)
        store = serve(port, "store2.log")
        # Up again before worker 0 goes: a loss while the store is down is the rejoin case.
        wait_for_line(tmp_path / "store2.log", "listening", store, timeout=60)
        wait_for_line(tmp_path / "w0.log", r"iteration +15/40", workers[0])
        kill(workers[0])
        hold.unlink()
        # Worker 1 reports for the job now; after its line for step 21, step 20's
        # checkpoint is committed.
        wait_for_line(tmp_path / "w1.log", r"iteration +21/40", workers[1], timeout=240)
        kill(workers[2])
        assert workers[1].wait(timeout=240) == 3, (tmp_path / "w1.log").read_text()[-3000:]
    finally:
        for p in [store, *workers]:
            if p.poll() is None:
                p.kill()
    log1 = (tmp_path / "w1.log").read_text()
    assert "membership epoch 1: workers [1, 2] (lost worker(s) [0]" in log1, log1[-3000:]
    # Worker 1's writers report for the job from the loss on; worker 2 never reports.
    reported = [r["iteration"] for r in read_jsonl(tmp_path / "w1.jsonl")]
    assert 15 < reported[0] and 21 in reported, reported
    assert not (tmp_path / "w2.jsonl").exists()
    kept = ckpt / "iter_0000020"
    assert sorted(p.name for p in kept.iterdir() if p.is_dir()) == ["worker1", "worker2"]
    meta = json.loads((kept / "checkpoint.json").read_text())
    keys = [k for k in meta["kinds"]["keys_by_part"]["worker1"] if k.startswith("outer.theta_g")]
    one, two = (read_tensors(str(kept / f"worker{w}"), keys) for w in (1, 2))
    assert keys and all(torch.equal(one[k], two[k]) for k in keys)
    # Below K: a checkpoint at the step worker 1 stopped after, and the reason.
    last = _tracker(ckpt)
    error = [line for line in log1.splitlines() if "pretrain_gpt.py: error:" in line]
    assert last >= 21 and len(error) == 1, log1[-3000:]
    assert (f"lost worker(s) [2] after step {last}; 1 of 3 workers alive is not a majority of "
            f"--diloco-workers 3: the other side of a partition may be the one that goes on "
            f"(membership epoch 1 was workers [1, 2]); stopping after step {last}. Last good "
            f"checkpoint: {ckpt}/iter_{last:07d} (iteration {last}); resume with --load"
            ) in error[0], error[0]
    assert sorted(p.name for p in (ckpt / f"iter_{last:07d}").iterdir() if p.is_dir()) == \
        ["worker1"]

    lonely = run(1, [*STREAMING, "--train-iters", "40", "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port()), "--rendezvous-external",
                     "--diloco-worker-index", "0", "--distributed-timeout-minutes", "0.05"],
                 check=False, timeout=120)
    errors = [line for line in lonely.stderr.splitlines() if "error:" in line]
    assert lonely.returncode == 3 and len(errors) == 1, lonely.stderr[-3000:]
    assert "unreachable within 0.05 min (--distributed-timeout-minutes): `python -m " \
           "megatron_streaming.job.rendezvous --port" in errors[0], errors[0]


def _mount_tmpfs(path, size: str) -> None:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True)


def _remount(path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True,
                   capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (tmpfs): room for one checkpoint of the test model."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mnt = tmp_path / "disk"
    try:
        _mount_tmpfs(mnt, "8m")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount tmpfs here: {e}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.timeout(420)
def test_full_or_read_only_save_fails_naming_the_path_and_keeps_the_last_checkpoint(
        tmp_path, small_disk):
    ckpt = small_disk / "ckpt"
    flags = [*STREAMING, "--train-iters", "6", "--save-interval", "2"]

    # 1. The disk fills up during the second checkpoint.
    full = run(2, [*flags, "--save", str(ckpt)], check=False, timeout=240)
    assert full.returncode != 0
    err = full.stderr
    # Checked before writing (each rank compares what its worker's ranks will write with
    # the free space), so nothing is written, and every rank learns it at the commit.
    assert (f"pretrain_gpt.py: error: --save {ckpt}: writing the checkpoint of iteration 4 "
            "failed on rank(s) [0, 1]: [Errno 28] No space left on device for the checkpoint"
            ) in err, err[-3000:]
    assert f"the latest checkpoint is still {ckpt}/iter_0000002" in err
    assert _tracker(ckpt) == 2 and sorted(os.listdir(ckpt)) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"]  # the partial one is gone

    # 2. A read-only --save is refused before training starts.
    _remount(small_disk, "ro")
    refused = run(2, [*flags, "--save", str(ckpt), "--load", str(ckpt)], check=False,
                  timeout=240)
    assert refused.returncode != 0
    assert (f"pretrain_gpt.py: error: --save {ckpt} is not writable: [Errno 30] Read-only "
            "file system") in refused.stderr, refused.stderr[-3000:]

    # 3. It turns read-only while training: the next checkpoint fails, the last one holds.
    _remount(small_disk, "rw,size=32m")
    log = tmp_path / "ro.log"
    proc = start(2, [*flags, "--train-iters", "10", "--save", str(ckpt), "--load", str(ckpt)],
                 log, {"MEGATRON_STREAMING_SLOW_WORKER": "0:0.4"}, FAULTS)
    try:
        wait_for_line(log, r"saved checkpoint .*iter_0000004", proc)
        _remount(small_disk, "ro")
        assert proc.wait(timeout=180) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert f"resumed from {ckpt} at iteration 2" in text
    assert (f"--save {ckpt}: writing the checkpoint of iteration 6 failed on rank(s) [0, 1]: "
            "[Errno 30] Read-only file system") in text, text[-3000:]
    assert f"the latest checkpoint is still {ckpt}/iter_0000004" in text
    assert _tracker(ckpt) == 4

    # 4. That checkpoint loads: training resumes from it (saving elsewhere) to the end.
    summary = tmp_path / "end.json"
    resumed = run(2, [*flags, "--train-iters", "8", "--load", str(ckpt), "--save",
                      str(tmp_path / "elsewhere"), "--summary-json", str(summary)], timeout=240)
    assert f"resumed from {ckpt} at iteration 4" in resumed.stdout + resumed.stderr
    assert json.loads(summary.read_text())["iteration"] == 8

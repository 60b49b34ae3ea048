"""Membership epochs (``megatron_streaming.job.membership``) on a real TCPStore, and epoch groups
made by their members alone (``Topology.add_cross_worker_groups``) going on after a member
dies. No training: the processes only meet and reduce."""

import datetime
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch.distributed as dist

from megatron_streaming.job.membership import Membership, Record, quorum_problem


def _store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10)), port


def test_majority_and_min_workers_rule():
    assert quorum_problem([0, 2], 3, 2) is None
    assert "not a majority" in quorum_problem([1], 3, 1)
    assert "not a majority" in quorum_problem([0, 1], 4, 1)  # a half of an even split
    assert quorum_problem([0, 1, 2], 4, 3) is None
    assert "fewer than --diloco-min-workers 4" in quorum_problem([0, 1, 2], 4, 4)


def test_first_proposal_wins_and_every_proposer_reads_it():
    store, _ = _store()
    m = Membership(store, configured=3, min_workers=2)
    epoch0 = m.latest()
    assert epoch0 == Record(0, (0, 1, 2))
    # Two survivors propose at once with different views: one record, the same for both.
    results = []
    views = ([0, 2], [2, 0, 1])
    threads = [threading.Thread(target=lambda v=v: results.append(
        Membership(store, 3, 2).propose(epoch0, v, 40, "lost worker 1"))) for v in views]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] and results[0].epoch == 1
    assert results[0].members in ((0, 2), (0, 1, 2))
    assert m.latest() == results[0]
    # A later proposal after epoch 1 writes epoch 2.
    back = m.propose(m.latest(), [0, 1, 2], 90, "worker 1 rejoined")
    assert back == Record(2, (0, 1, 2), 90, "worker 1 rejoined") == m.latest()
    assert m.bytes > 0


def test_too_few_alive_write_a_stopping_record_and_the_first_proposal_still_wins():
    store, _ = _store()
    m = Membership(store, configured=3, min_workers=1)
    # A minority that got there first: nobody goes on (the stopping record wins the epoch).
    lone = m.propose(m.latest(), [2], 10, "lost worker(s) [0, 1] after step 10")
    assert lone.stopping and lone.members == (2,) and lone.epoch == 1
    assert "1 of 3 workers alive is not a majority" in lone.reason
    assert m.latest() == lone == Record.decode(1, lone.encode())
    assert m.propose(m.record(0), [0, 1], 10, "lost worker(s) [2]") == lone
    # A majority below --diloco-min-workers stops too; a valid record is not a stopping one.
    store, _ = _store()
    few = Membership(store, 3, 3).propose(Record(0, (0, 1, 2)), [0, 1], 10, "lost [2]")
    assert few.stopping and "fewer than --diloco-min-workers 3" in few.reason
    assert not Membership(store, 3, 2).propose(few, [0, 1], 11, "x").stopping


_MEMBER = textwrap.dedent("""
    import datetime, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, os.environ["REPO"])
    from megatron_streaming.job.membership import Membership
    from megatron_streaming.parallel.topology import RankLayout, Topology
    worker, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))
    t = Topology(RankLayout(3, workers=3), worker)
    timeout = datetime.timedelta(seconds=10)
    t.add_cross_worker_groups(store, 0, [0, 1, 2], timeout)
    x = torch.tensor([float(worker + 1)])
    dist.all_reduce(x, group=t.groups["cross_worker"])
    print("epoch0", x.item(), flush=True)
    if worker == 1:
        os._exit(0)  # lost: its sockets close
    try:
        dist.all_reduce(x, group=t.groups["cross_worker_control"])
        print("no error", flush=True)
    except Exception as e:
        print("failed", type(e).__name__, flush=True)
    from patches.torch_process_group import drop
    for name in ("cross_worker", "cross_worker_control"):
        drop(t.groups[name])
    m = Membership(store, 3, 2)
    record = m.propose(m.record(0), [0, 2], 5, "lost worker 1")  # the epoch it was in
    t.add_cross_worker_groups(store, record.epoch, list(record.members), timeout)
    y = torch.tensor([float(worker + 1)])
    dist.all_reduce(y, group=t.groups["cross_worker"])
    print("epoch", record.epoch, list(record.members), y.item(),
          t.group_ranks["cross_worker"], flush=True)
    t.groups.clear()  # a gloo group left to the interpreter's teardown may abort the exit
""")


def test_survivors_make_the_next_epochs_groups_without_the_lost_worker(tmp_path):
    """Three one-rank workers meet on the store alone (no world group); worker 1 dies; the
    others' next collective fails, they record epoch 1 = {0, 2} and reduce over it."""
    store, port = _store()
    script = tmp_path / "member.py"
    script.write_text(_MEMBER)
    env = dict(os.environ, REPO=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [subprocess.Popen([sys.executable, str(script), str(w), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for w, out in enumerate(outs):
        assert "epoch0 6.0" in out, out
    assert "epoch 1 [0, 2] 4.0 [0, 2]" in outs[0], outs[0]
    assert "epoch 1 [0, 2] 4.0 [0, 2]" in outs[2], outs[2]
    assert "failed" in outs[0] and "failed" in outs[2]
    assert [p.returncode for p in procs] == [0, 0, 0], outs


@pytest.mark.timeout(60)
def test_every_rank_of_a_launch_takes_its_first_ranks_rejoin_decision():
    """A first launch's later rank must not take the door claim its own first rank has just
    made for a predecessor's (it would wait out the distributed timeout); a restarted launch's
    ranks all rejoin the epoch that lacks their worker, each launch under its own number."""
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.job.door import PREFIX as DOOR
    from megatron_streaming.job.rejoin import running_job

    cfg = parse_args(["--mock-data", "--diloco-workers", "3", "--diloco-min-workers", "2",
                      "--distributed-timeout-minutes", "10"])
    store = dist.HashStore()
    # worker 0, two ranks, first launch: rank 0 decides before it claims; rank 1 comes later
    assert running_job(cfg, store, 0, 0, 2) is None
    store.set(f"{DOOR}worker0", "claimed by rank 0 of this launch")
    assert running_job(cfg, store, 0, 1, 2) is None
    # worker 1 (two ranks) lost: epoch 1 is workers [0, 2]; its restart's ranks rejoin it
    assert running_job(cfg, store, 1, 0, 2) is None  # its first launch
    store.set(f"{DOOR}worker1", "the first launch's claim")
    assert running_job(cfg, store, 1, 1, 2) is None
    Membership(store, 3, 2).propose(Record(0, (0, 1, 2)), [0, 2], 31, "worker 1 lost")
    got = [running_job(cfg, store, 1, local, 2) for local in range(2)]
    assert [(r.epoch, r.members) for r in got] == [(1, (0, 2))] * 2


def _leading_rank_of(store, members, train_iters=40, hosted_by="rank0"):
    """An ``Elastic`` reduced to what its last steps read: the job's leading rank (worker 0's
    first rank) of membership ``members`` among three workers, its store ``store``."""
    from types import SimpleNamespace

    from megatron_streaming.job.elastic import Elastic
    from megatron_streaming.parallel.distributed import StoreAddress

    e = Elastic.__new__(Elastic)
    e.enabled, e.record = True, Record(1, tuple(members), 31, "lost worker(s) [1]")
    e.ended_at = None
    e.cfg = SimpleNamespace(training=SimpleNamespace(train_iters=train_iters))
    e.topology = SimpleNamespace(store=store, layout=SimpleNamespace(workers=3),
                                 leads_job=lambda: True)
    e.rendezvous = StoreAddress(None, None, hosted_by)  # no address: through ``store``
    e.stop = SimpleNamespace(join_agreed=True)  # a worker asked in, as the flag said
    e.admitted = []
    e._admit = e.admitted.append
    return e


def test_the_leading_rank_records_the_end_and_waits_for_a_worker_asking_in(caplog):
    """After the last step the job admits nobody: its leading rank records where the job ended
    and, hosting the store, waits until the worker asking in has read it (the worker withdraws
    its request); before the last step the request is admitted as always."""
    from megatron_streaming.job.rejoin import ENDED, JOIN, ended

    store = dist.HashStore()
    e = _leading_rank_of(store, (0, 2))
    e.after_stop_flag(39)
    assert e.admitted == [39] and ended(store) is None
    store.set(f"{JOIN}1", "1")

    def newcomer():  # polls as ``Elastic._wait_for_admission`` does, then reads the end
        while ended(store) is None:
            threading.Event().wait(0.05)
        said.append(ended(store))
        store.delete_key(f"{JOIN}1")

    said = []
    thread = threading.Thread(target=newcomer)
    thread.start()
    with caplog.at_level("WARNING", logger="megatron_streaming"):
        e.after_stop_flag(40)
    thread.join(10)
    assert e.admitted == [39] and e.ended_at == 40
    assert said == [{"iteration": 40, "epoch": 1, "members": [0, 2]}]
    store.set(f"{JOIN}1", "1")
    e.end(41)  # once per run: a second call records nothing and waits for nobody
    assert ended(store)["iteration"] == 40 and store.check([f"{JOIN}1"])
    assert "worker(s) [1] asked to rejoin as the job ended after step 40: told there is " \
        "nothing to rejoin" in caplog.text
    # With the store elsewhere (a standalone rendezvous) nobody is waited for: it stays.
    store = dist.HashStore()
    store.set(f"{JOIN}1", "1")
    _leading_rank_of(store, (0, 2), hosted_by="external").after_stop_flag(40)
    assert json.loads(store.get(ENDED))["iteration"] == 40 and store.check([f"{JOIN}1"])

"""Elastic workers (``--diloco-min-workers``): a lost worker is dropped and the others go on;
restarted, it rejoins the running job; both against the single-process reference that drops
and re-adds it at the same points.

Three workers, one launch each: worker 1 on two ranks (TP=2), workers 0 and 2 on one
(workers of different sizes: one lane per fragment, and the one-rank workers stand in for
worker 1's second rank in the control groups, re-made at every membership change). The
worker lost and restarted is the two-rank one: its launch's first rank decides that it
rejoins and its second rank takes that decision from the store; it finds its first global
rank, 1, from the others' shapes. Worker 1 leaves after step 29 having finished what it
started (``pretrain_with_faults``' LEAVE), so the step where the others notice is a function
of the schedule and the reference can follow it exactly: sends after the loss fail and their
merges are skipped, the exchanges not merged when the loss is noticed are dropped, and the
mean is over workers 0 and 2 from then on (each sends what an exchange between two workers
sends, to the byte). Relaunched with the same command, worker 1 asks in; the others admit it
after a step of their choosing (the test reads it from the membership record): the exchanges
in flight merge first, it starts from theta_g with a fresh inner optimizer and the data of
the steps after that one (three workers' bytes from then on). Beside it, a launch with
another join secret is refused at the door. The saves are written in the background
(``--async-save``): the survivors' save after step 30, begun before they noticed the loss (at
that step's stop flag, the first collective to miss worker 1), is dropped without stopping
them; a save in flight when worker 1 asks back in is committed before it is admitted.

Worker 2 runs another layout (ZeRO-2, worker 1 ZeRO-1: the same Adam over another flat
partition; ZeRO-0's Adam rounds differently, and over 90 steps that alone comes near the
tolerance) and half the batch: the workers exchange by the layout-free lanes
(``streaming.canonical``), the mean weighs each by its tokens over the members of the
moment, and the state a survivor resyncs or a newcomer takes travels by lanes too.
"""

import datetime
import json
import subprocess
import sys
import time

import pytest
import torch

from harness import REPO, TINY, free_port, start, wait_for_line
from test_streaming import SPARSE, BASE, analytic_bytes, dumps, reference, relative

ELASTIC = [*BASE, "--num-layers", "2", "--diloco-workers", "3", "--diloco-min-workers", "2",
           "--diloco-inner-steps", "4", "--diloco-fragments", "2",
           "--diloco-overlap-steps", "1", "--diloco-timeout", "60", "--train-iters", "90",
           "--save-interval", "30", "--async-save"]
OWN = {1: ["--tensor-model-parallel-size", "2"],  # each worker's own flags
       2: ["--zero-stage", "2", "--global-batch-size", "2"]}
RANKS = (1, 2, 1)
LEAVES_AFTER = 29  # worker 1; the others' save after step 30 is the first to miss it
DRIVER = "tests/streaming_driver.py"


def _lose_and_rejoin(tmp_path, elastic, own, ranks, stray=True):
    """The job of the module docstring: worker 1 leaves after step LEAVES_AFTER and is
    relaunched once the others noticed (beside it, with ``stray``, a launch with another join
    secret, refused); every launch ends with status 0. Returns the workers' logs."""
    port = free_port()
    flags = [*elastic, "--master-addr", "127.0.0.1", "--master-port", str(port), "--save",
             str(tmp_path / "ckpt")]
    common = [str(tmp_path), *flags]  # the driver's: its output directory first
    # Worker 0 is paced from worker 1's loss until worker 1 is back and the stray refused:
    # 1 s a step, so that its last 50-odd steps leave a loaded machine about a minute to
    # start the stray and the restarted worker (at 0.3 s worker 0 once finished, taking the
    # store with it, before a stray slowed by other jobs on the cores reached it).
    hold = tmp_path / "paced"
    paced = {"MEGATRON_STREAMING_SLOW_WORKER": f"0:1.0:{hold}"}
    logs = {w: tmp_path / f"w{w}.log" for w in range(3)}
    procs = {}
    try:
        # Worker 0 also logs Megatron's world-size at every step (it follows the membership).
        procs[0] = start(ranks[0], [*common, "--diloco-worker-index", "0", "--log-interval",
                                    "1", "--log-world-size-to-tensorboard", "--log-jsonl",
                                    str(tmp_path / "w0.jsonl")], logs[0], paced, DRIVER)
        procs[1] = start(ranks[1], [*common, *own.get(1, []), "--diloco-worker-index", "1"],
                         logs[1], {"MEGATRON_STREAMING_LEAVE_WORKER": f"1:{LEAVES_AFTER}"},
                         DRIVER)
        procs[2] = start(ranks[2], [*common, *own.get(2, []), "--diloco-worker-index", "2"],
                         logs[2], None, DRIVER)
        assert procs[1].wait(timeout=180) == 0, logs[1].read_text()[-3000:]
        hold.touch()
        wait_for_line(logs[0], r"membership epoch 1: workers \[0, 2\]", procs[0])
        if stray:  # with it, a launch with another join secret: refused, it takes no claim
            strayed = start(1, [*flags, "--diloco-worker-index", "1"], tmp_path / "stray.log",
                            {"MEGATRON_STREAMING_AUTH_TOKEN": "not the job's"})
        logs[1] = tmp_path / "w1_again.log"
        procs[1] = start(ranks[1], [*common, *own.get(1, []), "--diloco-worker-index", "1"],
                         logs[1], None, DRIVER)
        if stray:
            assert strayed.wait(timeout=120) == 2, \
                (tmp_path / "stray.log").read_text()[-3000:]
        wait_for_line(logs[0], r"membership epoch 2: workers \[0, 1, 2\]", procs[0])
        hold.unlink()
        for w, proc in procs.items():
            assert proc.wait(timeout=300) == 0, logs[w].read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return logs


@pytest.mark.timeout(420)
@pytest.mark.parametrize("exchange", ["dense", "sparse"])
def test_a_lost_worker_is_dropped_then_rejoins_and_every_step_matches_the_reference(
        tmp_path, exchange):
    """``sparse``: the same with the sparse exchange (SGD, as test_streaming's sparse cases):
    the survivors keep their accumulators across the loss and the rejoin, the lost worker's
    is gone, the newcomer starts with an empty one (the reference does the same)."""
    elastic = [*ELASTIC, *(SPARSE if exchange == "sparse" else [])]
    ckpt = tmp_path / "ckpt"
    logs = _lose_and_rejoin(tmp_path, elastic, OWN, RANKS)
    refused = (tmp_path / "stray.log").read_text()
    assert "pretrain_gpt.py: error: a worker rejoining the running job differs from it " \
        "(it stops here): worker 0 (" in refused, refused[-3000:]
    assert "joined with another join secret than this launch's" in refused
    assert "not the job's" not in refused
    assert "asks to rejoin the running job" in logs[1].read_text()
    got = {w: dumps(tmp_path, w) for w in range(3)}
    lost, back = got[0]["epochs"]
    assert got[2]["epochs"] == [lost, back] and got[1]["epochs"] == [back], got
    (_, members, noticed), (_, everyone, admitted) = lost, back
    assert members == [0, 2] and everyone == [0, 1, 2]
    assert LEAVES_AFTER < noticed < admitted < 90
    print(f"worker 1 left after step {LEAVES_AFTER}; the others noticed after step "
          f"{noticed}; it rejoined after step {admitted}")
    # Megatron's world-size: every worker's ranks, the survivors' while worker 1 is away.
    sizes = {row["iteration"]: row["world-size"] for row in map(
        json.loads, (tmp_path / "w0.jsonl").read_text().splitlines()) if "world-size" in row}
    assert sizes[1] == sizes[90] == sum(RANKS) and set(sizes.values()) == {4, 2}, sizes
    assert all(noticed <= i <= admitted + 1 for i, v in sizes.items() if v == 2), sizes
    assert sizes[noticed + 2] == 2, sizes
    # The save after step 30 was being written when the loss was noticed: dropped, training
    # went on; the final checkpoint has every worker's part.
    assert "the checkpoint of iteration 30 was not written: a worker was lost while it was " \
        "being written in the background" in logs[0].read_text()
    assert not (ckpt / "iter_0000030").exists()
    assert sorted(p.name for p in (ckpt / "iter_0000090").iterdir() if p.is_dir()) == \
        ["worker0", "worker1", "worker2"]
    for d in (got[0], got[2]):  # a merge after the loss was skipped (its exchange failed)
        assert any(kind == "lost" for _, kind, _, _ in d["events"]), d["events"]
    ref = reference(elastic, tmp_path, ",".join(map(str, RANKS)), {
        "REFERENCE_DROP": f"1:{LEAVES_AFTER}:{noticed}", "REFERENCE_READD": f"1:{admitted}",
        "REFERENCE_WORKER_ARGS": json.dumps([[*elastic, *OWN.get(w, [])] for w in range(3)])})
    # The engine's and the reference's fp32 summation orders differ (clip norms, ZeRO-2's
    # buckets, the token-weighted mean), and AdamW turns a rounding-level change of a near-zero
    # gradient into a full step of that element: over 90 steps that reached 3e-7 to 5.3e-6 of
    # the whole model (worst tensor 3.8e-5) in five runs whose loss and rejoin steps differed.
    # Wrong arithmetic is about three orders above the bound: against one run's dumps, uniform
    # weights instead of tokens give 7.8e-2, the rejoin a step early 2.5e-2.
    # Sparse: the same noise decides now and then a top-k place or a 2-bit level the other
    # way, which moves that element by half its chunk's scale: measured 1.3e-4 of the whole
    # model (a few dozen elements; the median element 1e-8 off), against 6.5e-8 without the
    # loss; workers whose steps repeat the reference's match it bit for bit (the next test).
    # Wrong accumulators are 2.4e-2 and more: the rejoiner keeping its old one 4.8e-2,
    # the survivors' emptied at the loss 7.5e-2, failed sends kept by them 2.4e-2.
    bound = (3e-3, 1.0) if exchange == "sparse" else (3e-5, 3e-4)
    for w in range(3):
        for kind, expected in (("local", ref["local"][w]), ("global", ref["globals"][w])):
            worst, whole = relative(got[w][kind], expected)
            print(exchange, w, kind, f"worst {worst:.2e} whole {whole:.2e}")
            assert whole <= bound[0] and worst <= bound[1], (w, kind, worst, whole)
    for n in ref["global"]:
        assert torch.equal(got[0]["global"][n], got[1]["global"][n])
        assert torch.equal(got[0]["global"][n], got[2]["global"][n])
    # Bytes: two workers' exchanges between the loss and the rejoin, three workers' after.
    sends = {(s, f) for s, kind, f, _ in got[0]["events"] if kind == "send"}

    def per_worker(window, workers):
        if exchange == "sparse":  # one lane per fragment: its row to each of the others
            return sparse_bytes(got[0]["local"], {(s, f) for s, f in sends if s in window},
                                workers)
        return analytic_bytes(got[0]["local"], {(s, f) for s, f in sends if s in window},
                              workers, fragments=2, block=1, codec="none", layers=2,
                              lanes=True) // workers

    two, three = range(noticed + 1, admitted + 1), range(admitted + 1, 91)
    for w in (0, 2):
        sent = got[w]["sent"]  # by the step about to start
        assert sent[admitted + 1] - sent[noticed + 1] == per_worker(two, 2), (w, sent)
        assert sent["end"] - sent[admitted + 1] == per_worker(three, 3), (w, sent)
    assert got[1]["sent"]["end"] == per_worker(three, 3)


def sparse_bytes(params: dict, sends, workers: int) -> int:
    """The sparse exchange's bytes of one worker's ranks over ``sends``, one lane per fragment
    (both param groups in one vector): per send, the fragment's row (``wire_bytes`` and a
    4-byte flag) to each of the others."""
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.streaming.fragments import FragmentPlan
    from megatron_streaming.streaming.settings import codec as codec_of

    codec = codec_of(parse_args(SPARSE))
    plan, numel = FragmentPlan(2, 2, "strided"), {}
    for name, tensor in params.items():
        numel[plan.fragment_of(name)] = numel.get(plan.fragment_of(name), 0) + tensor.numel()
    return sum((workers - 1) * (codec.wire_bytes(numel[f]) + 4) for _, f in sends)


@pytest.mark.timeout(300)
def test_sparse_accumulators_across_a_loss_and_a_rejoin_match_the_reference_bit_for_bit(
        tmp_path):
    """The job above with the sparse exchange on three one-rank workers of one layout and
    batch, whose inner steps repeat the reference's to the bit (SGD): every parameter, local
    and global, of every worker equals the reference's, which keeps the survivors'
    accumulators, forgets the lost worker's, starts the rejoiner's empty and restores those
    of the sends that failed."""
    elastic = [*ELASTIC, *SPARSE]
    _lose_and_rejoin(tmp_path, elastic, {}, (1, 1, 1), stray=False)
    got = {w: dumps(tmp_path, w) for w in range(3)}
    (_, members, noticed), (_, everyone, admitted) = got[0]["epochs"]
    assert members == [0, 2] and everyone == [0, 1, 2]
    ref = reference(elastic, tmp_path, "1,1,1", {
        "REFERENCE_DROP": f"1:{LEAVES_AFTER}:{noticed}", "REFERENCE_READD": f"1:{admitted}"})
    for w in range(3):
        for kind, expected in (("local", ref["local"][w]), ("global", ref["globals"][w])):
            assert relative(got[w][kind], expected) == (0.0, 0.0), (w, kind)


# ---- a relaunched worker whose job ends before it is admitted --------------------------------
# No job trains here: the store stands in for worker 0's first rank (a rendezvous process, its
# host), the test writes what the running job would have left in it (workers 0 and 2's door
# claims, membership epoch 1 without worker 1), and only the relaunched worker 1 is launched.
ENDING = [*TINY, "--diloco-workers", "3", "--diloco-min-workers", "2",
          "--diloco-inner-steps", "4", "--diloco-fragments", "2", "--train-iters", "40",
          "--distributed-timeout-minutes", "2"]


def _running_job_without_worker_1(port: int):
    """The rendezvous store at ``port`` as a job of three one-rank workers leaves it once it
    has gone on without worker 1 (membership epoch 1: workers 0 and 2): a client of it."""
    from megatron_streaming.cli.arguments import parse_args, validate
    from megatron_streaming.data.inputs import load_run_tokenizer
    from megatron_streaming.job.door import Door, fingerprint
    from megatron_streaming.job.membership import Membership, Record
    from megatron_streaming.job.workers import WorkerShape
    from megatron_streaming.parallel.distributed import store_client
    from megatron_streaming.parallel.topology import RankLayout

    cfg = parse_args(ENDING)
    validate(cfg, 3)  # as each worker's ranks do: the values the door compares
    layout = RankLayout.of(cfg, 3)
    mine = fingerprint(cfg, layout, load_run_tokenizer(cfg))
    store = store_client("127.0.0.1", port, 30)
    for w in (0, 2):
        Door(store, w, 3, 0, datetime.timedelta(seconds=30), secret="")._claim(
            mine, shape=WorkerShape.of(cfg, layout).settings())
    Membership(store, 3, 2).propose(Record(0, (0, 1, 2)), [0, 2], 31, "lost worker(s) [1]")
    return store


@pytest.mark.timeout(240)
def test_a_relaunched_worker_whose_job_ends_before_it_is_admitted_exits_with_one_line(
        tmp_path):
    """Worker 1 relaunched into a running job asks to rejoin and waits; before it is admitted
    the job ends. Where the leading rank recorded the end (``rejoin.record_end``, as it does
    after its last step), the worker says at which iteration and that there is nothing to
    rejoin, and the leading rank waits for it to read that; where the store's host goes
    without a word (it died), the worker says the store went away. One line each, status 3,
    no traceback (the store's errors used to escape as a ``DistNetworkError`` traceback)."""
    from megatron_streaming.job.membership import Membership
    from megatron_streaming.job.rejoin import JOIN, record_end

    hosts, stores, workers, logs = {}, {}, {}, {}
    try:
        for case in ("ended", "store gone"):
            port = free_port()
            hosts[case] = subprocess.Popen(
                [sys.executable, "-m", "megatron_streaming.job.rendezvous", "--host",
                 "127.0.0.1", "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
            assert "listening" in hosts[case].stdout.readline()
            stores[case] = _running_job_without_worker_1(port)
            logs[case] = tmp_path / f"{case.replace(' ', '_')}.log"
            workers[case] = start(1, [*ENDING, "--diloco-worker-index", "1", "--master-addr",
                                      "127.0.0.1", "--master-port", str(port)], logs[case])
        for case, store in stores.items():  # both ask in, then wait to be admitted
            deadline = time.monotonic() + 180
            while not store.check([f"{JOIN}1"]):
                assert workers[case].poll() is None, logs[case].read_text()[-3000:]
                assert time.monotonic() < deadline, logs[case].read_text()[-3000:]
                time.sleep(0.5)
        # The job ends after iteration 40: its leading rank records it, and waits (bounded)
        # until the worker asking in has read it before its process takes the store away.
        epoch = Membership(stores["ended"], 3, 2).latest()
        assert record_end(stores["ended"], 40, epoch, 3, wait_s=60) == [1]
        hosts["ended"].kill()
        hosts["store gone"].kill()  # worker 0's first rank dies, the store with it
        codes = {case: p.wait(timeout=120) for case, p in workers.items()}
    finally:
        for p in [*hosts.values(), *workers.values()]:
            if p.poll() is None:
                p.kill()
    said = {}
    for case, log in logs.items():
        text = log.read_text()
        errors = [line for line in text.splitlines() if "error:" in line]
        assert codes[case] == 3 and "Traceback" not in text and len(errors) == 1, text[-3000:]
        said[case] = errors[0]
    print(*said.values(), sep="\n")
    assert said["ended"] == (
        "pretrain_gpt.py: error: worker 1 asked to rejoin, but the job ended at iteration 40 "
        "(membership epoch 1: workers [0, 2]): nothing to rejoin"), said
    assert said["store gone"].startswith(
        "pretrain_gpt.py: error: worker 1 asked to rejoin, but the rendezvous store "
        "127.0.0.1:"), said
    assert "went away before it was admitted" in said["store gone"], said

"""Launching: a bare ``srun`` (SLURM's task variables as the launcher's), the device every
backend takes, and where each worker's own store is found.

All in-process and without processes: the host-list reader, the variables of a real step's
tasks (as SLURM 22 sets them: a batch script of ``sbatch --ntasks=2``, an ``salloc --ntasks=2``
shell and a task of ``srun --ntasks=2``), the entry point on such an environment, the device
with CUDA faked, and the worker's store met by two threads on a real TCPStore. The launch
under a real SLURM is ``tests/test_slurm.py``'s; the in-worker world on the worker's store in
real runs is checked by ``tests/test_streaming.py``.
"""

import datetime
import os
import signal
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_streaming.parallel import distributed, slurm
from megatron_streaming.cli.arguments import ConfigError

pytestmark = pytest.mark.filterwarnings(
    "ignore:Transformer Engine and Apex are not installed:UserWarning")

# What SLURM sets (the variables this reads, from `env` in each place, job 7).
BATCH = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[01-02]"}
SALLOC = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2",
          "SLURM_JOB_NODELIST": "gpu[01-02]"}
TASK = {**BATCH, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "gpu02", "SLURM_STEP_TASKS_PER_NODE": "2"}


# ---- the host list ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,hosts", [
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("node7", ["node7"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[1]-ib,y", ["x1-ib", "y"]),
])
def test_host_lists_expand_in_slurms_order(text, hosts):
    assert slurm.expand_hostlist(text) == hosts
    assert slurm.first_host(text, scontrol=None) == hosts[0]


@pytest.mark.parametrize("text", ["gpu[01-", "gpu01]", "gpu[3-1]", "gpu[a-b]", "gpu[[1]]", ""])
def test_what_is_no_host_list_is_refused(text):
    with pytest.raises(ValueError):
        slurm.expand_hostlist(text)


def test_scontrol_reads_the_list_where_it_runs_else_the_parser(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho site01\necho site02\n")
    fake.chmod(0o755)
    assert slurm.first_host("gpu[01-02]", scontrol=str(fake)) == "site01"
    fake.write_text("#!/bin/sh\nexit 1\n")
    assert slurm.first_host("gpu[01-02]", scontrol=str(fake)) == "gpu01"


# ---- SLURM's variables as the launcher's -----------------------------------------------------

def test_a_task_of_srun_becomes_its_rank():
    env = dict(TASK)
    note = slurm.task_environment(env, scontrol=None)
    port = slurm.default_port("7", "0")
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                "MASTER_PORT")} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu02",
        "MASTER_PORT": str(port)}
    assert note == (f"SLURM step 7.0: 2 tasks on gpu02 as the job's ranks (SLURM_PROCID, "
                    f"SLURM_LOCALID), rendezvous at gpu02:{port} (MASTER_PORT from the job "
                    "and step ids; --master-port or MASTER_PORT to choose)")
    # The port: the same in every task of a step, below the ephemeral range, per step.
    assert 20000 <= port < 32000 and port == slurm.default_port("7", "0")
    assert len({slurm.default_port("7", str(step)) for step in range(8)}) == 8
    # Set ones stand (the flags --master-addr/--master-port override later still).
    env = {**TASK, "MASTER_ADDR": "login1", "MASTER_PORT": "29500"}
    assert slurm.task_environment(env, scontrol=None).endswith("rendezvous at login1:29500")
    # The job's node list where the step's is missing.
    env = {k: v for k, v in TASK.items() if k != "SLURM_STEP_NODELIST"}
    slurm.task_environment(env, scontrol=None)
    assert env["MASTER_ADDR"] == "gpu01"


@pytest.mark.parametrize("env", [
    {},                                                        # not under SLURM
    SALLOC,                                                    # an allocation's shell
    {**TASK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4"},  # srun -n1 in a job of 4
    {**TASK, "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"},  # a launcher under srun
    {**TASK, "LOCAL_RANK": "0"},                               # (any of its variables)
    {**TASK, "OMPI_COMM_WORLD_RANK": "5"},                     # mpirun's rank in a step
    {**BATCH, "SLURM_NTASKS": "1"},                            # a batch script of one task
], ids=["none", "salloc", "one-task-step", "launcher", "local-rank", "mpirun", "batch-of-1"])
def test_nothing_changes_where_no_task_of_a_step_runs(env):
    before = dict(env)
    assert slurm.task_environment(env, scontrol=None) is None
    assert env == before


@pytest.mark.parametrize("env,says", [
    (BATCH, "this is the batch script of SLURM job 7 (SLURM_NTASKS=2, no job step), one "
            "process where the job asks for 2: "),
    ({**TASK, "SLURM_PROCID": "2"}, "cannot tell this process's rank from SLURM's variables "
                                    "(SLURM_PROCID=2 of 2 tasks): "),
    ({**TASK, "SLURM_LOCALID": ""}, "(SLURM_LOCALID='' in step '0'): "),
    ({k: v for k, v in TASK.items() if not k.endswith("NODELIST")},
     "(no SLURM_STEP_NODELIST): "),
    ({**TASK, "SLURM_STEP_NODELIST": "gpu[02"},
     "cannot read the first node of SLURM_STEP_NODELIST='gpu[02' (unbalanced brackets in "
     "host list 'gpu[02'): set MASTER_ADDR, or "),
])
def test_a_process_slurm_counts_as_one_of_several_but_no_task_is_refused(env, says):
    with pytest.raises(ConfigError) as refused:
        slurm.task_environment(dict(env), scontrol=None)
    line = str(refused.value)
    assert line.endswith(says + slurm.ADVICE) and "\n" not in line
    assert line.startswith(("this is the batch script", "cannot tell this process's rank",
                            "cannot read the first node"))
    assert line.endswith("or submit launch/slurm.sh")


@pytest.fixture
def own_environment():
    """The entry point in this process writes os.environ and installs its SIGTERM handler:
    both as they were afterwards."""
    saved, handler = dict(os.environ), signal.getsignal(signal.SIGTERM)
    for name in [*os.environ]:
        if name.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            del os.environ[name]
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)
    signal.signal(signal.SIGTERM, handler)


def _main(args, capsys):
    from test_errors import _load_entry_point

    code = _load_entry_point().main(args)
    return code, [line for line in capsys.readouterr().err.splitlines()
                  if line.startswith("pretrain_gpt.py: error:")]


def test_bare_srun_ranks_are_the_steps_tasks_not_worlds_of_one(own_environment, capsys):
    """The command that trained alone as a world of one in every task of ``srun --ntasks 2``
    now checks its flags against the step's two tasks: TP=4 does not fit them (with the
    variables read as before, it would not fit a world of one), before any process group."""
    own_environment.update({**TASK, "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                            "SLURM_STEP_NODELIST": "127.0.0.1"})
    code, errors = _main(["--mock-data", "--tensor-model-parallel-size", "4"], capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "world size 2 is not divisible by" in errors[0], errors
    assert {k: own_environment[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                            "MASTER_ADDR")} == {
        "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


def test_the_batch_script_of_several_tasks_is_refused_in_one_line(own_environment, capsys):
    own_environment.update(BATCH)
    code, errors = _main(["--mock-data"], capsys)
    assert code == 2
    assert errors == ["pretrain_gpt.py: error: this is the batch script of SLURM job 7 "
                      "(SLURM_NTASKS=2, no job step), one process where the job asks for 2: "
                      + slurm.ADVICE]


# ---- the device ------------------------------------------------------------------------------

class _Reached(Exception):
    pass


def test_every_backend_takes_the_local_ranks_device(monkeypatch):
    """gloo on a GPU node too (it used to be NCCL alone, which put every gloo rank on
    cuda:0); more local ranks than devices share them."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def init_process_group(backend, **kwargs):  # the device is set before the world is made
        raise _Reached(f"{backend} with device {chosen}")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for backend, local_rank, device in (("gloo", 3, 1), ("gloo", 0, 0), ("nccl", 5, 1)):
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        chosen.clear()
        with pytest.raises(_Reached, match=rf"^{backend} with device \[{device}\]$"):
            distributed.init_distributed(backend, 1, store=dist.HashStore())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    chosen.clear()
    assert distributed.set_device(3) is None and chosen == []


# ---- the worker's own store ------------------------------------------------------------------

@pytest.mark.parametrize("env,own,address", [
    ({distributed.WORKER_STORE_ENV: "node-b17:29555"}, "ignored", ("node-b17", 29555)),
    ({distributed.WORKER_STORE_ENV: "10.1.2.3"}, None, ("10.1.2.3", None)),
    ({distributed.WORKER_STORE_ENV: "[fd00::7]:29555"}, None, ("fd00::7", 29555)),
    ({distributed.WORKER_STORE_ENV: "fd00::7"}, None, ("fd00::7", None)),
    ({"MASTER_ADDR": "far-away"}, "b001", ("b001", None)),  # the worker's own launcher's
    ({"MASTER_ADDR": "127.0.0.1"}, None, ("127.0.0.1", None)),  # a one-node launch
])
def test_where_a_workers_first_rank_hosts_its_store(env, own, address):
    assert distributed.store_address(env, own) == address


def test_a_launch_of_one_worker_names_its_own_first_node():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "b001", "MASTER_PORT": "29400"}
    assert distributed.join_worker_launch(env, 2, 1, "a001", 6000) == "b001"
    assert env["MASTER_ADDR"] == "a001"
    # Without --master-addr the launcher's MASTER_ADDR is the job's, not the worker's.
    assert distributed.join_worker_launch({"MASTER_ADDR": "a001"}, 2, 1, None, None) is None
    assert distributed.join_worker_launch({"MASTER_ADDR": "b001"}, 2, None, "a001", 1) is None


def test_the_route_to_a_loopback_master_names_the_master():
    assert distributed.address_towards("127.0.0.1") == "127.0.0.1"
    assert distributed.address_towards("localhost") == "localhost"


@pytest.mark.timeout(60)
def test_a_workers_ranks_meet_on_its_first_ranks_store_found_through_one_key(monkeypatch):
    """Worker 1 of two, two ranks: its first rank hosts the store and publishes where, its
    second finds it there, past the address a gone predecessor left (a launch that took
    over a claim); what they set in their store is not in the job's."""
    from megatron_streaming.parallel.topology import RankLayout

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv(distributed.WORKER_STORE_ENV, raising=False)
    job = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=30))
    layout = RankLayout(4, workers=2, tp=2)
    with socket_closed() as gone:
        job.set("megatron_streaming/worker1/epoch3/store", f"127.0.0.1:{gone}")
    got = {}

    def rank(global_rank):
        got[global_rank] = distributed.worker_world_store(job, layout, global_rank, 3, 0.5)

    probed, connect = threading.Event(), socket.create_connection

    def probe(*args, **kwargs):  # only the second rank's check of an address calls it
        probed.set()
        return connect(*args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", probe)
    second = threading.Thread(target=rank, args=(3,))
    second.start()
    assert probed.wait(20)  # it found the predecessor's address, which takes no connection
    rank(2)
    second.join()
    (first_store, sent), (other_store, read) = got[2], got[3]
    published = job.get("megatron_streaming/worker1/epoch3/store").decode()
    assert published == f"127.0.0.1:{first_store.port}"
    assert sent == len("megatron_streaming/worker1/epoch3/store") + len(published)
    assert read > sent  # both addresses, and the checks for the key
    other_store.set("0//cpu//0/1", "in-worker")
    assert first_store.get("0//cpu//0/1") == b"in-worker"
    assert not job.check(["0//cpu//0/1"])
    # One worker: the job's store (its own part); one rank: a store of its own, in-process.
    one = distributed.worker_world_store(job, RankLayout(2, workers=1), 1, 0, 0.5)
    assert isinstance(one[0], dist.PrefixStore) and one[1] == 0
    alone = distributed.worker_world_store(job, RankLayout(2, workers=2), 1, 0, 0.5)
    assert isinstance(alone[0], dist.HashStore) and alone[1] == 0


class socket_closed:
    """A port that was just bound and is closed again (a gone store's)."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc):
        self.sock.close()


def test_a_first_rank_that_cannot_host_the_store_says_where_and_what_to_set(monkeypatch):
    from megatron_streaming.errors import JobFailure
    from megatron_streaming.parallel.topology import RankLayout

    job = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=30))
    monkeypatch.setenv(distributed.WORKER_STORE_ENV, f"127.0.0.1:{job.port}")  # taken
    with pytest.raises(JobFailure, match=rf"^worker 1's own store cannot start at 127.0.0.1:"
                       rf"{job.port}: .* \(set {distributed.WORKER_STORE_ENV} to an address "
                       r"of this node, with a free port or none\)$"):
        distributed.worker_world_store(job, RankLayout(4, workers=2, tp=2), 2, 0, 0.1)

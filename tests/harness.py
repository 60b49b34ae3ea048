"""Runs ``pretrain_gpt.py`` the way a user does (torchrun, CPU, gloo) and reads its output."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
STAND_INS = REPO / "tests" / "stand_ins"  # apex and Transformer Engine (stand_ins/README.md)


def with_stand_ins(*packages: str, record=None) -> dict:
    """The environment that makes the stand-in ``packages`` ("apex", "transformer_engine")
    importable; ``record``: the file their kernels note themselves in."""
    out = {"PYTHONPATH": os.pathsep.join(str(STAND_INS / p) for p in packages)}
    if record is not None:
        out["STAND_IN_RECORD"] = str(record)
    return out

# Dropout draws different masks under different layouts: off wherever runs are compared.
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# A model small enough for 2 cores, big enough that every parallel axis has work to split.
TINY = [*NO_DROPOUT, "--mock-data", "--num-layers", "4", "--hidden-size", "64",
        "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-warmup-iters", "0", "--clip-grad", "0.5", "--log-interval", "1"]


# Set in this process by in-process fixtures (megatron_world): a launched job must not inherit
# them, or a lone process would try to host its store on this process's port.
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
# Set in this process by in-process model builds (megatron-core's attention backend choice)
# and tokenizer loads: a launch sets its own, and inheriting them would make it differ at
# import from the session's zygote (tests/zygote.py), so that it imports everything anew.
IN_PROCESS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "HF_HUB_OFFLINE")
_AT_START = {k: os.environ[k] for k in IN_PROCESS if k in os.environ}


def env(extra: Optional[dict] = None) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS + IN_PROCESS}
    e.update(_AT_START)
    e.setdefault("OMP_NUM_THREADS", "1")
    # torch.compile off in launched runs: its imports (inductor, pulled in by the functions
    # megatron-core decorates at import) cost 1.5 s of a 5.5 s start-up, on every rank of
    # every launch; the runs here compile nothing they need (the codec compiles only tensors
    # of 64k elements and more: test_codec checks those kernels in-process).
    e.setdefault("TORCHDYNAMO_DISABLE", "1")
    e["PYTHONUNBUFFERED"] = "1"
    e.update(extra or {})
    return e


_PORTS_GIVEN: set = set()


def free_port() -> int:
    """A TCP port free on the loopback right now (for a rendezvous or a daemon).

    Drawn below the kernel's ephemeral range (32768 and up by default): a port the kernel
    hands out (``bind(0)``) can be taken again, before the caller listens on it, by any
    outgoing or gloo socket of a worker started meanwhile; one below the range is only ever
    taken by an explicit bind. Never the same port twice in one test process."""
    import random
    import socket

    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free TCP port in 20000-32000 on the loopback")


# Launches start from tests/zygote.py, a process of the test session that imported torch,
# DeepSpeed and megatron-core once: each launch's processes are forked from it (a third of the
# suite's time went to every process importing them). A launch whose environment changes what
# an import reads (stand-in packages on PYTHONPATH) starts from tests/preloaded_launcher.py,
# which imports them once per launch, or as plain ``python`` for one process. Tests of the
# launchers' own behaviour (torchrun's rank sessions, a killed agent) set PRELOADED to False;
# tests that find a launch's ranks among its child processes set FORKED to False (the ranks of
# a launch forked from the zygote are not the client's children).
PRELOADED = True
FORKED = True
_ZYGOTE: dict = {}  # the session's server: its process and socket, started at first use


def _zygote_socket(environment: dict) -> Optional[str]:
    """The session's zygote socket, if a launch with ``environment`` can start from it."""
    import atexit
    import tempfile

    import zygote

    if not (PRELOADED and FORKED) or os.environ.get("MEGATRON_STREAMING_TEST_ZYGOTE") == "0":
        return None
    if _ZYGOTE.get("owner") != os.getpid():  # a process forked from this one starts its own
        base = env()
        path = os.path.join(tempfile.mkdtemp(prefix="zygote"), "socket")
        log = open(os.path.join(os.path.dirname(path), "server.log"), "w")
        server = subprocess.Popen([sys.executable, "tests/zygote.py", "serve", path], cwd=REPO,
                                  env=base, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT)
        atexit.register(server.kill)
        _ZYGOTE.update(owner=os.getpid(), server=server, path=path, env=base)
    if zygote.differs_at_import(_ZYGOTE["env"], environment):
        return None
    return _ZYGOTE["path"]


def command(nproc: int, args, script: str = "pretrain_gpt.py",
            environment: Optional[dict] = None, forked: bool = True) -> list:
    """The command line of a launch of ``script`` on ``nproc`` ranks in ``environment`` (the
    tests' ``env()`` unless given); ``forked``: from the session's zygote where it can.
    ``script`` "-m": ``args`` start with a module's name, run as ``python -m`` runs it."""
    path = _zygote_socket(env() if environment is None else environment) if forked else None
    if path is not None:
        return [sys.executable, "tests/zygote.py", path, str(nproc), script, *args]
    if nproc == 1:
        return [sys.executable, script, *args]
    if PRELOADED:
        return [sys.executable, "tests/preloaded_launcher.py", str(nproc), script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", script, *args]


def run(nproc: int, args, timeout: float = 240, check: bool = True,
        extra_env: Optional[dict] = None, script: str = "pretrain_gpt.py"):
    """Launch ``nproc`` ranks of ``script`` (pretrain_gpt.py unless told otherwise); returns
    the CompletedProcess.

    ``extra_env`` is added to the environment, e.g. ``WORLD_SIZE`` to make a single process
    validate its flags against a larger world."""
    environment = env(extra_env)
    cmd = command(nproc, args, script, environment)
    proc = subprocess.run(cmd, cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


# pretrain_gpt.py with the faults its environment variables ask for (a slow or stalled worker).
FAULTS = "tests/pretrain_with_faults.py"


def start(nproc: int, args, log_path, extra_env: Optional[dict] = None,
          script: str = "pretrain_gpt.py", wrap=None) -> subprocess.Popen:
    """Launch in the background, stdout and stderr into ``log_path``; ``wrap`` may prefix
    the command (e.g. to run it in a network namespace)."""
    log = open(log_path, "w")
    environment = env(extra_env)
    # Wrapped (in another network namespace, say): not forked from the session's zygote.
    cmd = command(nproc, args, script, environment, forked=wrap is None)
    return subprocess.Popen(wrap(cmd) if wrap else cmd, cwd=REPO, env=environment,
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_for_line(path, pattern: str, proc: subprocess.Popen, timeout: float = 120) -> str:
    """Poll ``path`` until a line matches the regex ``pattern``; fails if ``proc`` ends."""
    import re
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            for line in f:
                if re.search(pattern, line):
                    return line
        if proc.poll() is not None:
            raise AssertionError(f"ended ({proc.returncode}) before /{pattern}/:\n"
                                 f"{open(path).read()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no /{pattern}/ within {timeout} s:\n{open(path).read()[-4000:]}")


def read_jsonl(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(nproc: int, args, tmp_path, name: str = "run", **run_kwargs) -> list:
    """Per-iteration training losses of a run (logged every iteration); ``run_kwargs`` go to
    ``run`` (``script``, ``extra_env``)."""
    log = tmp_path / f"{name}.jsonl"
    run(nproc, [*args, "--log-jsonl", str(log)], **run_kwargs)
    return [r["train/loss"] for r in read_jsonl(log) if "train/loss" in r]


def train_losses_together(runs, tmp_path, timeout: float = 300) -> dict:
    """``train_losses`` of several independent runs at once, ``{name: (nproc, args)}`` or
    ``(nproc, args, extra_env[, script])``: a one-rank run beside a two-rank one fills the
    cores that start-up leaves idle."""
    return Together(runs, tmp_path).losses(timeout)


class Together:
    """``train_losses_together`` in two halves: the runs start now, ``losses`` waits for
    them (each run's log and losses under ``tmp_path``, named by its key)."""

    def __init__(self, runs, tmp_path):
        self.names, self.tmp_path, self.procs = list(runs), tmp_path, {}
        try:
            for name, (nproc, args, *rest) in runs.items():
                self.procs[name] = start(
                    nproc, [*args, "--log-jsonl", str(tmp_path / f"{name}.jsonl")],
                    tmp_path / f"{name}.log", *rest)
        except BaseException:
            self.kill()
            raise

    def losses(self, timeout: float = 300) -> dict:
        try:
            for name, proc in self.procs.items():
                assert proc.wait(timeout=timeout) == 0, \
                    (self.tmp_path / f"{name}.log").read_text()[-4000:]
        finally:
            self.kill()
        return {name: [r["train/loss"] for r in read_jsonl(self.tmp_path / f"{name}.jsonl")
                       if "train/loss" in r] for name in self.names}

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()


class LaunchAhead:
    """The cases of a parametrized test that are independent launches, one case started
    ahead: ``take(case)`` starts that case's runs if they are not running yet, and the next
    case's, so that two launches overlap (one's start-up, single-threaded while it imports,
    fills the core the other leaves idle). ``runs_of(case)`` gives a case's runs (as for
    ``train_losses_together``); ``cases``: the selected ones, in the order they run."""

    def __init__(self, cases, runs_of, tmp_path_factory):
        self.cases, self.runs_of, self.factory = list(cases), runs_of, tmp_path_factory
        self.started: dict = {}

    @classmethod
    def for_test(cls, request, test_name: str, param: str, runs_of, tmp_path_factory):
        cases = [item.callspec.params[param] for item in request.session.items
                 if getattr(item, "originalname", None) == test_name and
                 hasattr(item, "callspec")]
        return cls(cases, runs_of, tmp_path_factory)

    def _start(self, case) -> None:
        tmp_path = self.factory.mktemp(str(case))
        self.started[case] = Together(self.runs_of(case, tmp_path), tmp_path)

    def take(self, case) -> Together:
        if case not in self.started:
            self._start(case)
        following = self.cases[self.cases.index(case) + 1:] if case in self.cases else []
        if following and following[0] not in self.started:
            self._start(following[0])
        return self.started.pop(case)

    def close(self) -> None:
        for together in self.started.values():
            together.kill()

"""The tests' launches forked from the session's zygote (``tests/zygote.py``) behave as the
launches they stand in for: a lone process's exit status and its signals, the output, a
killed launch taking its processes with it, and launches whose environment changes imports
kept out. Small scripts, no training: each launch costs a fork."""

import os
import signal
import subprocess
import time

import pytest

import harness
import zygote

SCRIPT = """
import os, signal, sys, time
what = sys.argv[1]
print("rank", os.environ.get("RANK"), "of", os.environ.get("WORLD_SIZE"), what, flush=True)
if what == "abort":
    os.abort()
if what == "term":  # SIGTERM ends it with a status of its own
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))
if what in ("sleep", "term"):
    open(os.path.join(sys.argv[2], str(os.getpid())), "w").close()
    time.sleep(600)
sys.exit(int(what))
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("zygote") / "script.py"
    path.write_text(SCRIPT)
    return str(path)


def _launch(nproc, args, script, **kwargs):
    return subprocess.run(harness.command(nproc, args, script), cwd=harness.REPO,
                          env=harness.env(kwargs.pop("extra_env", None)), capture_output=True,
                          text=True, timeout=120, **kwargs)


def _pids(directory, count, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p) for p in os.listdir(directory)]
        if len(pids) == count:
            return pids
        assert proc.poll() is None, proc.returncode
        time.sleep(0.05)
    raise AssertionError(f"{count} processes did not start")


def _gone(pid) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie not reaped yet counts as gone
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_lone_process_exits_as_itself(script):
    assert harness.command(1, ["0"], script)[1] == "tests/zygote.py"
    for what, code in (("0", 0), ("3", 3), ("abort", -signal.SIGABRT)):
        proc = _launch(1, [what], script)
        assert proc.returncode == code, proc.stderr
        assert f"rank None of None {what}" in proc.stdout  # no rank variables added
    two = _launch(2, ["0"], script)
    assert two.returncode == 0
    assert sorted(line for line in two.stdout.splitlines() if line.startswith("rank")) == \
        ["rank 0 of 2 0", "rank 1 of 2 0"]
    assert _launch(2, ["3"], script).returncode == 1  # as torchrun: a rank failed


def test_signals_reach_the_launch_and_a_killed_launch_takes_its_processes(script, tmp_path):
    (tmp_path / "lone").mkdir()
    lone = subprocess.Popen(harness.command(1, ["term", str(tmp_path / "lone")], script),
                            cwd=harness.REPO, env=harness.env(), stdout=subprocess.DEVNULL)
    _pids(tmp_path / "lone", 1, lone)
    lone.send_signal(signal.SIGTERM)
    assert lone.wait(60) == 7
    (tmp_path / "pair").mkdir()
    pair = subprocess.Popen(harness.command(2, ["sleep", str(tmp_path / "pair")], script),
                            cwd=harness.REPO, env=harness.env(), stdout=subprocess.DEVNULL)
    ranks = _pids(tmp_path / "pair", 2, pair)
    pair.kill()  # as a test's timeout does
    pair.wait(60)
    deadline = time.monotonic() + 60
    while not all(_gone(pid) for pid in ranks):
        assert time.monotonic() < deadline, "the ranks outlived their killed launch"
        time.sleep(0.1)


def test_a_launch_whose_imports_differ_starts_on_its_own():
    base = harness.env()
    assert zygote.differs_at_import(base, {**base, "MASTER_PORT": "1", "SLURM_PROCID": "3"}) \
        == []
    stand_ins = {**base, **harness.with_stand_ins("apex")}
    assert zygote.differs_at_import(base, stand_ins) == ["PYTHONPATH"]
    assert harness.command(1, ["x"], environment=stand_ins)[1] == "pretrain_gpt.py"
    assert harness.command(2, ["x"], environment=stand_ins)[1] == "tests/preloaded_launcher.py"


def test_the_sessions_environment_still_lets_launches_fork():
    """What the in-process tests before this one left in the environment (inductor's cache
    directory, for one) does not send every later launch back to importing on its own."""
    harness.command(1, ["x"])  # the server, if no launch started it yet
    assert zygote.differs_at_import(harness._ZYGOTE["env"], harness.env()) == []

"""A real one-node SLURM cluster on this machine, for tests of the batch scripts in launch/.

munged, slurmctld and slurmd from Debian's packages (``slurm-wlm``, ``munge``; installed with
apt-get on first use), each started in the foreground by this process with a private munge
socket and key and a generated ``slurm.conf`` in a temporary directory, so nothing of the
machine's own configuration is read or changed (beyond the packages) and the cluster leaves
nothing running behind::

    with one_node_cluster() as cluster:
        job = cluster.sbatch(["--nodes=1", "launch/slurm.sh", ...], cwd=REPO)
        info = cluster.wait(job, timeout=600)   # scontrol's fields: JobState, ExitCode, ...

Where the cluster cannot run here (not root, no package access, the daemons do not come up)
it raises ``Unavailable`` with the reason, which tests turn into a skip.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from harness import free_port
from pathlib import Path
from typing import Dict, Iterator, List, Optional

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}


class Unavailable(RuntimeError):
    """SLURM cannot run on this machine; the message says why."""


def _path() -> str:
    return os.environ.get("PATH", "/usr/bin:/bin") + ":" + SBIN_PATH


def _which(name: str) -> Optional[str]:
    return shutil.which(name, path=_path())


def _tail(text: str, n: int = 2000) -> str:
    return text[-n:].strip()


def ensure_installed(timeout: float = 600) -> None:
    """Install slurm-wlm and munge with apt-get when a daemon or client is missing."""
    if os.geteuid() != 0:
        raise Unavailable("needs root: it starts munged, slurmctld and slurmd")
    if all(_which(b) for b in DAEMONS + CLIENTS):
        return
    if not _which("apt-get"):
        raise Unavailable("slurm-wlm/munge are not installed and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", PATH=_path())
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    # The packages' maintainer scripts would start system-wide daemons; a policy-rc.d that
    # answers 101 keeps them from doing so (Docker images ship one; add it only if missing).
    policy = Path("/usr/sbin/policy-rc.d")
    own_policy = not policy.exists()
    if own_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:  # stale package lists: refresh once and retry
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=timeout)
            proc = subprocess.run(install, env=env, capture_output=True, text=True,
                                  timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"'{' '.join(install)}' did not finish in {timeout:.0f} s") from None
    finally:
        if own_policy:
            policy.unlink()
    if proc.returncode != 0:
        raise Unavailable(f"'{' '.join(install)}' failed ({proc.returncode}): "
                          f"{_tail(proc.stdout + proc.stderr, 800)}")
    missing = [b for b in DAEMONS + CLIENTS if not _which(b)]
    if missing:
        raise Unavailable(f"installed {PACKAGES} but {missing} are still missing")


def _node_line(node: str) -> str:
    """This machine's hardware as slurmd sees it (``slurmd -C``), named ``node``."""
    proc = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=60)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("NodeName=")), None)
    if line is None:
        raise Unavailable(f"'slurmd -C' printed no node line: {_tail(proc.stdout + proc.stderr)}")
    # Memory is not a consumable here (CR_Core), and a configured size above what slurmd
    # measures at start would drain the node: leave RealMemory at its default.
    fields = [f for f in line.split()[1:] if not f.startswith(("RealMemory=", "UpTime="))]
    return " ".join([f"NodeName={node}", "NodeAddr=127.0.0.1", f"NodeHostname={node}", *fields])


def write_conf(root: Path, node: str) -> Path:
    """A one-node cluster: everything in ``root``, no accounting, no cgroups, jobs share cores
    (CR_Core: two one-task jobs run at once on two cores), finished jobs kept an hour so
    ``scontrol show job`` still has their exit state (there is no sacct without accounting)."""
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=ci",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire is also how long a requeued job waits before it may start again.
        f"AuthInfo=socket={root / 'munge.socket'},cred_expire=10",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        # A requeued job starts at the first scheduling pass after its wait: every second
        # here, not every 30 s (the default backfill interval) or 60 s (the main loop's).
        "SchedulerParameters=bf_interval=1,sched_interval=1",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "PropagateResourceLimits=NONE",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "MinJobAge=3600",
        "JobRequeue=1",
        "KillWait=30",
        "InactiveLimit=0",
        _node_line(node),
        f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    return conf


def parse_fields(text: str) -> Dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show -o`` line (values may hold spaces)."""
    return dict(re.findall(r"(?:^| )([A-Za-z][\w:/]*)=(.*?)(?= [A-Za-z][\w:/]*=|$)",
                           text.strip()))


class Cluster:
    """The running cluster: its daemons, and the client side (submit, inspect, wait)."""

    def __init__(self, root: Path, conf: Path, node: str):
        self.root, self.conf, self.node = root, conf, node
        self.env = dict(os.environ, SLURM_CONF=str(conf), PATH=_path())
        self.daemons: List[subprocess.Popen] = []

    def command(self, *args: str, timeout: float = 60, check: bool = True,
                cwd: Optional[Path] = None, env: Optional[dict] = None):
        proc = subprocess.run(list(args), env={**self.env, **(env or {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stdout}{proc.stderr}")
        return proc

    def sbatch(self, args: List[str], cwd: Path, env: Optional[dict] = None) -> int:
        """Submit; returns the job id. ``env`` is added to the environment the job inherits."""
        out = self.command("sbatch", "--parsable", *args, cwd=cwd, env=env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> Dict[str, str]:
        return parse_fields(self.command("scontrol", "show", "job", "-o", str(job_id)).stdout)

    def wait(self, job_id: int, timeout: float, poll: float = 2.0) -> Dict[str, str]:
        """Poll until the job reaches a final state; returns its scontrol fields."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after "
                                   f"{timeout:.0f} s: {info}")
            time.sleep(poll)

    def log(self, name: str) -> str:
        path = self.root / name
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, cmd: List[str], ready, timeout: float) -> None:
        """Start a daemon in the foreground (ours to stop) and wait until ``ready()``."""
        with open(self.root / "daemons.out", "ab") as out:
            self.daemons.append(subprocess.Popen(
                cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout
        while not ready():
            if self.daemons[-1].poll() is not None or time.monotonic() > deadline:
                logs = " | ".join(f"{name}: {_tail(self.log(name), 600)}" for name in (
                    "daemons.out", "munged.log", "slurmctld.log", "slurmd.log"))
                raise Unavailable(f"{Path(cmd[0]).name} did not come up; logs: {logs}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged, then kill what the
        jobs left behind (slurmd does not take its job steps down with it)."""
        with contextlib.suppress(Exception):
            jobs = self.command("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.command("scancel", *jobs, check=False)
                deadline = time.monotonic() + 40
                while time.monotonic() < deadline and self.command(
                        "squeue", "-h", "-o", "%i", check=False).stdout.split():
                    time.sleep(1)
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for pid in self._leftovers():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _leftovers(self) -> List[int]:
        """Processes started under this cluster: they carry its SLURM_CONF."""
        tag = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if tag in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
        return pids


@contextlib.contextmanager
def one_node_cluster(start_timeout: float = 60) -> Iterator[Cluster]:
    """Install if needed, start munged, slurmctld and slurmd, wait for the node to be idle;
    on exit cancel every job, stop the daemons and delete the directory, also on failure."""
    ensure_installed()
    node = socket.gethostname().split(".")[0]
    root = Path(tempfile.mkdtemp(prefix="slurm-ci-"))
    cluster = None
    try:
        for sub in ("state", "spool"):
            (root / sub).mkdir()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        cluster = Cluster(root, write_conf(root, node), node)
        conf = str(cluster.conf)

        def query(*args):
            return cluster.command(*args, check=False).stdout

        cluster.start([_which("munged"), "--foreground", "--force",
                       f"--socket={root / 'munge.socket'}", f"--key-file={key}",
                       f"--log-file={root / 'munged.log'}", f"--pid-file={root / 'munged.pid'}",
                       f"--seed-file={root / 'munged.seed'}"],
                      lambda: (root / "munge.socket").exists(), start_timeout)
        cluster.start([_which("slurmctld"), "-D", "-i", "-f", conf],
                      lambda: "UP" in query("scontrol", "ping"), start_timeout)
        cluster.start([_which("slurmd"), "-D", "-f", conf],
                      lambda: query("sinfo", "-h", "-o", "%t").strip() == "idle", start_timeout)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)

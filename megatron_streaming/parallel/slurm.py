"""A bare ``srun python pretrain_gpt.py``: SLURM's task variables as a launcher's.

``srun`` starts one process per task and numbers them (``SLURM_PROCID`` of
``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID`` on its node) but sets none of RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT, which torchrun and the deepspeed launcher set and
``distributed`` reads. Without them every task would train alone, as a world of one, on the
same device. ``task_environment`` fills them in from the step, before anything reads them:

* only in a process that no launcher numbered (none of RANK, WORLD_SIZE, LOCAL_RANK; not
  under ``mpirun``, whose ranks inherit the variables of the step that started its daemons)
  and that is one task of a step of several (``SLURM_STEP_ID`` is set in a step's tasks only:
  not in a batch script, not in an ``salloc`` shell);
* MASTER_ADDR: the step's first node (``SLURM_STEP_NODELIST``, SLURM's compressed host list),
  unless set; MASTER_PORT, unless set: a port in [20000, 32000) drawn from the job and step
  ids, the same in every task of the step (below the kernel's ephemeral range, so no
  outgoing socket holds it); ``--master-addr``/``--master-port`` still override both.

A batch script of several tasks running ``python pretrain_gpt.py`` itself (``SLURM_PROCID``
set, no step) is refused: it is one process where the job asked for several. So are step
variables that cannot describe a task. An ``salloc`` shell runs one process, as any shell.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import zlib
from typing import List, Optional

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
ADVICE = ("run one task per rank (srun --ntasks N python pretrain_gpt.py ...), a launcher "
          "(torchrun, deepspeed), or submit launch/slurm.sh")


def expand_hostlist(text: str) -> List[str]:
    """SLURM's compressed host list, in its order: ``gpu[01-03,07],cpu5`` -> gpu01, gpu02,
    gpu03, gpu07, cpu5. Several bracket groups in one name multiply out (``r[1-2]n[1-2]``:
    r1n1, r1n2, r2n1, r2n2); a range keeps its lower bound's zero padding. Raises ValueError
    on what is not one."""
    hosts: List[str] = []
    for name in _split_outside_brackets(text.strip()):
        hosts.extend(_expand_name(name))
    if not hosts:
        raise ValueError(f"empty host list {text!r}")
    return hosts


def _split_outside_brackets(text: str) -> List[str]:
    names, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in host list {text!r}")
        if c == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    names.append(text[start:])
    return [n for n in names if n]


def _expand_name(name: str) -> List[str]:
    match = re.match(r"([^\[\]]*)\[([^\[\]]*)\](.*)$", name)
    if match is None:
        if "[" in name or "]" in name:
            raise ValueError(f"unbalanced brackets in host name {name!r}")
        return [name]
    prefix, ranges, rest = match.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) < int(lo):
            raise ValueError(f"bad range {part!r} in host name {name!r}")
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(f"{prefix}{n:0{len(lo)}d}{tail}" for tail in _expand_name(rest))
    return out


def first_host(nodelist: str, scontrol: Optional[str] = "") -> str:
    """The first host of a node list: by ``scontrol show hostnames`` where it runs (SLURM's
    own reading, as launch/slurm.sh takes it), else by ``expand_hostlist``. ``scontrol``: its
    path ("" finds it on PATH, None does without)."""
    scontrol = shutil.which("scontrol") if scontrol == "" else scontrol
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], timeout=30,
                                 capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_hostlist(nodelist)[0]


def default_port(job_id: str, step_id: str) -> int:
    """MASTER_PORT for a step: in [20000, 32000), from its job and step ids (two steps of one
    job running at once get different ports, almost always)."""
    return 20000 + zlib.crc32(f"{job_id}.{step_id}".encode()) % 12000


def task_environment(env, scontrol: Optional[str] = "") -> Optional[str]:
    """Fill RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in ``env`` from the SLURM
    step this process is a task of; returns a line saying so, or None where there is nothing
    to do (a launcher's rank, a lone process). Raises ConfigError (one line, naming the
    variables) where the process is one of several SLURM meant but no task of a step."""
    from ..errors import ConfigError

    if any(v in env for v in LAUNCHER_VARIABLES) or "OMPI_COMM_WORLD_RANK" in env:
        return None
    step = env.get("SLURM_STEP_ID")
    tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS")) if step is not None \
        else env.get("SLURM_NTASKS")
    if tasks is None or tasks == "1":
        return None  # not under SLURM, a one-task step, or an allocation's shell
    if step is None:
        if "SLURM_PROCID" not in env:
            return None  # an salloc shell: one process, as from any shell
        raise ConfigError(f"this is the batch script of SLURM job {env.get('SLURM_JOB_ID')} "
                          f"(SLURM_NTASKS={tasks}, no job step), one process where the job "
                          f"asks for {tasks}: {ADVICE}")
    problem = _step_problem(env, tasks)
    if problem:
        raise ConfigError(f"cannot tell this process's rank from SLURM's variables "
                          f"({problem}): {ADVICE}")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    try:
        master = first_host(nodes, scontrol)
    except ValueError as e:
        raise ConfigError(f"cannot read the first node of SLURM_STEP_NODELIST={nodes!r} "
                          f"({e}): set MASTER_ADDR, or {ADVICE}") from None
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], tasks
    env["LOCAL_RANK"] = env["SLURM_LOCALID"]
    env.setdefault("MASTER_ADDR", master)
    port = "MASTER_PORT" in env
    env.setdefault("MASTER_PORT", str(default_port(env["SLURM_JOB_ID"], step)))
    return (f"SLURM step {env['SLURM_JOB_ID']}.{step}: {tasks} tasks on {nodes} as the job's "
            f"ranks (SLURM_PROCID, SLURM_LOCALID), rendezvous at "
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            + ("" if port else " (MASTER_PORT from the job and step ids; --master-port or "
               "MASTER_PORT to choose)"))


def _step_problem(env, tasks: str) -> Optional[str]:
    """What makes the step's variables unusable for a task's rank, or None."""
    for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID"):
        if not env.get(name, "").isdigit():
            return f"{name}={env.get(name)!r} in step {env.get('SLURM_STEP_ID')!r}"
    if not tasks.isdigit() or int(tasks) < 1:
        return f"SLURM_STEP_NUM_TASKS={tasks!r}"
    if int(env["SLURM_PROCID"]) >= int(tasks):
        return f"SLURM_PROCID={env['SLURM_PROCID']} of {tasks} tasks"
    if not (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")):
        return "no SLURM_STEP_NODELIST"
    return None

"""The container mode of ``launch/setup.sh`` (``launch/container.py``), rehearsed on the CPU.

The plan (what goes into ``.venv`` over a container's packages) in-process; then the one
command a user runs inside NVIDIA's PyTorch container, for real, in a rehearsal of one: a
Python installation of its own whose site-packages holds torch with a container's version
(``2.13.0a0+4f3e2b1.nv26.10``), the stand-in apex and Transformer Engine
(``tests/stand_ins``), megatron-core at another version, the versions of two more packages
that differ from our pins, a pip constraint file as NVIDIA's, and no index to download from:
megatron-core, deepspeed and a few others come from a wheelhouse rebuilt from this machine's
``.venv`` (``tests/wheelhouse.py``). Set up in a copy of the repository, it trains through the
venv's ``deepspeed`` launcher, as ``launch/worker.sh`` runs it.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from harness import NO_DROPOUT, REPO, STAND_INS, env, read_jsonl

spec = importlib.util.spec_from_file_location("container", REPO / "launch" / "container.py")
container = importlib.util.module_from_spec(spec)
spec.loader.exec_module(container)

TORCH = "2.13.0a0+4f3e2b1.nv26.10"


# ---- the plan --------------------------------------------------------------------------------

def _found(version, in_venv=False):
    return container.Found(version, "/venv" if in_venv else "/usr/lib/site-packages", in_venv)


def test_the_plan_adds_what_the_container_lacks_and_keeps_the_rest():
    pins = container.read_pins(str(REPO / "requirements.txt"))
    assert pins["torch"] == ("torch", "2.13.0") and pins["jinja2"] == ("Jinja2", "3.1.6")
    found = {"torch": _found(TORCH), "megatron-core": _found("0.15.0"),
             "numpy": _found("1.26.4"), "jinja2": _found("3.1.6"),
             "hjson": _found("3.0.0", in_venv=True)}  # ours, from an earlier pin
    found.update({key: _found(pin) for key, (_, pin) in pins.items()
                  if key not in found and key not in ("deepspeed", "xxhash")})
    p = container.plan(pins, found)
    assert p.torch == TORCH
    assert p.install == [("deepspeed", "0.19.8"), ("hjson", "3.1.0"),
                         ("megatron-core", "0.16.1"), ("xxhash", "4.1.0")]
    assert p.shadow == [("megatron-core", "0.15.0", "0.16.1")]
    assert p.kept == [("numpy", "1.26.4", "2.4.6")]
    # Only the entries of a constraint file that differ from what is installed are named.
    entries = {"hjson": ("hjson", "3.0.0"), "deepspeed": ("deepspeed", "0.19.8"),
               "numpy": ("numpy", "1.26.4")}
    assert container.overridden(p.install, entries) == ["hjson 3.0.0 (3.1.0)"]


def test_a_constraint_file_is_read_as_pip_reads_it(tmp_path):
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("# the container's\ntorch==2.13.0a0+4f3e2b1.nv26.10\nHjson == 3.0.0  # x\n"
                   "apex @ file:///opt/apex\npytest>=8\n")
    two.write_text("megatron_core==0.15.0;python_version>'3'\n")
    entries = container.constraint_entries(f"{one} {two} {tmp_path / 'missing.txt'}")
    assert entries == {"torch": ("torch", TORCH), "hjson": ("Hjson", "3.0.0"),
                       "megatron-core": ("megatron_core", "0.15.0")}
    assert container.constraint_entries("") == {}


@pytest.mark.parametrize("line,names", [
    ("a-b 1.0 requires C_d, which is not installed.", ("a-b", "C_d", None, None)),
    ("anyio 4.16.0 has requirement typing_extensions>=4.16.0,<5; python_version < \"3.15\", "
     "but you have typing-extensions 4.15.0.",
     ("anyio", None, "typing_extensions", "typing-extensions")),
])
def test_pip_checks_lines_name_both_packages(line, names):
    assert container._NAMES.match(line).groups() == names


# ---- the command in a container --------------------------------------------------------------

VENV_SITE = Path(REPO / ".venv" / "lib").glob("python3*/site-packages").__next__()
# What the rehearsal's container lacks (megatron-core: it has 0.15.0): the wheelhouse's.
WHEELHOUSE = ("megatron-core", "deepspeed", "hjson", "py-cpuinfo", "msgpack", "xxhash")
# The container's versions where they are not our pins: .venv's code under another label.
RELABELLED = {"torch": TORCH, "megatron-core": "0.15.0", "packaging": "26.2",
              "typing-extensions": "4.15.0"}
SKIPPED = {container.canonical(name) for name in (*WHEELHOUSE, *RELABELLED)}


def _metadata_only(site: Path, name: str, version: str, *requires: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def _link_distribution(site: Path, name: str, version=None) -> None:
    """The distribution ``name`` of ``.venv``, linked into ``site``: its top-level files and
    folders, and its dist-info (a copy saying ``version``, where given)."""
    from wheelhouse import distribution

    dist = distribution(VENV_SITE, name)
    tops = {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}
    for top in tops:
        if top.endswith(".dist-info") and version is not None:
            info = site / f"{top.split('-')[0]}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(re.sub(r"^Version: .*$", f"Version: {version}",
                                                  dist.read_text("METADATA"), count=1,
                                                  flags=re.M))
            entry_points = dist.read_text("entry_points.txt")  # torch 2.14 registers its
            if entry_points:  # process-group backends there
                (info / "entry_points.txt").write_text(entry_points)
        elif not (site / top).exists():
            (site / top).symlink_to(VENV_SITE / top)


def python_installation(root: Path) -> Path:
    """A Python installation of its own at ``root``, this machine's binary with its standard
    library linked and an empty site-packages, which it returns."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    lib = root / "lib" / version
    lib.mkdir(parents=True)
    for entry in Path(sysconfig.get_paths()["stdlib"]).iterdir():
        if entry.name not in ("site-packages", "dist-packages"):
            (lib / entry.name).symlink_to(entry)
    # A copy, not a link: Python finds its prefix (and so its site-packages) from where its
    # binary is.
    (root / "bin").mkdir()
    shutil.copy2(os.path.realpath(sys._base_executable), root / "bin" / version)
    (root / "bin" / "python3").symlink_to(version)
    # Where this build's site module looks (Debian's Pythons: dist-packages).
    where = subprocess.run([str(root / "bin" / "python3"), "-S", "-c",
                            "import site; print(*site.getsitepackages(), sep='\\n')"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    site = Path(next(path for path in where if path.startswith(str(root))))
    site.mkdir(parents=True)
    return site


def make_container(root: Path) -> Path:
    """The rehearsal's container: a Python installation (``python_installation``) whose
    site-packages, which it returns, holds what the module's docstring says."""
    site = python_installation(root)
    for dist in container.metadata.distributions(path=[str(VENV_SITE)]):
        name = dist.metadata["Name"]
        if container.canonical(name) not in SKIPPED:
            _link_distribution(site, name)
    for name, version in RELABELLED.items():  # .venv's code, labelled as the container's
        _link_distribution(site, name, version)
    _metadata_only(site, "container-tools", "26.10", "megatron-core==0.15.0")
    (site / "stand_ins.pth").write_text(f"{STAND_INS / 'apex'}\n"
                                        f"{STAND_INS / 'transformer_engine'}\n")
    return site


def copy_repository(target: Path) -> Path:
    """The repository as a fresh clone has it: what git ignores left out."""
    ignored = [".git"]
    for name in (".gitignore", ".git/info/exclude"):
        path = REPO / name
        if path.exists():
            ignored += [line.strip().strip("/") for line in path.read_text().splitlines()
                        if line.strip() and not line.startswith("#")]
    shutil.copytree(REPO, target, symlinks=True, ignore=shutil.ignore_patterns(*ignored))
    return target


def offline_env(extra: dict) -> dict:
    """The tests' environment without this machine's pip settings (an index, find-links) or
    Python paths: pip reads only what ``extra`` sets."""
    e = {k: v for k, v in env().items() if not k.startswith("PIP_") and k not in (
        "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHON")}
    e.update({"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
              "PIP_NO_CACHE_DIR": "1", "PYTHONNOUSERSITE": "1", **extra})
    return e


PINS = container.read_pins(str(REPO / "requirements.txt"))


def _pinned(*names: str) -> str:
    """``name pin, ...`` as the set-up lists them (requirements.txt's spelling and pins)."""
    return ", ".join(" ".join(PINS[container.canonical(name)]) for name in names)


@pytest.mark.timeout(300)
def test_the_container_command_keeps_the_containers_torch_and_trains(tmp_path):
    """``bash launch/setup.sh --container --wheels DIR`` in the rehearsal's container, then
    ``.venv/bin/deepspeed pretrain_gpt.py``: the container's torch and apex run, our pins of
    megatron-core and deepspeed come from the wheelhouse, and it trains."""
    from wheelhouse import repack

    site = make_container(tmp_path / "container")
    wheels = tmp_path / "wheels"
    for name in WHEELHOUSE:
        repack(VENV_SITE, name, wheels)
    constraint = tmp_path / "constraint.txt"  # as NVIDIA's /etc/pip/constraint.txt
    constraint.write_text(f"torch=={TORCH}\nmegatron-core==0.15.0\nhjson==3.0.0\n"
                          "packaging==26.2\n")
    repo = copy_repository(tmp_path / "repo")
    path = os.pathsep.join([str(tmp_path / "container" / "bin"), "/usr/bin", "/bin"])
    e = offline_env({"PATH": path, "PIP_NO_INDEX": "1", "PIP_CONSTRAINT": str(constraint)})

    def run(*command, timeout=300):
        return subprocess.run(command, cwd=repo, env=e, capture_output=True, text=True,
                              timeout=timeout)

    done = run("bash", "launch/setup.sh", "--container", "--wheels", str(wheels))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout.splitlines()
    assert said[0] == f"container set-up: torch {TORCH} is the container's (kept; never " \
                      "installed here)"
    assert "container set-up: megatron-core 0.15.0 is the container's; 0.16.1 goes into .venv " \
           "ahead of it (the patches pin it), the container's copy stays installed" in said
    kept = ", ".join(f"{PINS[key][0]} {RELABELLED[key]} ({PINS[key][1]})"
                     for key in ("packaging", "typing-extensions"))
    assert "container set-up: kept the container's versions of 2 pinned packages " \
           f"(requirements.txt's pin in brackets): {kept}" in said
    assert f"container set-up: PIP_CONSTRAINT ({constraint}) names other versions of 2 " \
           "packages going into .venv: hjson 3.0.0 (3.1.0), megatron-core 0.15.0 (0.16.1); " \
           "the pins go in (the container's own packages are not touched)" in said
    assert "container set-up: installing 6 pinned packages into .venv: " + _pinned(
        "deepspeed", "hjson", "megatron-core", "msgpack", "py-cpuinfo", "xxhash") in said
    # What shadowing and the kept versions break, as warnings (the run goes on to train):
    # the container's tool that wants its megatron-core, ours that want a newer
    # typing-extensions (pydantic's, for one).
    warned = [line for line in said if line.startswith("container set-up: warning: pip check:")]
    assert "container set-up: warning: pip check: container-tools 26.10 has requirement " \
           "megatron-core==0.15.0, but you have megatron-core 0.16.1." in warned
    assert len(warned) > 1 and all(line.endswith("but you have typing-extensions 4.15.0.")
                                   for line in warned if "container-tools" not in line), warned

    # What the venv imports: the container's torch and stand-ins, our pins of the rest.
    venv = repo / ".venv"
    seen = run(str(venv / "bin" / "python"), "-c", """if True:
        import importlib.metadata as m, torch, apex, megatron.core, deepspeed, hjson, packaging
        for module in (torch, apex, megatron.core, deepspeed, hjson, packaging):
            print("module", module.__name__, module.__file__)
        for name in ("torch", "megatron-core", "deepspeed", "hjson", "packaging"):
            print("version", name, m.version(name))""")
    assert seen.returncode == 0, seen.stderr[-3000:]
    lines = [line.split(" ", 2) for line in seen.stdout.splitlines()]
    where = {name: path for kind, name, path in lines if kind == "module"}
    assert {name: v for kind, name, v in lines if kind == "version"} == {
        "torch": TORCH, "megatron-core": "0.16.1", "deepspeed": "0.19.8", "hjson": "3.1.0",
        "packaging": "26.2"}
    for module in ("torch", "apex", "packaging"):
        assert not where[module].startswith(str(venv)), where
    for module in ("megatron.core", "deepspeed", "hjson"):
        assert where[module].startswith(str(venv)), where
    assert not list(venv.glob("lib/python3*/site-packages/torch*"))
    assert (site / "megatron_core-0.15.0.dist-info").is_dir()  # the container's, untouched
    assert (venv / ".setup-options").read_text() == f"--container\n--wheels\n{wheels}\n"

    # Again, as quickstart.sh and test.sh call it: the container venv is recognised, the same
    # pins are not installed twice, torch never.
    again = run("bash", "launch/setup.sh")
    assert again.returncode == 0 and again.stdout == again.stderr == "", again

    # Training through the venv's launcher, as launch/worker.sh starts it; apex's norm runs.
    record, log = tmp_path / "stand_ins.record", tmp_path / "train.jsonl"
    e["STAND_IN_RECORD"] = str(record)
    trained = run(str(venv / "bin" / "deepspeed"), "--num_gpus", "1", "pretrain_gpt.py",
                  *NO_DROPOUT, "--mock-data", "--num-layers", "2", "--hidden-size", "64",
                  "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
                  "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "3",
                  "--eval-iters", "0", "--log-interval", "1", "--log-jsonl", str(log))
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-5000:]
    losses = [r["train/loss"] for r in read_jsonl(log) if "train/loss" in r]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses), losses
    out = trained.stdout + trained.stderr
    assert re.search(r"^iteration +3/3 \| loss [0-9.]+ ", out, re.M)
    assert re.search(r"^done: \{'iteration': 3, 'train_loss': [0-9.]+, ", out, re.M)
    assert "--transformer-impl auto: megatron-core's local layers (Transformer Engine imports" \
        in out
    assert sorted(line.split()[0] for line in record.read_text().splitlines()) == [
        "apex.FusedLayerNormAffineFunction", "transformer_engine._SplitAlongDim"]


def test_the_container_command_refuses_a_python_without_torch_and_an_isolated_venv(tmp_path):
    python_installation(tmp_path / "python")
    python = tmp_path / "python" / "bin" / "python3"
    repo = copy_repository(tmp_path / "repo")
    e = offline_env({"PYTHON": str(python)})

    def setup(*options):
        return subprocess.run(["bash", "launch/setup.sh", *options], cwd=repo, env=e,
                              capture_output=True, text=True, timeout=60)

    done = setup("--container")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"container set-up: {python} has no torch: --container is for a " \
                          "container's Python that has one (set PYTHON to it); without, run " \
                          "launch/setup.sh alone\n"
    assert not (repo / ".venv").exists()
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(repo / ".venv")], check=True)
    done = setup("--container", "--wheels", str(tmp_path))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "setup.sh: .venv is an isolated venv (made without --container): " \
                          "remove it (rm -rf .venv) to make a container one\n"
    assert setup("--wheel", "x").stderr == "setup.sh: unknown option --wheel (--container, " \
                                           "--wheels DIR)\n"
    # Without --container, --wheels too keeps pip off the index: torch is looked for there only.
    shutil.rmtree(repo / ".venv")
    (tmp_path / "empty").mkdir()
    done = setup("--wheels", str(tmp_path / "empty"))
    assert done.returncode == 1
    assert "No matching distribution found for torch==2.13.0" in done.stderr, done.stderr
    assert (repo / ".venv" / ".setup-options").read_text() == f"--wheels\n{tmp_path / 'empty'}\n"


# ---- launch/worker.sh in a container's step ------------------------------------------------

def _worker_sh(tmp_path, nodelist):
    """``launch/worker.sh 8 all --flag`` in a step on gpu02 whose PATH has no SLURM tools (a
    container's), against a ``deepspeed`` that prints its hostfile and its arguments."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch" / "worker.sh", repo / "launch")
    for name in ("megatron_streaming", "patches"):
        (repo / name).symlink_to(REPO / name)
    venv_bin, tools = repo / ".venv" / "bin", tmp_path / "tools"
    venv_bin.mkdir(parents=True)
    tools.mkdir()
    for tool in ("dirname", "mktemp", "rm", "cat"):
        (tools / tool).symlink_to(shutil.which(tool))
    stubs = {"python": f'#!/bin/sh\nexec {sys.executable} "$@"\n',
             "deepspeed": '#!/bin/sh\nwhile [ $# -gt 0 ]; do\n'
                          '  [ "$1" = --hostfile ] && cat "$2"\n  echo "$1"; shift\ndone\n'}
    for name, text in stubs.items():
        (venv_bin / name).write_text(text)
        (venv_bin / name).chmod(0o755)
    return subprocess.run(["/bin/bash", str(repo / "launch" / "worker.sh"), "8", "all", "--flag"],
                          env={"PATH": str(tools), "SLURM_STEP_NODELIST": nodelist,
                               "SLURMD_NODENAME": "gpu02", "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)


def test_worker_sh_reads_the_steps_nodes_without_slurms_tools(tmp_path):
    done = _worker_sh(tmp_path, "gpu[01-02]")
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert said[:3] == ["gpu01 slots=8", "gpu02 slots=8", "--hostfile"]
    assert said[4:] == ["--no_ssh", "--node_rank", "1", "--master_addr", "gpu01",
                        str(tmp_path / "repo" / "pretrain_gpt.py"), "--flag"]
    bad = _worker_sh(tmp_path / "bad", "gpu[01-")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "worker.sh: unbalanced brackets in host list 'gpu[01-'",
        "worker.sh: cannot read the step's nodes from 'gpu[01-'"]

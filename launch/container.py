"""The container mode of ``launch/setup.sh``: a venv over the Python of an NVIDIA PyTorch
container (made with ``--system-site-packages``) keeps the container's torch, apex, Transformer
Engine and NCCL build, and gets only the pinned packages of ``requirements.txt`` that the
container lacks.

    bash launch/setup.sh --container [--wheels DIR]     # runs, in order:
    python3 launch/container.py --check                 # before the venv: is torch there?
    .venv/bin/python launch/container.py [--wheels DIR]  # the install, from the venv

What it does with each pin of ``requirements.txt``:

* torch: never installed; the container's is the one (no torch: refused in one line).
* missing: installed into the venv at our pin, ``--no-deps`` (requirements.txt is the whole
  closure) and ``--no-build-isolation`` (deepspeed builds against the container's torch).
* present at our pin: nothing.
* megatron-core and deepspeed at another version: ours go into the venv, ahead of the
  container's on ``sys.path`` (the patches pin them exactly); the container's stay installed.
* any other at another version: the container's is kept (it was built and tested with its
  torch); one line lists them, and ``pip check`` reports what that breaks, as a warning.

NVIDIA's containers set ``PIP_CONSTRAINT=/etc/pip/constraint.txt`` (since 25.03), the versions
of every package the container was built with, so that no install replaces them. Nothing here
can replace them: every install goes into the venv, and only packages the container lacks (or
the two pinned exactly) are installed. A constraint entry for such a package names a version
the container does not hold, or the container's own copy, which stays where it is; pip would
refuse our pin against it (a constraint never yields to a requirement), so the install runs without constraints (PIP_CONSTRAINT, or a pip
configuration file's), and one line names the entries of PIP_CONSTRAINT our pins differ from.

Standard library only: this runs before anything else is installed.
"""

import argparse
import dataclasses
import importlib
import importlib.util
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from typing import Dict, List, Optional, Tuple

# Our patches reach into these two packages' private names, pinned exactly
# (patches/megatron_*.py, patches/deepspeed_*.py): another version never runs here.
EXACT = ("megatron-core", "deepspeed")
SAYS = "container set-up:"


def canonical(name: str) -> str:
    """PEP 503's form of a distribution name (``Jinja2`` and ``jinja2`` are one package)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str) -> Dict[str, Tuple[str, str]]:
    """``requirements.txt``'s ``name==version`` lines: canonical name -> (name, version)."""
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, version = line.partition("==")
            if not sep:
                raise SystemExit(f"{SAYS} {path}: {line!r} is not pinned as name==version")
            pins[canonical(name.strip())] = (name.strip(), version.strip())
    return pins


@dataclasses.dataclass(frozen=True)
class Found:
    """The distribution of a name that this Python imports: the first on ``sys.path``."""

    version: str
    location: str
    in_venv: bool


def installed() -> Dict[str, Found]:
    """Every distribution this Python sees, the first of each name on ``sys.path`` (the one
    that imports); ``in_venv``: in this venv (where this runs in one), not the container's."""
    importlib.invalidate_caches()
    venv = os.path.realpath(sys.prefix) + os.sep if sys.prefix != sys.base_prefix else None
    found: Dict[str, Found] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or canonical(name) in found:
            continue
        location = os.path.realpath(str(dist.locate_file("")))
        found[canonical(name)] = Found(dist.version, location,
                                       venv is not None and (location + os.sep).startswith(venv))
    return found


@dataclasses.dataclass
class Plan:
    """What the install does with each pin (names as requirements.txt spells them)."""

    torch: Optional[str] = None
    """The container's torch version (None: it has none)."""
    install: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    """(name, pin) of each package that goes into .venv."""
    shadow: List[Tuple[str, str, str]] = dataclasses.field(default_factory=list)
    """(name, the container's version, pin) of those in ``install`` that the container has
    at another version (``EXACT``'s)."""
    kept: List[Tuple[str, str, str]] = dataclasses.field(default_factory=list)
    """(name, the container's version, pin) where the container's version stays."""


def plan(pins: Dict[str, Tuple[str, str]], found: Dict[str, Found]) -> Plan:
    out = Plan(torch=found["torch"].version if "torch" in found else None)
    for key, (name, pin) in sorted(pins.items()):
        have = found.get(key)
        if key == "torch" or (have is not None and have.version == pin):
            continue
        if have is None or have.in_venv:  # missing, or ours from an earlier pin
            out.install.append((name, pin))
        elif key in EXACT:
            out.install.append((name, pin))
            out.shadow.append((name, have.version, pin))
        else:
            out.kept.append((name, have.version, pin))
    return out


def constraint_entries(value: Optional[str]) -> Dict[str, Tuple[str, str]]:
    """``name==version`` entries of the constraint files PIP_CONSTRAINT names (pip reads it
    as a whitespace-separated list); unreadable files and other lines are passed over."""
    entries = {}
    for path in (value or "").split():
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
            if match:
                entries[canonical(match.group(1))] = (match.group(1), match.group(2))
    return entries


def overridden(install: List[Tuple[str, str]], entries: Dict[str, Tuple[str, str]]) -> List[str]:
    """``name constraint (pin)`` for each package installed here whose constraint differs."""
    return [f"{name} {entries[canonical(name)][1]} ({pin})" for name, pin in install
            if canonical(name) in entries and entries[canonical(name)][1] != pin]


def report(p: Plan, constrained: List[str], constraint_files: str) -> List[str]:
    lines = [f"{SAYS} torch {p.torch} is the container's (kept; never installed here)"]
    for name, theirs, pin in p.shadow:
        lines.append(f"{SAYS} {name} {theirs} is the container's; {pin} goes into .venv ahead "
                     f"of it (the patches pin it), the container's copy stays installed")
    if p.kept:
        listed = ", ".join(f"{name} {theirs} ({pin})" for name, theirs, pin in p.kept)
        lines.append(f"{SAYS} kept the container's versions of {len(p.kept)} pinned packages "
                     f"(requirements.txt's pin in brackets): {listed}")
    if constrained:
        lines.append(f"{SAYS} PIP_CONSTRAINT ({constraint_files}) names other versions of "
                     f"{len(constrained)} packages going into .venv: {', '.join(constrained)}; "
                     f"the pins go in (the container's own packages are not touched)")
    if p.install:
        listed = ", ".join(f"{name} {pin}" for name, pin in p.install)
        lines.append(f"{SAYS} installing {len(p.install)} pinned packages into .venv: {listed}")
    else:
        lines.append(f"{SAYS} the container has every pinned package; nothing to install")
    return lines


def pip_install(install: List[Tuple[str, str]], wheels: Optional[str]) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "--no-deps", "--no-build-isolation", "--no-warn-conflicts"]
    if wheels:
        command += ["--no-index", "--find-links", wheels]
    # No constraint (the module's docstring says why): an empty file rather than no variable,
    # which would leave a constraint of a pip configuration file in force.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull, "DS_BUILD_OPS": "0"}
    done = subprocess.run(command + [f"{name}=={pin}" for name, pin in install], env=env)
    if done.returncode != 0:
        where = f"the wheels in {wheels}" if wheels else "the package index (or PIP_FIND_LINKS)"
        raise SystemExit(f"{SAYS} pip could not install the packages above from {where} "
                         f"(exit {done.returncode})")


def check_exact(pins: Dict[str, Tuple[str, str]]) -> None:
    """The exactly pinned packages import from the venv now, at our pins: a container package
    found ahead of the venv (on PYTHONPATH) would still win, and the patches would refuse it
    at every start; say so here instead."""
    found = installed()
    for key in EXACT:
        name, pin = pins[key]
        have = found.get(key)
        if have is None or have.version != pin:
            seen = f"{have.version} from {have.location}" if have else "nothing"
            raise SystemExit(f"{SAYS} {name} imports as {seen}, not .venv's {pin}: a "
                             f"PYTHONPATH entry ahead of .venv? (PYTHONPATH="
                             f"{os.environ.get('PYTHONPATH', '')!r})")


# pip check's lines: "A 1.0 requires B, which is not installed." and "A 1.0 has requirement
# B>=2,<3, but you have B 1.5."
_NAMES = re.compile(r"^(\S+) \S+ (?:requires ([A-Za-z0-9._-]+)|has requirement "
                    r"([A-Za-z0-9._-]+).*, but you have (\S+) )")


def pip_check_warnings(pins: Dict[str, Tuple[str, str]]) -> List[str]:
    """``pip check``'s conflicts that involve a pinned package (torch aside: the container's
    own) or one of the venv, as warnings; the container's other conflicts, counted. A conflict
    does not stop the set-up: the kept versions are the container's choice, and the tests are
    what tell."""
    done = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
                          capture_output=True, text=True)
    if done.returncode == 0:
        return []
    ours = {key for key, have in installed().items() if have.in_venv} | set(pins) - {"torch"}
    mine, theirs = [], 0
    for line in done.stdout.splitlines():
        match = _NAMES.match(line)
        names = {canonical(n) for n in match.groups() if n} if match else set()
        if names & ours:
            mine.append(f"{SAYS} warning: pip check: {line}")
        elif line.strip():
            theirs += 1
    if theirs:
        mine.append(f"{SAYS} ({theirs} more pip check lines among the container's own packages)")
    return mine


VENV = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".venv"))


def check_torch() -> str:
    """The container's torch version, or one line (exit 1) where this Python (the container's,
    or .venv's over it) cannot give the venv the container's torch."""
    have = installed().get("torch")
    ours = os.path.realpath(sys.prefix) == VENV
    if have is None and ours:
        raise SystemExit(f"{SAYS} .venv's Python ({os.path.realpath(sys.executable)}) has no "
                         f"torch: .venv was made over a container's Python (launch/setup.sh "
                         f"--container); run inside that container")
    if have is None:
        raise SystemExit(f"{SAYS} {sys.executable} has no torch: --container is for a container's "
                         f"Python that has one (set PYTHON to it); without, run launch/setup.sh "
                         f"alone")
    if sys.prefix != sys.base_prefix and not ours:
        # venv's --system-site-packages reaches the base installation's packages, not this
        # venv's: a venv made from here would not see this torch.
        raise SystemExit(f"{SAYS} {sys.executable} is itself a venv's Python ({sys.prefix}): set "
                         f"PYTHON to the container's own Python")
    if have.in_venv:
        raise SystemExit(f"{SAYS} torch {have.version} in .venv ({have.location}) hides the "
                         f"container's: remove .venv and run launch/setup.sh --container again")
    if importlib.util.find_spec("pip") is None:
        raise SystemExit(f"{SAYS} {sys.executable} has no pip to install the pinned packages with")
    return have.version


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="print the container's torch and Python versions, or refuse in one "
                             "line")
    parser.add_argument("--wheels", help="install from the wheels in this folder only")
    parser.add_argument("--requirements", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "requirements.txt"))
    args = parser.parse_args(argv)
    torch = check_torch()
    if args.check:
        print(f"torch {torch} python {platform.python_version()}")
        return 0
    if os.path.realpath(sys.prefix) != VENV:
        raise SystemExit(f"{SAYS} run from .venv's Python ({VENV}/bin/python), not "
                         f"{sys.executable}: it installs into that venv")
    pins = read_pins(args.requirements)
    p = plan(pins, installed())
    constraints = os.environ.get("PIP_CONSTRAINT", "")
    for line in report(p, overridden(p.install, constraint_entries(constraints)), constraints):
        print(line, flush=True)
    if p.install:
        pip_install(p.install, args.wheels)
    check_exact(pins)
    for line in pip_check_warnings(pins):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

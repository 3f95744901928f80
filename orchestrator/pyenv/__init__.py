"""`clusterctl setup`: the same Python environment on every node, without an index on the nodes.

resolve.py turns the inventory's requirements into a wheelhouse and a lock on this machine,
once (an edit that adds lines, from the file's previous lock); nodes.py probes the nodes, ships
each node only the files its cache lacks with sync's relay and has orchestrator/remote/pyenv.py
build and switch the venv on each. This module holds the pure parts they share: the nodes'
common target, the per-node plan, the pushes that carry it out, and the results.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import UsageError
from orchestrator.pyenv.resolve import Target

UNCHANGED = "unchanged"  # a node whose venv records the lock's hash: nothing is shipped or run


@dataclass(frozen=True)
class SetupResult:
    node: str
    action: str  # created | updated | unchanged | failed
    ok: bool
    detail: str  # what was done, or why it failed
    hash: str | None = None  # the hash the node's venv records afterwards
    seconds: float = 0.0
    bytes: int = 0  # wheelhouse bytes that reached this node
    wheels: tuple[str, ...] = ()  # the wheel files shipped to it (those its cache lacked)

    @property
    def error(self) -> str | None:
        return None if self.ok else self.detail

    def to_json(self) -> dict:
        return {"name": self.node, "ok": self.ok, "action": self.action, "hash": self.hash,
                "seconds": round(self.seconds, 3), "bytes": self.bytes, "wheels": list(self.wheels),
                "detail": self.detail, "error": self.error}


@dataclass(frozen=True)
class SetupReport:
    results: list[SetupResult]  # one per inventory node, rank order
    seconds: float
    hash: str | None  # the lock's hash (None when the nodes could not even be probed)
    packages: int = 0
    wheel_bytes: int = 0
    bytes_sent: int = 0  # wheelhouse bytes that left this machine
    resolved: str = ""  # "cached" or "resolved in 7.9s"
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def to_json(self) -> dict:
        return {"ok": self.ok, "seconds": round(self.seconds, 3), "hash": self.hash,
                "packages": self.packages, "wheel_bytes": self.wheel_bytes, "bytes_sent": self.bytes_sent,
                "resolved": self.resolved, "notes": self.notes, "nodes": [r.to_json() for r in self.results]}


def target_of(probes: dict[str, dict], python_version: str | None) -> Target:
    """The one Python X.Y and architecture every probed node runs (and their oldest glibc);
    a UsageError naming the nodes when they differ, or differ from setup.python_version."""
    if not probes:
        raise UsageError("no node could be probed")
    for key, what in (("xy", "Python"), ("arch", "architecture")):
        seen: dict[str, list[str]] = {}
        for name, p in probes.items():
            seen.setdefault(p[key], []).append(name)
        if len(seen) > 1:
            groups = "; ".join(f"{v}: {', '.join(n)}" for v, n in seen.items())
            raise UsageError(f"the nodes run different {what}s ({groups}); "
                             "one venv cannot serve them all: set setup.python_version (or setup.interpreter) "
                             "to one that every node has")
    first = next(iter(probes.values()))
    if python_version and first["xy"] != python_version:
        raise UsageError(f"setup.python_version is {python_version} but the nodes' interpreter "
                         f"{first.get('executable', '')} is Python {first['python']}")
    libcs = [p["glibc"] for p in probes.values() if p.get("glibc")]
    oldest = min(libcs, key=lambda v: tuple(int(x) for x in v.split(".")[:2])) if libcs else None
    return Target(first["xy"], first["arch"], oldest)


def plan(probes: dict[str, dict], lock_hash: str, files: dict[str, tuple[str, str | None, int]], *,
         force: bool = False) -> dict[str, list[str] | None]:
    """node -> None when its venv records the lock's hash (nothing is shipped or run; with
    `force`, no node), else the files it lacks: the keys of `files` (Lock.files: path here ->
    path in the node's cache, sha256, size) whose path its cache does not hold with that sha256,
    and the lock itself (sha256 None) unless its cache holds the lock whole."""
    out: dict[str, list[str] | None] = {}
    for name, p in probes.items():
        if p.get("venv") == "managed" and p.get("hash") == lock_hash and not force:
            out[name] = None
            continue
        cache, has_lock = p.get("cache") or {}, lock_hash[:16] in (p.get("wheelhouses") or ())
        out[name] = [src for src, (dest, sha, _) in files.items()
                     if (not has_lock if sha is None else cache.get(dest) != sha)]
    return out


def pushes(lacking: dict[str, list[str]]) -> list[tuple[list[str], list[str]]]:
    """The relays that give every node the files it lacks with each file leaving this machine
    once: [(nodes, files)], the files grouped by the nodes that lack them (one relay when the
    nodes lack the same files; a new node and the others' one added wheel make two)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    sets = {n: set(fs) for n, fs in lacking.items()}
    for f in dict.fromkeys(f for fs in lacking.values() for f in fs):
        groups.setdefault(tuple(n for n in lacking if f in sets[n]), []).append(f)
    return [(list(nodes), files) for nodes, files in groups.items()]


def requirements_path(inv) -> Path:
    """setup.requirements on this machine: a relative path is relative to the inventory's
    directory (the current one for the embedded inventory)."""
    p = Path(os.path.expanduser(inv.setup.requirements))
    if not p.is_absolute() and os.path.isfile(inv.source):
        p = Path(inv.source).resolve().parent / p
    return p

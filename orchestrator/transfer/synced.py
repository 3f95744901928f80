"""Where each node's workdir was last pushed from by `clusterctl sync`, kept on this machine in
~/.clusterctl/synced.json: {"user@host:port workdir": {"src", "include", "exclude", "digest",
"time"}}; digest is code_sync's digest of what that sync shipped.

`train`'s preflight reads it: when every node of the first attempt was last synced from the same
directory and that directory's code has changed since (its digest differs), code_sync compares
the nodes with it as it is now (what `sync` would ship from it, with the --include/--exclude that
sync used), so an edit made there and not synced fails the launch naming the files, wherever
`train` is run from. A directory unchanged since its sync says nothing new (the nodes may have
been updated another way since: they are compared with each other), and nodes never synced by
clusterctl, or synced from different places, are compared with each other only, as before.
"""

from __future__ import annotations

import json
import os
import time

from orchestrator.home import home
from orchestrator.inventory import Node


def _path():
    return home() / "synced.json"


def key(node: Node) -> str:
    """The node's workdir as a place: who logs in where (a `connection: local` node is this machine)."""
    where = "local" if node.connection == "local" else f"{node.ssh.user or ''}@{node.host}:{node.ssh.port or 22}"
    return f"{where} {node.workdir}"


def _read() -> dict:
    try:
        doc = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def record(nodes: list[Node], src: str, include: list[str], exclude: list[str], digest: str) -> None:
    """`nodes` now hold what `src` ships (with those include/exclude globs; code_sync's `digest`)."""
    doc = _read()
    for n in nodes:
        doc[key(n)] = {"src": os.path.abspath(src), "include": list(include), "exclude": list(exclude),
                       "digest": digest, "time": time.time()}
    p = _path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".synced.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, p)


def source_of(nodes: list[Node]) -> dict | None:
    """The record every node of `nodes` shares (the same src, include, exclude and digest), when
    its src is still a directory here; None otherwise."""
    doc = _read()
    found = [doc.get(key(n)) for n in nodes]
    if not found or any(not isinstance(f, dict) for f in found):
        return None
    first = {k: found[0].get(k) for k in ("src", "include", "exclude", "digest")}
    if any({k: f.get(k) for k in first} != first for f in found[1:]):
        return None
    return first if isinstance(first["src"], str) and os.path.isdir(first["src"]) else None

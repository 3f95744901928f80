"""Files and trees onto and off nodes (`clusterctl cp`, and `fetch RUN PATH`), over each node's
existing connection: exec channels only, never sftp, which an sshd may not offer.

Onto nodes (`upload`): sync's tar stream (archive.py, with directories, so an empty one arrives
too, and symbolic links as links) through sync's relay (chain.py): node to node when several
nodes get it, checked by sha256 on each and installed only once it is whole.
Off nodes (`pull`, `download`): remote/artifacts.py `tree` writes a tar of the path on the
connection's stdout, unpacked here as it arrives (unpack.py, the member rule with links), every
node at once. Relative node paths are relative to the node's workdir; `~/` is the node's home.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator import shell
from orchestrator.errors import UsageError
from orchestrator.inventory import Node
from orchestrator.node import artifacts, wire
from orchestrator.node.form import Exec
from orchestrator.transfer.archive import TarStream
from orchestrator.transfer.chain import push
from orchestrator.transfer.unpack import Unpacker
from orchestrator.transport import Cluster, NodeResult

TIMEOUT = 3600.0  # the default limit on one whole copy
PROBE_S = 30.0  # asking the nodes what their target path is
JOIN_S = 60.0  # how long unpacking may take past a node's last byte


@dataclass
class Copied:
    """One node's part of a copy. `dest`: where it landed (a directory here, or the node's path)."""

    name: str
    dest: str
    ok: bool = False
    exit_code: int | None = None
    error: str | None = None
    error_kind: str | None = None  # connect, lost, timeout, missing, outside, unpack, failed
    files: int = 0  # files and links written
    bytes: int = 0  # bytes of the files written (uploads: of the stream that reached the node)
    stream_bytes: int = 0  # downloads: bytes of the tar stream that came over the connection
    top: str | None = None  # downloads: the name the node sent its path as
    unreachable: bool = False

    def doc(self) -> dict:
        return {"name": self.name, "ok": self.ok, "exit_code": self.exit_code, "error": self.error,
                "error_kind": self.error_kind, "files": self.files, "bytes": self.bytes, "dest": self.dest}


def node_path(node: Node, path: str) -> str:
    """A node path as written by the user: relative to the node's workdir unless it starts with
    `/` or `~`."""
    if path.startswith(("/", "~")):
        return path
    return node.workdir if path in ("", ".") else posixpath.join(node.workdir, path)


def _failed(f: Copied, r: NodeResult, err: str, path: str) -> None:
    kind = getattr(r.kind, "value", r.kind)
    if r.exit_code == artifacts.TREE_MISSING:
        tried = err.removeprefix("no such file or directory: ")
        f.error, f.error_kind = f"{path} does not exist on {f.name}" + (f" (looked for {tried})" if err else ""), "missing"
    elif r.exit_code == artifacts.TREE_OUTSIDE:
        f.error, f.error_kind = f"{f.name}: {err}", "outside"
    else:
        f.error = r.describe() + (f": {err}" if err else "")
        f.error_kind = str(kind) if kind is not None else "failed"


def pull(cluster: Cluster, command: Callable[[Node], Exec], dests: dict[str, Path], *, path: str,
         tree: bool = True, timeout: float = TIMEOUT) -> dict[str, Copied]:
    """Run `command` (a program of remote/artifacts.py, on stdin) on each node of `dests` and
    unpack the tar it writes into dests[node]. `path` names what was asked for, in errors."""
    out = {n: Copied(n, str(d)) for n, d in dests.items()}
    unpackers, errs = {}, {n: bytearray() for n in dests}
    for name, d in dests.items():
        if name in cluster.connections:
            d.mkdir(parents=True, exist_ok=True)
            unpackers[name] = Unpacker(d, tree=tree, name=f"pull-{name}")

    def on_bytes(node: str, stream: str, data: bytes) -> None:
        if stream == "stdout" and node in unpackers:
            unpackers[node].feed(data)
        elif stream == "stderr":
            errs[node] += data
            del errs[node][:-4096]  # the end of it is what explains a failure

    try:
        res = wire.send(cluster, command, list(dests), timeout=timeout, capture=False, on_bytes=on_bytes)
    finally:
        for u in unpackers.values():
            u.close(JOIN_S)
    for name, r in res.items():
        f, u = out[name], unpackers.get(name)
        if u is not None:
            f.files, f.bytes, f.stream_bytes, f.top = u.files, u.bytes, u.stream_bytes, u.first
        f.exit_code, f.unreachable = r.exit_code, name in cluster.unreachable
        if not r.ok:
            _failed(f, r, errs[name].decode(errors="replace").strip()[-300:], path)
        elif u is not None and u.error:
            f.error, f.error_kind = f"could not unpack: {u.error}", "unpack"
        else:
            f.ok = True
    return out


def _local_target(dest: str, base: str, node: str | None) -> tuple[Path, str]:
    """(directory to unpack into, name of the copy there) for a download to DEST."""
    d = Path(dest).expanduser()
    if node is not None:  # several nodes: DEST/NODE/BASE
        return d / node, base
    if dest.endswith("/") or d.is_dir():
        return d, base
    return (d.parent, d.name)


def download(cluster: Cluster, nodes: list[Node], path: str, dest: str, *,
             timeout: float = TIMEOUT) -> list[Copied]:
    """NODE:PATH to DEST here: into DEST when it is a directory (DEST/NODE/ for several nodes),
    else as DEST."""
    base = posixpath.basename(posixpath.normpath(node_path(nodes[0], path)))
    if base in ("", "~", ".", "/"):
        raise UsageError(f"name a path below the directory, not {path or 'the workdir'!r} itself: "
                         f"a copy needs a name to land under")
    targets = {n.name: _local_target(dest, base, n.name if len(nodes) > 1 else None) for n in nodes}
    for n in nodes:
        _refuse_copy_onto_itself(n, path, targets[n.name])
    res = pull(cluster, lambda n: artifacts.tree(n, {"path": node_path(n, path), "name": targets[n.name][1]}),
               {name: d for name, (d, _) in targets.items()}, path=path, timeout=timeout)
    for name, f in res.items():
        f.dest = str(targets[name][0] / targets[name][1])
    return [res[n.name] for n in nodes]


def _refuse_copy_onto_itself(n: Node, path: str, target: tuple[Path, str]) -> None:
    if not n.is_local:
        return
    src = os.path.realpath(os.path.expanduser(node_path(n, path)))
    dst = os.path.realpath(target[0] / target[1])
    if dst == src or dst.startswith(src.rstrip("/") + "/"):
        raise UsageError(f"{n.name} is a local node and {path!r} there is {src}, the destination itself: "
                         "copying it onto itself would destroy it")


def _tree_files(src: str) -> tuple[str, list[str]]:
    """(parent directory, entries relative to it): SRC itself (followed if a link), then, for a
    directory, everything under it (links as links, directories included), sorted."""
    real = os.path.realpath(src)
    root, top = os.path.split(real)
    if not top:
        raise UsageError(f"cannot copy {src!r}: name a file or a directory below /")
    files = [top]
    if os.path.isdir(real):
        for d, dirs, names in os.walk(real):
            dirs.sort()
            files += [os.path.relpath(os.path.join(d, x), root) for x in sorted(dirs + names)]
    return root, files


def _kinds(cluster: Cluster, nodes: list[Node], path: str) -> dict[str, str]:
    """node -> dir | file | none: what the target path is on each node that answered."""
    def probe(n: Node) -> str:
        p = shell.path(node_path(n, path))
        return shell.wrap(f"if [ -d {p} ]; then echo dir; elif [ -e {p} ] || [ -L {p} ]; then echo file; "
                          "else echo none; fi")

    res = cluster.run(probe, nodes=[n.name for n in nodes], timeout=PROBE_S)
    return {name: r.stdout.strip() for name, r in res.items() if r.ok}


def _placement(cluster: Cluster, nodes: list[Node], src: str, path: str) -> tuple[bool, str]:
    """(into: SRC lands inside PATH, name of its top entry there). PATH ending in `/` is a
    directory; otherwise the nodes are asked, and must agree."""
    if path.endswith("/") or path in ("", ".", "~"):
        return True, os.path.basename(os.path.realpath(src))
    kinds = _kinds(cluster, nodes, path)
    dirs = sorted(n for n, k in kinds.items() if k == "dir")
    if dirs and len(dirs) != len(kinds):
        raise UsageError(f"{path} is a directory on {', '.join(dirs)} but not on "
                         f"{', '.join(sorted(set(kinds) - set(dirs)))}, so the copy would land in different places: "
                         f"end it with / to copy into a directory, or name a new path")
    if not dirs and os.path.isdir(src) and "file" in kinds.values():
        raise UsageError(f"cannot put the directory {src} where a file is: {path} is a file on "
                         f"{', '.join(n for n, k in kinds.items() if k == 'file')}")
    return (True, os.path.basename(os.path.realpath(src))) if dirs else (False, posixpath.basename(path))


def upload(cluster: Cluster, nodes: list[Node], src: str, path: str, *, relay: bool = True,
           timeout: float = TIMEOUT, on_bytes=None) -> tuple[list[Copied], list[str]]:
    """SRC here to PATH on every node: into PATH when it is a directory there (or ends in /),
    else as PATH. Returns one Copied per node, and notes (relay fallbacks)."""
    if not os.path.exists(src):
        raise UsageError(f"{src} does not exist here")
    root, files = _tree_files(src)
    out = {n.name: Copied(n.name, path) for n in nodes}
    for name, r in cluster.unreachable.items():
        if name in out:
            out[name].error, out[name].error_kind, out[name].unreachable = r.error, "connect", True
    reached = [n for n in nodes if n.name in cluster.connections]
    notes: list[str] = []
    if reached:
        into, top = _placement(cluster, reached, src, path)
        names = {f: top + f[len(files[0]):] for f in files}

        def dest(n: Node) -> str:
            p = node_path(n, path)
            return p if into else posixpath.dirname(p.rstrip("/")) or "/"

        results, _, notes = push(cluster, reached, root, files, chain=relay, on_bytes=on_bytes, timeout=timeout,
                                 dest=dest, stream=lambda: TarStream(root, files, dirs=True, names=names))
        for r in results:
            f = out[r.node]
            f.ok, f.bytes, f.files, f.exit_code = r.ok, r.bytes, r.files, 0 if r.ok else None
            f.dest = posixpath.join(dest(next(n for n in nodes if n.name == r.node)), top)
            if not r.ok:
                f.error, f.error_kind = r.detail, "failed"
    return [out[n.name] for n in nodes], notes

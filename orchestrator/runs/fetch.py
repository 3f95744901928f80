"""`clusterctl fetch`: a run's files copied from its nodes to the control machine.

Each node sends one uncompressed tar (orchestrator/remote/artifacts.py `pack`) over the
connection's stdout: the run's artifacts (~/.clusterctl/artifacts/RUN/, checkpoints/ and
tensorboard/) as artifacts/..., and the node-runs directory of every attempt the node took part
in (~/.clusterctl/node-runs/KEY@NODE/: log, spec.json, exit_code, ...) as node-runs/KEY@NODE/....
The bytes go through a pipe into a tar reader that extracts member by member, so neither the
archive nor a file is ever held whole in memory or on disk twice. Every node at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from orchestrator.errors import UsageError
from orchestrator.runs.checkpoints import AGENT, artifacts_cmd
from orchestrator.runs.store import Run
from orchestrator.transfer.unpack import Unpacker
from orchestrator.transport import Cluster

TIMEOUT = 3600.0  # the default limit on one node's whole fetch
JOIN_S = 60.0  # how long the extraction may take past the node's last byte


def check_path(path: str | None) -> str | None:
    """A relative path inside the run's artifacts, normalised; None for everything."""
    if path is None:
        return None
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts:
        raise UsageError(f"PATH must be relative to the run's artifacts and stay inside them "
                         f"(e.g. checkpoints or tensorboard): got {path!r}")
    return None if str(p) == "." else str(p)


def run_keys(rec: dict) -> dict[str, list[str]]:
    """Every node the run used, in first-use order, with the node-runs keys (KEY@NODE) it has:
    one per attempt the node took part in (`attempts`), else the run id's."""
    out: dict[str, list[str]] = {}
    for attempt in rec.get("attempts") or []:
        for name in attempt.get("nodes") or []:
            out.setdefault(name, []).append(f"{attempt.get('key') or rec['id']}@{name}")
    for nd in rec.get("nodes") or []:
        out.setdefault(nd["name"], [f"{rec['id']}@{nd['name']}"])
    return out


@dataclass
class NodeFetch:
    name: str
    dest: Path
    ok: bool = False
    exit_code: int | None = None
    error: str | None = None
    error_kind: str | None = None
    bytes: int = 0  # bytes of the files written here
    files: int = 0
    stream_bytes: int = 0  # bytes of the tar stream that came over the connection
    unreachable: bool = False

    def doc(self) -> dict:
        return {"name": self.name, "ok": self.ok, "exit_code": self.exit_code, "error": self.error,
                "error_kind": self.error_kind, "bytes": self.bytes, "files": self.files,
                "stream_bytes": self.stream_bytes, "dest": str(self.dest)}


def nodes_of(run: Run, only: tuple[str, ...] | list[str] = ()) -> dict[str, list[str]]:
    keys = run_keys(run.record)
    unknown = [n for n in only if n not in keys]
    if unknown:
        raise UsageError(f"run {run.id} did not use {', '.join(unknown)}; its nodes are {', '.join(keys) or 'none'}")
    return {n: k for n, k in keys.items() if not only or n in only}


def fetch(run: Run, path: str | None = None, only: tuple[str, ...] | list[str] = (), out: Path | None = None,
          timeout: float = TIMEOUT) -> list[NodeFetch]:
    """Copy the run's files from each of its nodes (or `only` those) into OUT/NODE/ (default
    runs/RUN/fetched/NODE/). One NodeFetch per node; a node that failed or could not be reached
    is reported in its NodeFetch, the others are still fetched."""
    rel = check_path(path)
    keys = nodes_of(run, only)
    root = out if out is not None else run.dir / "fetched"
    results = {n: NodeFetch(n, root / n) for n in keys}
    spec = run.spec
    with Cluster(spec.load_inventory(list(keys)), connect_timeout=spec.connect_timeout,
                 fanout=spec.fanout) as cluster:
        unpackers = {}
        for name in keys:
            if name in cluster.connections:
                results[name].dest.mkdir(parents=True, exist_ok=True)
                unpackers[name] = Unpacker(results[name].dest, name=f"fetch-{name}")

        errs = {n: bytearray() for n in keys}

        def on_bytes(node: str, stream: str, data: bytes) -> None:
            if stream == "stdout" and node in unpackers:
                unpackers[node].feed(data)
            elif stream == "stderr":
                errs[node] += data
                del errs[node][:-4096]  # the end of it is what explains a failure

        try:
            res = cluster.run(lambda n: artifacts_cmd(n, "pack", run.id, rel or "-", *keys[n.name]),
                              stdin=AGENT, nodes=list(keys), timeout=timeout, capture=False, on_bytes=on_bytes)
        finally:
            for u in unpackers.values():
                u.close(JOIN_S)
    for name, r in res.items():
        f = results[name]
        if (u := unpackers.get(name)) is not None:
            f.files, f.bytes, f.stream_bytes = u.files, u.bytes, u.stream_bytes
        kind = getattr(r.kind, "value", r.kind)
        f.exit_code, f.error_kind = r.exit_code, None if kind is None else str(kind)
        f.unreachable = name in cluster.unreachable
        if not r.ok:
            tail = errs[name].decode(errors="replace").strip()[-300:]
            f.error = r.describe() + (f": {tail}" if tail else "")
        elif u is not None and u.error:
            f.error, f.error_kind = f"could not unpack: {u.error}", "unpack"
        else:
            f.ok = True
    return [results[n] for n in keys]

"""`clusterctl fetch`: a run's files copied from its nodes to the control machine.

Without PATH each node sends one uncompressed tar (orchestrator/remote/artifacts.py `pack`) over
the connection's stdout: the run's artifacts (~/.clusterctl/artifacts/RUN/, checkpoints/ and
tensorboard/) as artifacts/..., and the node-runs directory of every attempt the node took part
in (~/.clusterctl/node-runs/KEY@NODE/: log, spec.json, exit_code, ...) as node-runs/KEY@NODE/....
With PATH it sends that one path (artifacts.py `tree`): relative, in the run's artifacts or else
in the node's workdir (artifacts/PATH, workdir/PATH); `~/...` or absolute, inside the workdir or
the home (workdir/..., home/...); anywhere else is refused on the node, links resolved there.
The bytes go through a pipe into a tar reader that extracts member by member
(transfer/copy.py `pull`), so neither the archive nor a file is ever held whole in memory or on
disk twice. Every node at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from orchestrator.errors import UsageError
from orchestrator.runs.checkpoints import artifacts_cmd
from orchestrator.runs.store import Run
from orchestrator.transfer.copy import pull, tree_cmd
from orchestrator.transport import Cluster

TIMEOUT = 3600.0  # the default limit on one node's whole fetch
JOIN_S = 60.0  # how long the extraction may take past the node's last byte


def check_path(path: str | None) -> str | None:
    """PATH normalised: relative (the run's artifacts, else the workdir), `~/...` or absolute; no
    `..` part. None for everything. Whether it lies inside the workdir or the home is the node's
    to say (artifacts.py `tree`), where links resolve."""
    if path is None:
        return None
    p = PurePosixPath(path)
    if ".." in p.parts:
        raise UsageError(f"PATH must stay inside the run's artifacts, the node's workdir or its home "
                         f"(e.g. checkpoints, out/ckpt.pt or ~/data), without `..`: got {path!r}")
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
    source: str | None = None  # with PATH: what it was found as on the node (artifacts/..., workdir/..., home/...)

    def doc(self) -> dict:
        return {"name": self.name, "ok": self.ok, "exit_code": self.exit_code, "error": self.error,
                "error_kind": self.error_kind, "bytes": self.bytes, "files": self.files,
                "stream_bytes": self.stream_bytes, "dest": str(self.dest), "source": self.source}


def nodes_of(run: Run, only: tuple[str, ...] | list[str] = ()) -> dict[str, list[str]]:
    keys = run_keys(run.record)
    unknown = [n for n in only if n not in keys]
    if unknown:
        raise UsageError(f"run {run.id} did not use {', '.join(unknown)}; its nodes are {', '.join(keys) or 'none'}")
    return {n: k for n, k in keys.items() if not only or n in only}


def fetch(run: Run, path: str | None = None, only: tuple[str, ...] | list[str] = (), out: Path | None = None,
          timeout: float = TIMEOUT) -> list[NodeFetch]:
    """Copy the run's files (or PATH) from each of its nodes (or `only` those) into OUT/NODE/
    (default runs/RUN/fetched/NODE/). One NodeFetch per node; a node that failed, lacks PATH or
    could not be reached is reported in its NodeFetch, the others are still fetched."""
    rel = check_path(path)
    keys = nodes_of(run, only)
    root = out if out is not None else run.dir / "fetched"
    spec = run.spec

    def command(n) -> str:
        if rel is None:
            return artifacts_cmd(n, "pack", run.id, "-", *keys[n.name])
        return tree_cmd(n, {"path": rel, "run": run.id, "workdir": n.workdir})

    with Cluster(spec.load_inventory(list(keys)), connect_timeout=spec.connect_timeout,
                 fanout=spec.fanout) as cluster:
        got = pull(cluster, command, {n: root / n for n in keys}, path=rel or "", tree=rel is not None,
                   timeout=timeout)
    return [NodeFetch(n, root / n, g.ok, g.exit_code, g.error, g.error_kind, g.bytes, g.files, g.stream_bytes,
                      g.unreachable, g.top if rel is not None and g.ok else None)
            for n, g in ((n, got[n]) for n in keys)]

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

from pathlib import Path, PurePosixPath

from orchestrator.errors import UsageError
from orchestrator.inventory import Inventory
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.store import Run
from orchestrator.node import artifacts
from orchestrator.node.form import Exec
from orchestrator.transfer.copy import Copied, pull
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


def run_keys(rec: RunRecord) -> dict[str, list[str]]:
    """Every node the run used, in first-use order, with the node-runs keys (KEY@NODE) it has:
    one per attempt the node took part in (`attempts`), else the run id's."""
    out: dict[str, list[str]] = {}
    for attempt in rec.attempts:
        for name in attempt.nodes:
            out.setdefault(name, []).append(f"{attempt.key or rec.id}@{name}")
    for nd in rec.nodes:
        out.setdefault(nd.name, [f"{rec.id}@{nd.name}"])
    return out


def nodes_of(run: Run, only: tuple[str, ...] | list[str] = ()) -> dict[str, list[str]]:
    keys = run_keys(run.record)
    unknown = [n for n in only if n not in keys]
    if unknown:
        raise UsageError(f"run {run.id} did not use {', '.join(unknown)}; its nodes are {', '.join(keys) or 'none'}")
    return {n: k for n, k in keys.items() if not only or n in only}


def reach(run: Run, names: list[str], inventory: Inventory | None) -> Inventory:
    """How the run's nodes `names` are reached: as its record says, or (-i) as `inventory` says (an
    address or key that changed since the run started). Every node must be in it, by name."""
    if inventory is None:
        return run.spec.load_inventory(names)
    missing = [n for n in names if n not in {nd.name for nd in inventory.nodes}]
    if missing:
        raise UsageError(f"{inventory.source} has no node named {', '.join(missing)}, which run {run.id} used: "
                         f"give the inventory the run was started with (or none: the run's recorded one is used)")
    return inventory.select(names)


def fetch(run: Run, path: str | None = None, only: tuple[str, ...] | list[str] = (), out: Path | None = None,
          timeout: float = TIMEOUT, inventory: Inventory | None = None, connect_timeout: float | None = None
          ) -> list[Copied]:
    """Copy the run's files (or PATH) from each of its nodes (or `only` those) into OUT/NODE/
    (default runs/RUN/fetched/NODE/). One Copied per node (`top`: with PATH, what it was found as on
    the node: artifacts/..., workdir/..., home/...); a node that failed, lacks PATH or could not be
    reached is reported in its Copied, the others are still fetched. `inventory` (-i): the nodes
    are reached as it says instead of as the run recorded them."""
    rel = check_path(path)
    keys = nodes_of(run, only)
    root = out if out is not None else run.dir / "fetched"
    spec = run.spec

    def command(n) -> Exec:
        if rel is None:
            return artifacts.pack(n, run.id, *keys[n.name])
        return artifacts.tree(n, {"path": rel, "run": run.id, "workdir": n.workdir})

    with Cluster(reach(run, list(keys), inventory), connect_timeout=connect_timeout or spec.connect_timeout,
                 fanout=spec.fanout) as cluster:
        got = pull(cluster, command, {n: root / n for n in keys}, path=rel or "", tree=rel is not None,
                   timeout=timeout)
    for g in got.values():
        if rel is None or not g.ok:
            g.top = None  # the whole run's files, or nothing found: no PATH to name
    return [got[n] for n in keys]

"""Setup on the nodes: one probe round trip, the lock resolved here, the wheelhouse shipped with
sync's relay (each byte crosses this machine's link once) to the nodes that lack it, and the
venv built and switched on each by orchestrator/remote/pyenv.py.

Nothing on a node changes before the lock exists: a requirement that cannot be resolved stops
the command after the (read-only) probe. A node whose venv records the lock's hash is skipped
without shipping or running anything else.
"""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator import shell
from orchestrator.inventory import Inventory, SetupSection
from orchestrator.node import pyenv as door
from orchestrator.node import wire
from orchestrator.node.form import Exec
from orchestrator.pyenv import UNCHANGED, SetupReport, SetupResult, plan, pushes, target_of
from orchestrator.pyenv.resolve import Lock, resolve
from orchestrator.pyenv.selfwheel import addition
from orchestrator.transfer import SyncResult
from orchestrator.transfer import chain as relay
from orchestrator.transfer.archive import TarStream, estimate
from orchestrator.transfer.progress import SyncEvents
from orchestrator.transport import Cluster, NodeResult

CACHE = "~/.cache/clusterctl"  # on the nodes: the wheel cache and the locks (remote/pyenv.py)
PROBE_TIMEOUT = 60.0
INSTALL_TIMEOUT = 3600.0

def probe(cluster: Cluster, nodes: list[str], setup: SetupSection) -> dict[str, dict | str]:
    """node -> its probe (see remote/pyenv.py) or why it could not be probed."""
    res = wire.send(cluster, lambda n: door.command(n, setup.base, "probe", setup.venv, CACHE), nodes,
                    timeout=PROBE_TIMEOUT)
    out: dict[str, dict | str] = {}
    for name, r in res.items():
        got = door.read(r, f"cannot run {setup.base}")
        out[name] = got.doc if got.error is None else got.error
    return out


def _stream(src: str, names: dict[str, str]):
    """The tar stream of files in the lock's directory here, each named by its place in a node's
    cache (a wheel under wheels/, the lock under wheelhouse/<hash16>/)."""
    return lambda: TarStream(src, list(names), names=names)


def _ship(cluster: Cluster, inv: Inventory, lacking: dict[str, list[str]], setup: SetupSection, lock: Lock,
          events: SyncEvents, online: bool) -> tuple[dict[str, str], dict[str, int], int, list[str]]:
    """Relay to each node the files it lacks, each file once from here; returns (failures,
    bytes per node, bytes sent, notes)."""
    files = lock.files(online)
    groups = [(nodes, srcs, estimate(str(lock.dir), srcs)[1]) for nodes, srcs in pushes(lacking)]
    base = {n: 0 for n in lacking}  # each node's bytes from the pushes before this one
    for n in lacking:
        events.planned(n, "relay", sum(size for nodes, _, size in groups if n in nodes))
    failed, got, sent, notes = {}, {}, 0, []
    for nodes, srcs, _ in groups:
        res, out, more = relay.push(cluster, [inv.node(n) for n in nodes if n not in failed], str(lock.dir), srcs,
                                    chain=True, on_bytes=lambda n, b: events.advanced(n, base[n] + b),
                                    dest=lambda n: CACHE, python=lambda n: setup.base,
                                    stream=_stream(str(lock.dir), {src: files[src][0] for src in srcs}))
        sent, notes = sent + out, notes + more
        for r in res:
            base[r.node] += r.bytes
            got[r.node] = base[r.node]
            if not r.ok:
                failed[r.node] = f"shipping the wheels failed: {r.detail}"
    for n in lacking:
        events.finished(SyncResult(n, "relay", n not in failed, failed.get(n, ""), got.get(n, 0)))
    return failed, got, sent, notes


def _changes(doc: dict, created: bool) -> str:
    """What a node's install changed, from its report: "+colorama, ~numpy, -six; imported colorama"."""
    if created:
        return f"imported {', '.join(doc.get('imported') or []) or 'nothing'}"
    moved = [f"+{n}" for n in doc.get("added") or []] + [f"~{n}" for n in doc.get("changed") or []] + \
        [f"-{n}" for n in doc.get("removed") or []]
    return (f"{', '.join(moved) or 'the same packages'}; "
            f"imported {', '.join(doc.get('imported') or []) or 'nothing (no checked module reaches a change)'}")


def _installed(name: str, r: NodeResult, probes: dict, lock: Lock, nbytes: int, wheels: list[str]) -> SetupResult:
    doc = door.read(r, "installing failed").doc
    if doc is None or doc.get("installed") != lock.hash:
        return SetupResult(name, "failed", False, door.why(r, "installing failed"), probes[name].get("hash"),
                           r.duration, nbytes, tuple(wheels))
    created = probes[name].get("venv") == "absent"
    steps = ", ".join(f"{k} {v:.1f}s" for k, v in doc.get("steps", {}).items())
    return SetupResult(name, "created" if created else "updated", True,
                       f"{len(lock.pins)} packages with {doc['installer']} in {doc['seconds']:.1f}s "
                       f"({steps}): {_changes(doc, created)}", lock.hash, r.duration, nbytes, tuple(wheels))


def _same_machine(results: dict[str, SetupResult], local: list[str]) -> None:
    """Local nodes share this machine, so the first one's venv is theirs: its result too."""
    for name in local[1:]:
        first = results[local[0]]
        results[name] = SetupResult(name, first.action, first.ok, first.detail if not first.ok else
                                    f"the venv of {local[0]} (the same machine)", first.hash)


def _install_command(s: SetupSection, lock: Lock, shipped: bool, online: bool, force: bool):
    """The node's install, with the node's env exported (an online install's index settings:
    PIP_INDEX_URL, UV_DEFAULT_INDEX, ...)."""
    flags = [f for f, on in (("--shipped", shipped), ("--online", online), ("--force", force)) if on]
    return lambda n: Exec((shell.exports(n.env) + " " + door.command(n, s.base, "install", s.venv, CACHE, lock.short,
                                                                  *flags).command).strip(), None)


def _probed(cluster: Cluster, inv: Inventory, results: dict[str, SetupResult], local: list[str]) -> dict[str, dict]:
    """The probes of the nodes that can take a venv; the others' results go into `results`."""
    s = inv.setup
    for n in inv.nodes:
        if n.name not in cluster.connections:
            err = cluster.unreachable.get(n.name)
            results[n.name] = SetupResult(n.name, "failed", False, err.error if err else "not connected")
    probes = probe(cluster, [n.name for n in inv.nodes if n.name not in results and n.name not in local[1:]], s)
    for name, p in probes.items():
        if isinstance(p, str):
            results[name] = SetupResult(name, "failed", False, p)
        elif p.get("venv") == "foreign":
            results[name] = SetupResult(name, "failed", False, f"{s.venv} is a directory that clusterctl setup "
                                        "did not build; it is never replaced: move it away or name another setup.venv")
    return {k: v for k, v in probes.items() if k not in results}


def _resolved(lock: Lock, seconds: float) -> str:
    if lock.cached:
        return "cached"
    kept = f" (added lines only: {lock.kept} of {len(lock.wheels)} wheels kept)" if lock.kept else ""
    return f"resolved in {seconds:.1f}s{kept}"


def setup_nodes(cluster: Cluster, inv: Inventory, requirements: Path, *, force: bool = False,
                refresh: bool = False, online: bool = False, events: SyncEvents | None = None) -> SetupReport:
    """Build inv.setup's venv on every connected node; one result per inventory node. online:
    the nodes download the lock's exact files from their index instead of a shipped wheelhouse."""
    events = events or SyncEvents()
    t0 = time.monotonic()
    s = inv.setup
    results: dict[str, SetupResult] = {}
    local = [n.name for n in inv.nodes if n.is_local and n.name in cluster.connections]
    good = _probed(cluster, inv, results, local)
    if not good:
        _same_machine(results, local)
        return SetupReport([results[n.name] for n in inv.nodes], time.monotonic() - t0, None)
    target = target_of(good, s.python_version)
    t1 = time.monotonic()
    lock = resolve(requirements, target, refresh=refresh, add=addition() if s.clusterctl else None)
    resolved = _resolved(lock, time.monotonic() - t1)
    lacking = plan(good, lock.hash, lock.files(online), force=force)
    for name in (k for k, v in lacking.items() if v is None):
        results[name] = SetupResult(name, UNCHANGED, True, f"{s.venv} is current", lock.hash)
    lacking = {n.name: lacking[n.name] for n in inv.nodes if lacking.get(n.name)}  # rank order
    sent, notes, got = 0, [], {}
    if lacking:
        failed, got, sent, notes = _ship(cluster, inv, lacking, s, lock, events, online)
        for name, why in failed.items():
            results[name] = SetupResult(name, "failed", False, why, bytes=got.get(name, 0))
    todo = [name for name in good if name not in results]
    if todo:
        cmds = {shipped: _install_command(s, lock, shipped, online, force) for shipped in (True, False)}
        res = wire.send(cluster, lambda n: cmds[n.name in got](n), todo, timeout=INSTALL_TIMEOUT,
                        on_line=events.node_line)  # each node's steps, shown as they start
        for name, r in res.items():
            wheels = [f for f in lacking.get(name, []) if f.endswith(".whl")]
            results[name] = _installed(name, r, good, lock, got.get(name, 0), wheels)
    _same_machine(results, local)
    return SetupReport([results[n.name] for n in inv.nodes], time.monotonic() - t0, lock.hash,
                       len(lock.pins), lock.bytes, sent, resolved, notes)

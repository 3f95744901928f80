"""Setup on the nodes: one probe round trip, the lock resolved here, the wheelhouse shipped with
sync's relay (each byte crosses this machine's link once) to the nodes that lack it, and the
venv built and switched on each by orchestrator/remote/pyenv.py.

Nothing on a node changes before the lock exists: a requirement that cannot be resolved stops
the command after the (read-only) probe. A node whose venv records the lock's hash is skipped
without shipping or running anything else.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from orchestrator import shell
from orchestrator.inventory import Inventory, Node, SetupSection
from orchestrator.probe import program
from orchestrator.pyenv import SHIP, UNCHANGED, SetupReport, SetupResult, plan, target_of
from orchestrator.pyenv.resolve import Lock, resolve
from orchestrator.pyenv.selfwheel import addition
from orchestrator.transfer import chain as relay
from orchestrator.transfer.archive import estimate
from orchestrator.transfer.progress import SyncEvents
from orchestrator.transport import Cluster, NodeResult

WHEELHOUSES = "~/.cache/clusterctl/wheelhouse"  # on the nodes: one directory per lock, <hash16>
PROBE_TIMEOUT = 60.0
INSTALL_TIMEOUT = 3600.0

PYENV = program("pyenv").decode()


def _script(setup: SetupSection, *args: str) -> str:
    """The node-side script run by the interpreter that creates the venv; paths keep `~/`."""
    return f"{shell.path(setup.base)} -c {shell.quote(PYENV)} " + " ".join(shell.path(a) for a in args)


def last_json(text: str) -> dict | None:
    """The last JSON object a node-side script printed on a line of its own (None: none, or unreadable)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _why(r: NodeResult, what: str) -> str:
    """A failed node command as one line: the script's `error:` line, else its last words."""
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    errs = [ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")]
    if errs:
        return errs[-1]
    if r.exit_code == 127 or any("not found" in ln for ln in lines[-2:]):
        return f"{what}: {lines[-1] if lines else 'command not found'}"
    return f"{what}: {r.error or (lines[-1] if lines else f'exit code {r.exit_code}')}"


def probe(cluster: Cluster, nodes: list[str], setup: SetupSection) -> dict[str, dict | str]:
    """node -> its probe (see remote/pyenv.py) or why it could not be probed."""
    res = cluster.run(lambda n: _script(setup, "probe", setup.venv, WHEELHOUSES), nodes=nodes,
                      timeout=PROBE_TIMEOUT)
    out: dict[str, dict | str] = {}
    for name, r in res.items():
        doc = last_json(r.stdout) if r.ok else None
        out[name] = doc if doc is not None else _why(r, f"cannot run {setup.base}")
    return out


def _ship(cluster: Cluster, nodes: list[Node], setup: SetupSection, lock: Lock, events: SyncEvents,
          online: bool) -> tuple[dict[str, str], dict[str, int], int, list[str]]:
    """Relay the wheelhouse to `nodes`; returns (failures, bytes per node, bytes sent, notes)."""
    files = lock.files(online)
    _, stream_bytes = estimate(str(lock.dir), files)
    for n in nodes:
        events.planned(n.name, "relay", stream_bytes)
    res, sent, notes = relay.push(cluster, nodes, str(lock.dir), files, chain=True,
                                  on_bytes=events.advanced, dest=lambda n: f"{WHEELHOUSES}/{lock.short}",
                                  python=lambda n: setup.base)
    failed, got = {}, {}
    for r in res:
        events.finished(r)
        got[r.node] = r.bytes
        if not r.ok:
            failed[r.node] = f"shipping the wheelhouse failed: {r.detail}"
    return failed, got, sent, notes


def _installed(name: str, r: NodeResult, probes: dict, lock: Lock, nbytes: int) -> SetupResult:
    doc = last_json(r.stdout) if r.ok else None
    if doc is None or doc.get("installed") != lock.hash:
        return SetupResult(name, "failed", False, _why(r, "installing failed"), probes[name].get("hash"),
                           r.duration, nbytes)
    action = "created" if probes[name].get("venv") == "absent" else "updated"
    steps = ", ".join(f"{k} {v:.1f}s" for k, v in doc.get("steps", {}).items())
    return SetupResult(name, action, True, f"{len(lock.pins)} packages with {doc['installer']} in "
                       f"{doc['seconds']:.1f}s ({steps})", lock.hash, r.duration, nbytes)


def _same_machine(results: dict[str, SetupResult], local: list[str]) -> None:
    """Local nodes share this machine, so the first one's venv is theirs: its result too."""
    for name in local[1:]:
        first = results[local[0]]
        results[name] = SetupResult(name, first.action, first.ok, first.detail if not first.ok else
                                    f"the venv of {local[0]} (the same machine)", first.hash)


def _install_command(s: SetupSection, lock: Lock, shipped: bool, online: bool):
    """The node's install, with the node's env exported (an online install's index settings:
    PIP_INDEX_URL, UV_DEFAULT_INDEX, ...)."""
    mode = " --online" if online else " --shipped" if shipped else ""
    return lambda n: (shell.exports(n.env) + " " + _script(s, "install", s.venv, f"{WHEELHOUSES}/{lock.short}")
                      + mode).strip()


def setup_nodes(cluster: Cluster, inv: Inventory, requirements: Path, *, force: bool = False,
                refresh: bool = False, online: bool = False, events: SyncEvents | None = None) -> SetupReport:
    """Build inv.setup's venv on every connected node; one result per inventory node. online:
    the nodes download the lock's exact files from their index instead of a shipped wheelhouse."""
    events = events or SyncEvents()
    t0 = time.monotonic()
    s = inv.setup
    results: dict[str, SetupResult] = {}

    def fail(name: str, why: str) -> None:
        results[name] = SetupResult(name, "failed", False, why)

    for n in inv.nodes:
        if n.name not in cluster.connections:
            err = cluster.unreachable.get(n.name)
            fail(n.name, err.error if err else "not connected")
    local = [n.name for n in inv.nodes if n.is_local and n.name not in results]
    probes = probe(cluster, [n.name for n in inv.nodes if n.name not in results and n.name not in local[1:]], s)
    for name, p in probes.items():
        if isinstance(p, str):
            fail(name, p)
        elif p.get("venv") == "foreign":
            fail(name, f"{s.venv} is a directory that clusterctl setup did not build; it is never replaced: "
                       "move it away or name another setup.venv")
    good = {k: v for k, v in probes.items() if k not in results}
    if not good:
        _same_machine(results, local)
        return SetupReport([results[n.name] for n in inv.nodes], time.monotonic() - t0, None)
    target = target_of(good, s.python_version)
    t1 = time.monotonic()
    lock = resolve(requirements, target, refresh=refresh, add=addition() if s.clusterctl else None)
    resolved = "cached" if lock.cached else f"resolved in {time.monotonic() - t1:.1f}s"
    steps = plan(good, lock.hash, force=force, online=online)
    for name in (k for k, v in steps.items() if v == UNCHANGED):
        results[name] = SetupResult(name, UNCHANGED, True, f"{s.venv} is current", lock.hash)
    sent, notes, got = 0, [], {}
    ship = [n for n in inv.nodes if steps.get(n.name) == SHIP]
    if ship:
        failed, got, sent, notes = _ship(cluster, ship, s, lock, events, online)
        for name, why in failed.items():
            fail(name, why)
    todo = [name for name in steps if name not in results]
    if todo:
        cmds = {shipped: _install_command(s, lock, shipped, online) for shipped in (True, False)}
        res = cluster.run(lambda n: cmds[n.name in got](n), nodes=todo, timeout=INSTALL_TIMEOUT,
                          on_line=events.node_line)  # each node's steps, shown as they start
        for name, r in res.items():
            results[name] = _installed(name, r, probes, lock, got.get(name, 0))
    _same_machine(results, local)
    return SetupReport([results[n.name] for n in inv.nodes], time.monotonic() - t0, lock.hash,
                       len(lock.pins), lock.bytes, sent, resolved, notes)

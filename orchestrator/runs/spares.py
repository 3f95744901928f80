"""Spares are prepared, not assumed: before a relaunch's preflight, each node entering the run
fresh gets the run's code and, with a `setup:` section, the run's venv.

    prepare_nodes(cluster, inv, fresh, donors, say) -> {node: why it could not be prepared}

The code is what the last `clusterctl sync` pushed to the surviving nodes (the donors): each one
lists it (nodeinfo's `select`: the list that push recorded there, never what a job wrote since,
such as rank 0's lightning_logs/, wandb/ or checkpoints) and one of them copies it node to node
(transfer/pair.py `copy_code`): the code the run started with, not what was edited on this
machine since. Files of an older tree on the fresh node are pruned, the list recorded there, and
its code digest checked against the donors'.
Only when no donor can serve does this machine's copy of the workdir go out, with `sync`, and only
when it hashes the same as the donors' code (or no donor could even be listed). Run outputs are
never shipped. The venv is `clusterctl setup`'s own (pyenv/nodes.py) for the fresh nodes, which
must record the same lock hash as the donors' venvs. Every wait has a timeout.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Callable

from orchestrator.errors import ClusterctlError
from orchestrator.inventory import Inventory, Node
from orchestrator.node import nodeinfo, wire
from orchestrator.sync import prune_command, sync
from orchestrator.transfer.files import control_code, run_outputs
from orchestrator.transfer.pair import copy_code
from orchestrator.transport import Cluster

LIST_TIMEOUT = 120.0  # a donor lists and hashes its code; a fresh node hashes its copy or prunes
COPY_TIMEOUT = 600.0  # one node-to-node copy of the code


def _nodeinfo(inv: Inventory, node: Node, mode: str, *extra: str) -> wire.Call[nodeinfo.Workdir]:
    """nodeinfo MODE on node's workdir with the run's outputs named (and `extra` options)."""
    outputs = [a for d in run_outputs(inv, node) for a in ("--output", d)]
    return nodeinfo.workdir(node, mode, outputs, *extra, timeout=LIST_TIMEOUT)


def _listings(cluster: Cluster, inv: Inventory, donors: list[str]) -> dict[str, dict | str]:
    """donor -> {"files", "code"} (what it would hand over) or why it cannot say."""
    sel = [a for p in inv.sync.include for a in ("--include", p)] + \
          [a for p in inv.sync.exclude for a in ("--exclude", p)]
    res = wire.run(cluster, lambda n: _nodeinfo(inv, n, "select", *sel), donors)
    out: dict[str, dict | str] = {}
    for name, got in res.items():
        doc = got.doc
        if doc is None:
            out[name] = got.error
        elif (doc.get("code") or {}).get("kind") == "missing":
            out[name] = f"its workdir {inv.node(name).workdir} does not exist"
        else:
            out[name] = doc
    return out


def _reference(listings: dict[str, dict | str], say) -> tuple[str | None, list[str]]:
    """The run's code digest (the donors' most common one) and the donors that hold it."""
    digests = {k: v["code"]["digest"] for k, v in listings.items() if isinstance(v, dict)}
    if not digests:
        return None, []
    ref = Counter(digests.values()).most_common(1)[0][0]
    odd = [k for k, d in digests.items() if d != ref]
    if odd:
        say(f"{', '.join(odd)} hold other code than the other surviving nodes (digest {ref}): not used as donors")
    return ref, [k for k, d in digests.items() if d == ref]


def _settle(cluster: Cluster, inv: Inventory, node: Node, files: list[str], ref: str | None) -> str | None:
    """Prune what files does not list from node's workdir (marking its outputs), then check its
    code digest against ref. None when it matches (or there is no ref), else why not."""
    manifest = "\0".join(files).encode("utf-8", "surrogateescape")
    r = wire.send(cluster, lambda n: prune_command(inv, n), [node.name], data=lambda n: [manifest],
                  timeout=LIST_TIMEOUT)[node.name]
    if not r.ok:
        return f"removing stale files failed: {nodeinfo.why(r)}"
    if ref is None:
        return None
    info = wire.run(cluster, lambda n: _nodeinfo(inv, n, "info"), [node.name])[node.name]
    got = ((info.doc or {}).get("code") or {}).get("digest")
    if got != ref:
        return f"its code digest is {got or info.error or 'not said'} after the copy, the run's is {ref}"
    return None


def _from_donors(cluster: Cluster, inv: Inventory, fresh: Node, donors: list[str], listings: dict,
                 ref: str | None, say) -> str | None:
    """Copy the code to fresh from the first donor that serves it; None, or why none did."""
    whys = []
    for name in donors:
        files = listings[name]["files"]
        t0 = time.monotonic()
        res = copy_code(cluster, inv.node(name), fresh, files, timeout=COPY_TIMEOUT)
        why = res.detail if not res.ok else _settle(cluster, inv, fresh, files, ref)
        if why is None:
            say(f"{fresh.name}: the run's code ({len(files)} files, {res.bytes / 1e6:.1f} MB) copied from "
                f"{name} in {time.monotonic() - t0:.1f}s")
            return None
        whys.append(f"from {name}: {why}")
    unlisted = [f"{k}: {v}" for k, v in listings.items() if isinstance(v, str)]
    return "; ".join(whys) or "no surviving node could list its code (" + ("; ".join(unlisted) or "none left") + ")"


def _from_control(cluster: Cluster, inv: Inventory, fresh: Node, ref: str | None, say) -> str | None:
    """Push this machine's copy of the workdir to fresh with `sync`, when it is the run's code."""
    src = os.path.expanduser(inv.workdir)
    if not os.path.isdir(src):
        return (f"and this machine has no copy of the workdir to push instead (the inventory's workdir "
                f"{inv.workdir} is {src} here)")
    mine = control_code(inv, src)["digest"]  # what `sync` would push from it
    if ref is not None and mine != ref:
        return (f"and this machine's copy of the workdir ({src}, digest {mine}) is not the code the run "
                f"started with (digest {ref})")
    say(f"{fresh.name}: no surviving node could hand over the code; pushing this machine's copy ({src})")
    try:
        report = sync(cluster, inv.select([fresh.name]), src)
    except ClusterctlError as e:
        return f"and pushing this machine's copy failed: {e}"
    bad = [r.detail for r in report.results if not r.ok]
    return f"and pushing this machine's copy failed: {bad[0]}" if bad else None


def _venvs(cluster: Cluster, inv: Inventory, fresh: list[str], donors: list[str], say) -> dict[str, str]:
    """setup's venv on the fresh nodes, which must record the lock hash the donors' venvs record."""
    from orchestrator.pyenv import requirements_path
    from orchestrator.pyenv.nodes import probe, setup_nodes

    hashes = Counter(p.get("hash") for p in probe(cluster, donors, inv.setup).values()
                     if isinstance(p, dict) and p.get("hash"))
    want = hashes.most_common(1)[0][0] if hashes else None
    say(f"{', '.join(fresh)}: building the venv {inv.setup.venv} (clusterctl setup)")
    try:
        report = setup_nodes(cluster, inv.select(fresh), requirements_path(inv))
    except ClusterctlError as e:
        return {n: f"building the venv failed: {e}" for n in fresh}
    out = {}
    for r in report.results:
        if not r.ok:
            out[r.node] = f"building the venv failed: {r.detail}"
        elif want is not None and r.hash != want:
            out[r.node] = (f"its venv was built from requirements that resolve differently now (lock "
                           f"{str(r.hash)[:16]}) than the run's nodes' venvs (lock {want[:16]})")
    return out


def prepare_nodes(cluster: Cluster, inv: Inventory, fresh: list[str], donors: list[str],
                  say: Callable[[str], None]) -> dict[str, str]:
    """Bring each fresh node's workdir to the run's code (and venv); {node: why} for each node
    that could not be prepared, {} when all are ready for preflight."""
    failed: dict[str, str] = {}
    fresh = [n for n in dict.fromkeys(fresh) if n not in donors]
    for name in fresh:
        if name not in cluster.connections:
            err = cluster.unreachable.get(name)
            failed[name] = f"unreachable: {err.error if err else 'not connected'}"
    live = [d for d in donors if d in cluster.connections]
    todo = [n for n in fresh if n not in failed]
    if inv.setup is not None and todo:
        failed.update(_venvs(cluster, inv, todo, live, say))
        todo = [n for n in todo if n not in failed]
    if not todo:
        return failed
    listings = _listings(cluster, inv, live)
    ref, serving = _reference(listings, say)
    for i, name in enumerate(todo):
        order = serving[i % len(serving):] + serving[:i % len(serving)] if serving else []
        why = _from_donors(cluster, inv, inv.node(name), order, listings, ref, say)
        if why is not None:
            more = _from_control(cluster, inv, inv.node(name), ref, say)
            if more is not None:
                failed[name] = f"the run's code could not be copied to it: {why}; {more}"
    return failed

"""The queue: `train --queue` waits for its nodes instead of refusing them.

A queued run's supervisor holds its connections and polls, every QUEUE_POLL_S, the claims on
its nodes (node agent `claims`, ~/.clusterctl/claims/NODE on each node). It takes the nodes
(runs/launch.py claim_nodes, atomic on each node) once no node is held and no earlier queued
run of this control machine wants any of them: first come, first served per node set. A claim
taken by someone else between the look and the take just sends the run back to waiting.
While it waits the record says `queued` and `waiting_for` says on what; a stop request ends
the wait (recorded `stopped`), and so does --queue-timeout (recorded `failed`). A queued run
whose supervisor died is adopted like any run (`tail`, `status`, `stop`): it waits again, in
its original place.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable

from orchestrator.errors import EXIT_FAILED, EXIT_INTERRUPTED, LaunchError
from orchestrator.runs.launch import NodeBusy, claim_nodes, live_keys, node_claims, parse_key
from orchestrator.runs.spec import RunState
from orchestrator.runs.store import Run

if TYPE_CHECKING:
    from orchestrator.inventory import Inventory
    from orchestrator.runs.record import Book
    from orchestrator.runs.spec import RunSpec
    from orchestrator.transport import Cluster

QUEUE_POLL_S = 1.0  # how often a queued run looks at its nodes' claims again
STOP_CHECK_S = 0.2  # how soon a stop request ends the wait
YOUNG_S = 10.0  # a queued run this young may not have recorded its supervisor yet


def holders(cluster: "Cluster", names: list[str]) -> dict[str, dict]:
    """node -> the live claim on it ({"run", "who", "since"}); a node that cannot be asked
    counts as held (by {"error": why}), so a queued run never takes half a node set."""
    out: dict[str, dict] = {}
    for name, r in node_claims(cluster, names).items():
        try:
            doc = json.loads(r.stdout).get(name) if r.ok else {"error": r.describe()}
        except ValueError:
            doc = {"error": r.stdout[-200:]}
        if doc and not doc.get("stale"):
            out[name] = doc
    return out


def ahead_of(run: Run, names: list[str]) -> list[str]:
    """Earlier queued runs of this control machine that want any of these nodes, and are alive."""
    created = run.record.get("created", 0)
    out = []
    for other in Run.all():
        rec = other.record
        if other.id == run.id or rec.get("created", 0) >= created or other.state(rec) is not RunState.QUEUED:
            continue
        young = time.time() - rec.get("created", 0) < YOUNG_S
        if set(rec.get("queue_nodes") or []) & set(names) and (young or other.supervisor_alive()):
            out.append(other.id)
    return out


def describe(busy: dict[str, dict], ahead: list[str]) -> str:
    if ahead:
        return f"queued behind {', '.join(ahead)}"
    return "; ".join(f"{node}: {d['error']}" if "error" in d else
                     f"{node} held by {d.get('run', '?')} ({d.get('who', '?')})" for node, d in busy.items())


def claim_when_free(run: Run, book: "Book", cluster: "Cluster", inv: "Inventory", spec: "RunSpec", who: str,
                    stop_requests: Callable[[], int]) -> None:
    """Wait until the run's nodes are free and its turn has come, then claim them (recorded
    `queued` while it waits, `claimed` once they are its)."""
    names = [n.name for n in inv.nodes]
    deadline = None if spec.queue_timeout is None else time.monotonic() + spec.queue_timeout
    book.queued(names)
    while True:
        ahead = ahead_of(run, names)
        # its own claims do not hold it back (a supervisor that died just after claiming, adopted)
        busy = {} if ahead else {k: v for k, v in holders(cluster, names).items() if v.get("run") != run.id}
        if not ahead and not busy:
            try:
                claim_nodes(cluster, inv, run.id, who)
                book.claimed(names)
                return
            except NodeBusy as e:  # taken between the look and the claim: wait on
                busy = {e.node: e.holder}
        waiting = describe(busy, ahead)
        book.waiting(waiting)
        wait_a_poll(run, spec, stop_requests, deadline, waiting)


def wait_a_poll(run: Run, spec: "RunSpec", stop_requests: Callable[[], int], deadline: float | None,
                waiting: str) -> None:
    """Sleep one poll interval, ending the wait on a stop request or the queue timeout."""
    until = time.monotonic() + QUEUE_POLL_S
    while True:
        if stop_requests() or run.stop_request:
            raise LaunchError("stopped while queued; nothing was started", EXIT_INTERRUPTED)
        if deadline is not None and time.monotonic() >= deadline:
            raise LaunchError(f"still queued after --queue-timeout {spec.queue_timeout:g}s "
                              f"({waiting}); nothing was started", EXIT_FAILED)
        if time.monotonic() >= until:
            return
        time.sleep(STOP_CHECK_S)


def cluster_runs(cluster: "Cluster", names: list[str]) -> tuple[list[dict], dict[str, str]]:
    """Every run holding a live claim on any of these nodes, or with a live process on one, from
    whichever control machine it came: [{"run", "who", "since", "nodes", "live"}] oldest first
    ("nodes": where it holds a claim; "live": {node: [attempt keys with live processes]}), and
    {node: why} for nodes not asked."""
    runs: dict[str, dict] = {}
    failed: dict[str, str] = {}
    live, failed_live = live_keys(cluster, names)
    failed.update(failed_live)
    for name, r in node_claims(cluster, names).items():
        try:
            doc, why = (json.loads(r.stdout).get(name), None) if r.ok else (None, r.describe())
        except ValueError:
            doc, why = None, f"the node agent printed {r.stdout[-200:]!r}"
        if why:
            failed[name] = why
        elif doc and not doc.get("stale"):
            held = runs.setdefault(doc.get("run", "?"), {"run": doc.get("run", "?"), "who": doc.get("who"),
                                                         "since": doc.get("since"), "nodes": []})
            held["nodes"].append(name)
    for name, keys in live.items():
        for key in keys:
            run_id = (parse_key(key) or (key,))[0]
            held = runs.setdefault(run_id, {"run": run_id, "who": None, "since": None, "nodes": []})
            held.setdefault("live", {}).setdefault(name, []).append(key)
    for held in runs.values():
        held.setdefault("live", {})
    return sorted(runs.values(), key=lambda d: d.get("since") or 0), failed

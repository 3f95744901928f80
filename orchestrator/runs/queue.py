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

import time
from typing import TYPE_CHECKING, Callable

from orchestrator.errors import EXIT_FAILED, EXIT_INTERRUPTED, LaunchError
from orchestrator.node import agent
from orchestrator.node.agent import Claim
from orchestrator.runs.launch import NodeBusy, claim_nodes
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


def holders(cluster: "Cluster", names: list[str]) -> tuple[dict[str, Claim], dict[str, str]]:
    """node -> the live claim on it, and node -> why for the nodes that could not be asked (they
    count as held: a queued run never takes half a node set)."""
    asked = agent.run(cluster, agent.claims, names)
    held = {name: c for name, got in asked.items() if (c := got.held.get(name)) is not None and not c.stale}
    return held, {name: got.error for name, got in asked.items() if got.error is not None}


def ahead_of(run: Run, names: list[str]) -> list[str]:
    """Earlier queued runs of this control machine that want any of these nodes, and are alive."""
    created = run.record.created
    out = []
    for other in Run.all():
        rec = other.record
        if other.id == run.id or rec.created >= created or rec.state is not RunState.QUEUED:
            continue
        young = time.time() - rec.created < YOUNG_S
        if set(rec.queue_nodes) & set(names) and (young or other.supervisor_alive()):
            out.append(other.id)
    return out


def describe(busy: dict[str, Claim], failed: dict[str, str], ahead: list[str]) -> str:
    if ahead:
        return f"queued behind {', '.join(ahead)}"
    return "; ".join([f"{node}: {why}" for node, why in failed.items()] +
                     [f"{node} held by {c.run or '?'} ({c.who or '?'})" for node, c in busy.items()])


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
        held, failed = holders(cluster, names) if not ahead else ({}, {})
        busy = {k: c for k, c in held.items() if c.run != run.id}
        if not ahead and not busy and not failed:
            try:
                claim_nodes(cluster, inv, run.id, who)
                book.claimed(names)
                return
            except NodeBusy as e:  # taken between the look and the claim: wait on
                busy = {e.node: e.holder}
        waiting = describe(busy, failed, ahead)
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
    live = agent.run(cluster, agent.live, names)
    claims, failed = holders(cluster, names)
    failed = {**{name: got.error for name, got in live.items() if got.error is not None}, **failed}
    for name, c in claims.items():
        held = runs.setdefault(c.run or "?", {"run": c.run or "?", "who": c.who, "since": c.since, "nodes": []})
        held["nodes"].append(name)
    for name, got in live.items():
        for key in got.keys:
            held = runs.setdefault(key.run, {"run": key.run, "who": None, "since": None, "nodes": []})
            held.setdefault("live", {}).setdefault(name, []).append(key.key)
    for held in runs.values():
        held.setdefault("live", {})
    return sorted(runs.values(), key=lambda d: d.get("since") or 0), failed

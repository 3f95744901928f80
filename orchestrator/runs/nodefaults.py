"""Each node's record across runs: every fault attributed to a node, ~/.clusterctl/node-faults.jsonl.

A fault is *attributed* to a node when the run's verdict names that node as its cause:

  lost       the node was lost: no handshake on its SSH port while others answered, or silent for --lost-timeout
  killed     a worker on it was killed by a signal (the OOM killer's SIGKILL included)
  hung       the hang watch named a rank on it as the one the others wait for (a stopped,
             idle, gone or spinning rank; a collective mismatch or a deadlock names no node)
  straggled  the straggler watch named a rank on it and the run acted on it (--on-straggler replace)
  health     its preflight failed a health check (gpu_health) at a launch or relaunch

A script's own error, an exit code the user asked to retry, and a collective that failed because a
peer went away are attributed to no node: they cost no node anything (and spend no spare:
runs/policy.py RETRY_RULES).

A node with `quarantine_after` attributed faults (the inventory's train.quarantine_after, default
3; 0: never) within `quarantine_window` seconds (default 24 h) is quarantined on its own
(runs/quarantine.py): no launch or restart from this machine uses it until `clusterctl health
--release NODE`. Releasing a node starts its count afresh: only faults after the release count.

One line per fault, appended under a lock, so runs ending at once never lose each other's lines;
a fault is recorded once per run, attempt, node and kind (an adopted run that records its verdict
again adds nothing). A damaged line is skipped, never fatal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from orchestrator.home import home
from orchestrator.inventory import Node
from orchestrator.runs import quarantine

# a verdict's cause (runs/restart.py Verdict.cause) -> the kind of fault it attributes to its culprits
KINDS = {"node lost": "lost", "killed by signal": "killed", "hang": "hung", "straggler": "straggled"}
HEALTH = "health"
RELEASED = "released"  # not a fault: `clusterctl health --release` let the node back in; its count starts afresh
DEFAULT_AFTER = 3
DEFAULT_WINDOW = 24 * 3600.0


@dataclass(frozen=True)
class Fault:
    node: str
    host: str
    kind: str  # lost | killed | hung | straggled | health
    run: str
    attempt: int
    at: float
    detail: str = ""

    def key(self) -> tuple:
        return self.run, self.attempt, self.node, self.host, self.kind, self.at if self.kind == RELEASED else 0

    def line(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at))
        return f"{when} {self.kind} in {self.run} attempt {self.attempt}" + (f": {self.detail}" if self.detail else "")


def path(root: Path | None = None) -> Path:
    return (root if root is not None else home()) / "node-faults.jsonl"


def load(root: Path | None = None) -> list[Fault]:
    """Every recorded fault, oldest first (a damaged or foreign line is skipped)."""
    try:
        text = path(root).read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for ln in text.splitlines():
        try:
            doc = json.loads(ln)
            out.append(Fault(**{f: doc[f] for f in Fault.__dataclass_fields__ if f in doc}))
        except (ValueError, TypeError):
            continue
    return out


@contextlib.contextmanager
def _locked():
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield p


def record(faults: Iterable[Fault]) -> list[Fault]:
    """Append the faults not recorded yet. -> those appended."""
    faults = list(faults)
    if not faults:
        return []
    with _locked() as p:
        seen = {f.key() for f in load()}
        new = []
        for f in faults:
            if f.key() not in seen:
                seen.add(f.key())
                new.append(f)
        if new:
            with open(p, "a") as out:
                out.write("".join(json.dumps(asdict(f)) + "\n" for f in new))
    return new


def of(node: Node, faults: list[Fault]) -> list[Fault]:
    return [f for f in faults if f.node == node.name and f.host == node.host]


def counted(node: Node, faults: list[Fault], window: float, now: float) -> list[Fault]:
    """The node's faults that count toward its quarantine: within `window` seconds of `now`, and
    after its last release (a repaired node starts afresh)."""
    mine = of(node, faults)
    released = max((f.at for f in mine if f.kind == RELEASED), default=None)
    return [f for f in mine if f.kind != RELEASED and f.at >= now - window and (released is None or f.at > released)]


def released(entries: Iterable[quarantine.Entry]) -> None:
    """Note that these quarantined nodes were let back in: faults before now no longer count."""
    now = time.time()
    record(Fault(e.node, e.host, RELEASED, e.run or "", 0, now, f"was: {e.reason}") for e in entries)


def attribute(inv, run: str, attempt: int, kind: str, culprits: dict[str, str], tell,
              quarantine_on: bool = True) -> list[str]:
    """Record a fault of `kind` for each culprit ({node: detail}) of `run`'s `attempt`, and
    quarantine each one whose count reached the inventory's train.quarantine_after within
    train.quarantine_window. -> the nodes quarantined now."""
    now = time.time()
    nodes = {n: inv.node(n) for n in culprits}
    record(Fault(n, nodes[n].host, kind, run, attempt, now, d) for n, d in culprits.items())
    after, window = inv.train.quarantine_after, inv.train.quarantine_window
    if not quarantine_on or not after:
        return []
    everything = load()
    due = {}
    for n, node in nodes.items():
        mine = counted(node, everything, window, now)
        if len(mine) >= after:
            kinds = ", ".join(f"{f.kind} ({f.run})" for f in mine[-after:])
            due[n] = f"{len(mine)} faults within {_span(window)}: {kinds}"
    added = quarantine.add([nodes[n] for n in due], due, run)
    for e in added:
        tell(f"{e.node} quarantined: {e.reason} (train.quarantine_after {after}; no run from this machine "
             f"uses it until `clusterctl health --release {e.node}`)")
    return [e.node for e in added]


def _span(seconds: float) -> str:
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)} h"
    if seconds % 60 == 0:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"


def of_verdict(inv, run: str, attempt: int, nodes: list[str], verdict, tell, quarantine_on: bool, spares_left):
    """Record the attempt's verdict against its culprits' nodes (runs/restart.py Verdict.culprits).
    A node of the attempt quarantined by it now is also left out of the next attempt, when a spare
    is there to take its place (else it stays for this run, and said so). -> the verdict to act on."""
    kind = KINDS.get(verdict.cause)
    if kind is None or not verdict.culprits:
        return verdict
    try:
        held = attribute(inv, run, attempt, kind, {n: verdict.detail for n in verdict.culprits}, tell, quarantine_on)
    except OSError as e:  # a full control disk: the run goes on, without this fault on the nodes' record
        tell(f"the nodes' fault record ({path()}) could not be written: {e}; {', '.join(verdict.culprits)} "
             f"not counted toward a quarantine")
        return verdict
    extra = tuple(n for n in held if n in nodes and n not in verdict.bad_nodes)
    if not extra or not verdict.retry:
        return verdict
    if len(spares_left()) < len(verdict.bad_nodes) + len(extra):
        tell(f"{', '.join(extra)} stays in this run's next attempt: no spare left to take its place")
        return verdict
    return dataclasses.replace(verdict, bad_nodes=verdict.bad_nodes + extra)


def health(inv, run: str, attempt: int, sick: dict[str, str]) -> None:
    """Record a failed health check ({node: reason}) against each node (a full disk records none:
    the node is quarantined by its health check itself)."""
    now = time.time()
    with contextlib.suppress(OSError):
        record(Fault(n, inv.node(n).host, HEALTH, run, attempt, now, why) for n, why in sick.items())

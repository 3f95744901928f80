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

The file does not grow forever: each fault is kept on its own line for KEEP_S (7 days), or for the
longest train.quarantine_window of any inventory that recorded a fault here when that is longer
(the count toward a quarantine never reaches back that far). Older faults are folded, per node,
host and kind, into one tally line (`tally`: how many), so `clusterctl health` and the exporter's
clusterctl_node_faults_total still count every fault ever attributed; a release marker that old
is dropped, since every fault it could hide is older than any window. The fold happens when a
fault is appended and the oldest single line is a day past the horizon (a rewrite a day at most,
never on a read), by a temporary file renamed over the record under the lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from orchestrator.home import home, locked
from orchestrator.inventory import Node
from orchestrator.runs import quarantine
from orchestrator.runs.space import is_disk_full

# a verdict's cause (runs/restart.py Verdict.cause) -> the kind of fault it attributes to its culprits
KINDS = {"node lost": "lost", "killed by signal": "killed", "hang": "hung", "straggler": "straggled"}
HEALTH = "health"
RELEASED = "released"  # not a fault: `clusterctl health --release` let the node back in; its count starts afresh
DEFAULT_AFTER = 3
DEFAULT_WINDOW = 24 * 3600.0
KEEP_S = 7 * 24 * 3600.0  # each fault on its own line at least this long (what `health` lists one by one)
FOLD_SLACK_S = 24 * 3600.0  # fold once the oldest single line is this far past the horizon: a rewrite a day at most


@dataclass(frozen=True)
class Fault:
    node: str
    host: str
    kind: str  # lost | killed | hung | straggled | health
    run: str
    attempt: int
    at: float
    detail: str = ""
    window: float = 0.0  # the recording inventory's train.quarantine_window: the record keeps faults that long
    tally: int = 0  # 0: one fault; N: a fold of N faults of this kind, the newest at `at`

    @property
    def weight(self) -> int:
        return self.tally or 1

    def key(self) -> tuple:
        return self.run, self.attempt, self.node, self.host, self.kind, self.at if self.kind == RELEASED else 0

    def line(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at))
        if self.tally:
            return f"up to {when} {self.tally} {self.kind} (older faults, counted together)"
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


class Reader:
    """load() for a reader that asks again and again (the exporter, on every scrape): the record is
    parsed again only when its file changed (inode, mtime, size: a fold renames a new file in)."""

    def __init__(self, root: Path | None = None):
        self.root = root
        self.seen: tuple | None = None
        self.faults: list[Fault] = []
        self.parsed = 0  # how many times the file was read and parsed

    def load(self) -> list[Fault]:
        try:
            st = os.stat(path(self.root))
        except FileNotFoundError:
            return []
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig != self.seen:
            self.faults, self.seen = load(self.root), sig
            self.parsed += 1
        return self.faults


def _json(f: Fault) -> str:
    return json.dumps({k: v for k, v in asdict(f).items() if v or k not in ("window", "tally")}) + "\n"


def record(faults: Iterable[Fault], window: float = 0.0) -> list[Fault]:
    """Append the faults not recorded yet, folding what is past the record's horizon (the module's
    docstring) when that is due. -> those appended."""
    faults = [dataclasses.replace(f, window=f.window or window) for f in faults]
    if not faults:
        return []
    with locked(path()) as p:
        kept = load()
        seen = {f.key() for f in kept}
        new = []
        for f in faults:
            if f.key() not in seen:
                seen.add(f.key())
                new.append(f)
        horizon = time.time() - max([KEEP_S, window] + [f.window for f in kept + new])
        if any(not f.tally and f.at < horizon - FOLD_SLACK_S for f in kept) and _rewrite(p, fold(kept, horizon) + new):
            return new
        if new:
            with open(p, "a") as out:
                out.write("".join(_json(f) for f in new))
    return new


def _rewrite(p: Path, faults: list[Fault]) -> bool:
    """Replace the record at `p` whole (under its lock). -> False when it could not be (no room for
    the new file: the old one stays, and the fold waits for the next append)."""
    tmp = p.with_suffix(".tmp")
    try:
        tmp.write_text("".join(_json(f) for f in faults))
        os.replace(tmp, p)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def fold(faults: list[Fault], before: float) -> list[Fault]:
    """`faults` with those before `before` folded into one tally per node, host and kind (tallies
    folded earlier included); a release marker before it goes (every fault it could keep from a
    count is older than any window). -> the tallies, oldest first, then the faults kept in their order."""
    tallies: dict[tuple[str, str, str], Fault] = {}
    for f in faults:
        if f.at >= before or f.kind == RELEASED:
            continue
        k = (f.node, f.host, f.kind)
        was = tallies.get(k)
        tallies[k] = Fault(f.node, f.host, f.kind, "", 0, max(f.at, was.at if was else f.at), "",
                           max(f.window, was.window if was else 0.0), f.weight + (was.tally if was else 0))
    return sorted(tallies.values(), key=lambda f: f.at) + [f for f in faults if f.at >= before]


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
    after, window = inv.train.quarantine_after, inv.train.quarantine_window
    record((Fault(n, nodes[n].host, kind, run, attempt, now, d) for n, d in culprits.items()), window)
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
        record((Fault(n, inv.node(n).host, HEALTH, run, attempt, now, why) for n, why in sick.items()),
               inv.train.quarantine_window)


def quarantine_sick(inv, run: str, attempt: int, sick: dict[str, str], tell, quarantine_on: bool) -> dict[str, str]:
    """Record the failed health checks ({node: reason}) against each node and quarantine the nodes
    (not with quarantine_on False: --allow-unhealthy). A full control disk costs the record, not
    the run: the nodes are still left out of this run, and what was not recorded is said once.
    -> {node: why} of the nodes quarantined (or to be, had there been room)."""
    health(inv, run, attempt, sick)
    if not sick or not quarantine_on:
        return {}
    try:
        added = quarantine.add([inv.node(n) for n in sick], sick, run)
    except OSError as e:
        if not is_disk_full(e):
            raise
        tell(f"{', '.join(sick)} not quarantined: the quarantine ({quarantine.path()}) could not be written: {e}; "
             f"this run leaves {'it' if len(sick) == 1 else 'them'} out, later runs from this machine do not know")
        return sick
    for entry in added:
        tell(f"{entry.node} quarantined: {entry.reason} (no run from this machine uses it until "
             f"`clusterctl health --release {entry.node}`)")
    return sick

"""Nodes kept out of launches and restarts because their health failed: ~/.clusterctl/quarantine.json.

A node whose preflight fails a health check (HEALTH_CHECKS: gpu_health, the GPUs' ECC, row remaps,
Xids, throttling, dcgmi) when `train` launches or relaunches is recorded here with the reason, the
time and the run. From then on no launch or restart of any run from this control machine uses it:
a spare takes its place (runs/controller.py), and with none left the launch says why and how to
release it. It stays out until the user releases it (`clusterctl health --release NODE`);
`train --allow-unhealthy` uses quarantined nodes for one run. `clusterctl health` lists every
node's health and quarantine.

A node is known by its inventory name and host together (two `connection: local` demo nodes share
a host; one machine under another name is another node). The file is replaced atomically under a
lock, so runs ending at once never lose each other's entries.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.home import home, locked
from orchestrator.inventory import Node

HEALTH_CHECKS = frozenset({"gpu_health"})  # a failure of these quarantines the node


@dataclass(frozen=True)
class Entry:
    node: str
    host: str
    reason: str  # the check and its detail, as preflight said it
    since: float
    run: str | None = None

    def line(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.since))
        return f"{self.node} ({self.host}) quarantined since {when}" + (f" by run {self.run}" if self.run else "") + \
            f": {self.reason}"


def key(node: Node) -> str:
    return f"{node.name}@{node.host}"


def path(root: Path | None = None) -> Path:
    return (root if root is not None else home()) / "quarantine.json"


def load(root: Path | None = None) -> dict[str, Entry]:
    try:
        doc = json.loads(path(root).read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        return {}  # a damaged file quarantines nothing rather than stopping every launch
    return {k: Entry(**{f: v for f, v in e.items() if f in Entry.__dataclass_fields__}) for k, e in doc.items()}


@contextlib.contextmanager
def _locked():
    with locked(path()) as p:
        entries = load()
        yield entries
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: asdict(e) for k, e in sorted(entries.items())}, indent=1))
        os.replace(tmp, p)


def add(nodes: list[Node], reasons: dict[str, str], run: str | None) -> list[Entry]:
    """Quarantine `nodes` ({name: reason}); a node already in keeps its first reason and time."""
    added = []
    with _locked() as entries:
        for n in nodes:
            if key(n) not in entries:
                entries[key(n)] = Entry(n.name, n.host, reasons[n.name], time.time(), run)
                added.append(entries[key(n)])
    return added


def release(nodes: list[Node]) -> list[Entry]:
    """Let `nodes` be used again. -> the entries removed."""
    with _locked() as entries:
        return [entries.pop(key(n)) for n in nodes if key(n) in entries]


def of(nodes) -> dict[str, Entry]:
    """{node name: its entry} for the quarantined ones among `nodes`."""
    entries = load()
    return {n.name: entries[key(n)] for n in nodes if key(n) in entries}


def health_failures(checks: dict[str, dict[str, str]]) -> dict[str, str]:
    """{node: reason} for the nodes whose failed checks ({node: {check: detail}}) include a health
    check: the reason names each failed health check with its detail."""
    out = {}
    for node, failed in checks.items():
        health = {c: d for c, d in failed.items() if c in HEALTH_CHECKS}
        if health:
            out[node] = "; ".join(f"{c}: {d}" for c, d in sorted(health.items()))
    return out

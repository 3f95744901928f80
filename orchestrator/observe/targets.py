"""The nodes' own exporters as a Prometheus file_sd file: `clusterctl metrics targets -i INV`.

One target group per node and exporter (node_exporter on 9100, dcgm-exporter on 9400 by default),
labelled with the node's inventory name (`node`), the exporter (`exporter`) and, when a run of this
control home trains on the node now, the run (`run_id`) and the global ranks the node serves
(`ranks`, as `0-7`). Those labels join the nodes' GPU and host metrics to clusterctl's own
(metrics.py), whose node series carry the same `run_id` and `node`.

Prometheus re-reads a file_sd file when it changes; the file is written whole and renamed into
place, so it never reads half a file. A run that restarts on other nodes changes the labels: write
the file again then (`train --notify-on restarting --notify 'clusterctl metrics targets ...'`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from orchestrator.inventory import Inventory
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.store import Run

DEFAULT_PORTS = {"node_exporter": 9100, "dcgm_exporter": 9400}


def serving(records: list[RunRecord]) -> dict[str, tuple[str, str]]:
    """node name -> (run id, ranks) for the nodes the live runs' current attempts hold, the newest
    run first (a node shared by two runs with --force is labelled with the newer)."""
    out: dict[str, tuple[str, str]] = {}
    for rec in sorted(records, key=lambda r: r.created, reverse=True):
        if rec.state.terminal:
            continue
        for nd in rec.nodes:
            out.setdefault(nd.name, (rec.id, nd.ranks if nd.first_rank is not None else ""))
    return out


def target_groups(inv: Inventory, ports: dict[str, int], records: list[RunRecord],
                  run_id: str | None = None) -> list[dict]:
    """The file_sd document: a list of {"targets": [...], "labels": {...}}. `ports`: exporter ->
    port (an exporter left out is not listed); `run_id`: label with this run's ranks only."""
    if run_id is not None:
        records = [r for r in records if r.id == run_id]
    held = serving(records)
    groups = []
    for node in inv.nodes:
        for exporter, port in ports.items():
            labels = {"node": node.name, "exporter": exporter}
            if node.name in held:
                labels["run_id"], ranks = held[node.name]
                if ranks:
                    labels["ranks"] = ranks
            if node.spare:
                labels["spare"] = "true"
            groups.append({"targets": [node.hostport(port)], "labels": labels})
    return groups


def live_records() -> list[RunRecord]:
    return [r.record for r in Run.all()]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def dumps(groups: list[dict]) -> str:
    return json.dumps(groups, indent=2) + "\n"

"""What `--json` prints, one style for every command (the schemas are orchestrator/schemas/*.json).

- One document on stdout (`train`/`tail`: one object per line, see `line_event`), indented JSON.
- A report has `"ok": bool`; per-node results are objects with `"name"` (and `"rank"` where the
  command knows it), `"ok"`, `"exit_code"` (null when the node never finished), `"error"` (text
  or null) and `"error_kind"` (`unreachable`, `timeout`, `lost`, ... or null).
- A user error (bad flag, bad inventory, unknown run, unreachable nodes) prints
  `{"ok": false, "error": {"message", "exit_code", "kind"}}` on stdout and exits with that
  code; the same paragraph still goes to stderr for whoever watches the terminal.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # the commands that print a run's end import the runs package; the others need not
    from orchestrator.runs.runrecord import RunRecord


def emit(doc, *, compact: bool = False) -> None:
    click.echo(json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=2))


def error_doc(message: str, exit_code: int, kind: str) -> dict:
    return {"ok": False, "error": {"message": message, "exit_code": exit_code, "kind": kind}}


def wants_json(argv: list[str]) -> bool:
    """--json among the options (not among a trainer's or command's own words after `--`)."""
    own = argv[:argv.index("--")] if "--" in argv else argv
    return "--json" in own


def node_result(r, rank: int | None = None, **extra) -> dict:
    """A transport NodeResult in the shared per-node shape."""
    doc = {"name": r.node}
    if rank is not None:
        doc["rank"] = rank
    kind = getattr(r.kind, "value", r.kind)
    return doc | {"ok": r.ok, "exit_code": r.exit_code, "error": r.error,
                  "error_kind": None if kind is None else str(kind)} | extra


def line_event(label: str, stream: str, text: str, node: str | None = None) -> dict:
    """A run's log line: {"event": "line", "node", "rank", "stream", "line", "t"}; `label` is the
    printed prefix, `node/rN` for a rank's line, the bare node for torchrun's own."""
    name, _, rank = label.partition("/r")
    return {"event": "line", "node": node or name, "rank": int(rank) if rank.isdigit() else None,
            "stream": stream, "line": text, "t": round(time.time(), 3)}


def json_lines(label: str, stream: str, text: str, node: str | None = None) -> None:
    """A line sink (like output.Prefixer) that prints each line as a compact `line_event`."""
    emit(line_event(label, stream, text, node), compact=True)


def run_doc(rec: RunRecord) -> dict:
    """A run record as `train`/`tail`/`stop` report its end: {"event": "end", "ok", "run_id", ...}."""
    from orchestrator.runs.spec import NodeState

    nodes = [{"name": nd.name, "rank": nd.rank, "ok": nd.exit_code == 0, "exit_code": nd.exit_code, "error": nd.error,
              "error_kind": "lost" if nd.state in (NodeState.LOST, NodeState.UNREACHABLE) else
              ("failed" if nd.exit_code not in (0, None) else None),
              "state": nd.state.value, "first_rank": nd.first_rank, "last_rank": nd.last_rank} for nd in rec.nodes]
    return {"event": "end", "ok": rec.exit_code == 0, "run_id": rec.id, "state": rec.state.value,
            "exit_code": rec.exit_code, "summary": rec.summary, "error": rec.error,
            "first_failure": rec.first_failure.to_json() if rec.first_failure is not None else None, "hang": last_hang(rec), "nodes": nodes,
            "goodput": ledger_of(rec)}


def ledger_of(rec: RunRecord) -> dict | None:
    """The run's goodput ledger (runs/goodput.py) as `goodput --json` prints it; None without a
    run directory."""
    from orchestrator.runs.goodput import of_run
    from orchestrator.runs.store import Run

    run = Run(rec.id)
    return of_run(run).to_json() if rec.id and (run.dir / "run.json").exists() else None


def last_hang(rec: RunRecord) -> dict | None:
    """The newest attempt's hang verdict (runs/judge/hang.py), as run_doc reports it."""
    for a in reversed(rec.attempts):
        if a.hang:
            return {"attempt": a.attempt, "text": a.hang, "snapshots": a.hang_dir}
    return None

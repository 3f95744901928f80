"""`clusterctl queue`: the queued and running runs of this control machine, and what each waits for."""

from __future__ import annotations

import json
import time

import click

from orchestrator.runs.store import Run


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


@click.command("queue")
@click.option("--json", "as_json", is_flag=True, help="The records of those runs, as a JSON list.")
def queue_command(as_json):
    """Runs of this control machine not ended yet, oldest first: queued ones (train --queue) with
    what they wait for, in the order they will start when their nodes are free."""
    from rich.console import Console
    from rich.table import Table

    rows = [(r, rec) for r in Run.all() for rec in [r.record] if not rec.state.terminal]
    if as_json:
        click.echo(json.dumps([rec.to_json() for _, rec in rows], indent=2))
        return
    t = Table(title="queue")
    t.add_column("run", no_wrap=True, min_width=max((len(r.id) for r, _ in rows), default=3))
    for c in ("state", "nodes", "created", "waiting for"):
        t.add_column(c, no_wrap=c in ("state", "created"))
    for run, rec in rows:
        nodes = rec.queue_nodes or [n.name for n in rec.nodes]
        t.add_row(run.id, str(rec.state), ",".join(nodes), _when(rec.created), rec.waiting_for or "-")
    Console().print(t)


__all__ = ["queue_command"]

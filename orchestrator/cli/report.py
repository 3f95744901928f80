"""`clusterctl report [RUN] -o run.html`: a run as one self-contained HTML page (orchestrator/observe/report.py)."""

from __future__ import annotations

import os
from pathlib import Path

import click


@click.command("report")
@click.argument("run_id", metavar="[RUN]", required=False)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Where the page goes [default: RUN_ID.html here].")
def report_command(run_id: str | None, output: str | None):
    """One HTML file of a run (the latest when RUN is left out): its timeline of attempts, faults,
    verdicts and restarts, the loss and step-rate curves from its TensorBoard files, its nodes and
    ranks, and how it ended. Everything is inside the file: open it anywhere, offline."""
    from orchestrator.observe.report import render
    from orchestrator.runs.store import Run

    run = Run.find(run_id)
    path = Path(output or f"{run.id}.html")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(render(run))
    os.replace(tmp, path)
    click.echo(f"clusterctl: wrote {path} (run {run.id})", err=True)

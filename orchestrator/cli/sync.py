from __future__ import annotations

import dataclasses
import json
import sys

import click

from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import EXIT_FAILED, EXIT_OK, UsageError, with_unreachable
from orchestrator.sync import sync
from orchestrator.transfer import synced


@click.command("sync")
@cluster_options
@click.option("--src", type=click.Path(file_okay=False), default=None,
              help="Local directory to push (default: the inventory's sync.src, else the git checkout "
                   "the current directory is in).")
@click.option("--method", type=click.Choice(["auto", "relay", "tar", "rsync"]), default="auto",
              show_default=True,
              help="relay: one stream from here, forwarded node to node (each byte leaves this machine "
                   "once); tar: that stream to every node directly; rsync: per node, only what changed; "
                   "auto: rsync for small updates of a synced tree, else the relay.")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Also ship this directory or glob even if .gitignore excludes it or it is a tool's "
                   "output folder such as wandb/ (repeatable; adds to the inventory's sync.include).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Never ship paths matching this glob (repeatable; adds to sync.exclude).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document (per-node name, ok, method, bytes, seconds, error) instead "
                   "of the progress view.")
def sync_command(opts: ClusterOptions, src: str | None, method: str, include: tuple[str, ...],
                 exclude: tuple[str, ...], as_json: bool):
    """Push this checkout (or --src, or the inventory's sync.src) to every node's workdir
    (.gitignore aware; never the inventory, its key files, nor what git does not track in
    lightning_logs/, wandb/, runs/, outputs/, multirun/), then check code_sync against it."""
    from rich.console import Console

    from orchestrator.checks.preflight import run_preflight
    from orchestrator.transfer.files import control_code, require_code_source
    from orchestrator.transfer.progress import RichEvents, SyncEvents, summary

    inv = opts.load()
    src = require_code_source(inv, src)
    for p in include + exclude:
        if not p or p.startswith(("/", "~")) or ".." in p.split("/"):
            raise UsageError(f"--include/--exclude {p!r}: give a path or glob inside {src}")
    # --include/--exclude add to the inventory's: the push and the code_sync after it see the same selection
    inv = dataclasses.replace(inv, sync=inv.sync.model_copy(update={
        "include": [*inv.sync.include, *include], "exclude": [*inv.sync.exclude, *exclude]}))
    console = Console(stderr=True)
    with opts.cluster(inv) as cluster:
        if as_json:
            report = sync(cluster, inv, src, method=method, events=SyncEvents())
        else:
            with RichEvents(console) as events:
                report = sync(cluster, inv, src, method=method, events=events)
        shipped = control_code(inv, src)  # what this sync ships: code_sync's and the record's
        code = run_preflight(cluster, inv, ["code_sync"], control_dir=src, code_required=True, control=shipped)
        unreachable = list(cluster.unreachable)
    bad_code = {n.node.name: r.detail for n in code.nodes
                if (r := n.results.get("code_sync")) is not None and r.status != "ok"}
    pushed = {r.node for r in report.results if r.ok}
    # train's preflight compares these nodes with `src` from now on (transfer/synced.py)
    synced.record([inv.node(n) for n in sorted(pushed - set(bad_code) - set(unreachable))], src,
                  list(inv.sync.include), list(inv.sync.exclude), shipped["digest"])
    ok = report.ok and code.ok
    if as_json:
        doc = report.to_json() | {"ok": ok, "code_sync": bad_code or "ok"}
        click.echo(json.dumps(doc, indent=2))
        sys.exit(with_unreachable(unreachable, EXIT_OK if ok else EXIT_FAILED))
    for r in report.results:
        mark = "[green]ok[/]" if r.ok else "[bold red]failed[/]"
        console.print(f"  {r.node}: {mark} {r.method}: {r.detail}", soft_wrap=True, markup=True,
                      highlight=False)
    for note in report.notes:
        console.print(f"  note: {note}", soft_wrap=True, markup=False, highlight=False)
    for name, detail in bad_code.items():
        console.print(f"  {name}: code_sync: {detail}", soft_wrap=True, markup=False)
    console.print(summary(report), soft_wrap=True, highlight=False)
    console.print("[green]sync ok: code_sync passes on every node[/]" if ok else "[bold red]sync incomplete[/]")
    sys.exit(with_unreachable(unreachable, EXIT_OK if ok else EXIT_FAILED))

"""`clusterctl fetch RUN [PATH]`: copy a run's files from its nodes to the control machine."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from orchestrator.cli.jsonout import emit
from orchestrator.cli.runs import complete_run_ids
from orchestrator.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, with_unreachable
from orchestrator.inventory import load_inventory
from orchestrator.runs.fetch import TIMEOUT, check_path, fetch
from orchestrator.runs.store import Run


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@click.command("fetch")
@click.argument("run_id", shell_complete=complete_run_ids)
@click.argument("path", required=False)
@click.option("--node", "nodes", multiple=True, help="Only this node of the run (repeatable).")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Write into DIR/NODE/ instead of ~/.clusterctl/runs/RUN/fetched/NODE/.")
@click.option("--timeout", type=click.FloatRange(1), default=TIMEOUT, show_default=True,
              help="Seconds one node's copy may take.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (orchestrator/schemas/fetch.json).")
@click.option("-i", "--inventory", "inventory_path", type=click.Path(dir_okay=False), default=None,
              help="Reach the run's nodes as this inventory says (an address or key changed since the run "
                   "started); default: as the run recorded them.")
@click.option("--connect-timeout", type=click.FloatRange(0.1, 600), default=None,
              help="Seconds to wait for each node's SSH handshake (default: the run's).")
def fetch_command(run_id, path, nodes, output, timeout, as_json, inventory_path, connect_timeout):
    """Copy a run's files from every node it used: its artifacts (checkpoints/, tensorboard/) into
    NODE/artifacts/ and each attempt's node-side log, spec and exit code into NODE/node-runs/.

    PATH copies only that file or tree: relative, from the run's artifacts (e.g. `checkpoints`)
    or else from the node's workdir (e.g. `out/ckpt.pt`, into NODE/workdir/); `~/...` or absolute,
    from inside the workdir or the home (NODE/workdir/, NODE/home/); anywhere else is refused
    (exit 2). A PATH a node does not have exits 1 naming the node and the path. Exits 3 naming
    every node that could not be reached; the others are still copied."""
    rel = check_path(path)
    run = Run.find(run_id)
    inv = load_inventory(inventory_path) if inventory_path else None
    results = fetch(run, rel, nodes, Path(output) if output else None, timeout, inv, connect_timeout)
    for f in results:
        if f.ok:
            head = f"{f.name}: {f.top}: " if f.top else f"{f.name}: "
            click.echo(f"{head}{f.files} files, {size_text(f.bytes)} → {f.dest}", err=True)
        else:
            click.echo(f"{f.name}: not fetched: {f.error}", err=True)
    unreachable = [f.name for f in results if f.unreachable]
    refused = [f for f in results if f.error_kind == "outside"]
    failed = [f.name for f in results if not f.ok and not f.unreachable]
    code = with_unreachable(unreachable, EXIT_USAGE if refused else EXIT_FAILED if failed else EXIT_OK)
    if unreachable:
        click.echo(f"clusterctl: error: could not reach {', '.join(unreachable)}, so "
                   f"{'its' if len(unreachable) == 1 else 'their'} files of run {run.id} were not "
                   f"fetched; the other nodes' were", err=True)
    elif refused:
        click.echo(f"clusterctl: error: {rel} is refused: fetch copies only from the run's artifacts, the "
                   f"node's workdir and its home ({refused[0].error})", err=True)
    elif failed:
        click.echo(f"clusterctl: error: {rel or 'the run files'} could not be fetched from "
                   f"{', '.join(failed)} (see above); "
                   + ("use --node to fetch from the nodes that have it" if len(failed) < len(results)
                      else "nothing was fetched"), err=True)
    if as_json:
        emit({"ok": code == EXIT_OK, "run_id": run.id, "path": rel,
              "nodes": [{**f.doc(), "stream_bytes": f.stream_bytes, "source": f.top} for f in results]})
    sys.exit(code)

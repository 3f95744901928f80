from __future__ import annotations

import json
import sys
import time

import click

from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import EXIT_OK, with_unreachable
from orchestrator.top import collect, table


@click.command("top")
@cluster_options
@click.option("--once", is_flag=True, help="One snapshot, then exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once: one JSON document for scripts.")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=2.0, show_default=True,
              help="Seconds between refreshes.")
def top_command(opts: ClusterOptions, once: bool, as_json: bool, interval: float):
    """Every GPU of every node, live: utilisation, memory, temperature, power and the
    process on it (with its clusterctl run id). Ctrl-C quits.

    `--once --json` prints {"nodes": [{"name", "host", "gpus": [{"index", "name", "util",
    "mem_used_mib", "mem_total_mib", "temp_c", "power_w", "processes": [...]}], "error"}]}
    and exits 3 if a node could not be reached."""
    if as_json and not once:
        raise click.UsageError("--json needs --once (a live view has no single document)")
    inv = opts.load()
    with opts.cluster(inv) as cluster:
        if once:
            views = collect(cluster)
            if as_json:
                click.echo(json.dumps({"nodes": [v.to_json() for v in views]}, indent=2))
            else:
                from rich.console import Console
                Console().print(table(views, _title(inv, views)))
            sys.exit(with_unreachable([v.name for v in views if not v.reachable], EXIT_OK))
        _live(cluster, inv, interval)


def _title(inv, views) -> str:
    n = sum(len(v.gpus) for v in views)
    busy = sum(1 for v in views for g in v.gpus if g.busy)
    return f"{inv.source}: {len(views)} nodes, {n} GPUs, {busy} busy  ({time.strftime('%H:%M:%S')})"


def _live(cluster, inv, interval: float) -> None:
    from rich.live import Live

    try:
        with Live(table([], f"{inv.source}: connecting..."), auto_refresh=False, screen=False) as live:
            while True:
                t0 = time.monotonic()
                if cluster.unreachable:
                    cluster.connect()  # a node back up joins the view
                views = collect(cluster)
                live.update(table(views, _title(inv, views)), refresh=True)
                time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        pass  # quitting a watch is not an error

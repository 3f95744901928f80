"""`clusterctl metrics serve|targets`: the runs of this control home for Prometheus, with no server
of ours (orchestrator/observe/metrics.py), and the nodes' own exporters as file_sd targets
(orchestrator/observe/targets.py)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import click

from orchestrator.errors import UsageError
from orchestrator.home import runs_dir

TEXTFILE = "clusterctl.prom"


@click.group("metrics")
def metrics_group():
    """Prometheus metrics of the runs recorded on this machine, and the nodes' exporters as targets."""


def _serve(port: int, bind: str) -> None:
    from prometheus_client import start_http_server

    from orchestrator.observe.metrics import registry

    try:
        server, _ = start_http_server(port, addr=bind, registry=registry(runs_dir()))
    except OSError as e:
        raise UsageError(f"cannot serve metrics on {bind}:{port}: {e.strerror or e} (another exporter there? "
                         "choose another with --port, or --bind another address)") from None
    host, real_port = server.server_address[:2]
    click.echo(f"clusterctl: serving the runs under {runs_dir()} on http://{bind}:{real_port}/metrics "
               "(Ctrl-C stops)", err=True)
    threading.Event().wait()  # the server's thread serves; this one waits for a signal


def _textfile(directory: str, interval: float, once: bool) -> None:
    from prometheus_client import write_to_textfile

    from orchestrator.observe.metrics import registry

    d = Path(directory)
    if not d.is_dir():
        raise UsageError(f"--textfile {directory}: not a directory (node_exporter's "
                         "--collector.textfile.directory)")
    reg, path = registry(runs_dir()), d / TEXTFILE
    stop = threading.Event()
    while True:
        write_to_textfile(str(path), reg)  # a temporary file renamed into place: never read half written
        if once:
            click.echo(f"clusterctl: wrote {path}", err=True)
            return
        if stop.wait(interval):
            return


@metrics_group.command("serve")
@click.option("--port", type=click.IntRange(0, 65535), default=9464, show_default=True,
              help="The port Prometheus scrapes (/metrics); 0 picks a free one.")
@click.option("--bind", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="The address to listen on: 0.0.0.0 (or ::) for a Prometheus on another machine.")
@click.option("--textfile", metavar="DIR", default=None,
              help="Instead of serving, write DIR/clusterctl.prom for node_exporter's textfile collector.")
@click.option("--interval", type=click.FloatRange(1), default=15.0, show_default=True, metavar="SECONDS",
              help="With --textfile: how often the file is written again.")
@click.option("--once", is_flag=True, help="With --textfile: write the file once and exit.")
def serve_command(port: int, bind: str, textfile: str | None, interval: float, once: bool):
    """Every run recorded under this machine's control home ($CLUSTERCTL_HOME, else ~/.clusterctl)
    as Prometheus metrics: state, attempt, step, step time, tokens/s, restarts, lost nodes, hang and
    straggler verdicts, checkpoint age, and each node's and rank's, labelled run_id, node, rank.

    Each scrape reads only what changed since the last; a run that ended is not read again."""
    if once and textfile is None:
        raise click.UsageError("--once goes with --textfile DIR")
    if textfile is not None:
        _textfile(textfile, interval, once)
    else:
        _serve(port, bind)


@metrics_group.command("targets")
@click.option("-i", "--inventory", "inventory_path", type=click.Path(),
              default=lambda: os.environ.get("CLUSTERCTL_INVENTORY"),
              help="Inventory YAML (default: $CLUSTERCTL_INVENTORY, else the embedded two-local-node demo).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the file here (replaced whole) instead of printing it.")
@click.option("--run", "run_id", metavar="RUN", default=None,
              help="Label the nodes with this run only (id or unique prefix) [default: every live run].")
@click.option("--node-exporter-port", type=click.IntRange(0, 65535), default=9100, show_default=True,
              help="node_exporter's port on the nodes; 0 leaves it out.")
@click.option("--dcgm-port", type=click.IntRange(0, 65535), default=9400, show_default=True,
              help="dcgm-exporter's port on the nodes; 0 leaves it out.")
def targets_command(inventory_path, output, run_id, node_exporter_port, dcgm_port):
    """The nodes' own exporters (node_exporter, dcgm-exporter) as a Prometheus file_sd file, each
    target labelled with its node and, while a run of this machine trains there, the run and the
    ranks the node serves (labels run_id, ranks), so GPU metrics join the run's."""
    from orchestrator.inventory import load_inventory
    from orchestrator.observe.targets import dumps, live_records, target_groups, write_atomic
    from orchestrator.runs.store import Run

    inv = load_inventory(inventory_path)
    ports = {k: p for k, p in (("node_exporter", node_exporter_port), ("dcgm_exporter", dcgm_port)) if p}
    if not ports:
        raise click.UsageError("--node-exporter-port 0 and --dcgm-port 0 leave no exporter to list")
    rid = Run.find(run_id).id if run_id else None
    text = dumps(target_groups(inv, ports, live_records(), rid))
    if output is None:
        sys.stdout.write(text)
        return
    write_atomic(Path(output), text)
    click.echo(f"clusterctl: wrote {output} ({len(inv.nodes)} nodes, {', '.join(ports)})", err=True)

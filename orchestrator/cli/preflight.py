"""`clusterctl preflight`: the registered checks (orchestrator/checks/registry.py) as a command."""

from __future__ import annotations

import json
import os
import sys

import click

from orchestrator.checks.preflight import run_preflight, select_checks
from orchestrator.checks.registry import CHECKS, REGISTRY
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import EXIT_FAILED, EXIT_OK, with_unreachable
from orchestrator.transfer.files import code_source


@click.command("preflight")
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the table.")
@click.option("--only", default=None, metavar="CHECKS", help=f"Only these checks (comma list of: {', '.join(CHECKS)}).")
@click.option("--skip", "skip_", default=None, metavar="CHECKS", help="Leave these checks out (comma list).")
@click.option("--details", is_flag=True, help="Show every check's detail, not only warnings and failures.")
@click.option("--list", "list_", is_flag=True, help="List the checks (what each verifies, where, the usual fix) and exit.")
@click.option("--port-timeout", type=click.FloatRange(0.5, 60), default=3.0, show_default=True,
              help="Seconds each worker waits for its connect to master:master_port.")
def preflight_command(opts: ClusterOptions, as_json: bool, only: str | None, skip_: str | None,
                      port_timeout: float, details: bool, list_: bool):
    """Check every node before a run: SSH, ping, GPUs, ports, firewall, clocks, code, Python, iface,
    disk, /dev/shm and the output directory.

    One probe per node over its single SSH connection. Exit code 0 when nothing failed
    (warnings allowed), 1 when a check failed, 2 for a bad flag or inventory, 3 when a
    node could not be reached (the other nodes are still checked and shown)."""
    if list_:
        for c in REGISTRY:
            where = {"all": "every node", "master": "the master", "workers": "workers"}[c.nodes]
            fast = ", also before `train`" if c.fast else ""
            click.echo(f"{c.name:15} {c.summary} ({where}{fast})\n{'':15} fix: {c.remedy}")
        sys.exit(EXIT_OK)
    checks = select_checks(only, skip_)
    inv = opts.load()
    # code_sync compares every node with what `sync` would push from here
    source = code_source(inv) if "code_sync" in checks else None
    with opts.cluster(inv) as cluster:
        report = run_preflight(cluster, inv, checks, connect_timeout=port_timeout,
                               control_dir=source if source and os.path.isdir(source) else None, code_required=True)
        unreachable = list(cluster.unreachable)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        from rich.console import Console

        report.render(Console(), details=details)
    sys.exit(with_unreachable(unreachable, EXIT_OK if report.ok else EXIT_FAILED))

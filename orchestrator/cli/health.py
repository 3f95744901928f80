"""`clusterctl health`: every node's health now (preflight's gpu_health on each), the faults attributed
to it across runs (runs/nodefaults.py), and which nodes are quarantined (runs/quarantine.py), with
the reason and since when; `--release` lets nodes be used again."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import click

from orchestrator.checks.preflight import run_preflight
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import EXIT_FAILED, EXIT_OK, with_unreachable
from orchestrator.runs import nodefaults, quarantine


def _release(inv, names: str) -> None:
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {n.name: n for n in inv.nodes}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise click.UsageError(f"--release {names}: {', '.join(unknown)} not in the inventory "
                               f"(its nodes: {', '.join(known)})")
    gone = quarantine.release([known[n] for n in wanted])
    nodefaults.released(gone)  # faults before the release no longer count toward a quarantine
    released = {e.node for e in gone}
    for n in wanted:
        click.echo(f"{n}: released (was: {next(e.reason for e in gone if e.node == n)})" if n in released
                   else f"{n}: was not quarantined")


def _rows(inv, report) -> list[dict]:
    held = quarantine.of(inv.nodes)
    by_name = {nr.node.name: nr for nr in report.nodes}
    faults, now, window = nodefaults.load(), time.time(), inv.train.quarantine_window
    rows = []
    for n in inv.nodes:
        r = by_name[n.name].results.get("gpu_health") if n.name in by_name else None
        e = held.get(n.name)
        mine = [f for f in nodefaults.of(n, faults) if f.kind != nodefaults.RELEASED]
        rows.append({"name": n.name, "host": n.host, "spare": n.spare,
                     "health": r.status if r else "unreachable", "detail": r.detail if r else "",
                     "quarantined": e is not None, "reason": e.reason if e else None,
                     "since": e.since if e else None, "run": e.run if e else None,
                     "faults": [dataclasses.asdict(f) for f in mine],
                     "faults_counted": len(nodefaults.counted(n, faults, window, now))})
    return rows


@click.command("health")
@cluster_options
@click.option("--release", metavar="NODES", default=None,
              help="Let these nodes (comma list) be used by launches and restarts again, once repaired.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document instead of the table.")
def health_command(opts: ClusterOptions, release: str | None, as_json: bool):
    """Every node's GPU health now, its faults across runs, and which nodes are quarantined.

    A node whose health check fails when `train` launches or restarts is quarantined, and so is
    one with train.quarantine_after faults attributed to it (lost, killed, hung, straggled)
    within train.quarantine_window: no run from this machine uses it (a spare takes its place)
    until `--release NODE`;
    `train --allow-unhealthy` uses it for one run. Exit 0 when every reachable node is
    healthy, 1 when a node's health fails or a node is quarantined, 3 when a node could not
    be reached."""
    inv = opts.load()
    if release is not None:
        _release(inv, release)
        sys.exit(EXIT_OK)
    with opts.cluster(inv) as cluster:
        report = run_preflight(cluster, inv, ["ssh", "gpu_health"])
        unreachable = list(cluster.unreachable)
    rows = _rows(inv, report)
    if as_json:
        click.echo(json.dumps({"nodes": rows, "quarantine_file": str(quarantine.path())}, indent=2))
    else:
        _table(rows)
    bad = any(r["health"] == "fail" or r["quarantined"] for r in rows)
    sys.exit(with_unreachable(unreachable, EXIT_FAILED if bad else EXIT_OK))


def _table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for col in ("node", "health", "faults", "quarantined"):
        t.add_column(col, overflow="fold")
    for r in rows:
        since = time.strftime("%m-%d %H:%M", time.localtime(r["since"])) if r["since"] else ""
        q = f"since {since}: {r['reason']}" if r["quarantined"] else "no"
        name = r["name"] + (" (spare)" if r["spare"] else "")
        t.add_row(name, f"{r['health']}: {r['detail']}" if r["detail"] else r["health"], _faults(r), q)
    Console().print(t)
    _fault_lines(rows)
    if any(r["quarantined"] for r in rows):
        click.echo("release a repaired node with `clusterctl health --release NODE`; "
                   "`train --allow-unhealthy` uses quarantined nodes for one run")


def _faults(row: dict) -> str:
    """The table's cell: how many faults by kind, and how many count toward a quarantine now."""
    if not row["faults"]:
        return "none"
    kinds: dict[str, int] = {}
    for f in row["faults"]:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + (f.get("tally") or 1)  # a tally: older faults folded
    return ", ".join(f"{k} {n}" for k, n in kinds.items()) + f" ({row['faults_counted']} counted)"


def _fault_lines(rows: list[dict]) -> None:
    """Below the table, each node's newest faults (five at most), one line each."""
    for r in rows:
        faults = [nodefaults.Fault(**f) for f in r["faults"]]
        if faults:
            earlier = sum(f.weight for f in faults[:-5])
            more = f" (and {earlier} earlier)" if earlier else ""
            click.echo(f"{r['name']} faults{more}:")
            for f in faults[-5:]:
                click.echo(f"  {f.line()}")

from __future__ import annotations

import sys

import click

from orchestrator.cli.jsonout import emit
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import EXIT_FAILED, EXIT_OK, UsageError, with_unreachable
from orchestrator.pyenv import requirements_path


def _summary(report) -> str:
    counts = {}
    for r in report.results:
        counts[r.action] = counts.get(r.action, 0) + 1
    what = ", ".join(f"{n} {a}" for a, n in counts.items())
    ok = sum(r.ok for r in report.results)
    shipped = len({w for r in report.results for w in r.wheels})
    return (f"setup: {ok}/{len(report.results)} nodes ok ({what}) in {report.seconds:.1f}s; "
            f"{report.packages} packages, {report.wheel_bytes / 1e6:,.1f} MB of wheels ({report.resolved or '-'}), "
            f"{shipped} {'wheel' if shipped == 1 else 'wheels'} shipped, "
            f"{report.bytes_sent / 1e6:,.1f} MB left this machine")


@click.command("setup")
@cluster_options
@click.option("--force", is_flag=True,
              help="Rebuild venvs that are already current, trusting nothing: every wheel in the nodes' caches "
                   "is checked against its sha256 and unpacked again, and every checked module imported.")
@click.option("--refresh", is_flag=True,
              help="Resolve the requirements again, even though this file was resolved before (unpinned "
                   "requirements then move to their newest versions).")
@click.option("--online", is_flag=True,
              help="The nodes can reach an index: ship only the lock (and uv), and let each node download "
                   "exactly the locked files (sha256-checked) from its index; the inventory's env: may set "
                   "PIP_INDEX_URL or UV_DEFAULT_INDEX.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document (per node: name, ok, action, hash, seconds, bytes, error).")
def setup_command(opts: ClusterOptions, force: bool, refresh: bool, online: bool, as_json: bool):
    """Build the inventory's `setup:` venv, identical on every node, with no index on the nodes.

    The requirements are resolved once here (pip, with this machine's pip configuration) into a
    wheelhouse; each node is sent only the wheels its cache lacks (sync's relay: each file leaves
    this machine once), and installs with no index into a new directory that replaces the venv
    only once it imports. Packages an earlier venv had are linked from uv's unpacked copies, and
    only the modules a change reaches are imported, so adding one package costs about that
    package. An edit that only adds lines keeps every other pin (--refresh moves them). Nodes
    whose venv records the same resolved set are skipped. Then preflight's python_env runs. With
    `clusterctl: true` in setup:, clusterctl's node side goes into the venv too (`render
    slurm|k8s` run it there)."""
    from rich.console import Console

    from orchestrator.checks.preflight import run_preflight
    from orchestrator.pyenv.nodes import setup_nodes
    from orchestrator.transfer.progress import RichEvents, SyncEvents

    inv = opts.load()
    if inv.setup is None:
        raise UsageError(f"{inv.source} has no setup: section; add one, e.g. setup: {{requirements: "
                         "trainer/requirements.txt, venv: ~/venvs/train}")
    req = requirements_path(inv)
    console = Console(stderr=True)
    with opts.cluster(inv) as cluster:
        if as_json:
            report = setup_nodes(cluster, inv, req, force=force, refresh=refresh, online=online,
                                 events=SyncEvents())
        else:
            with RichEvents(console) as events:
                report = setup_nodes(cluster, inv, req, force=force, refresh=refresh, online=online,
                                     events=events)
        check = run_preflight(cluster, inv, ["python_env"])
        unreachable = list(cluster.unreachable)
    bad_env = {n.node.name: r.detail for n in check.nodes
               if (r := n.results.get("python_env")) is not None and r.status == "fail"}
    ok = report.ok and not bad_env
    code = with_unreachable(unreachable, EXIT_OK if ok else EXIT_FAILED)
    if as_json:
        emit(report.to_json() | {"ok": ok, "python_env": bad_env or "ok"})
        sys.exit(code)
    for r in report.results:
        mark = {"failed": "[bold red]failed[/]", "unchanged": "unchanged"}.get(r.action, f"[green]{r.action}[/]")
        tag = f" (hash {r.hash[:12]})" if r.hash and r.ok else ""
        detail = "" if r.action == "unchanged" else f": {r.detail}"
        console.print(f"  {r.node}: {mark}{tag}{detail}", soft_wrap=True, markup=True, highlight=False)
    for note in report.notes:
        console.print(f"  note: {note}", soft_wrap=True, markup=False, highlight=False)
    for name, detail in bad_env.items():
        console.print(f"  {name}: python_env: {detail}", soft_wrap=True, markup=False, highlight=False)
    console.print(_summary(report), soft_wrap=True, highlight=False, markup=False)
    console.print(f"[green]setup ok: {inv.setup.python} on every node, python_env passes[/]" if ok
                  else "[bold red]setup incomplete[/]")
    sys.exit(code)

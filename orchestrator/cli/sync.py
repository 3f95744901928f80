from __future__ import annotations

import os
import sys

import click

from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import EXIT_FAILED, EXIT_OK, UsageError, with_unreachable
from orchestrator.sync import sync


@click.command("sync")
@cluster_options
@click.option("--src", type=click.Path(file_okay=False), default=None,
              help="Local directory to push (default: the inventory's workdir on this machine).")
@click.option("--method", type=click.Choice(["auto", "rsync", "tar"]), default="auto", show_default=True,
              help="auto: rsync where both sides have it, else a tar stream over the SSH connection.")
def sync_command(opts: ClusterOptions, src: str | None, method: str):
    """Push the workdir to every node in parallel (.gitignore aware), then check code_sync."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from orchestrator.checks.preflight import run_preflight

    inv = opts.load()
    src = os.path.expanduser(src or inv.workdir)
    if not os.path.isdir(src):
        raise UsageError(f"nothing to push: {src} is not a directory here (use --src DIR)")
    console = Console(stderr=True)
    with opts.cluster(inv) as cluster:
        with Progress(TextColumn("sync"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=console, transient=not console.is_terminal) as progress:
            task = progress.add_task("", total=len(inv.nodes))
            results = sync(cluster, inv, src, method=method,
                           on_done=lambda r: progress.update(task, advance=1, description=r.node))
        for r in results:
            mark = "[green]ok[/]" if r.ok else "[bold red]failed[/]"
            console.print(f"  {r.node}: {mark} {r.method}: {r.detail}", soft_wrap=True, markup=True)
        report = run_preflight(cluster, inv, ["code_sync"], control_dir=src)
        unreachable = list(cluster.unreachable)
    for n in report.nodes:
        r = n.results.get("code_sync")
        if r is not None and r.status != "ok":
            console.print(f"  {n.node.name}: code_sync {r.status}: {r.detail}", soft_wrap=True)
    ok = all(r.ok for r in results) and report.ok
    console.print("[green]sync ok: code_sync passes on every node[/]" if ok else "[bold red]sync incomplete[/]")
    sys.exit(with_unreachable(unreachable, EXIT_OK if ok else EXIT_FAILED))


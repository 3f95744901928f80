from __future__ import annotations

import json

import click

from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import UnreachableError
from orchestrator.netbench import (
    NetReport,
    measure_allreduce,
    measure_links,
    parse_size,
)


def _fmt_bps(bps: float) -> str:
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.0f} Mbit/s"


@click.command("netbench")
@cluster_options
@click.option("--seconds", type=click.FloatRange(0.2, 60), default=2.0, show_default=True,
              help="How long each throughput transfer should last.")
@click.option("--allreduce", "allreduce_size", default=None,
              help="Also time a torch.distributed all-reduce of this size across all nodes (e.g. 60.3MB).")
@click.option("--dtype", type=click.Choice(["fp16", "bf16", "fp32"]), default="fp16", show_default=True)
@click.option("--iters", type=click.IntRange(1, 100), default=3, show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=0,
              help="Port for the throughput probe on the master (default: any free port).")
@click.option("--save", type=click.Path(dir_okay=False), help="Write the JSON here (for `plan --link`).")
@click.option("--json", "as_json", is_flag=True)
def netbench_command(opts: ClusterOptions, seconds, allreduce_size, dtype, iters, port, save, as_json):
    """Measure master<->worker TCP throughput and latency (and optionally an all-reduce)."""
    from rich.console import Console
    from rich.table import Table

    inv = opts.load()
    if len(inv.nodes) < 2:
        raise click.UsageError("netbench needs at least two nodes")
    nbytes = parse_size(allreduce_size) if allreduce_size else None
    with opts.cluster(inv) as cluster:
        if cluster.unreachable:
            raise UnreachableError({k: v.error for k, v in cluster.unreachable.items()}, "nothing was measured")
        report = NetReport(inv.master.name, measure_links(cluster, inv, seconds=seconds, port=port))
        if nbytes:
            report.allreduce = measure_allreduce(cluster, inv, nbytes=nbytes, iters=iters, dtype=dtype)
    doc = report.to_json()
    if save:
        with open(save, "w") as f:
            json.dump(doc, f, indent=2)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    con = Console()
    t = Table(title=f"links to the master ({inv.master.name})")
    for c in ("worker", "up (→master)", "down (master→)", "rtt"):
        t.add_column(c)
    for x in report.links:
        t.add_row(x.node, _fmt_bps(x.up_bps), _fmt_bps(x.down_bps), f"{x.rtt_s * 1e3:.2f} ms")
    con.print(t)
    if report.allreduce:
        a = report.allreduce
        con.print(f"all-reduce of {a.nbytes / 1e6:.1f} MB ({a.dtype}, {a.backend}, {a.nodes} nodes): "
                  f"median {a.seconds:.3f} s over {len(a.times)}")
    con.print(f"for the planner: clusterctl plan --bandwidth {report.bandwidth_bps / 1e6:.0f}mbit "
              f"--latency {report.latency_s * 1e6:.0f}us" + (f"   (or --link {save})" if save else ""))

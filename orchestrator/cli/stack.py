"""`clusterctl stack`: every rank's Python stack and collectives now, by run id.

Asks each node of the run's current attempt (node agent `snapshot`) for its ranks: the hook
clusterctl puts on every rank's PYTHONPATH answers with all its threads' stacks and its Flight
Recorder (remote/hook/sitecustomize.py), a stopped or D-state rank is named by its /proc state.
Identical stacks print once under their ranks, like `exec -b` (runs/judge/hang.py stacks_text). The
same snapshot the hang watch takes, on demand and without stopping anything.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Collection

import click

from orchestrator.cli.runs import _err, complete_run_ids
from orchestrator.errors import EXIT_FAILED, EXIT_OK, ClusterctlError, with_unreachable
from orchestrator.node import agent
from orchestrator.runs.judge.hang import SNAPSHOT_WAIT_S, RankSnap, stacks_text
from orchestrator.runs.runrecord import AttemptRecord
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster


def take_stacks(run: Run, a: AttemptRecord, names: list[str], ranks: Collection[int] = (),
                wait: float = SNAPSHOT_WAIT_S) -> tuple[list[RankSnap], dict[str, list], dict[str, str]]:
    """Attempt `a`'s ranks on the nodes `names` now (only `ranks`, when given): (their snapshots,
    each node's documents as its agent reported them, node -> why it could not be asked)."""
    spec = run.spec
    request = time.time_ns() // 1_000_000  # unique per ask: the hang watch asks the same hooks
    with Cluster(spec.load_inventory(names), connect_timeout=spec.connect_timeout, fanout=spec.fanout,
                 accept_new_host_keys=spec.accept_new_host_keys) as cluster:
        got = agent.run(cluster, lambda n: agent.snapshot(n, a.key, request, wait))
        unreachable = {name: r.error for name, r in cluster.unreachable.items()}
    snaps, docs = [], {}
    for name, sn in sorted(got.items()):
        if sn.error is not None:
            unreachable[name] = sn.error
            continue
        keep = [d for d in sn.ranks if not ranks or d.get("rank") in ranks]
        docs[name] = keep
        snaps.extend(RankSnap.from_agent(name, d) for d in keep)
    return snaps, docs, unreachable


@click.command("stack")
@click.argument("run_id", required=False, shell_complete=complete_run_ids)
@click.option("--node", "nodes", multiple=True, help="Only this node's ranks (repeatable).")
@click.option("--rank", "ranks", type=click.IntRange(0), multiple=True, help="Only this global rank (repeatable).")
@click.option("--wait", type=click.FloatRange(1, 120), default=SNAPSHOT_WAIT_S, show_default=True,
              help="Seconds each rank has to answer.")
@click.option("--json", "as_json", is_flag=True, help="Each rank as its node's agent reported it.")
def stack_command(run_id, nodes, ranks, wait, as_json):
    """Every rank's Python stack and collectives now (the latest run by default).

    Exits 1 when a rank did not answer (stopped, in D state, no hook), 3 when a node could not
    be reached."""
    run = Run.find(run_id)
    rec = run.record
    a = rec.current
    if a is None or rec.state.terminal:
        where = f"; its last hang's stacks: {run.dir / a.hang_dir / 'stacks.txt'}" if a and a.hang_dir else ""
        raise ClusterctlError(f"run {run.id} is {rec.state}: it has no ranks to ask{where}")
    unknown = sorted(set(nodes) - set(a.nodes))
    if unknown:
        raise click.UsageError(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not in attempt "
                               f"{a.attempt} of run {run.id} ({', '.join(a.nodes)})")
    names = [n for n in a.nodes if not nodes or n in nodes]
    snaps, docs, unreachable = take_stacks(run, a, names, ranks, wait)
    for name, why in sorted(unreachable.items()):
        _err(f"clusterctl: {name}: {why}")
    if as_json:
        click.echo(json.dumps({"run_id": run.id, "attempt": a.attempt, "nodes": docs,
                               "unreachable": unreachable}, indent=2))
    elif snaps:
        click.echo(f"run {run.id}, attempt {a.attempt}: {len(snaps)} rank{'s' if len(snaps) != 1 else ''} on "
                   f"{len(docs)} node{'s' if len(docs) != 1 else ''}")
        click.echo(stacks_text(snaps), nl=False)
    else:
        _err(f"clusterctl: no rank of run {run.id} found on {', '.join(names)}")
    silent = [s for s in snaps if not s.answered]
    sys.exit(with_unreachable(unreachable, EXIT_FAILED if silent or not snaps else EXIT_OK))


__all__ = ["stack_command", "take_stacks"]

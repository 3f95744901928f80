"""`clusterctl status` and `clusterctl runs`: a run's nodes now, and the runs recorded here.

Both render with rich tables sized to the terminal (80 columns when not one); their layouts at
80 and 120 columns are held by tests/test_golden.py.
"""

from __future__ import annotations

import json
import time

import click

from orchestrator.cli import tables
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.cli.runs import _err, _summary, complete_run_ids, ensure_supervisor
from orchestrator.errors import UnreachableError
from orchestrator.home import runs_dir
from orchestrator.node import agent
from orchestrator.node.agent import AgentStatus
from orchestrator.runs.spec import NodeState
from orchestrator.runs.ckpt.jobdir_replicas import newest_copied
from orchestrator.runs.goodput import of_run
from orchestrator.runs.liveview import COLLECTIVES_NOTE, LiveView
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster


def _nodes_table(run: Run, rec: RunRecord, from_nodes: dict[str, AgentStatus], now: float, view: LiveView,
                 note: str = ""):
    """The attempt, its nodes in rank order, each node's state (the nodes' own word when they
    were asked), pid, exit, runtime, step (runs/liveview.py: the log's, else the hook's, else
    its collectives) and the job's last line there."""
    a = rec.current
    tries = f", attempt {a.attempt} of at most {tables.at_most(rec, run.spec.max_restarts)}" if a is not None else ""
    steps = {r.name: r.progress for r in view.rows(now=now)}
    rows = []
    for nd in rec.nodes:
        state, code, last = nd.state, nd.exit_code, tables.last_line(run.node_log(nd.name), nd.first_rank)
        asked = from_nodes.get(nd.name)
        if asked is not None:  # the nodes' own word beats a stale record (its last line: the job's)
            code, last = code if asked.error else asked.exit_code, tables.node_line(asked.last_line, nd.first_rank)[0] or last
            state = _node_state_now(asked, code)
        rows.append((nd.name, nd.ranks, tables.shown_state(state, rec), str(nd.pid or "-"),
                     "-" if code is None else str(code), tables.runtime(nd, rec, now), steps.get(nd.name, "-"), last))
    return tables.status_table(f"{run.id}: {rec.state}{tries}{note}", rows)


def ask_nodes(run: Run, rec: RunRecord) -> dict[str, AgentStatus]:
    """Each started node's own view of the run's current attempt (node agent `status` under that
    attempt's key, RunRecord.key: RUN, then RUN.aK), for when the supervisor is gone."""
    spec = run.spec
    started = [nd.name for nd in rec.nodes if nd.pid]
    if not started:
        return {}
    key = rec.key
    with Cluster(spec.load_inventory(started), connect_timeout=spec.connect_timeout, fanout=spec.fanout) as cluster:
        out = agent.run(cluster, lambda n: agent.status(n, key))
        for name, r in cluster.unreachable.items():
            out[name] = AgentStatus(error=r.error)
    return out


def _node_state_now(now: AgentStatus, code: int | None) -> NodeState:
    """A node's state from its own answer (the node agent's `status`)."""
    if now.error:
        return NodeState.UNREACHABLE
    if code is None and now.alive:
        return NodeState.RUNNING
    if code is None:
        return NodeState.GONE
    return NodeState.FINISHED if code == 0 else NodeState.FAILED


@click.command("status")
@click.argument("run_id", required=False, shell_complete=complete_run_ids)
@click.option("--json", "as_json", is_flag=True)
def status_command(run_id, as_json):
    """Per node: state, pid, exit code, runtime and last line of a run (the latest by default)."""
    from rich.console import Console

    run = Run.find(run_id)
    rec = run.record
    alive, terminal = run.supervisor_alive(), rec.state.terminal
    from_nodes = {} if alive or terminal else ask_nodes(run, rec)
    if not alive:
        ensure_supervisor(run)
    view = LiveView(run.dir, run.spec.hang_timeout)
    view.look(rec.nodes, rec.current)
    ledger = of_run(run)
    if as_json:
        nodes_now = {name: s.as_json() for name, s in from_nodes.items()}
        click.echo(json.dumps({**rec.to_json(), "supervisor_alive": alive, "nodes_now": nodes_now,
                               "ranks_now": view.ranks_json(), "goodput": ledger.to_json()}, indent=2))
        return
    a = rec.current
    Console().print(_nodes_table(run, rec, from_nodes, time.time(), view,
                                 "" if alive or terminal else " (supervisor gone: asked the nodes and started one "
                                 "that takes the run over)"))
    if any(r.collectives is not None for r in view.rows()):
        _err(f"clusterctl: {COLLECTIVES_NOTE}")
    if a is not None and a.preflight_ok is False and a.preflight_file:  # the table that says what to fix
        _err((run.dir / a.preflight_file).read_text().rstrip() if (run.dir / a.preflight_file).exists() else "")
    newest = newest_copied(run.dir)
    if newest is not None:
        _err(f"clusterctl: newest checkpoint copied home: {newest}, in {run.dir / 'checkpoints'}")
    if a is not None and a.hang:
        _err(f"clusterctl: attempt {a.attempt}: {a.hang}" + (f" (snapshots: {run.dir / a.hang_dir})"
                                                             if a.hang_dir else ""))
    if a is not None and a.straggler:  # named now by the straggler watch (runs/judge/straggler.py)
        _err(f"clusterctl: attempt {a.attempt}: {a.straggler}")
    if rec.recovering:
        _err(f"clusterctl: recovering after {rec.recovering}")
    if (line := tables.goodput_line(ledger)) is not None:  # `clusterctl goodput` has the whole ledger
        _err(f"clusterctl: {line}")
    if rec.summary or rec.error:
        _summary(rec)
    for p in rec.pending_stops:
        why = f": {p.why} (try {p.tries}" + (f", next in {max(0, p.next_try - time.time()):.0f}s)"
                                             if p.next_try else ")") if p.why else ""
        _err(f"clusterctl: stop pending on {p.node} ({p.key}){why}: not confirmed yet; it is carried out as "
             "soon as the node answers again")


@click.command("runs")
@cluster_options
@click.option("--cluster", "on_cluster", is_flag=True,
              help="Ask the inventory's nodes (-i) which runs hold them, from whichever control machine.")
@click.option("--json", "as_json", is_flag=True)
def runs_command(opts: ClusterOptions, on_cluster, as_json):
    """The runs recorded on this control machine, oldest first; with --cluster, every run holding
    a node of the inventory: run id, who started it (user@control-host), since when, its nodes."""
    from rich.console import Console

    if on_cluster:
        return _cluster_runs(opts, as_json)
    rows = [r.record for r in Run.all()]
    if as_json:
        click.echo(json.dumps([rec.to_json() for rec in rows], indent=2))
        return
    click.echo(f"runs recorded in the control home {runs_dir().parent}")  # CLUSTERCTL_HOME picks another
    Console().print(tables.runs_table(rows))


def _cluster_runs(opts: ClusterOptions, as_json: bool) -> None:
    """`runs --cluster`: the nodes' claims, grouped by run; exit 3 naming nodes not asked."""
    from rich.console import Console
    from rich.table import Table

    from orchestrator.runs.queue import cluster_runs

    inv = opts.load()
    with opts.cluster(inv) as cluster:
        held, failed = cluster_runs(cluster, [n.name for n in inv.nodes])
    if as_json:
        click.echo(json.dumps(held, indent=2))
    else:
        t = Table(title="runs on the cluster")
        t.add_column("run", no_wrap=True, min_width=max((len(d["run"]) for d in held), default=3))
        for c in ("who", "since", "claims", "live processes"):
            t.add_column(c, no_wrap=c == "since")
        for d in held:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["since"])) if d.get("since") else "-"
            live = ", ".join(f"{n} ({', '.join(k.split('@')[0] for k in ks)})" for n, ks in d["live"].items())
            t.add_row(d["run"], d.get("who") or "?", since, ",".join(d["nodes"]) or "-", live or "-")
        Console().print(t)
    if failed:
        raise UnreachableError(failed, "so runs holding them may be missing above")


__all__ = ["ask_nodes", "runs_command", "status_command"]

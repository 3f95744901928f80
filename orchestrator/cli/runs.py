"""`clusterctl tail`, `status`, `runs`, `stop`, and following a run's logs (shared with `train`).

Everything here re-attaches by run id: the supervisor's copies first, then the nodes
themselves when the supervisor is gone (a crashed or killed controller loses nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import click

from orchestrator.cli.jsonout import emit, json_lines, run_doc
from orchestrator.cli.output import Prefixer
from orchestrator.errors import EXIT_INTERRUPTED, ClusterctlError, UnreachableError
from orchestrator.runs.launch import agent_status, stop_on
from orchestrator.runs.logs import Follower, NodeLog, last_lines_offset
from orchestrator.runs.spec import NodeState, NodeStatus, RunState
from orchestrator.runs.store import Run
from orchestrator.runs.watch import copy_logs
from orchestrator.transport import Cluster

SUPERVISOR_GRACE_S = 10  # a run this young may not have recorded its supervisor yet


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def complete_run_ids(ctx, param, incomplete: str):
    """Shell completion: the recorded run ids, newest first."""
    from click.shell_completion import CompletionItem

    try:
        runs = reversed(Run.all())
        return [CompletionItem(r.id, help=str(r.record.get("state", ""))) for r in runs if r.id.startswith(incomplete)]
    except Exception:  # noqa: BLE001 - completion never fails loudly
        return []


def _logs_for(run: Run, rec: dict, n: int | None) -> list[NodeLog]:
    """One NodeLog per node of the run: from the start, or from each log's last `n` lines."""
    return [NodeLog(nd.name, path, nd.first_rank, 0 if n is None else last_lines_offset(path, n))
            for nd in run.nodes(rec) for path in [run.node_log(nd.name)]]


def _printer(rec: dict) -> Prefixer:
    return Prefixer([f"{nd['name']}/r{nd.get('last_rank', 0)}" for nd in rec.get("nodes", [])])


def _summary(rec: dict) -> None:
    state, code = rec.get("state"), rec.get("exit_code")
    if rec.get("error"):
        _err(f"clusterctl: run {rec.get('id')} {state}: {rec['error']}")
    elif rec.get("summary"):
        _err(f"clusterctl: run {rec.get('id')} {state} (exit code {code}): {rec['summary']}")
    else:
        _err(f"clusterctl: run {rec.get('id')} {state} (exit code {code})")


class _Show:
    """What `follow` prints once: the preflight table, the rank map, then the log lines."""

    def __init__(self, run: Run, n: int | None, node: str | None, rank: int | None, show_preflight: bool,
                 sink=None):
        self.run, self.n, self.node, self.rank, self.sink = run, n, node, rank, sink
        self.shown_pf = not show_preflight
        self.pf_text = ""
        self.follower: Follower | None = None

    def header(self, rec: dict) -> None:
        pf = self.run.dir / "preflight.txt"
        if not self.shown_pf and pf.exists():
            self.pf_text = pf.read_text()
            click.echo(self.pf_text.rstrip(), err=True)
            self.shown_pf = True
        if self.follower is None and rec.get("rank_map"):
            # the preflight table already shows the same map unless --nproc-per-node changed it
            if rec["rank_map"] not in self.pf_text:
                click.echo(rec["rank_map"], err=True)
            self.start(rec)

    def start(self, rec: dict) -> Follower:
        if self.follower is None:
            self.follower = Follower(_logs_for(self.run, rec, self.n), _printer(rec), node=self.node, rank=self.rank,
                                     sink=self.sink)
        return self.follower


def follow(run: Run, *, keep_following: bool = True, n: int | None = None, node: str | None = None,
           rank: int | None = None, on_interrupt=None, show_preflight: bool = True,
           supervisor: subprocess.Popen | None = None, sink=None) -> int:
    """Print the run's lines until it ends (or once, without following); `sink(label, stream,
    text, node)` takes each line instead of the prefixed printer (--json)."""
    show = _Show(run, n, node, rank, show_preflight, sink)
    while True:
        try:
            rec = run.record
            show.header(rec)
            terminal = run.state(rec).terminal
            if show.follower:
                show.follower.poll(final=terminal or not keep_following)
            if terminal or not keep_following:
                break
            if supervisor is not None:
                supervisor.poll()  # reap it, so a dead supervisor is seen as dead
            if not run.supervisor_alive() and time.time() - rec.get("created", 0) > SUPERVISOR_GRACE_S:
                rec = run.record
                if not run.state(rec).terminal:
                    return recover(run, show.start(rec))
            time.sleep(0.1)
        except KeyboardInterrupt:
            if on_interrupt is None:
                raise
            on_interrupt()
    _summary(run.record)
    code = run.record.get("exit_code")
    return 1 if code is None else int(code)


def recover(run: Run, follower: Follower) -> int:
    """The supervisor is gone but the run was not finished: fetch the rest from the nodes by
    byte offset (so every line is printed exactly once), and record how it ended."""
    spec, rec = run.spec, run.record
    _err(f"clusterctl: the supervisor of {run.id} is gone; reading the rest from the nodes")
    inv = spec.load_inventory()
    started = {nd.name for nd in run.nodes(rec) if nd.pid}
    with Cluster(inv, connect_timeout=spec.connect_timeout, fanout=spec.fanout,
                 lost_timeout=spec.lost_timeout) as cluster:
        reachable = [nd for nd in inv.nodes if nd.name in started and nd.name in cluster.connections]
        copy_logs(cluster, run, reachable, on_end=lambda _res: None, echo=_err, after_write=follower.poll)
        follower.poll(final=True)
        now = agent_status(cluster, run.id, [nd.name for nd in reachable])
    codes = {name: doc.get("exit_code") for name, doc in now.items()}
    bad = {k: v for k, v in codes.items() if v != 0}
    first = next(iter(bad.items()), None)
    nodes = [dict(nd, exit_code=codes.get(nd["name"], nd.get("exit_code"))) for nd in rec.get("nodes", [])]
    run.update(nodes=nodes, state=RunState.FAILED if bad else RunState.FINISHED,
               exit_code=(first[1] if first and first[1] is not None else (255 if first else 0)),
               summary="recovered from the nodes after the supervisor was gone"
               + (f"; {first[0]} exited {first[1]}" if first else ""), ended=time.time())
    _summary(run.record)
    return int(run.record["exit_code"])


@click.command("tail")
@click.argument("run_id", required=False, shell_complete=complete_run_ids)
@click.option("-n", "lines", type=click.IntRange(0), default=None, help="Start with the last N lines of each node.")
@click.option("--no-follow", is_flag=True, help="Print what is there and return.")
@click.option("--node", help="Only this node's lines.")
@click.option("--rank", type=click.IntRange(0), default=None, help="Only this global rank's lines.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per log line, then one for the run "
                                                        "(orchestrator/schemas/tail.json).")
def tail_command(run_id, lines, no_follow, node, rank, as_json):
    """Re-attach to a run (the latest by default); Ctrl-C detaches, the run goes on."""
    run = Run.find(run_id)
    try:
        code = follow(run, keep_following=not no_follow, n=lines, node=node, rank=rank,
                      sink=json_lines if as_json else None)
        if as_json:
            emit(run_doc(run.record), compact=True)
        sys.exit(code)
    except KeyboardInterrupt:
        _err(f"clusterctl: detached from {run.id}; it keeps running (clusterctl stop {run.id} to stop it)")
        sys.exit(EXIT_INTERRUPTED)


def _runtime(nd: NodeStatus, rec: dict) -> str:
    start = rec.get("started")
    if not start:
        return "-"
    end = nd.ended or rec.get("ended") or time.time()
    s = int(end - start)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _last_line(run: Run, node: str) -> str:
    p = run.node_log(node)
    off = last_lines_offset(p, 1)
    try:
        with open(p, "rb") as f:
            f.seek(off)
            return f.read().decode(errors="replace").strip()[:100]
    except OSError:
        return ""


def ask_nodes(run: Run) -> dict[str, dict]:
    """Each started node's own view of the run (node agent `status`), for when the supervisor is gone."""
    spec = run.spec
    started = [nd.name for nd in run.nodes() if nd.pid]
    if not started:
        return {}
    with Cluster(spec.load_inventory(started), connect_timeout=spec.connect_timeout, fanout=spec.fanout) as cluster:
        out = agent_status(cluster, run.id)
        for name, r in cluster.unreachable.items():
            out[name] = {"error": r.error}
    return out


def _node_state_now(now: dict, code: int | None) -> NodeState:
    """A node's state from its own answer (the node agent's `status`)."""
    if now.get("error"):
        return NodeState.UNREACHABLE
    if code is None and now.get("alive"):
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
    from rich.table import Table

    run = Run.find(run_id)
    rec = run.record
    alive, terminal = run.supervisor_alive(), run.state(rec).terminal
    from_nodes = {} if alive or terminal else ask_nodes(run)
    if as_json:
        click.echo(json.dumps(dict(rec, supervisor_alive=alive, nodes_now=from_nodes), indent=2))
        return
    t = Table(title=f"{run.id}: {rec.get('state')}" + ("" if alive or terminal else
                                                      " (supervisor gone: asked the nodes; "
                                                      "`clusterctl tail` recovers the logs)"))
    t.add_column("node", no_wrap=True)
    for c in ("ranks", "state", "pid", "exit", "runtime", "last line"):
        t.add_column(c)
    for nd in run.nodes(rec):
        state, code, last = nd.state, nd.exit_code, _last_line(run, nd.name)
        now = from_nodes.get(nd.name)
        if now is not None:  # the nodes' own word beats a stale record
            code, last = now.get("exit_code", code), now.get("last_line") or last
            state = _node_state_now(now, code)
        t.add_row(nd.name, nd.ranks, str(state), str(nd.pid or "-"), "-" if code is None else str(code),
                  _runtime(nd, rec), last[:100])
    Console().print(t)
    if rec.get("summary") or rec.get("error"):
        _summary(rec)


@click.command("runs")
@click.option("--json", "as_json", is_flag=True)
def runs_command(as_json):
    """The runs recorded on this control machine, oldest first."""
    from rich.console import Console
    from rich.table import Table

    rows = [r.record for r in Run.all()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    t = Table(title="runs")
    # the id is what `tail`/`status`/`stop` take: never cut it short, the other columns give way
    t.add_column("run", no_wrap=True, min_width=max((len(r.get("id", "?")) for r in rows), default=3))
    for c in ("state", "nodes", "world", "created", "exit"):
        t.add_column(c, no_wrap=c in ("state", "created"))
    for rec in rows:
        t.add_row(rec.get("id", "?"), rec.get("state", "?"), str(len(rec.get("nodes", []))),
                  str(rec.get("world_size", "-")), time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.get("created", 0))),
                  "-" if rec.get("exit_code") is None else str(rec["exit_code"]))
    Console().print(t)


def _stop_by_supervisor(run: Run, timeout: float) -> None:
    """Ask the supervisor for its graceful stop and wait until the run's record says it ended."""
    os.kill(run.record["supervisor_pid"], signal.SIGTERM)
    deadline = time.time() + timeout
    while not run.terminal:
        if time.time() > deadline:
            raise ClusterctlError(f"run {run.id} did not stop within {timeout:g}s")
        time.sleep(0.2)


@click.command("stop")
@click.argument("run_id", shell_complete=complete_run_ids)
@click.option("--grace", type=click.FloatRange(0, 3600), default=None,
              help="Seconds between SIGTERM and SIGKILL (default: the run's own).")
@click.option("--timeout", type=click.FloatRange(1), default=120, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the run as it ended (orchestrator/schemas/stop.json).")
def stop_command(run_id, grace, timeout, as_json):
    """Stop a run on every node: SIGTERM (the trainer checkpoints), then SIGKILL."""
    run = Run.find(run_id)
    _stop(run, grace, timeout)
    if as_json:
        emit(run_doc(run.record))


def _stop(run: Run, grace: float | None, timeout: float) -> None:
    if run.terminal:
        _err(f"clusterctl: run {run.id} already {run.record.get('state')}")
        return
    if run.supervisor_alive() and grace is None:
        _stop_by_supervisor(run, timeout)
        _summary(run.record)
        return
    if run.supervisor_alive():
        os.kill(run.record["supervisor_pid"], signal.SIGKILL)  # stop directly, with the grace asked for
    spec = run.spec
    with Cluster(spec.load_inventory(), connect_timeout=spec.connect_timeout, fanout=spec.fanout) as cluster:
        res = stop_on(cluster, run.id, spec.grace if grace is None else grace)
    run.update(state=RunState.STOPPED, exit_code=EXIT_INTERRUPTED, ended=time.time(),
               summary="stopped with `clusterctl stop`")
    for name, r in res.failed.items():
        _err(f"clusterctl: {name}: could not stop: {r.describe()}")
    lost = {name: r.describe() for name, r in res.items() if not r.reachable}
    if lost:
        raise UnreachableError(lost, "so the run may still be there; run `clusterctl stop` again once they answer")
    res.check("some nodes could not stop the run (above); run `clusterctl stop` again")
    _summary(run.record)


__all__ = ["follow", "runs_command", "status_command", "stop_command", "tail_command"]

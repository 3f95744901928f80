"""`clusterctl tail`, `status`, `runs`, and following a run's logs (shared with `train`).

Everything here re-attaches by run id. When the run's supervisor is gone (a crashed or
killed controller), `tail`, `status` and `stop` start one that adopts the run
(orchestrator/runs/supervisor.py --adopt): it resumes the log copies where they stopped,
so nothing is lost or printed twice, and applies the failure policy and pending stops.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import click

from orchestrator.cli.jsonout import emit, json_lines, run_doc
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.cli.output import Prefixer
from orchestrator.errors import EXIT_INTERRUPTED, ClusterctlError, UnreachableError
from orchestrator.runs import agent
from orchestrator.runs.agent import AgentStatus
from orchestrator.runs.checkpoints import CheckpointStore
from orchestrator.runs.record import load as load_record
from orchestrator.runs.record import story
from orchestrator.runs.logs import Follower, NodeLog, last_lines_offset, quiet_nodes
from orchestrator.runs.spec import NodeState, NodeStatus
from orchestrator.runs.store import Run
from orchestrator.runs.supervisor import spawn
from orchestrator.transport import Cluster

SUPERVISOR_GRACE_S = 10  # a run this young may not have recorded its supervisor yet
SUPERVISOR_START_S = 30  # how long a replacement supervisor may take to record itself
MAX_RESTARTS = 3  # replacements one `tail` starts before it gives up (see supervisor.log)


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


def _ranks(rec: dict) -> tuple:
    return tuple((nd["name"], nd.get("first_rank")) for nd in rec.get("nodes", []))


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
        self.shown_tables: set[str] = set()
        self.announced: set[int] = set()  # attempts whose start was told
        self.story_at = 0  # the story's bytes printed (a re-attached `tail` tells it from the start)
        self.follower: Follower | None = None
        self.ranks: tuple = ()  # (node, first rank) of the attempt being followed

    def header(self, rec: dict) -> None:
        pf = self.run.dir / "preflight.txt"
        if not self.shown_pf and pf.exists():
            self.pf_text = pf.read_text()
            click.echo(self.pf_text.rstrip(), err=True)
            self.shown_pf = True
        for a in rec.get("attempts") or []:  # a relaunch's failed preflight: the table says what was wrong
            f = a.get("preflight_file")
            if a.get("attempt", 1) > 1 and a.get("preflight_ok") is False and a.get("verdict") and f \
                    and f not in self.shown_tables:
                self.shown_tables.add(f)
                if (self.run.dir / f).exists():
                    click.echo(f"clusterctl: attempt {a['attempt']}'s preflight failed on "
                               f"{', '.join(a.get('bad_nodes') or []) or 'a node'}:", err=True)
                    click.echo((self.run.dir / f).read_text().rstrip(), err=True)
        lines, self.story_at = story(self.run, self.story_at)
        for line in lines:  # what clusterctl saw and did, as it happened (record.py Book.tell)
            click.echo(f"clusterctl: {line}", err=True)
        for a in rec.get("attempts") or []:
            self.announce(a)
        if self.follower is not None:
            self.follower.folder.quiet = quiet_nodes(rec)
        if self.follower is None and rec.get("rank_map"):
            # the preflight table already shows the same map unless --nproc-per-node changed it
            if " ".join(rec["rank_map"].split()) not in " ".join(self.pf_text.split()):  # the table wraps it
                click.echo(rec["rank_map"], err=True)
            self.start(rec)
        elif self.follower is not None and (ranks := _ranks(rec)) != self.ranks:
            self.ranks = ranks  # a restart: the next attempt's nodes and ranks
            self.follower.retarget([(name, self.run.node_log(name), first) for name, first in ranks])

    def announce(self, a: dict) -> None:
        """Once an attempt is launched: what it starts from, and any damaged copy passed over."""
        k = a.get("attempt", 1)
        if k in self.announced or not a.get("launched") or (k == 1 and not a.get("resumed_from")):
            return
        self.announced.add(k)
        if a.get("skipped"):
            click.echo(f"clusterctl: attempt {k}: skipping checkpoint {', '.join(a['skipped'])} on this machine: "
                       "the bytes no longer match their checksums (damaged after the copy)", err=True)
        where = {"nodes": "the nodes"}.get(a.get("restored_from") or "", "this machine")
        if a.get("resumed_from"):
            where = f"run {a['resumed_from']}"
        told = f" with {shlex.join(a['resume_args'])}" if a.get("resume_args") else ""
        click.echo(f"clusterctl: attempt {k} on {', '.join(a.get('nodes') or [])} starts from checkpoint "
                   f"{a['checkpoint']} ({where}){told}" if a.get("checkpoint") else
                   f"clusterctl: attempt {k} on {', '.join(a.get('nodes') or [])} starts from scratch: no "
                   "checkpoint was copied" + (" (--resume-args not added)" if self.run.spec.resume_args else ""), err=True)

    def start(self, rec: dict) -> Follower:
        if self.follower is None:
            self.ranks = _ranks(rec)
            self.follower = Follower(_logs_for(self.run, rec, self.n), _printer(rec), node=self.node, rank=self.rank,
                                     sink=self.sink)
        return self.follower


def ensure_supervisor(run: Run) -> subprocess.Popen | None:
    """Start a supervisor that adopts the run when the recorded one is gone and the run still
    needs one (not ended, or a stop still pending); returns it once it has recorded itself."""
    rec = run.record
    if run.supervisor_alive() or time.time() - rec.get("created", 0) < SUPERVISOR_GRACE_S:
        return None
    if run.state(rec).terminal and not rec.get("stop_pending"):
        return None
    _err(f"clusterctl: the supervisor of {run.id} is gone; starting one that takes the run over")
    proc = spawn(run, adopt=True)
    deadline = time.time() + SUPERVISOR_START_S
    while time.time() < deadline and proc.poll() is None and run.record.get("supervisor_pid") != proc.pid:
        time.sleep(0.1)
    return proc


def follow(run: Run, *, keep_following: bool = True, n: int | None = None, node: str | None = None,
           rank: int | None = None, on_interrupt=None, show_preflight: bool = True,
           supervisor: subprocess.Popen | None = None, sink=None) -> int:
    """Print the run's lines until it ends (or once, without following); `sink(label, stream,
    text, node)` takes each line instead of the prefixed printer (--json)."""
    show = _Show(run, n, node, rank, show_preflight, sink)
    restarts = 0
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
                if restarts >= MAX_RESTARTS:
                    raise ClusterctlError(f"the supervisor of {run.id} keeps dying; see "
                                          f"{run.dir / 'supervisor.log'}")
                supervisor = ensure_supervisor(run) or supervisor
                restarts += 1
            time.sleep(0.1)
        except KeyboardInterrupt:
            if on_interrupt is None:
                raise
            on_interrupt()
    if show.follower:
        show.follower.close()
    _summary(run.record)
    _results(run)
    code = run.record.get("exit_code")
    return 1 if code is None else int(code)


def _results(run: Run) -> None:
    """Where a run's results are on this machine: its checkpoints, its TensorBoard events (with the
    command that shows them) and its logs."""
    newest = CheckpointStore(run.dir).newest() if (run.dir / "checkpoints").is_dir() else None
    if newest is not None:
        _err(f"clusterctl: checkpoints: {run.dir / 'checkpoints'} (newest {newest}); `clusterctl train "
             f"--resume-from {run.id}` starts a run from it")
    tb = run.dir / "tensorboard"
    if tb.is_dir() and any(p.is_file() for p in tb.rglob("*")):
        _err(f"clusterctl: TensorBoard: tensorboard --logdir {tb}")
    _err(f"clusterctl: logs: {run.dir / 'nodes'} (every byte of every rank); what clusterctl did: "
         f"{run.dir / 'supervisor.log'}")


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


def ask_nodes(run: Run) -> dict[str, AgentStatus]:
    """Each started node's own view of the run (node agent `status`), for when the supervisor is gone."""
    spec = run.spec
    started = [nd.name for nd in run.nodes() if nd.pid]
    if not started:
        return {}
    with Cluster(spec.load_inventory(started), connect_timeout=spec.connect_timeout, fanout=spec.fanout) as cluster:
        out = agent.run(cluster, lambda n: agent.status(n, run.id))
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
    from rich.table import Table

    run = Run.find(run_id)
    rec = run.record
    alive, terminal = run.supervisor_alive(), run.state(rec).terminal
    from_nodes = {} if alive or terminal else ask_nodes(run)
    if not alive:
        ensure_supervisor(run)
    if as_json:
        nodes_now = {name: s.as_json() for name, s in from_nodes.items()}
        click.echo(json.dumps(dict(rec, supervisor_alive=alive, nodes_now=nodes_now), indent=2))
        return
    typed = load_record(run)
    a = typed.current
    attempt = f", attempt {a.attempt} of at most {run.spec.max_restarts + 1}" if a is not None and \
        (a.attempt > 1 or run.spec.max_restarts) else ""
    t = Table(title=f"{run.id}: {rec.get('state')}{attempt}" + ("" if alive or terminal else
                                                      " (supervisor gone: asked the nodes and started "
                                                      "one that takes the run over)"))
    t.add_column("node", no_wrap=True)
    for c in ("ranks", "state", "pid", "exit", "runtime", "last line"):
        t.add_column(c)
    for nd in run.nodes(rec):
        state, code, last = nd.state, nd.exit_code, _last_line(run, nd.name)
        now = from_nodes.get(nd.name)
        if now is not None:  # the nodes' own word beats a stale record
            code, last = code if now.error else now.exit_code, now.last_line or last
            state = _node_state_now(now, code)
        t.add_row(nd.name, nd.ranks, str(state), str(nd.pid or "-"), "-" if code is None else str(code),
                  _runtime(nd, rec), last[:100])
    Console().print(t)
    if a is not None and a.preflight_ok is False and a.preflight_file:  # the table that says what to fix
        _err((run.dir / a.preflight_file).read_text().rstrip() if (run.dir / a.preflight_file).exists() else "")
    newest = CheckpointStore(run.dir).newest() if (run.dir / "checkpoints").is_dir() else None
    if newest is not None:
        _err(f"clusterctl: newest checkpoint copied home: {newest} ({run.dir / 'checkpoints'})")
    if a is not None and a.hang:
        _err(f"clusterctl: attempt {a.attempt}: {a.hang}" + (f" (snapshots: {run.dir / a.hang_dir})"
                                                             if a.hang_dir else ""))
    if typed.recovering:
        _err(f"clusterctl: recovering after {typed.recovering}")
    if rec.get("summary") or rec.get("error"):
        _summary(rec)
    if typed.pending_stops:
        what = ", ".join(f"{p.node} ({p.key})" for p in typed.pending_stops)
        _err(f"clusterctl: stop pending on {what}: not confirmed yet; it is carried out as soon as the node "
             "answers again")


@click.command("runs")
@cluster_options
@click.option("--cluster", "on_cluster", is_flag=True,
              help="Ask the inventory's nodes (-i) which runs hold them, from whichever control machine.")
@click.option("--json", "as_json", is_flag=True)
def runs_command(opts: ClusterOptions, on_cluster, as_json):
    """The runs recorded on this control machine, oldest first; with --cluster, every run holding
    a node of the inventory: run id, who started it (user@control-host), since when, its nodes."""
    from rich.console import Console
    from rich.table import Table

    if on_cluster:
        return _cluster_runs(opts, as_json)
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


__all__ = ["complete_run_ids", "ensure_supervisor", "follow", "runs_command", "status_command", "tail_command"]

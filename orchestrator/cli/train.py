"""`clusterctl train`, `tail`, `status`, `runs`, `stop`.

`train` records the run, starts the detached supervisor (orchestrator/supervisor.py)
and follows the run's logs from the run directory. Everything else re-attaches by
run id: the supervisor's copies first, then the nodes themselves when the
supervisor is gone (a crashed or killed controller loses nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import click

from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.cli.output import Prefixer
from orchestrator.errors import EXIT_INTERRUPTED, ClusterctlError, UnreachableError, UsageError
from orchestrator.inventory import load_inventory
from orchestrator.runs.logs import Follower, NodeLog, last_lines_offset
from orchestrator.runs.store import TERMINAL, Run, new_run_id
from orchestrator.runs.supervisor import AGENT, agent_cmd, node_key
from orchestrator.transport import Cluster


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def _nproc(ctx, param, value):
    if value in (None, "auto"):
        return value
    try:
        n = int(value)
        if n < 1:
            raise ValueError
        return n
    except ValueError:
        raise click.BadParameter("use 'auto' or a positive number of processes per node") from None


def start_supervisor(run: Run) -> subprocess.Popen:
    log = open(run.dir / "supervisor.log", "ab")
    env = dict(os.environ, CLUSTERCTL_SUPERVISOR=run.id)
    return subprocess.Popen([sys.executable, "-m", "orchestrator.runs.supervisor", run.id], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _logs_for(run: Run, rec: dict, start: str, n: int | None) -> list[NodeLog]:
    logs = []
    for nd in rec.get("nodes", []):
        path = run.node_log(nd["name"])
        off = 0 if start == "begin" else last_lines_offset(path, n or 0)
        logs.append(NodeLog(nd["name"], path, nd.get("first_rank"), off))
    return logs


def _printer(rec: dict) -> Prefixer:
    labels = [f"{nd['name']}/r{nd.get('last_rank', 0)}" for nd in rec.get("nodes", [])]
    return Prefixer(labels)


def _summary(rec: dict) -> None:
    state, code = rec.get("state"), rec.get("exit_code")
    if rec.get("error"):
        _err(f"clusterctl: run {rec.get('id')} {state}: {rec['error']}")
    elif rec.get("summary"):
        _err(f"clusterctl: run {rec.get('id')} {state} (exit code {code}): {rec['summary']}")
    else:
        _err(f"clusterctl: run {rec.get('id')} {state} (exit code {code})")


def follow(run: Run, *, keep_following: bool = True, n: int | None = None, node: str | None = None,
           rank: int | None = None, on_interrupt=None, show_preflight: bool = True,
           supervisor: subprocess.Popen | None = None) -> int:
    """Print the run's lines until it ends (or once, without following)."""
    follower, shown_pf, shown_map = None, False, False
    while True:
        try:
            rec = run.record
            pf = run.dir / "preflight.txt"
            if show_preflight and not shown_pf and pf.exists():
                click.echo(pf.read_text().rstrip(), err=True)
                shown_pf = True
            if follower is None and rec.get("rank_map"):
                # once: the preflight table already shows the same map unless --nproc-per-node changed it
                if not shown_map and rec["rank_map"] not in (pf.read_text() if shown_pf else ""):
                    click.echo(rec["rank_map"], err=True)
                shown_map = True
                follower = Follower(_logs_for(run, rec, "begin" if n is None else "last", n), _printer(rec),
                                    node=node, rank=rank)
            terminal = rec.get("state") in TERMINAL
            if follower:
                follower.poll(final=terminal or not keep_following)
            if terminal or not keep_following:
                break
            if supervisor is not None:
                supervisor.poll()  # reap it, so a dead supervisor is seen as dead
            if not run.supervisor_alive() and time.time() - rec.get("created", 0) > 10:
                rec = run.record
                if rec.get("state") not in TERMINAL:
                    if follower is None:
                        follower = Follower(_logs_for(run, rec, "begin" if n is None else "last", n),
                                            _printer(rec), node=node, rank=rank)
                    return recover(run, follower)
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
    inv = load_inventory(spec.get("inventory")).select(spec.get("nodes") or None)
    started = {nd["name"] for nd in rec.get("nodes", []) if nd.get("pid")}
    codes: dict[str, int | None] = {}
    with Cluster(inv, connect_timeout=spec.get("connect_timeout"), fanout=spec.get("fanout", 64)) as cluster:
        procs = {}
        for nd in inv.nodes:
            if nd.name not in started or nd.name not in cluster.connections:
                continue
            off = run.node_log(nd.name).stat().st_size if run.node_log(nd.name).exists() else 0
            procs[nd.name] = (cluster.connections[nd.name].exec(
                agent_cmd(nd, "tail", node_key(run.id, nd), off), stdin=AGENT), open(run.node_log(nd.name), "ab"))
        while procs:
            for name, (p, f) in list(procs.items()):
                out, _ = p.read()
                if out:
                    f.write(out)
                    f.flush()
                if p.done():
                    f.close()
                    del procs[name]
            follower.poll()
            time.sleep(0.05)
        follower.poll(final=True)
        res = cluster.run(lambda nd: agent_cmd(nd, "status", node_key(run.id, nd)), stdin=AGENT, timeout=30,
                          nodes=[x for x in started if x in cluster.connections])
        for name, r in res.items():
            codes[name] = json.loads(r.stdout).get("exit_code") if r.ok else None
    bad = {k: v for k, v in codes.items() if v != 0}
    first = next(iter(bad.items()), None)
    nodes = [dict(nd, exit_code=codes.get(nd["name"], nd.get("exit_code"))) for nd in rec.get("nodes", [])]
    run.update(nodes=nodes, state="failed" if bad else "finished",
               exit_code=(first[1] if first and first[1] is not None else (255 if first else 0)),
               summary="recovered from the nodes after the supervisor was gone"
               + (f"; {first[0]} exited {first[1]}" if first else ""), ended=time.time())
    _summary(run.record)
    return int(run.record["exit_code"])


@click.command("train", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@cluster_options
@click.option("--name", help="A name for the run (its id is NAME-DATE-TIME-XXXX).")
@click.option("--detach", is_flag=True, help="Return once the run is launched; re-attach with `clusterctl tail`.")
@click.option("--skip-preflight", is_flag=True, help="Launch without the fast preflight.")
@click.option("--force", is_flag=True, help="Launch despite a failed preflight, a node busy with another run, "
                                            "or more processes than a node has GPUs.")
@click.option("--nproc-per-node", default="auto", callback=_nproc, show_default=True,
              help="Processes per node: auto = train.nproc_per_node, else the inventory's gpus (gpus: 0 = "
                   "one), else the GPUs found, else 1. More than a node's GPUs exits 2 unless --force.")
@click.option("--grace", type=click.FloatRange(0, 3600), default=5.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when the run is stopped.")
@click.option("--lost-timeout", type=click.FloatRange(1, 3600), default=30.0, show_default=True,
              help="A node that does not answer for this long is lost, and the run is torn down.")
@click.argument("script", nargs=-1, type=click.UNPROCESSED)
def train_command(opts: ClusterOptions, name, detach, skip_preflight, force, nproc_per_node, grace,
                  lost_timeout, script):
    """Preflight, then torchrun on every node in rank order; stream every rank's log.

    Without SCRIPT it runs the inventory's `train:` section (the bundled trainer by
    default); otherwise `-- train.py ARGS` or `-- -m package.module ARGS`. When any
    node fails, every node is stopped and the first failure is explained."""
    if script and script[0].startswith("-") and script[0] != "-m":
        raise click.UsageError(f"no such option: {script[0]}. A script and its own arguments go after "
                               "`--`: clusterctl train -i nodes.yaml -- train.py --lr 3e-4")
    if script and script[0] == "-m" and len(script) == 1:
        raise click.UsageError("-m needs a module: clusterctl train -- -m package.module ARGS")
    inv = opts.load()  # a bad inventory ends here, with exit code 2
    run = Run.create(new_run_id(name), {
        "inventory": os.path.abspath(opts.inventory_path) if opts.inventory_path else None,
        "nodes": list(opts.nodes), "args": list(script), "skip_preflight": skip_preflight, "force": force,
        "nproc_per_node": nproc_per_node, "grace": grace, "lost_timeout": lost_timeout, "fanout": opts.fanout,
        "accept_new_host_keys": opts.accept_new_host_keys, "connect_timeout": opts.connect_timeout,
        "cwd": os.getcwd()})
    sup = start_supervisor(run)
    _err(f"clusterctl: run {run.id} on {len(inv.nodes)} nodes (records in {run.dir})")
    if detach:
        click.echo(run.id)
        return
    presses = []

    def interrupt():
        presses.append(time.time())
        try:
            os.kill(sup.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if len(presses) == 1:
            _err(f"clusterctl: stopping run {run.id} gracefully on every node (Ctrl-C again to kill)")
        else:
            _err(f"clusterctl: killing run {run.id} on every node now")

    code = follow(run, on_interrupt=interrupt, supervisor=sup)
    if presses and code == 0:
        code = EXIT_INTERRUPTED
    sys.exit(code)


@click.command("tail")
@click.argument("run_id", required=False)
@click.option("-n", "lines", type=click.IntRange(0), default=None, help="Start with the last N lines of each node.")
@click.option("--no-follow", is_flag=True, help="Print what is there and return.")
@click.option("--node", help="Only this node's lines.")
@click.option("--rank", type=click.IntRange(0), default=None, help="Only this global rank's lines.")
def tail_command(run_id, lines, no_follow, node, rank):
    """Re-attach to a run (the latest by default); Ctrl-C detaches, the run goes on."""
    run = Run.find(run_id)
    try:
        sys.exit(follow(run, keep_following=not no_follow, n=lines, node=node, rank=rank))
    except KeyboardInterrupt:
        _err(f"clusterctl: detached from {run.id}; it keeps running (clusterctl stop {run.id} to stop it)")
        sys.exit(EXIT_INTERRUPTED)


def _runtime(nd: dict, rec: dict) -> str:
    start = rec.get("started")
    if not start:
        return "-"
    end = nd.get("ended") or rec.get("ended") or time.time()
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
    spec, rec = run.spec, run.record
    started = [nd["name"] for nd in rec.get("nodes", []) if nd.get("pid")]
    if not started:
        return {}
    inv = load_inventory(spec.get("inventory")).select(started)
    out: dict[str, dict] = {}
    with Cluster(inv, connect_timeout=spec.get("connect_timeout"), fanout=spec.get("fanout", 64)) as cluster:
        res = cluster.run(lambda nd: agent_cmd(nd, "status", node_key(run.id, nd)), stdin=AGENT, timeout=30)
        for name, r in res.items():
            try:
                out[name] = json.loads(r.stdout) if r.ok else {"error": r.describe()}
            except ValueError:
                out[name] = {"error": r.stdout[-200:]}
        for name, r in cluster.unreachable.items():
            out[name] = {"error": r.error}
    return out


@click.command("status")
@click.argument("run_id", required=False)
@click.option("--json", "as_json", is_flag=True)
def status_command(run_id, as_json):
    """Per node: state, pid, exit code, runtime and last line of a run (the latest by default)."""
    from rich.console import Console
    from rich.table import Table

    run = Run.find(run_id)
    rec = run.record
    alive = run.supervisor_alive()
    from_nodes = {} if alive or rec.get("state") in TERMINAL else ask_nodes(run)
    if as_json:
        click.echo(json.dumps(dict(rec, supervisor_alive=alive, nodes_now=from_nodes), indent=2))
        return
    t = Table(title=f"{run.id}: {rec.get('state')}" + ("" if alive or rec.get("state") in TERMINAL
                                                      else " (supervisor gone: asked the nodes; "
                                                      "`clusterctl tail` recovers the logs)"))
    t.add_column("node", no_wrap=True)
    for c in ("ranks", "state", "pid", "exit", "runtime", "last line"):
        t.add_column(c)
    for nd in rec.get("nodes", []):
        ranks = f"{nd.get('first_rank')}-{nd.get('last_rank')}" if "first_rank" in nd else "-"
        state, code, last = nd.get("state", "?"), nd.get("exit_code"), _last_line(run, nd["name"])
        now = from_nodes.get(nd["name"])
        if now is not None:  # the nodes' own word beats a stale record
            code, last = now.get("exit_code", code), now.get("last_line") or last
            state = ("unreachable" if now.get("error") else "running" if code is None and now.get("alive")
                     else "finished" if code == 0 else "failed" if code is not None else "gone")
        t.add_row(nd["name"], ranks, state, str(nd.get("pid") or "-"),
                  "-" if code is None else str(code), _runtime(nd, rec), last[:100])
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


@click.command("stop")
@click.argument("run_id")
@click.option("--grace", type=click.FloatRange(0, 3600), default=None,
              help="Seconds between SIGTERM and SIGKILL (default: the run's own).")
@click.option("--timeout", type=click.FloatRange(1), default=120, show_default=True)
def stop_command(run_id, grace, timeout):
    """Stop a run on every node: SIGTERM (the trainer checkpoints), then SIGKILL."""
    run = Run.find(run_id)
    if run.terminal:
        _err(f"clusterctl: run {run.id} already {run.record.get('state')}")
        return
    pid = run.record.get("supervisor_pid")
    if run.supervisor_alive() and grace is None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + timeout
        while not run.terminal:
            if time.time() > deadline:
                raise ClusterctlError(f"run {run.id} did not stop within {timeout:g}s")
            time.sleep(0.2)
        _summary(run.record)
        return
    if run.supervisor_alive():
        os.kill(pid, signal.SIGKILL)  # stop directly, with the grace asked for
    spec = run.spec
    inv = load_inventory(spec.get("inventory")).select(spec.get("nodes") or None)
    g = spec.get("grace", 5) if grace is None else grace
    with Cluster(inv, connect_timeout=spec.get("connect_timeout")) as cluster:
        res = cluster.run(lambda nd: agent_cmd(nd, "stop", node_key(run.id, nd), g), stdin=AGENT, timeout=g + 30)
    run.update(state="stopped", exit_code=130, ended=time.time(), summary="stopped with `clusterctl stop`")
    for name, r in res.items():
        if not r.ok:
            _err(f"clusterctl: {name}: could not stop: {r.describe()}")
    lost = {name: r.describe() for name, r in res.items() if not r.reachable}
    if lost:
        raise UnreachableError(lost, "so the run may still be there; run `clusterctl stop` again once they answer")
    if not res.all_ok:
        raise ClusterctlError("some nodes could not stop the run (above); run `clusterctl stop` again")
    _summary(run.record)


__all__ = ["train_command", "tail_command", "status_command", "runs_command", "stop_command", "UsageError"]

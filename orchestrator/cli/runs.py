"""`clusterctl tail`, and following a run's logs (shared with `train`); `status` and `runs` are
cli/status.py.

Everything here re-attaches by run id. When the run's supervisor is gone (a crashed or
killed controller), `tail`, `status` and `stop` start one that adopts the run
(orchestrator/runs/supervisor.py --adopt): it resumes the log copies where they stopped,
so nothing is lost or printed twice, and applies the failure policy and pending stops.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from typing import Collection

import click

from orchestrator.cli import tables
from orchestrator.cli.jsonout import emit, json_lines, run_doc
from orchestrator.cli.output import Prefixer
from orchestrator.errors import EXIT_INTERRUPTED, ClusterctlError
from orchestrator.runs.ckpt.jobdir_replicas import NodeSnaps, newest_copied
from orchestrator.runs.goodput import of_run
from orchestrator.runs.logs.fold import rank_label
from orchestrator.runs.record import story
from orchestrator.runs.runrecord import AttemptRecord, RunRecord
from orchestrator.runs.logs.follow import Follower, NodeLog, last_lines_offset, quiet_nodes, rank_tail, worker_failure
from orchestrator.runs.policy import TAIL_LINES, log_tail
from orchestrator.runs.logs.rankfiles import rank_file
from orchestrator.runs.ckpt.jobdir_setaside import BEFORE_RUN, FORM, Found
from orchestrator.runs.store import Run

SUPERVISOR_GRACE_S = 10  # a run this young may not have recorded its supervisor yet
SUPERVISOR_START_S = 30  # how long a replacement supervisor may take to record itself
MAX_RESTARTS = 3  # replacements one `tail` starts before it gives up (see supervisor.log)
END_SETTLE_S = 10  # how long the end of a followed run waits for its supervisor's last writes (_settled)


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def complete_run_ids(ctx, param, incomplete: str):
    """Shell completion: the recorded run ids, newest first."""
    from click.shell_completion import CompletionItem

    try:
        runs = reversed(Run.all())
        return [CompletionItem(r.id, help=str(r.record.state)) for r in runs if r.id.startswith(incomplete)]
    except Exception:  # noqa: BLE001 - completion never fails loudly
        return []


def _logs_for(run: Run, rec: RunRecord, n: int | None) -> list[NodeLog]:
    """One NodeLog per node of the run: from the start, or from each log's last `n` lines."""
    return [NodeLog(nd.name, path, nd.first_rank, 0 if n is None else last_lines_offset(path, n), nd.last_rank)
            for nd in rec.nodes for path in [run.node_log(nd.name)]]


def _ranks(rec: RunRecord) -> tuple:
    return tuple((nd.name, nd.first_rank, nd.last_rank) for nd in rec.nodes)


def _printer(rec: RunRecord) -> Prefixer:
    return Prefixer([rank_label(nd.name, nd.last_rank or 0) for nd in rec.nodes])


def _summary(rec: RunRecord, shown: tuple[str, str] | None = None) -> None:
    """The run's end in one line (and its root cause's lines). `shown`: (the failed rank's last
    lines that end the summary, where the screen just showed them): named, not repeated."""
    state, code, summary = rec.state, rec.exit_code, rec.summary or ""
    if shown is not None and summary.endswith("\n" + shown[0]):
        summary = summary[:-len(shown[0]) - 1].rstrip() + "\n" + shown[1]
    if rec.error:
        _err(f"clusterctl: run {rec.id} {state}: {rec.error}")
    elif summary.startswith(f"{state} "):  # 'stopped on request': said once
        _err(f"clusterctl: run {rec.id} {summary} (exit code {code})")
    elif summary:
        _err(f"clusterctl: run {rec.id} {state} (exit code {code}): {summary}")
    else:
        _err(f"clusterctl: run {rec.id} {state} (exit code {code})")


class _Show:
    """What `follow` prints once: the preflight table, the rank map, then the log lines."""

    def __init__(self, run: Run, n: int | None, nodes: Collection[str], ranks: Collection[int], show_preflight: bool,
                 sink=None, fold: bool = True):
        self.run, self.n, self.nodes, self.ranks_only, self.sink, self.fold = run, n, nodes, ranks, sink, fold
        self.shown_pf = not show_preflight
        self.pf_text = ""
        self.shown_tables: set[str] = set()
        self.announced: set[int] = set()  # attempts whose start was told
        self.story_at = 0  # the story's bytes printed (a re-attached `tail` tells it from the start)
        self.follower: Follower | None = None
        self.ranks: tuple = ()  # (node, first rank) of the attempt being followed

    def header(self, rec: RunRecord) -> None:
        pf = self.run.dir / "preflight.txt"
        if not self.shown_pf and pf.exists():
            self.pf_text = pf.read_text()
            click.echo(self.pf_text.rstrip(), err=True)
            self.shown_pf = True
        for a in rec.attempts:  # a relaunch's failed preflight: the table says what was wrong
            f = a.preflight_file
            if a.attempt > 1 and a.preflight_ok is False and a.verdict and f and f not in self.shown_tables:
                self.shown_tables.add(f)
                if (self.run.dir / f).exists():
                    click.echo(f"clusterctl: attempt {a.attempt}'s preflight failed on "
                               f"{', '.join(a.bad_nodes) or 'a node'}:", err=True)
                    click.echo((self.run.dir / f).read_text().rstrip(), err=True)
        lines, self.story_at = story(self.run, self.story_at)
        if lines and self.follower is not None:
            self.follower.flush()  # the job's lines held for folding came first: they print first
        for line in lines:  # what clusterctl saw and did, as it happened (record.py Book.tell)
            click.echo(f"clusterctl: {line}", err=True)
        for a in rec.attempts:
            self.announce(a)
        if self.follower is not None:
            self.follower.quiet = quiet_nodes(rec)
        last = rec.current
        # an attempt not launched (yet, or ever: its launch failed) gets no map; a record that does not
        # say (an older one) by its state
        launched = last.launched if last is not None and last.launched is not None else \
            rec.state.value not in ("starting", "queued", "connecting", "preflight", "launching")
        if self.follower is None and rec.rank_map and launched:
            # the preflight table already shows the same map unless --nproc-per-node changed it
            if " ".join(rec.rank_map.split()) not in " ".join(self.pf_text.split()):  # the table wraps it
                click.echo(rec.rank_map, err=True)
            self.start(rec)
        elif self.follower is not None and (ranks := _ranks(rec)) != self.ranks:
            self.ranks = ranks  # a restart: the next attempt's nodes and ranks
            self.follower.retarget([(name, self.run.node_log(name), first, last) for name, first, last in ranks])

    def announce(self, a: AttemptRecord) -> None:
        """Once an attempt is launched: what it starts from, and any damaged copy passed over."""
        k = a.attempt
        if k in self.announced or not a.launched or (k == 1 and not a.resumed_from):
            return
        self.announced.add(k)
        if a.skipped:
            click.echo(f"clusterctl: attempt {k}: skipping checkpoint {', '.join(a.skipped)} on this machine: "
                       "the bytes no longer match their checksums (damaged after the copy)", err=True)
        where = "the nodes" if a.restored_from == "nodes" else "this machine"
        if a.resumed_from:
            where = f"run {a.resumed_from}"
        told = f" with {shlex.join(a.resume_args)}" if a.resume_args else ""
        about = f": {a.checkpoint_about}" if a.checkpoint_about else ""
        for node, names in sorted(a.set_aside.items() if a.checkpoint else ()):
            click.echo(f"clusterctl: attempt {k}: {node}: set aside {', '.join(names)} (not in the checkpoint; "
                       f"kept under ~/.clusterctl/artifacts/{self.run.id}/set-aside/ there)", err=True)
        click.echo(f"clusterctl: attempt {k} on {', '.join(a.nodes)} starts from checkpoint "
                   f"{a.checkpoint} ({where}{about}){told}" if a.checkpoint else
                   f"clusterctl: attempt {k} on {', '.join(a.nodes)} starts from scratch: no "
                   "checkpoint of this run was copied" + (" (--resume-args not added)" if self.run.spec.resume_args
                                                           else ""), err=True)

    def start(self, rec: RunRecord) -> Follower:
        if self.follower is None:
            self.ranks = _ranks(rec)
            self.follower = Follower(_logs_for(self.run, rec, self.n), _printer(rec), nodes=self.nodes,
                                     ranks=self.ranks_only, sink=self.sink, fold=self.fold)
        return self.follower


def ensure_supervisor(run: Run) -> subprocess.Popen | None:
    """Start a supervisor that adopts the run when the recorded one is gone and the run still
    needs one (not ended, or a stop still pending); returns it once it has recorded itself."""
    rec = run.record
    if run.supervisor_alive() or time.time() - rec.created < SUPERVISOR_GRACE_S:
        return None
    if rec.state.terminal and not rec.pending_stops:
        return None
    _err(f"clusterctl: the supervisor of {run.id} is gone; starting one that takes the run over")
    from orchestrator.runs.supervisor import spawn  # the whole run loop: only to take a run over

    proc = spawn(run, adopt=True)
    deadline = time.time() + SUPERVISOR_START_S
    while time.time() < deadline and proc.poll() is None and run.record.supervisor_pid != proc.pid:
        time.sleep(0.1)
    return proc


def _settled(run: Run) -> None:
    """Wait (up to END_SETTLE_S) for an ended run's supervisor to flush its copies (the step
    journal's last steps among them): it records its CPU time once they are, so the goodput line
    printed at the end is the one `clusterctl goodput` gives afterwards."""
    deadline = time.time() + END_SETTLE_S
    while time.time() < deadline and run.record.supervisor_cpu_s is None and run.supervisor_alive():
        time.sleep(0.1)


def follow(run: Run, *, keep_following: bool = True, n: int | None = None, nodes: Collection[str] = (),
           ranks: Collection[int] = (), on_interrupt=None, show_preflight: bool = True,
           supervisor: subprocess.Popen | None = None, sink=None, fold: bool = True) -> int:
    """Print the run's lines until it ends (or once, without following); `sink(label, stream,
    text, node)` takes each line instead of the prefixed printer (--json)."""
    show = _Show(run, n, nodes, ranks, show_preflight, sink, fold)
    restarts = 0
    while True:
        try:
            rec = run.record
            show.header(rec)
            terminal = rec.state.terminal
            if show.follower:
                show.follower.poll(final=terminal or not keep_following)
            if terminal or not keep_following:
                break
            if supervisor is not None:
                supervisor.poll()  # reap it, so a dead supervisor is seen as dead
            if not run.supervisor_alive() and time.time() - rec.created > SUPERVISOR_GRACE_S:
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
    rec = run.record
    _summary(rec, _shown_tail(run, rec, show.follower))
    if keep_following:
        _settled(run)
    if (line := tables.goodput_line(of_run(run))) is not None:  # where the time went: `clusterctl goodput`
        _err(f"clusterctl: {line}")
    _results(run)
    code = run.record.exit_code
    return 1 if code is None else int(code)


def _shown_tail(run: Run, rec: RunRecord, follower: Follower | None) -> tuple[str, str] | None:
    """When the run's summary ends with the failed rank's last lines (runs/policy.py root_cause)
    and the screen has just shown every line of that rank: (those lines, what to say instead)."""
    nd = rec.node(rec.first_failure.node) if rec.first_failure is not None else None
    if follower is None or nd is None or nd.first_rank is None:
        return None
    log = log_tail(run.node_log(nd.name))
    wf = worker_failure(log)
    if wf is None:
        return None
    rank = nd.first_rank + wf["local_rank"]
    if not follower.showed(nd.name, rank):
        return None
    return "\n".join(rank_tail(log, wf["local_rank"], TAIL_LINES)), \
        f"(rank {rank}'s last lines and traceback are above; all of them: {rank_file(run.dir, rank)})"


def _results(run: Run) -> None:
    """Where a run's results are on this machine: its checkpoints, its TensorBoard events (with the
    command that shows them) and its logs."""
    newest = newest_copied(run.dir)
    on_nodes = NodeSnaps(run.dir)
    if newest is not None and (n := on_nodes.newest()) is not None and newest == on_nodes.describe(n):
        _err(f"clusterctl: checkpoints: kept on the nodes (newest {newest}); their manifests: {on_nodes.dir}")
        _err(f"clusterctl:   a new run from it: clusterctl train --resume-from {run.id} (while those nodes hold it)")
    elif newest is not None:
        _err(f"clusterctl: checkpoints: {run.dir / 'checkpoints'} (newest {newest})")
        _err(f"clusterctl:   a new run from it: clusterctl train --resume-from {run.id}")
    found = Found(run.dir).about()
    if found is not None:  # what its checkpoint directory held before it: never offered as its own
        _err(f"clusterctl: set aside when the run started, not its own: {found} (kept under "
             f"~/.clusterctl/artifacts/{run.id}/set-aside/{BEFORE_RUN}/ there)")
        _err(f"clusterctl:   a new run from those files: clusterctl train --resume-from {run.id}:{FORM}")
    tb = run.dir / "tensorboard"
    if tb.is_dir() and any(p.is_file() for p in tb.rglob("*")):
        _err(f"clusterctl: TensorBoard: tensorboard --logdir {tb}")
        if run.spec.resume_from:  # its files were linked in at the start (runs/curves.py)
            _err(f"clusterctl:   the curves go on from run {run.spec.resume_from}'s")
    _err(f"clusterctl: logs: {run.dir / 'nodes'} (every byte of every node)")
    if (run.dir / "ranks" / "rank0.log").exists():
        _err(f"clusterctl:   rank 0: {run.dir / 'ranks' / 'rank0.log'} (rank N: rankN.log)")
    _err(f"clusterctl:   what clusterctl did: {run.dir / 'supervisor.log'}")


def parse_ranks(value: str | None) -> frozenset[int]:
    """`--ranks 0,5,8-15` -> those global ranks; a bad value is a usage error naming it."""
    out: set[int] = set()
    for part in (value or "").split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise click.BadParameter(f"{part.strip()!r} is not a rank or a range of ranks: use numbers and "
                                     "ranges such as 0,5,8-15", param_hint="'--ranks'")
        out.update(range(int(lo), int(hi if dash else lo) + 1))
    return frozenset(out)


def _node_filter(run: Run, value: str | None) -> frozenset[str]:
    """`--node n3` or `--node 'n[1-4],n7'` -> those nodes, each one of the run's."""
    if not value:
        return frozenset()
    from orchestrator.inventory.ranges import expand

    try:
        names = expand(value, what="--node")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--node'") from None
    rec = run.record
    known = list(dict.fromkeys([nd.name for nd in rec.nodes] + [n for a in rec.attempts for n in a.nodes]))
    unknown = [n for n in names if n not in known]
    if unknown and known:
        raise click.BadParameter(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a node of run "
                                 f"{run.id} ({', '.join(known)})", param_hint="'--node'")
    return frozenset(names)


@click.command("tail")
@click.argument("run_id", required=False, shell_complete=complete_run_ids)
@click.option("-n", "lines", type=click.IntRange(0), default=None, help="Start with the last N lines of each node.")
@click.option("--no-follow", is_flag=True, help="Print what is there and return.")
@click.option("--node", help="Only these nodes' lines: a name or a range (n3, 'n[1-4],n7').")
@click.option("--rank", type=click.IntRange(0), default=None, help="Only this global rank's lines.")
@click.option("--ranks", "rank_list", default=None, help="Only these global ranks' lines: 0,5 or 0-7,12.")
@click.option("--no-fold", is_flag=True, help="Print every line: identical lines of many ranks are not folded "
                                               "into one, nor stopped ranks' tracebacks.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per log line, then one for the run "
                                                        "(orchestrator/schemas/tail.json).")
def tail_command(run_id, lines, no_follow, node, rank, rank_list, no_fold, as_json):
    """Re-attach to a run (the latest by default); Ctrl-C detaches, the run goes on.

    Each rank's lines are also in ~/.clusterctl/runs/RUN/ranks/rankN.log (rank 0: rank0.log)."""
    ranks = parse_ranks(rank_list) if rank_list is not None else frozenset()
    run = Run.find(run_id)
    nodes = _node_filter(run, node)
    try:
        code = follow(run, keep_following=not no_follow, n=lines, nodes=nodes,
                      ranks=ranks | ({rank} if rank is not None else set()), fold=not no_fold,
                      sink=json_lines if as_json else None)
        if as_json:
            emit(run_doc(run.record), compact=True)
        sys.exit(code)
    except KeyboardInterrupt:
        _err(f"clusterctl: detached from {run.id}; it keeps running (clusterctl stop {run.id} to stop it)")
        sys.exit(EXIT_INTERRUPTED)


__all__ = ["complete_run_ids", "ensure_supervisor", "follow", "parse_ranks", "tail_command"]

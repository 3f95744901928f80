"""One attempt of a run: preflight, ranks, launch in rank order, watch, and how it ended.

An attempt runs under its own key on the nodes (RUN_ID, then RUN_ID.aK) and returns its RunResult to
the run loop (runs/controller.py) instead of deciding what follows; nothing final is recorded here.
Its failure policy is its own (runs/policy.py): the first node to fail stops the attempt's other
nodes, its teardown bound to the attempt's key and nodes (one not reached keeps a pending stop)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

from orchestrator.checks import retry
from orchestrator.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, LaunchError
from orchestrator.inventory import Inventory, Node
from orchestrator.observe import trackers
from orchestrator.node import agent
from orchestrator.runs.claims import Claims
from orchestrator.runs.judge.hang import HangVerdict
from orchestrator.runs.judge.hangsnap import RankSnap, links_down, snaps_of
from orchestrator.runs.judge.hangwatch import HangWatch
from orchestrator.runs.launch import Launcher, check_free
from orchestrator.runs.policy import FailurePolicy
from orchestrator.runs.progresslog import ProgressLog
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import AttemptRecord
from orchestrator.runs.spec import FirstFailure, NodeState, NodeStatus, RunResult, RunSpec, RunState
from orchestrator.runs.stopping import LOG_DRAIN_S, Stopper, asked_grace, grace_for
from orchestrator.transfer import synced
from orchestrator.transfer.files import control_code
from orchestrator.runs.judge.straggler import Slow, StragglerWatch
from orchestrator.runs.judge.stragglersnap import clock_offsets, progress
from orchestrator.runs.store import Run, exit_meaning
from orchestrator.torchrun import nprocs_for, rank_map, rank_map_text, too_many_procs
from orchestrator.runs.logs.streamask import snapshot_nodes
from orchestrator.runs.logs.streams import Artifacts, StreamAsks, copy_logs
from orchestrator.transport import Cluster, ErrorKind, NodeResult


class PreflightFailed(LaunchError):
    """The attempt's preflight failed on `nodes` (the table is in the run directory); `checks`:
    {node: {failed check: its detail}}."""

    def __init__(self, message: str, nodes: list[str], table: str, checks: dict[str, dict[str, str]] | None = None):
        super().__init__(message)
        self.nodes, self.table, self.checks = nodes, table, checks or {}


class AttemptRunner:
    def __init__(self, *, run: Run, spec: RunSpec, book: Book, cluster: Cluster, inv: Inventory,
                 record: AttemptRecord, stopper: Stopper, stop_requests: int, say: Callable[[str], None]):
        self.run, self.spec, self.book, self.cluster, self.inv = run, spec, book, cluster, inv
        self.record, self.key, self.stopper, self.say = record, record.key, stopper, say
        self.statuses = {n.name: NodeStatus(n.name, i, n.host) for i, n in enumerate(inv.nodes)}
        self.policy = FailurePolicy(self._first_failure)
        self.policy.stop_requests = stop_requests
        self.tlock = threading.Lock()  # teardowns: one at a time
        self.drained = threading.Event()  # set: stop copying logs (a stop's grace and drain are over)
        self.stopping = threading.Event()  # set at the teardown's start: the nodes' streams may go quiet
        self.drain_timer: threading.Timer | None = None
        self.artifacts: Artifacts | None = None  # the run's ArtifactCopier: the nodes' streams report to it
        self.hang_watch: HangWatch | None = None
        self.hang: HangVerdict | None = None  # the hang that failed this attempt
        self.snapshots: dict[int, dict] = {}  # request -> node -> the agent's ranks (hangs/N/snapshots.json)
        self.straggler: tuple[str, tuple[str, ...]] | None = None  # (line, nodes): --on-straggler replace ended it
        self.out_killed = False  # the straggler's nodes were killed once every other node had ended
        self.can_replace: Callable[[list[str]], str | None] = lambda nodes: "no restart planned"  # set by the run loop
        self.claims: Claims | None = None  # the run loop's (runs/claims.py), read as Readying reads it
        self.short: set[str] = set()  # nodes whose log copy ended short (no room here): runs/logs/catchup.py
        self.streams = StreamAsks()  # the nodes' open log streams: the first way to them for a stop, a snapshot
        self.warming: Callable[[], list[str]] = lambda: []  # the run loop's WarmPool.importing (runs/warmpool.py)
        self.launching: Callable[[list[str]], object] = lambda nodes: None  # ... and its before_launch

    def save(self, later: bool = False) -> None:  # later: a node's end, written with the others of its burst (record.py)
        self.book.nodes_changed(list(self.statuses.values()), later=later)

    # ---------------------------------------------------------------- the attempt
    def run_attempt(self, env: dict[str, str], node_env: dict[str, dict[str, str]]) -> RunResult:
        """Preflight, launch and watch this attempt's nodes; how it ended (nothing saved as final)."""
        gpus_found: dict[str, int | None] = {}
        t0 = time.monotonic()
        if not self.spec.skip_preflight:
            gpus_found = self.preflight()
        self.book.attempt_changed(preflight_s=round(time.monotonic() - t0, 3))
        check_free(self.cluster, self.inv, self.spec.force, self.claims.live_found if self.claims else {})
        if self.policy.stop_requests:
            raise LaunchError("stopped before launch", EXIT_INTERRUPTED)
        self.assign_ranks(gpus_found)
        self.launching([n.name for n in self.inv.nodes])  # the run's warm interpreters listen first: the ranks fork
        launcher = Launcher(self.cluster, self.inv, self.key, self.spec, self.statuses, self.record.resume_args)
        tracked = trackers.attempt_env(self.run, self.record.attempt, self.inv, self.say)  # W&B, MLflow: one run
        launcher.extra_env = {n: {**tracked.get(n, {}), **env, **e} for n, e in node_env.items()}
        t0 = time.monotonic()
        try:
            launcher.launch()
        except LaunchError:
            self.teardown("launch failed")
            raise
        self.book.attempt_changed(launch_s=round(time.monotonic() - t0, 3), launched=time.time())
        self.save()
        self.book.running()
        if self.policy.stop_requests:  # asked while launching
            self.teardown("stop")
        running = [n for n in self.inv.nodes if self.statuses[n.name].state is NodeState.RUNNING]
        return self.watch(running, self.record.log_start)

    def watch(self, nodes: list[Node], start_at: dict[str, int] | None = None, adopted: bool = False) -> RunResult:
        hw = self.watch_hangs([n.name for n in nodes], armed=adopted)
        sw = self.watch_stragglers([n.name for n in nodes])
        progress_sink = ProgressLog(self.run.dir, self.key).feeder(sw.feed if sw is not None and sw.streamed else None,
                                                                   hw.feed if hw is not None else None)
        try:
            self.short = copy_logs(self.cluster, self.run, nodes, self.node_ended, echo=self.say, stop=self.drained,
                                   key=self.key, start_at=start_at, artifacts=self.artifacts,
                                   after_write=hw.heard if hw else None, tell=self.book.tell, progress=progress_sink,
                                   progress_s=self.spec.progress_s, space=self.book.space, stopping=self.stopping,
                                   stall_s=self.spec.stream_stall, streams=self.streams)
        finally:
            for w in (hw, sw):
                if w is not None:
                    w.close()
        return self.result()

    def result(self) -> RunResult:
        r = self.policy.result(self.statuses.__getitem__, self.run.node_log, list(self.statuses.values()))
        v = self.hang
        if v is not None and r.state is RunState.FAILED:  # the hang is the story, not the stop it caused
            where = f"\nsnapshots of every rank: {self.run.dir / self.record.hang_dir}" if self.record.hang_dir else ""
            return RunResult(RunState.FAILED, EXIT_FAILED, v.text + "".join(f"\n  {d}" for d in v.details) + where,
                             r.first_failure)
        if self.straggler is not None and r.state is RunState.FAILED:  # ended to leave the straggler out
            return RunResult(RunState.FAILED, EXIT_FAILED, self.straggler[0], r.first_failure)
        return r

    # ---------------------------------------------------------------- hangs (runs/judge/hang.py)
    def watch_hangs(self, names: list[str], armed: bool = False) -> HangWatch | None:
        """The hang watch over this attempt's ranks, started (None when --hang-timeout is 0)."""
        if self.spec.hang_timeout <= 0:
            return None
        ranks_of = {r: st.name for st in self.statuses.values() if st.first_rank is not None
                    and st.last_rank is not None for r in range(st.first_rank, st.last_rank + 1)}
        self.hang_watch = hw = HangWatch(timeout=self.spec.hang_timeout, snap=lambda k: self.snapshot(names, k),
                                         world=sorted(ranks_of), ranks_of=ranks_of, out_dir=self.run.dir / "hangs",
                                         on_hang=self.on_hang, say=self.say, tell=self.book.tell,
                                         probe=lambda: links_down(self.cluster, self.inv, names),
                                         busy_limit=self.spec.hang_busy_limit,
                                         order=names, observe=self.spec.on_hang == "observe", armed=armed)
        hw.start()
        return hw

    def snapshot(self, names: list[str], request: int) -> tuple[list[RankSnap], list[str]]:
        """Every rank of the attempt on the nodes still running it (node agent `snapshot`), and the
        nodes that answered."""
        live = self.cluster.live(n for n in names if self.statuses[n].state is NodeState.RUNNING)
        got = snapshot_nodes(self.cluster, self.streams, live, self.key, self.spec.snapshot_wait)
        out = snaps_of(got, self.say)
        self.snapshots[request] = {name: (sn.error or list(sn.ranks)) for name, sn in got.items()}
        for old in sorted(self.snapshots)[:-2]:  # a verdict keeps the pair it came from; a quiet run
            del self.snapshots[old]               # checked for days must not grow the supervisor
        return out, sorted(n for n, sn in got.items() if sn.error is None)

    def on_hang(self, v: HangVerdict, d: Path) -> None:
        """A hang was found: recorded with its snapshots; unless observed, the attempt fails with it."""
        try:
            (d / "snapshots.json").write_text(json.dumps(self.snapshots, indent=1, default=str))
        except OSError as e:  # no room here: the verdict stands without its file
            if self.book.space is None or not self.book.space.full(e, "the hang's snapshots"):
                raise
        self.book.attempt_changed(hang=v.text, hang_dir=str(d.relative_to(self.run.dir)))
        for line in (v.text, *(f"  {x}" for x in v.details), f"  every rank's stacks: {d / 'stacks.txt'}"):
            self.book.tell(line)
        if self.spec.on_hang == "observe" or self.policy.stop_requests or self.policy.first is not None:
            return
        self.hang = v
        node = next((c.node for c in v.culprits if c.node in self.statuses), next(iter(self.statuses)))
        self.policy.failed(node, None, v.text)

    # ---------------------------------------------------------------- stragglers (runs/judge/straggler.py)
    def watch_stragglers(self, names: list[str]) -> StragglerWatch | None:
        """The straggler watch over this attempt's ranks, started (None when the factor is 0): fed by
        the nodes' log streams (`watch` hands them `feed`), else asking every node's agent (`progress`)."""
        if self.spec.straggler_factor <= 0:
            return None
        node_of = {r: st.name for st in self.statuses.values() if st.first_rank is not None
                   and st.last_rank is not None for r in range(st.first_rank, st.last_rank + 1)}

        def live() -> list[str]:
            return self.cluster.live(n for n in names if self.statuses[n].state is NodeState.RUNNING)

        sw = StragglerWatch(snap=lambda: progress(self.cluster, self.key, live(), self.say), node_of=node_of,
                            tell=self.book.tell, on_straggler=self.on_straggler, window=self.spec.straggler_window,
                            factor=self.spec.straggler_factor, say=self.say, period=self.spec.progress_s,
                            offsets=lambda: clock_offsets(self.cluster, live(), asks=self.streams),
                            streamed=self.artifacts is not None, warming=self.warming)
        sw.start()
        return sw

    def on_straggler(self, new: list[Slow], current: str | None) -> None:
        """Recorded (`status` shows it); with --on-straggler replace, a new straggler's node is left
        out: the attempt ends and the run restarts without it, when the run loop can."""
        self.book.attempt_changed(straggler=current)
        if not new or self.spec.on_straggler != "replace" or self.policy.stop_requests or self.policy.first:
            return
        nodes = tuple(dict.fromkeys(s.node for s in new))
        why_not = self.can_replace(list(nodes))
        if why_not:
            self.book.tell(f"--on-straggler replace: {', '.join(nodes)} stays in the run: {why_not}")
            return
        self.straggler = (current or "", nodes)
        self.book.tell(f"--on-straggler replace: restarting from the newest checkpoint without {', '.join(nodes)}")
        self.policy.failed(nodes[0], None, current or "straggler")

    def adopt(self, recorded: list[NodeStatus]) -> RunResult:
        """Take over this attempt from the record after the supervisor died: what ended while
        nobody watched is recorded in the order it ended on the nodes, then the logs are copied on
        from where they stopped."""
        for st in recorded:
            if st.name in self.statuses:
                self.statuses[st.name] = st
        started = [n for n in self.inv.nodes if self.statuses[n.name].pid]
        now = agent.run(self.cluster, lambda n: agent.status(n, self.key),
                        [n.name for n in started if n.name in self.cluster.connections])
        ended = sorted((s.ended or 0, name) for name, s in now.items() if s.exit_code is not None)
        for _, name in ended:
            self.record_end(name, now[name])
        if self.policy.stop_requests:
            self.teardown("stop")
        return self.watch(started, self.record.log_start, adopted=True)

    # ---------------------------------------------------------------- preflight and ranks
    def preflight(self) -> dict[str, int | None]:
        from orchestrator.checks.preflight import FAST_CHECKS, run_preflight

        inv, src, code = self.inv, None, None
        if self.record.attempt == 1 and (rec := synced.source_of(list(self.inv.nodes))) is not None:
            # the nodes were last synced from rec["src"], changed since: compared with it as it is
            # now, so an edit there that was not synced fails the launch naming the files
            there = dataclasses.replace(inv, sync=inv.sync.model_copy(update={"include": rec["include"],
                                                                               "exclude": rec["exclude"]}))
            if (now := control_code(there, rec["src"]))["digest"] != rec["digest"]:
                inv, src, code = there, rec["src"], now
        report = run_preflight(self.cluster, inv, FAST_CHECKS, control_dir=src, control=code)
        prev = self.book.rec.attempts[-2].nodes if self.record.attempt > 1 and len(self.book.rec.attempts) > 1 else []
        asked = retry.ask_survivors(report, lambda: run_preflight(self.cluster, inv, FAST_CHECKS), set(prev),
                                    self.pause)  # a relaunch: a blip on a node that ran the last attempt passes
        report = asked.report
        if asked.retried:
            self.book.attempt_changed(preflight_asked=asked.rounds)
            self.book.tell(f"attempt {self.record.attempt}: preflight failed on a node of attempt "
                           f"{self.record.attempt - 1} ({'; '.join(asked.first)[:300]}); "
                           + (f"passed when {asked.retried}" if report.ok else f"still failing, {asked.retried}"))
        table = report.text(ranks=report.ok or self.spec.force)  # no rank map for a launch that fails here
        name = "preflight.txt" if self.record.attempt == 1 else f"preflight-a{self.record.attempt}.txt"
        tmp = self.run.dir / (name + ".tmp")  # written whole, then renamed: `train` prints it once it exists
        try:
            tmp.write_text(table)
            os.replace(tmp, self.run.dir / name)
        except OSError as e:  # no room here: the run goes on without the file (the failure's message has it)
            tmp.unlink(missing_ok=True)
            if self.book.space is None or not self.book.space.full(e, "the preflight table"):
                raise
            name = None
        self.book.attempt_changed(preflight_ok=report.ok, preflight_file=name)
        if not report.ok and not self.spec.force:
            failing = sorted({node for node, _ in report.failures})
            what = "; ".join(f"{node} {r.check}: {r.detail}" for node, r in report.failures[:4])
            again = f" ({asked.retried})" if asked.retried else ""
            raise PreflightFailed(f"preflight failed on {', '.join(failing)} ({what}){again}; nothing was started. "
                                  "--force launches anyway", failing, table, report.failed_checks())
        return dict(report.gpus_found)

    def pause(self, seconds: float) -> bool:
        """Wait `seconds`, cut short by a stop request (then True)."""
        end = time.monotonic() + seconds
        while not self.policy.stop_requests and (left := end - time.monotonic()) > 0:
            time.sleep(min(0.2, left))
        return bool(self.policy.stop_requests)

    def assign_ranks(self, gpus_found: dict[str, int | None]) -> None:
        inv = self.inv
        nprocs = nprocs_for(inv, gpus_found, self.spec.nproc_per_node)
        over = too_many_procs(inv, nprocs, gpus_found)
        if over and not self.spec.force:
            desc = "; ".join(f"{name}: {k} processes, {g} GPUs {where}" for name, (k, g, where) in over.items())
            most = min(g for _, g, _ in over.values())
            raise LaunchError(f"more processes than GPUs ({desc}): the extra ranks would fail with 'invalid device "
                              f"ordinal'. Use --nproc-per-node {most} or fewer (or leave it out: one process per "
                              f"GPU), or --force to launch anyway; nothing was started.", EXIT_USAGE)
        for n, first, last in rank_map(inv, nprocs):
            st = self.statuses[n.name]
            st.nproc, st.first_rank, st.last_rank = nprocs[n.name], first, last
        self.save()
        self.book.launching(rank_map_text(inv, nprocs), sum(nprocs.values()))

    # ---------------------------------------------------------------- stopping this attempt
    def teardown(self, why: str, peer_failed: bool = False) -> None:
        """Stop this attempt on every one of its nodes, through their open log streams first; a node not
        reached now is stopped once it answers (a pending stop under this attempt's key). `peer_failed`: a
        node failed, so the nodes kill at once (unless a checkpoint is being written there) and nothing waits
        to ask them for the last save's length first: a user's stop grants a checkpoint its grace."""
        peer_failed = peer_failed and not self.policy.stop_requests
        self.stopping.set()
        with self.tlock:
            grace = asked_grace(self.run) if peer_failed else \
                grace_for(self.cluster, self.key, asked_grace(self.run), self.policy.stop_requests >= 2)
            self.book.tearing_down(why, grace)
            if self.drain_timer is None:  # the logs may take the grace, then LOG_DRAIN_S, to close
                self.drain_timer = threading.Timer(grace + LOG_DRAIN_S, self.drained.set)
                self.drain_timer.daemon = True
                self.drain_timer.start()
            # what never started, or ended and was cleaned up by its node, needs no stop later
            done = {n for n, st in self.statuses.items() if (st.state is NodeState.PENDING and not st.pid)
                    or st.state in (NodeState.FINISHED, NodeState.FAILED, NodeState.GONE)}
        # outside the lock: a second stop request (grace 0) must not wait for the first one's grace
        self.stopper.stop(self.key, list(self.statuses), grace, done, peer_failed, self.streams)

    def close(self) -> None:
        if self.drain_timer is not None:
            self.drain_timer.cancel()

    # ---------------------------------------------------------------- nodes ending
    def node_ended(self, res: NodeResult, final: agent.AgentStatus | None = None) -> None:
        """A node's log copy ended: the node was lost, or its torchrun ended (how: the status the
        agent's tail closed with, else ask the agent)."""
        name = res.node
        if self.hang_watch is not None:  # its ranks are the run's end there, never waited for
            self.hang_watch.ended(name)
        conn = self.cluster.connections.get(name)
        if final is not None:
            now = final
        elif conn is not None and conn.alive:
            now = agent.run(self.cluster, lambda n: agent.status(n, self.key), [name])[name]
        else:
            now = agent.AgentStatus(error="not connected")
        if now.exit_code is not None:
            self.record_end(name, now)
            return
        st = self.statuses[name]
        if res.kind is ErrorKind.STOPPED and now.alive:
            st.error = "still running when the log copy was given up"
            self.save(later=True)
            return
        if now.exists and not now.alive:  # reachable, but no process and no exit code
            st.state, st.error = NodeState.GONE, "the run vanished on the node without an exit code"
            self.policy.failed(name, None, st.error)
            self.save(later=True)
            return
        # a lost node's result carries the words its loss was told in (runs/logs/streams.py reconnect)
        reason = (res.error if res.kind is ErrorKind.LOST else None) or (conn.lost_reason if conn else None) \
            or res.error or "the SSH connection was lost"
        st.state, st.exit_code, st.error = NodeState.LOST, None, reason
        self.policy.failed(name, None, reason)
        self.save(later=True)
        if self.policy.first is not None or self.policy.stop_requests:  # its pending stop, too
            threading.Thread(target=self.teardown, args=("lost after the failure or stop", self.policy.first is not None),
                             daemon=True).start()

    def record_end(self, name: str, now: agent.AgentStatus) -> None:
        """A node's torchrun ended: its exit code and end time, by the node's own record."""
        st = self.statuses[name]
        if st.state in (NodeState.FINISHED, NodeState.FAILED) and st.node_ended == now.ended:
            return
        code = now.exit_code
        st.state = NodeState.FINISHED if code == 0 else NodeState.FAILED
        st.exit_code, st.ended, st.node_ended, st.rank_failed, st.error_file = (
            code, time.time(), now.ended, now.rank_failed, now.error_file)
        if code != 0:
            self.policy.failed(name, code, exit_meaning(code), ended=st.failed_at)
        self.save(later=True)
        if self.straggler is not None:
            self.kill_left_out(self.straggler[1])

    def kill_left_out(self, out: tuple[str, ...]) -> None:
        """--on-straggler replace stops as a user's stop does, so the job saves; once every node staying has
        ended, that save is over and a throttled rank's exit (3.6 s at 15 % of a core) is not waited for:
        the left-out nodes are stopped as after a failure (killed unless writing a checkpoint; not rank 0's)."""
        with self.tlock:
            if self.out_killed or self.policy.stop_requests or any(
                    st.state is NodeState.RUNNING for n, st in self.statuses.items() if n not in out):
                return
            self.out_killed = True
            rest = [n for n in out if self.statuses[n].state is NodeState.RUNNING and self.statuses[n].first_rank != 0]
        if rest:
            self.book.tell(f"every other node ended: stopping {', '.join(rest)} without waiting for its ranks to exit")
            # on a thread: the stream's answer to it is read by the loop this is called from
            threading.Thread(target=self.stopper.stop, args=(self.key, rest, asked_grace(self.run), set(), True,
                                                             self.streams), daemon=True).start()

    def _first_failure(self, ff: FirstFailure) -> None:
        self.book.tell(f"stopping every node of attempt {self.record.attempt} after the hang" if self.hang is not None
                       else f"stopping every node of attempt {self.record.attempt} to leave out the straggler"
                       if self.straggler is not None else f"{ff.node} failed first ({ff.reason}); stopping every node of attempt {self.record.attempt}")
        self.book.attempt_changed(failed_at=ff.at)
        # a straggler left out is stopped as a user's stop is: the trainer saves its checkpoint first
        threading.Thread(target=self.teardown, args=(f"{ff.node} failed", self.straggler is None), daemon=True).start()

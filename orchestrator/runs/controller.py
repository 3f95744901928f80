"""The run loop: queued → claimed → attempt k → classify → restore → attempt k+1 → ended.

One loop, whoever runs it. `train` starts a supervisor that enters it at the top; a replacement
supervisor (`tail`, `status` and `stop` start one with --adopt when the recorded one is gone) loads
the record (runs/record.py) and re-enters it at the recorded attempt, so restarts, checkpoint copies
and replicas go on after any supervisor dies. An attempt (runs/attempt.py) returns its result; the
loop classifies it (runs/restart.py `classify`), records a fault against the nodes it names
(runs/nodefaults.py), and for the infrastructure's failure prepares the next attempt's nodes (spares
brought to the run's code, runs/spares.py), restores the newest checkpoint and launches again. A
relaunch whose preflight fails on a node, or whose spare cannot be prepared, leaves that node out
and tries the next spare (or --min-nodes); that costs no restart, as nothing was launched.

The launch is part of the recovery: a node unreachable when the run starts, or lost during any
attempt's launch (at its claim, its preparation, preflight or torchrun's start), is left out the
same way. A restart is spent only by an attempt that launched on every node (--max-restarts
counts those), so an attempt that never launched costs none; each one leaves a node out, so
they end when the nodes do. A node the run leaves out, or ends on, has its claim released at
once (runs/claims.py), or once it answers again."""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
import traceback

import psutil

from orchestrator.errors import EXIT_INTERRUPTED, EXIT_UNREACHABLE, ClusterctlError, LaunchError
from orchestrator.runs.attempt import AttemptRunner, PreflightFailed
from orchestrator.runs.logs.catchup import ShortCopies
from orchestrator.runs import nodefaults, quarantine, stepjournal
from orchestrator.runs.ckpt.given_home import ArtifactCopier
from orchestrator.runs.claims import Claims
from orchestrator.runs.ckpt.jobdir_replicas import artifact_copier
from orchestrator.runs.launch import NodesNotReady, first_lineup, silent_nodes
from orchestrator.runs.policy import hang_retried
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import AttemptRecord
from orchestrator.runs.readying import Readying, fresh_nodes
from orchestrator.runs.restart import Verdict, classify, next_nodes, ordered, outcomes, summary
from orchestrator.runs.space import Space, end_writes
from orchestrator.runs.scaling import record_doc
from orchestrator.runs.spec import NodeState, RunResult, RunState
from orchestrator.runs.stopping import LOST_PATIENCE, Stopper, asked_grace, say
from orchestrator.runs.store import Run
from orchestrator.runs.warmpool import WarmPool, restart_nodes
from orchestrator.transport import Cluster, retry_wait


def _changes(old: list[str], new: list[str]) -> str:
    """How the next attempt's nodes differ: " (node5 in node2's place)", " (without node2)"."""
    if len(old) == len(new):
        subs = [f"{n} in {o}'s place" for o, n in zip(old, new) if o != n]
    else:
        subs = [f"without {o}" for o in old if o not in new]
    return f" ({', '.join(subs)})" if subs else ""


class Controller:
    def __init__(self, run: Run, adopt: bool = False):
        self.run, self.adopt, self.spec = run, adopt, run.spec
        self.space = Space(run.dir)  # no room on this disk: the run goes on from memory (runs/space.py)
        self.book = Book(run, self.space)
        self.full_inv = self.spec.load_inventory()  # spares included: restarts draw on them
        self.cluster: Cluster | None = None
        self.stopper: Stopper | None = None
        self.claims: Claims | None = None
        self.copier: ArtifactCopier | None = None
        self.readying: Readying | None = None
        self.shorts: ShortCopies | None = None  # log copies that ended short for want of room
        self.current: AttemptRunner | None = None
        self.warm: WarmPool | None = None  # the nodes' warm interpreters, for restarts (runs/warmpool.py)
        self.stop_requests = 0
        self.signalled = threading.Event()  # a SIGTERM/SIGINT came: end within the stop's grace

    # ---------------------------------------------------------------- process
    def main(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        req = self.run.stop_request
        if req:  # a stop asked for before this supervisor ran (or while none did)
            self.stop_requests = max(1, int(req.get("requests", 1)))
        self.run.clean_temporaries()
        self.space.keep_reserve()  # room for the final record should the disk be full when the run ends
        self.book.supervisor(os.getpid(), psutil.Process().create_time(), self.adopt)
        if self.spec.scaling is not None and self.book.rec.scaling is None:
            self.book.scaled(record_doc(self.spec))
        try:
            code = self.loop()
        except LaunchError as e:
            say(str(e))
            code = self.end_with_error(str(e), e.exit_code)
        except Exception as e:  # noqa: BLE001 - record, stop nodes, never leave them running
            traceback.print_exc()
            if self.current is not None:
                self.current.teardown("internal error")
            code = self.end_with_error(f"internal error: {type(e).__name__}: {e}", 1)
        finally:
            if self.warm is not None:
                self.warm.close()
            if self.copier is not None:
                self.copier.stop()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            self.book.cpu(ru.ru_utime + ru.ru_stime)
        end_writes(self.space, lambda: self.book.unsaved, say)  # a full disk: the reserve, else wait for room
        if self.stopper is not None and self.stopper.pending:
            say(f"waiting up to {LOST_PATIENCE:g}s for {', '.join(self.book.rec.stop_pending)} to answer, "
                "to stop the run there")
            self.stopper.join(LOST_PATIENCE)
        if self.cluster is not None:
            self.cluster.close()
        self.space.drop_reserve()  # nothing of it outlives the supervisor's end
        return code

    def on_signal(self, signum, frame) -> None:
        self.stop_requests += 1
        say(f"stop request {self.stop_requests} (signal {signum})")
        self.signalled.set()
        if self.stopper is not None and self.book.rec.state.terminal:  # only pending stops left: they
            self.stopper.end_by(0.0 if self.stop_requests > 1 else asked_grace(self.run))  # end with the grace
        runner = self.current
        if runner is not None:
            runner.policy.stop_requests = self.stop_requests
            threading.Thread(target=runner.teardown, args=("stop",), daemon=True).start()

    def end_with_error(self, error: str, code: int) -> int:
        if self.claims is not None:
            self.claims.release_all()
        # a stop is the request file as well as the signal: `clusterctl stop` writes the file first,
        # and a queued run that saw it ended before the signal arrived (it was recorded 'failed')
        stopped = (self.stop_requests or self.run.stop_request) and code == EXIT_INTERRUPTED
        a = self.book.rec.current
        if a is not None and a.verdict is None and not self.book.rec.state.terminal:  # ended before it launched
            self.book.attempt_changed(ended=time.time(), exit_code=code, verdict="stopped" if stopped else
                                      "launch failed", detail=error, retry=False)
        if not self.book.rec.state.terminal:
            self.book.ended(RunResult(RunState.STOPPED if stopped else RunState.FAILED, code, error), error=error)
        return code

    def connect(self, patient: bool) -> Cluster:
        spec = self.spec
        self.cluster = cluster = Cluster(self.full_inv, **spec.cluster_options())
        cluster.connect()
        deadline, tries = time.monotonic() + spec.lost_timeout, 0
        while patient and cluster.unreachable and time.monotonic() + retry_wait(tries, refused=False) < deadline:
            if self.signalled.wait(retry_wait(tries, refused=False)):  # backoff: not one try a second
                break
            tries += 1
            cluster.connect()  # an adopted run's node may be a moment from answering
        for name in [k for k in cluster.unreachable if self.full_inv.node(k).spare]:
            say(f"spare {name} is unreachable: {cluster.unreachable[name].error}")  # not needed to start
        return cluster  # a ranked node that is not reached: first_nodes puts a spare in its place

    # ---------------------------------------------------------------- claims (runs/claims.py)
    def claim_start(self, names: list[str]) -> None:
        """With --queue the first attempt's nodes are claimed once they are free; else as that
        attempt begins (runs/readying.py), where a node lost at its claim is one lost during the launch."""
        if self.queued:
            self.claims.wait_and_take(names, lambda: self.stop_requests)
        elif self.book.rec.state is not RunState.CONNECTING:
            self.book.connecting()

    @property
    def queued(self) -> bool:
        return self.spec.queue and not self.spec.force

    # ---------------------------------------------------------------- the loop
    def quarantined(self) -> dict[str, quarantine.Entry]:
        return {} if self.spec.allow_unhealthy else quarantine.of(self.full_inv.nodes)

    def first_nodes(self) -> list[str]:
        """The ranked nodes, a quarantined or unreachable one's place taken by a spare (launch.py)."""
        return first_lineup(self.full_inv, self.cluster, self.quarantined(), self.spec.min_nodes, self.book)

    def spares_left(self) -> list[str]:
        used = {n for a in self.book.rec.attempts for n in a.nodes} | set(self.book.rec.left_out)
        held = self.quarantined()
        return [n.name for n in self.full_inv.nodes if n.spare and n.name not in used and n.name not in held
                and n.name in self.cluster.connections]

    def restart_nodes(self) -> list[str]:
        """The nodes a restart may use now: the current attempt's and the spares left, none
        quarantined or left out of the run."""
        rec = self.book.rec
        return restart_nodes(self.full_inv, rec.current.nodes if rec.current is not None else None,
                             self.spares_left(), set(self.quarantined()) | set(rec.left_out))

    def loop(self) -> int:
        rec = self.book.rec
        cluster = self.connect(patient=self.adopt)
        self.stopper = Stopper(cluster, self.full_inv, self.run.id, self.book, say)
        if self.signalled.is_set() and rec.state.terminal:  # signalled while connecting
            self.stopper.end_by(asked_grace(self.run))
        self.stopper.resume(rec.pending_stops)
        self.claims = Claims(self.run, self.book, cluster, self.full_inv, self.stopper, self.book.tell)
        if rec.state.terminal:  # adopted only to carry out stops still pending
            return int(rec.exit_code or 0)
        self.copier = artifact_copier(cluster, self.run.dir, self.spec, say)
        self.copier.space = self.space
        self.shorts = ShortCopies(cluster, self.full_inv, self.book, self.space, say)
        self.space.on_room.append(self.shorts.settle)
        self.readying = Readying(self.run, self.spec, self.book, cluster, self.full_inv, self.claims, self.copier, say)
        if self.spec.warm and self.spec.max_restarts > 0:  # only a restart forks from them
            self.warm = WarmPool(cluster, self.full_inv, self.run.id, say, self.restart_nodes,
                                 progressed=lambda: stepjournal.progressed(self.run.dir))
            self.warm.start()
        k, nodes, ended = self.entry()
        while True:
            result, verdict = ended if ended is not None else self.attempt(k, nodes)
            ended = None
            self.book.attempt_changed(ended=time.time(), exit_code=result.exit_code, verdict=verdict.cause,
                                      detail=verdict.detail, retry=verdict.retry, bad_nodes=list(verdict.bad_nodes))
            verdict = nodefaults.of_verdict(self.full_inv, self.run.id, k, nodes, verdict, self.book.tell,
                                            not self.spec.allow_unhealthy, self.spares_left)
            launched = sum(1 for a in self.book.rec.attempts if a.launched)
            if not verdict.retry or launched > self.spec.max_restarts:
                return self.end(result, verdict)
            if verdict.bad_nodes:  # not used again by this run: their claims go at once
                self.book.leave_out({n: f"attempt {k}: {verdict.cause}" for n in verdict.bad_nodes})
                self.claims.release(list(verdict.bad_nodes))
            min_nodes = self.spec.min_nodes or len(nodes)
            nxt = next_nodes(nodes, self.spares_left(), verdict.bad_nodes, min_nodes)
            if nxt is None:
                self.book.tell(f"attempt {k} failed ({verdict.cause}: {verdict.detail}); not enough nodes for "
                               f"another attempt (no spare left, --min-nodes {min_nodes})")
                return self.end(result, verdict)
            # an attempt that never launched spends no restart, so the last attempt's number grows
            at_most = self.spec.max_restarts + 1 + sum(1 for a in self.book.rec.attempts if not a.launched)
            free = "" if self.book.rec.current.launched else f"; attempt {k} never launched, so no restart is spent"
            self.book.tell(f"attempt {k} failed ({verdict.cause}: {verdict.detail}); restarting as attempt {k + 1} "
                           f"of at most {at_most} on {', '.join(nxt[0])}{_changes(nodes, nxt[0])}{free}")
            self.book.recovering(f"attempt {k}: {verdict.cause}")
            nodes, k = nxt[0], k + 1

    def entry(self) -> tuple[int, list[str], tuple[RunResult, Verdict] | None]:
        """Where this supervisor enters the loop: the top, or (adopted) the recorded attempt."""
        rec = self.book.rec
        a = rec.current
        if a is None or rec.state in (RunState.STARTING, RunState.CONNECTING, RunState.QUEUED):
            nodes = a.nodes if a is not None else self.first_nodes()
            self.claim_start(nodes)
            return 1, nodes, None
        say(f"adopting run {self.run.id} at attempt {a.attempt} ({rec.state})")
        if rec.state is RunState.RECOVERING:  # died between attempts: the recorded verdict stands
            return a.attempt, a.nodes, (RunResult(RunState.FAILED, a.exit_code or 1, a.detail or ""),
                                        Verdict(True, a.verdict or "?", a.detail or "", tuple(a.bad_nodes)))
        runner = self.runner(a)
        # a node that does not answer now is not asked: its log stream declares it lost, as a running one
        self.copier.dirs.update(self.readying.dirs(self.cluster.live(a.nodes)))
        if rec.state is not RunState.RUNNING:  # died while launching: stop what started, relaunch
            runner.statuses.update({st.name: st for st in rec.nodes if st.name in runner.statuses})
            runner.teardown("the supervisor died while launching")
            why = f"the supervisor died during attempt {a.attempt}'s {rec.state}"
            return a.attempt, a.nodes, (RunResult(RunState.FAILED, 1, why), Verdict(True, "supervisor died", why))
        self.copier.start(lambda: list(a.nodes), a.key)
        try:
            result = runner.adopt(rec.nodes)
        finally:
            self.copier.stop()
            self.shorts.owe(a.key, runner.short)
            runner.close()
            self.current = None
        self.copier.sweep(list(a.nodes), finished=result.state is RunState.FINISHED)  # written just before the end
        return a.attempt, a.nodes, (result, self.verdict(runner, result))

    def runner(self, a: AttemptRecord) -> AttemptRunner:
        self.current = AttemptRunner(run=self.run, spec=self.spec, book=self.book, cluster=self.cluster,
                                     inv=ordered(self.full_inv, a.nodes), record=a, stopper=self.stopper,
                                     stop_requests=self.stop_requests, say=say)
        self.current.artifacts = self.copier
        self.current.can_replace = self.can_replace
        self.current.claims = self.claims
        if self.warm is not None:
            self.current.warming, self.current.launching = self.warm.importing, self.warm.before_launch
        return self.current

    def can_replace(self, nodes: list[str]) -> str | None:
        """Why the current attempt cannot restart without `nodes` (None: it can)."""
        if sum(1 for a in self.book.rec.attempts if a.launched) > self.spec.max_restarts:
            return f"no restart left (--max-restarts {self.spec.max_restarts})"
        cur = self.book.rec.current.nodes
        if next_nodes(cur, self.spares_left(), tuple(nodes), self.spec.min_nodes or len(cur)) is None:
            return "no spare left to take its place (and --min-nodes does not let the run shrink)"
        return None

    def verdict(self, runner: AttemptRunner, result: RunResult) -> Verdict:
        hang = runner.hang
        if hang is not None and result.state is RunState.FAILED:
            # a deterministic hang hangs again: retried only when its culprit's node can be left out
            restart = hang_retried(self.spec.on_hang, hang.nodes)
            return Verdict(restart, "hang", hang.text.removeprefix("hang: "), hang.nodes if restart else (), hang.nodes)
        if runner.straggler is not None and result.state is RunState.FAILED:  # --on-straggler replace
            return Verdict(True, "straggler", runner.straggler[0].removeprefix("straggler: "), runner.straggler[1],
                           runner.straggler[1])
        first = result.first_failure.node if result.first_failure else None
        return classify(outcomes(self.run, runner), first, stopped=result.state is RunState.STOPPED,
                        exit_codes=self.spec.restart_on_exit_codes)

    # ---------------------------------------------------------------- one attempt, set up and classified
    def attempt(self, k: int, nodes: list[str]) -> tuple[RunResult, Verdict]:
        # nodes entering the run (a spare; one whose preparation an earlier supervisor did not
        # finish) are prepared, not assumed to hold the run's code
        fresh = fresh_nodes(k, nodes, self.book.rec.attempts, self.full_inv)
        self.shorts.settle()  # before this attempt's log follows them in the copies
        a = AttemptRecord(attempt=k, key=self.run.id if k == 1 else f"{self.run.id}.a{k}", nodes=list(nodes),
                          started=time.time(), log_start={n: (p.stat().st_size if (p := self.run.node_log(n)).exists()
                                                             else 0) for n in nodes}, prepared=fresh, ready=[])
        runner = self.runner(a)
        self.book.attempt_started(a, list(runner.statuses.values()))
        try:
            dirs = self.readying.set_up(k, nodes, fresh, first_claim=k == 1 and not self.queued)
            say(f"attempt {k} on {', '.join(nodes)}" + (f", from checkpoint {a.checkpoint}" if a.checkpoint else ""))
            env = {"CLUSTERCTL_ATTEMPT": str(k)}
            per_node = {n: {"CLUSTERCTL_CHECKPOINT_DIR": d.get("ckptdir", d["checkpoints"]),
                            "CLUSTERCTL_TENSORBOARD_DIR": d["tensorboard"]} for n, d in dirs.items()}
            self.copier.start(lambda: list(nodes), a.key)
            try:
                result = runner.run_attempt(env, per_node)
            finally:
                self.copier.stop()
                self.shorts.owe(a.key, runner.short)
            # a checkpoint written just before the end (a checkpoint directory only after a good end:
            # a worker killed mid-write leaves a torn file that soon looks complete)
            self.copier.sweep(list(nodes), finished=result.state is RunState.FINISHED)
            self.book.attempt_changed(copy_s=round(self.copier.copy_s + sum(d.copy_s for d in self.copier.snaps), 3))
            return result, self.verdict(runner, result)
        except ClusterctlError as e:  # before the launch completed (the watch returns its result)
            return self.launch_failed(k, runner, e)
        finally:
            runner.close()
            self.current = None

    def launch_failed(self, k: int, runner: AttemptRunner, e: ClusterctlError) -> tuple[RunResult, Verdict]:
        """Attempt k failed before its launch completed (nothing ran, so no restart is spent). Nodes
        that went away meanwhile are lost: left out, a spare takes their place. A node whose
        preflight or preparation failed is left out the same way, except in attempt 1, where a
        failed preflight is the user's to fix (unless only sick nodes failed and spares can take
        their places). Anything else ends the run (raised)."""
        nodes = list(runner.statuses)
        if self.stop_requests:  # asked to stop: whatever failed meanwhile, the run stops before it launched
            raise e if e.exit_code == EXIT_INTERRUPTED else LaunchError(f"stopped before launch ({e})", EXIT_INTERRUPTED)
        lost = silent_nodes(self.cluster, nodes, self.book.tell)
        if lost:
            for name, why in lost.items():
                st = runner.statuses[name]
                st.state, st.error = NodeState.LOST, why
            runner.save()
            detail = f"{', '.join(lost)} lost during the launch"  # each loss was told as it was found
            return RunResult(RunState.FAILED, EXIT_UNREACHABLE, f"{detail}: {e}"), Verdict(True, "node lost", detail,
                                                                                            tuple(lost), tuple(lost))
        if not isinstance(e, (PreflightFailed, NodesNotReady)):
            raise e
        sick = self.quarantine_sick(e)
        # the first launch: the user's to fix, unless only sick nodes failed and spares can take their places
        if k == 1 and isinstance(e, PreflightFailed) and not (
                sick and set(e.nodes) <= set(sick) and len(self.spares_left()) >= len(sick)):
            raise e
        bad = tuple(e.nodes) if isinstance(e, PreflightFailed) else tuple(e.why)
        cause = "preflight failed" if isinstance(e, PreflightFailed) else "nodes not ready"
        self.book.tell(f"attempt {k}: {cause} on {', '.join(bad)}; leaving {'it' if len(bad) == 1 else 'them'} out")
        say(f"attempt {k}: {cause} on {', '.join(bad)}: {e}" +
            (f"\n{e.table}" if isinstance(e, PreflightFailed) else ""))
        return RunResult(RunState.FAILED, 1, str(e)), Verdict(True, cause, str(e), bad)

    def quarantine_sick(self, e: LaunchError) -> dict[str, str]:
        """Nodes whose preflight failed a health check are quarantined (not with --allow-unhealthy).
        -> {node: why} of those."""
        sick = quarantine.health_failures(e.checks) if isinstance(e, PreflightFailed) else {}
        return nodefaults.quarantine_sick(self.full_inv, self.run.id, self.book.rec.current.attempt, sick,
                                          self.book.tell, not self.spec.allow_unhealthy)

    def end(self, result: RunResult, verdict: Verdict) -> int:
        attempts = self.book.rec.attempts
        result = summary(result, attempts, verdict, self.spec.max_restarts)
        self.copier.store.clean_partials()
        if self.warm is not None:  # let go before the claims: each ends at once, no rank of its own running
            self.warm.close()
        self.claims.release_all()
        # closed before the final record: the foreground returns when it sees it, and by then no SSH
        # session of the run should still be winding down on a node (pending stops open their own)
        self.cluster.close()
        self.book.ended(result)
        return result.exit_code

"""The run supervisor: one detached process per run on the control machine.

`clusterctl train` starts it in its own session, so it outlives the terminal, a
closed laptop lid or a killed `clusterctl`. It owns the run's connections (one
handshake per node for preflight, launch and log streaming), takes the nodes' claims
before launch and drops them at the end, copies every node's log byte for byte into
the run directory (runs/watch.py, reconnecting dropped connections), and applies the
failure policy (runs/policy.py): the first node to fail stops every other node.

It can be replaced: `tail`, `status` and `stop` start one with --adopt when the
recorded supervisor is gone. It takes the run over from the records (run.json, the
nodes' own records), resumes the log copies at their sizes, carries out a pending stop
and applies the failure policy to what happened while nobody watched.

SIGTERM/SIGINT to the supervisor is a graceful stop request (runs/RUN/stop.json may give
the grace); a second one kills. A node that cannot be reached to stop it stays in the
record's stop_pending and is retried until it answers (up to LOST_PATIENCE).
Run: python -m orchestrator.runs.supervisor RUN_ID [--adopt]
"""

from __future__ import annotations

import getpass
import io
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

import psutil

from orchestrator.errors import (
    EXIT_INTERRUPTED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    LaunchError,
)
from orchestrator.inventory import Node
from orchestrator.runs.launch import (
    Launcher,
    agent_status,
    check_free,
    claim_nodes,
    release_nodes,
)
from orchestrator.runs.notify import notify_end
from orchestrator.runs.policy import FailurePolicy
from orchestrator.runs.spec import (
    FirstFailure,
    NodeState,
    NodeStatus,
    RunResult,
    RunState,
)
from orchestrator.runs.stopping import LOST_PATIENCE, Stopping, say
from orchestrator.runs.store import SUPERVISOR_MARK, Run, exit_meaning
from orchestrator.runs.torchrun import (
    nprocs_for,
    rank_map,
    rank_map_text,
    too_many_procs,
)
from orchestrator.runs.watch import copy_logs
from orchestrator.transport import Cluster, ErrorKind, NodeResult


def spawn(run: Run, adopt: bool = False) -> subprocess.Popen:
    """Start the run's supervisor, detached (own session), its output in supervisor.log."""
    log = open(run.dir / "supervisor.log", "ab")
    env = dict(os.environ, **{SUPERVISOR_MARK: run.id})
    argv = [sys.executable, "-m", "orchestrator.runs.supervisor", run.id] + (["--adopt"] if adopt else [])
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    finally:
        log.close()


class Supervisor(Stopping):
    def __init__(self, run: Run, adopt: bool = False):
        self.run, self.adopt = run, adopt
        self.spec = run.spec
        self.full_inv = self.spec.load_inventory()  # spares included: restarts (runs/restart.py) draw on them
        self.inv = self.full_inv.select([n.name for n in self.full_inv.nodes if not n.spare])
        # torchrun's node rank is the position in this run (--nodes may pick a subset)
        self.statuses = {n.name: NodeStatus(n.name, i, n.host) for i, n in enumerate(self.inv.nodes)}
        self.key = run.id  # the run's id on the nodes; attempt k > 1 of a restarted run: RUN_ID.aK
        self.log_start: dict[str, int] = {}  # where this attempt's bytes begin in each node's log copy
        self.say = say
        if adopt:
            self.statuses.update({st.name: st for st in run.nodes() if st.name in self.statuses})
            attempts = run.record.get("attempts") or []
            if attempts:  # a restarted run: the attempt that was running when the supervisor died
                self.key = attempts[-1].get("key") or run.id
        self.policy = FailurePolicy(self._first_failure)
        self.lock = threading.Lock()  # run.json writes
        self.tlock = threading.Lock()  # teardowns: one at a time
        self.stoppers: dict[str, threading.Thread] = {}
        self.cluster: Cluster | None = None
        self.claimed = False
        self.drained = threading.Event()  # set: stop copying logs (a stop's grace and drain are over)
        self.drain_timer: threading.Timer | None = None
        self.timing: dict[str, float] = {}

    def save(self, **changes) -> None:
        with self.lock:
            self.run.update(nodes=[st.to_json() for st in self.statuses.values()], **changes)

    # ---------------------------------------------------------------- main
    def main(self) -> int:
        def on_signal(signum, frame):
            self.policy.stop_requests += 1
            say(f"stop request {self.policy.stop_requests} (signal {signum})")
            threading.Thread(target=self.teardown, args=("stop",), daemon=True).start()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        req = self.run.stop_request
        if req:  # a stop asked for before this supervisor ran (or while none did)
            self.policy.stop_requests = max(1, int(req.get("requests", 1)))
        self.save(supervisor_pid=os.getpid(), supervisor_created=psutil.Process().create_time(),
                  **({"adopted_at": time.time()} if self.adopt else {"state": RunState.CONNECTING}))
        try:
            code = self._adopt() if self.adopt else self._main()
        except LaunchError as e:
            say(str(e))
            self.release_claims()
            if self.cluster is not None:
                self.cluster.close()
            stopped = self.policy.stop_requests and e.exit_code == EXIT_INTERRUPTED
            self.save(state=RunState.STOPPED if stopped else RunState.FAILED, exit_code=e.exit_code, error=str(e),
                      ended=time.time())
            code = e.exit_code
        except Exception as e:  # noqa: BLE001 - record, stop nodes, never leave them running
            traceback.print_exc()
            self.teardown("internal error")
            self.release_claims()
            self.save(state=RunState.FAILED, exit_code=1, error=f"internal error: {type(e).__name__}: {e}",
                      ended=time.time())
            code = 1
        finally:
            if self.drain_timer is not None:
                self.drain_timer.cancel()
            if self.cluster is not None:
                self.cluster.close()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            self.save(supervisor_cpu_s=round(ru.ru_utime + ru.ru_stime, 3))
        for name, t in list(self.stoppers.items()):  # a lost node is stopped when it answers again
            say(f"waiting up to {LOST_PATIENCE:g}s for {name} to answer, to stop it there")
            t.join(LOST_PATIENCE)
        return code

    def _main(self) -> int:
        cluster = self.connect()
        if not self.spec.force:
            who = f"{getpass.getuser()}@{socket.gethostname()}"
            if self.spec.queue:  # waits (recorded `queued`) until the nodes are free, then claims them
                from orchestrator.runs.queue import claim_when_free

                claim_when_free(self, cluster, who)
            else:
                claim_nodes(cluster, self.inv, self.run.id, who)
            self.claimed = True
        from orchestrator.runs.restart import Attempts

        return Attempts(self, cluster).run()

    # ---------------------------------------------------------------- one attempt (runs/restart.py loops)
    def begin_attempt(self, k: int, inv) -> None:
        """Fresh per-attempt state: the nodes in their rank order, statuses, failure policy, key."""
        stops = self.policy.stop_requests
        self.inv, self.key = inv, self.run.id if k == 1 else f"{self.run.id}.a{k}"
        self.statuses = {n.name: NodeStatus(n.name, i, n.host) for i, n in enumerate(inv.nodes)}
        self.policy = FailurePolicy(self._first_failure)
        self.policy.stop_requests = stops
        if self.drain_timer is not None:  # the last attempt's teardown: its drain is over
            self.drain_timer.cancel()
        self.drained, self.drain_timer = threading.Event(), None
        self.timing: dict[str, float] = {}  # this attempt's preflight_s, launch_s, launched (restart.py records them)
        self.log_start = {n.name: (p.stat().st_size if (p := self.run.node_log(n.name)).exists() else 0)
                          for n in inv.nodes}

    def attempt(self, cluster: Cluster, env: dict[str, str], node_env: dict[str, dict[str, str]]) -> RunResult:
        """Preflight, launch and watch this attempt's nodes; how it ended (nothing saved as final)."""
        gpus_found: dict[str, int | None] = {}
        t0 = time.monotonic()
        if not self.spec.skip_preflight:
            self.save(state=RunState.PREFLIGHT)
            gpus_found = self.preflight(cluster)
        self.timing["preflight_s"] = round(time.monotonic() - t0, 3)
        check_free(cluster, self.inv, self.spec.force)
        if self.policy.stop_requests:
            raise LaunchError("stopped before launch", EXIT_INTERRUPTED)
        self.assign_ranks(gpus_found)
        launcher = Launcher(cluster, self.inv, self.key, self.spec, self.statuses)
        launcher.extra_env = {n: {**env, **e} for n, e in node_env.items()}
        t0 = time.monotonic()
        try:
            launcher.launch()
        except LaunchError:
            self.teardown("launch failed")
            raise
        self.timing.update(launch_s=round(time.monotonic() - t0, 3), launched=time.time())
        self.save(state=RunState.RUNNING, started=time.time())
        if self.policy.stop_requests:  # asked while launching
            self.teardown("stop")
        running = [n for n in self.inv.nodes if self.statuses[n.name].state is NodeState.RUNNING]
        copy_logs(cluster, self.run, running, self.node_ended, echo=say, stop=self.drained, key=self.key,
                  start_at=self.log_start)
        return self.policy.result(self.statuses.__getitem__, self.run.node_log, list(self.statuses.values()))

    def watch(self, cluster: Cluster, running: list[Node]) -> int:
        """An adopted run: copy the logs to the end, then record how it ended."""
        copy_logs(cluster, self.run, running, self.node_ended, echo=say, stop=self.drained, key=self.key)
        return self.close_and_finish()

    def close_and_finish(self, result: RunResult | None = None) -> int:
        self.release_claims()
        # close before the final record: the foreground returns when it sees it, and by then
        # no SSH session of the run should still be winding down on a node
        if self.cluster is not None:
            self.cluster.close()
        return self.finish(result)

    def _adopt(self) -> int:
        """Take over a run whose supervisor is gone, from the records."""
        state = self.run.state()
        say(f"adopting run {self.run.id} ({state})")
        if state is RunState.QUEUED:  # nothing started yet: wait in the queue again, then run it
            return self._main()
        started = [n for n in self.inv.nodes if self.statuses[n.name].pid]
        cluster = self.connect(patient=True)
        self.claimed = not self.spec.force
        if state.terminal:  # ended, with a stop still pending on some nodes: carry it out
            self.stop_pending_again()
            return int(self.run.record.get("exit_code") or 0)
        if state is not RunState.RUNNING:
            self.teardown("the supervisor died while launching")
            copy_logs(cluster, self.run, started, lambda _res: None, echo=say, stop=self.drained)
            raise LaunchError("the supervisor died before the launch was complete; what had started was stopped")
        now = agent_status(cluster, self.key, [n.name for n in started if n.name in cluster.connections])
        ended = sorted((doc["ended"] or 0, name) for name, doc in now.items() if doc.get("exit_code") is not None)
        for _, name in ended:  # what ended while nobody watched, in the order it ended on the nodes
            self.record_end(name, now[name])
        if self.policy.stop_requests:
            self.teardown("stop")
        return self.watch(cluster, started)

    def stop_pending_again(self) -> None:
        pending = [n for n in self.inv.nodes if n.name in (self.run.record.get("stop_pending") or [])]
        for n in pending:
            self.statuses[n.name].state = NodeState.LOST
        with self.tlock:
            for n in pending:
                self.start_stopper(n, self.grace())
        self.save(stop_pending=sorted(self.stoppers))

    def connect(self, patient: bool = False) -> Cluster:
        spec = self.spec
        self.cluster = cluster = Cluster(self.full_inv, fanout=spec.fanout, accept_new_host_keys=spec.accept_new_host_keys,
                                         connect_timeout=spec.connect_timeout, lost_timeout=spec.lost_timeout)
        cluster.connect()
        deadline = time.monotonic() + spec.lost_timeout
        while patient and cluster.unreachable and time.monotonic() < deadline:
            time.sleep(1)
            cluster.connect()  # an adopted run's node may be a moment from answering
        for name in [k for k in cluster.unreachable if self.full_inv.node(k).spare]:
            say(f"spare {name} is unreachable: {cluster.unreachable[name].error}")  # not needed to start
        if not patient and any(not self.full_inv.node(k).spare for k in cluster.unreachable):
            bad = "; ".join(f"{k}: {v.error}" for k, v in cluster.unreachable.items())
            raise LaunchError(f"cannot reach every node, nothing was started. {bad}", EXIT_UNREACHABLE)
        return cluster

    def preflight(self, cluster: Cluster) -> dict[str, int | None]:
        from rich.console import Console

        from orchestrator.checks.preflight import FAST_CHECKS, run_preflight

        report = run_preflight(cluster, self.inv, FAST_CHECKS)
        console = Console(file=io.StringIO(), width=140, record=True, color_system=None)
        report.render(console)
        # written whole, then renamed: `train` prints the file the moment it exists
        tmp = self.run.dir / "preflight.txt.tmp"
        tmp.write_text(console.export_text())
        os.replace(tmp, self.run.dir / "preflight.txt")
        self.save(preflight_ok=report.ok)
        if not report.ok and not self.spec.force:
            raise LaunchError("preflight failed (the table above says what to fix); nothing was started. "
                              "--force launches anyway")
        return dict(report.gpus_found)

    def check_gpus(self, nprocs: dict[str, int], gpus_found: dict[str, int | None]) -> None:
        """More processes than GPUs on a GPU node is a usage error (exit 2) unless --force."""
        over = too_many_procs(self.inv, nprocs, gpus_found)
        if over and not self.spec.force:
            desc = "; ".join(f"{name}: {k} processes, {g} GPUs {where}" for name, (k, g, where) in over.items())
            most = min(g for _, g, _ in over.values())
            raise LaunchError(f"more processes than GPUs ({desc}): the extra ranks would fail with 'invalid device "
                              f"ordinal'. Use --nproc-per-node {most} or fewer (or leave it out: one process per "
                              f"GPU), or --force to launch anyway; nothing was started.", EXIT_USAGE)

    def assign_ranks(self, gpus_found: dict[str, int | None]) -> None:
        inv = self.inv
        nprocs = nprocs_for(inv, gpus_found, self.spec.nproc_per_node)
        self.check_gpus(nprocs, gpus_found)
        for n, first, last in rank_map(inv, nprocs):
            st = self.statuses[n.name]
            st.nproc, st.first_rank, st.last_rank = nprocs[n.name], first, last
        self.save(state=RunState.LAUNCHING, rank_map=rank_map_text(inv, nprocs), world_size=sum(nprocs.values()))

    def release_claims(self, names: list[str] | None = None) -> None:
        """Drop this run's claims on the connected nodes (a node with a stop pending keeps it)."""
        if not self.claimed or self.cluster is None:
            return
        names = [n for n in (names or self.statuses) if n not in self.stoppers and n in self.cluster.connections]
        if names:
            release_nodes(self.cluster, self.inv, self.run.id, names)

    # ---------------------------------------------------------------- nodes ending, failure
    def node_ended(self, res: NodeResult) -> None:
        """A node's log copy ended: the node was lost, or its torchrun ended (ask the agent how)."""
        name = res.node
        conn = self.cluster.connections.get(name)
        now = agent_status(self.cluster, self.key, [name])[name] if conn is not None and conn.alive else {}
        if now.get("exit_code") is not None:
            self.record_end(name, now)
            return
        st = self.statuses[name]
        if res.kind is ErrorKind.STOPPED and now.get("alive"):
            st.error = "still running when the log copy was given up"
            self.save()
            return
        if now.get("exists") and not now.get("alive"):  # reachable, but no process and no exit code
            st.state, st.error = NodeState.GONE, "the run vanished on the node without an exit code"
            self.policy.failed(name, None, st.error)
            self.save()
            return
        reason = (conn.lost_reason if conn else None) or res.error or "the SSH connection was lost"
        st.state, st.exit_code, st.error = NodeState.LOST, None, reason
        self.policy.failed(name, None, reason)
        self.save()
        if self.policy.first is not None or self.policy.stop_requests:  # start its stopper too
            threading.Thread(target=self.teardown, args=("lost after the failure or stop",), daemon=True).start()

    def record_end(self, name: str, now: dict) -> None:
        """A node's torchrun ended: its exit code and end time, by the node's own record."""
        st = self.statuses[name]
        if st.state in (NodeState.FINISHED, NodeState.FAILED) and st.node_ended == now.get("ended"):
            return
        code = now.get("exit_code")
        st.state = NodeState.FINISHED if code == 0 else NodeState.FAILED
        st.exit_code, st.ended, st.node_ended, st.error_file = code, time.time(), now.get("ended"), now.get("error_file")
        if code != 0:
            self.policy.failed(name, code, exit_meaning(code), ended=now.get("ended"))
        self.save()

    def _first_failure(self, ff: FirstFailure) -> None:
        say(f"{ff.node} failed first ({ff.reason}); stopping every node")
        threading.Thread(target=self.teardown, args=(f"{ff.node} failed",), daemon=True).start()

    def finish(self, result: RunResult | None = None) -> int:
        if result is None:
            result = self.policy.result(self.statuses.__getitem__, self.run.node_log, list(self.statuses.values()))
        self.save(**result.to_json(), ended=time.time(), stop_pending=sorted(self.stoppers))
        return result.exit_code


def main(argv: list[str] | None = None) -> int:
    from orchestrator.cli import quiet_paramiko

    argv = sys.argv[1:] if argv is None else argv
    quiet_paramiko(bool(os.environ.get("CLUSTERCTL_DEBUG")))
    run = Run(argv[0])
    lock = run.lock_supervisor()
    if lock is None:  # another supervisor runs the run
        return 0
    if "--adopt" in argv and run.state().terminal and not (run.record.get("stop_pending")):
        return 0  # nothing left to do: it ended between the check and this start
    try:
        return Supervisor(run, adopt="--adopt" in argv).main()
    finally:
        notify_end(run, say)  # train --notify / train.notify: when the run has ended (runs/notify.py)


if __name__ == "__main__":
    sys.exit(main())

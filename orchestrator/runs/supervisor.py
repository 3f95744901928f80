"""The run supervisor: one detached process per run on the control machine.

`clusterctl train` starts it in its own session, so it outlives the terminal, a
closed laptop lid or a killed `clusterctl`. It owns the run's connections (one
handshake per node for preflight, launch and log streaming), copies every node's
log byte for byte into the run directory (runs/watch.py), and applies the failure
policy (runs/policy.py): the first node to fail stops every other node.

SIGTERM/SIGINT to the supervisor is a graceful stop request; a second one kills.
Run: python -m orchestrator.runs.supervisor RUN_ID
"""

from __future__ import annotations

import io
import os
import resource
import signal
import sys
import threading
import time
import traceback

import psutil

from orchestrator.errors import EXIT_INTERRUPTED, EXIT_UNREACHABLE, EXIT_USAGE, ClusterctlError, LaunchError
from orchestrator.inventory import Node
from orchestrator.runs.launch import AGENT, Launcher, agent_cmd, agent_status, check_free, node_key, stop_on
from orchestrator.runs.policy import FailurePolicy
from orchestrator.runs.spec import FirstFailure, NodeState, NodeStatus, RunResult, RunState
from orchestrator.runs.store import Run, exit_meaning
from orchestrator.runs.torchrun import nprocs_for, rank_map, rank_map_text, too_many_procs
from orchestrator.runs.watch import copy_logs
from orchestrator.transport import Cluster, NodeResult, wait

LOST_PATIENCE = 300.0  # how long a lost node is retried, to stop the run there once it answers


def say(text: str) -> None:
    print(f"supervisor: {text}", flush=True)  # stdout is runs/RUN/supervisor.log


class Supervisor:
    def __init__(self, run: Run):
        self.run = run
        self.spec = run.spec
        self.full_inv = self.spec.load_inventory()  # spares included: restarts (runs/restart.py) draw on them
        self.inv = self.full_inv.select([n.name for n in self.full_inv.nodes if not n.spare])
        # torchrun's node rank is the position in this run (--nodes may pick a subset)
        self.statuses = {n.name: NodeStatus(n.name, i, n.host) for i, n in enumerate(self.inv.nodes)}
        self.key = run.id  # the run's id on the nodes; attempt k > 1 of a restarted run: RUN_ID.aK
        self.log_start: dict[str, int] = {}  # where this attempt's bytes begin in each node's log copy
        self.say = say
        self.policy = FailurePolicy(self._first_failure)
        self.lock = threading.Lock()
        self.lost_stoppers: dict[str, threading.Thread] = {}
        self.cluster: Cluster | None = None

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
        self.save(supervisor_pid=os.getpid(), supervisor_created=psutil.Process().create_time(),
                  state=RunState.CONNECTING)
        try:
            code = self._main()
        except LaunchError as e:
            say(str(e))
            if self.cluster is not None:
                self.cluster.close()
            self.save(state=RunState.FAILED, exit_code=e.exit_code, error=str(e), ended=time.time())
            code = e.exit_code
        except Exception as e:  # noqa: BLE001 - record, stop nodes, never leave them running
            traceback.print_exc()
            self.teardown("internal error")
            self.save(state=RunState.FAILED, exit_code=1, error=f"internal error: {type(e).__name__}: {e}",
                      ended=time.time())
            code = 1
        finally:
            if self.cluster is not None:
                self.cluster.close()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            self.save(supervisor_cpu_s=round(ru.ru_utime + ru.ru_stime, 3))
        for name, t in self.lost_stoppers.items():  # a lost node is stopped when it answers again
            say(f"waiting up to {LOST_PATIENCE:g}s for {name} to answer, to stop it there")
            t.join(LOST_PATIENCE)
        return code

    def _main(self) -> int:
        from orchestrator.runs.restart import Attempts

        return Attempts(self, self.connect()).run()

    # ---------------------------------------------------------------- one attempt (runs/restart.py loops)
    def begin_attempt(self, k: int, inv) -> None:
        """Fresh per-attempt state: the nodes in their rank order, statuses, failure policy, key."""
        stops = self.policy.stop_requests
        self.inv, self.key = inv, self.run.id if k == 1 else f"{self.run.id}.a{k}"
        self.statuses = {n.name: NodeStatus(n.name, i, n.host) for i, n in enumerate(inv.nodes)}
        self.policy = FailurePolicy(self._first_failure)
        self.policy.stop_requests = stops
        self.log_start = {n.name: (p.stat().st_size if (p := self.run.node_log(n.name)).exists() else 0)
                          for n in inv.nodes}

    def attempt(self, cluster: Cluster, env: dict[str, str], node_env: dict[str, dict[str, str]]) -> RunResult:
        """Preflight, launch and watch this attempt's nodes; how it ended (nothing saved as final)."""
        gpus_found: dict[str, int | None] = {}
        if not self.spec.skip_preflight:
            self.save(state=RunState.PREFLIGHT)
            gpus_found = self.preflight(cluster)
        check_free(cluster, self.inv, self.spec.force)
        if self.policy.stop_requests:
            raise LaunchError("stopped before launch", EXIT_INTERRUPTED)
        self.assign_ranks(gpus_found)
        launcher = Launcher(cluster, self.inv, self.key, self.spec, self.statuses)
        launcher.extra_env = {n: {**env, **e} for n, e in node_env.items()}
        try:
            launcher.launch()
        except LaunchError:
            self.teardown("launch failed")
            raise
        self.save(state=RunState.RUNNING, started=time.time())
        running = [n for n in self.inv.nodes if self.statuses[n.name].state is NodeState.RUNNING]
        copy_logs(cluster, self.run, running, self.node_ended, echo=say, key=self.key, start_at=self.log_start)
        return self.policy.result(self.statuses.__getitem__, self.run.node_log)

    def connect(self) -> Cluster:
        spec = self.spec
        self.cluster = cluster = Cluster(self.full_inv, fanout=spec.fanout, accept_new_host_keys=spec.accept_new_host_keys,
                                         connect_timeout=spec.connect_timeout, lost_timeout=spec.lost_timeout)
        cluster.connect()
        for name in [k for k in cluster.unreachable if self.full_inv.node(k).spare]:
            say(f"spare {name} is unreachable: {cluster.unreachable[name].error}")  # not needed to start
        if any(not self.full_inv.node(k).spare for k in cluster.unreachable):
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

    # ---------------------------------------------------------------- nodes ending, failure
    def node_ended(self, res: NodeResult) -> None:
        """A node's log copy ended: the node was lost, or its torchrun ended (ask the agent how)."""
        name, st = res.node, self.statuses[res.node]
        conn = self.cluster.connections.get(name)
        if conn is None or not conn.alive:
            reason = (conn.lost_reason if conn else None) or res.error or "the SSH connection was lost"
            st.state, st.exit_code, st.error = NodeState.LOST, None, reason
            self.policy.failed(name, None, reason)
            self.save()
            first = self.policy.first
            if first is not None and first.node != name:
                self.teardown("lost after the failure")  # start its stopper too
            return
        now = agent_status(self.cluster, self.key, [name])[name]
        code = now.get("exit_code")
        st.state = NodeState.FINISHED if code == 0 else NodeState.FAILED
        st.exit_code, st.ended, st.error_file = code, time.time(), now.get("error_file")
        if code != 0:
            self.policy.failed(name, code, exit_meaning(code), ended=now.get("ended"))
        self.save()

    def _first_failure(self, ff: FirstFailure) -> None:
        say(f"{ff.node} failed first ({ff.reason}); stopping every node")
        threading.Thread(target=self.teardown, args=(f"{ff.node} failed",), daemon=True).start()

    def teardown(self, why: str) -> None:
        """Stop the run on every node still connected; a second stop request kills at once."""
        grace = 0 if self.policy.stop_requests >= 2 else self.spec.grace
        cluster = self.cluster
        if cluster is None:
            return
        self.save(teardown=why, teardown_at=time.time())
        # every reachable node, the failed one too: its torchrun may be dead while workers linger
        live = [n.name for n in self.inv.nodes if self.statuses[n.name].state is not NodeState.LOST
                and (c := cluster.connections.get(n.name)) is not None and c.alive]
        if live:
            stop_on(cluster, self.key, grace, live)
        for n in self.inv.nodes:  # nodes we lost: stop them as soon as they answer again
            if self.statuses[n.name].state is NodeState.LOST and n.name not in self.lost_stoppers:
                t = threading.Thread(target=self.stop_lost, args=(n, self.key), daemon=True)
                self.lost_stoppers[n.name] = t
                t.start()

    def stop_lost(self, node: Node, key: str) -> None:
        """Retry a lost node on a fresh connection until it answers, then kill the run there."""
        deadline = time.time() + LOST_PATIENCE
        while time.time() < deadline:
            c = self.cluster.connection_for(node, connect_timeout=5)
            try:
                c.open()
                res = wait(c.exec(agent_cmd(node, "stop", node_key(key, node), 0), stdin=AGENT), 30)
                if res.reachable:
                    say(f"stopped the run on {node.name} after it answered again")
                    if node.name in self.statuses:
                        self.statuses[node.name].stopped_after_loss = True
                    self.save()
                    return
                say(f"{node.name}: the stop did not finish ({res.describe()}); retrying")
            except ClusterctlError as e:  # ConnectError, ConnectionLost: not answering yet
                say(f"{node.name} still unreachable ({e}); retrying")
            finally:
                c.close()
            time.sleep(2)

    def finish(self, result: RunResult) -> int:
        self.save(**result.to_json(), ended=time.time())
        return result.exit_code


def main(argv: list[str] | None = None) -> int:
    from orchestrator.cli import quiet_paramiko

    argv = sys.argv[1:] if argv is None else argv
    quiet_paramiko(bool(os.environ.get("CLUSTERCTL_DEBUG")))
    return Supervisor(Run(argv[0])).main()


if __name__ == "__main__":
    sys.exit(main())

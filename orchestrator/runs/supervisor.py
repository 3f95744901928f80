"""The run supervisor: one detached process per run on the control machine.

`clusterctl train` starts it in its own session, so it outlives the terminal, a
closed laptop lid or a killed `clusterctl`. It owns the run's SSH connections
(one handshake per node for preflight, launch and log streaming), copies every
node's log byte for byte into the run directory, and holds the failure policy:

  the first node whose torchrun exits non-zero, or whose connection is lost for
  `lost_timeout`, stops every other node (SIGTERM, then SIGKILL after `grace`).

SIGTERM/SIGINT to the supervisor is a graceful stop request; a second one kills.
Run: python -m orchestrator.runs.supervisor RUN_ID
"""

from __future__ import annotations

import io
import json
import os
import resource
import selectors
import signal
import sys
import threading
import time
import traceback
from importlib import resources

from orchestrator import shell
from orchestrator.inventory import Inventory, Node, load_inventory
from orchestrator.runs.logs import rank_tail, worker_failure
from orchestrator.runs.store import Run, exit_hint, exit_meaning
from orchestrator.runs.torchrun import nproc_for, node_env, rank_map, rank_map_text, target_argv, torchrun_argv
from orchestrator.transport import Cluster, SSHConnection

AGENT = resources.files("orchestrator").joinpath("remote/node_agent.py").read_bytes()
# runs each worker so its lines reach the log whole and tagged `[default<local rank>]:`
RANK_LINES = resources.files("orchestrator").joinpath("remote/rank_lines.py").read_text()
FAIL_FAST_GRACE = 5.0
CAUSE_WINDOW = 3.0  # failures detected this close together are ordered by the nodes' own end times


def agent_cmd(node: Node, *args: object) -> str:
    return f"{shell.path(node.python)} - {shell.join(args)}"


def node_key(run_id: str, node: Node) -> str:
    return f"{run_id}@{node.name}"


class LaunchError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class Supervisor:
    def __init__(self, run: Run):
        self.run = run
        spec = run.spec
        self.spec = spec
        inv = load_inventory(spec.get("inventory"))
        self.inv: Inventory = inv.select(spec.get("nodes") or None)
        # torchrun's node rank is the position in this run (--nodes may pick a subset)
        self.node_rank = {n.name: i for i, n in enumerate(self.inv.nodes)}
        self.grace = float(spec.get("grace", FAIL_FAST_GRACE))
        self.stop_requests = 0
        self.first_failure: dict | None = None
        self.states: dict[str, dict] = {n.name: {"state": "pending"} for n in self.inv.nodes}
        self.lock = threading.Lock()
        self.lost_stoppers: dict[str, threading.Thread] = {}
        self.cluster: Cluster | None = None

    # ---------------------------------------------------------------- record keeping
    def save(self, **changes) -> None:
        with self.lock:
            nodes = [{"name": n.name, "rank": self.node_rank[n.name], "host": n.host, **self.states[n.name]}
                     for n in self.inv.nodes]
            self.run.update(nodes=nodes, **changes)

    def fail(self, message: str, code: int = 1) -> None:
        raise LaunchError(message, code)

    # ---------------------------------------------------------------- main
    def main(self) -> int:
        def on_signal(signum, frame):
            self.stop_requests += 1
            print(f"supervisor: stop request {self.stop_requests} (signal {signum})", flush=True)
            threading.Thread(target=self.teardown, args=("stop",), daemon=True).start()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.save(supervisor_pid=os.getpid(), state="connecting")
        try:
            code = self._main()
        except LaunchError as e:
            print(f"supervisor: {e}", flush=True)
            if self.cluster is not None:
                self.cluster.close()
            self.save(state="failed", exit_code=e.code, error=str(e), ended=time.time())
            code = e.code
        except Exception as e:  # noqa: BLE001 - record, stop nodes, never leave them running
            traceback.print_exc()
            self.teardown("internal error")
            self.save(state="failed", exit_code=1, error=f"internal error: {type(e).__name__}: {e}",
                      ended=time.time())
            code = 1
        finally:
            if self.cluster is not None:
                self.cluster.close()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            self.save(supervisor_cpu_s=round(ru.ru_utime + ru.ru_stime, 3))
        for name, t in self.lost_stoppers.items():  # a lost node is stopped when it answers again
            print(f"supervisor: waiting up to 5 min for {name} to answer, to stop it there", flush=True)
            t.join(300)
        return code

    def _main(self) -> int:
        inv, spec = self.inv, self.spec
        self.cluster = cluster = Cluster(
            inv, fanout=spec.get("fanout", 64), accept_new_host_keys=spec.get("accept_new_host_keys", False),
            connect_timeout=spec.get("connect_timeout"), lost_timeout=spec.get("lost_timeout", 30.0))
        cluster.connect()
        if cluster.unreachable:
            bad = "; ".join(f"{k}: {v.error}" for k, v in cluster.unreachable.items())
            self.fail(f"cannot reach every node, nothing was started. {bad}", 3)
        gpus_found: dict[str, int | None] = {}
        if not spec.get("skip_preflight"):
            self.save(state="preflight")
            gpus_found = self.preflight(cluster)
        self.check_free(cluster)
        if self.stop_requests:
            self.fail("stopped before launch", 130)
        nprocs = {n.name: nproc_for(n, gpus_found.get(n.name), spec.get("nproc_per_node"))
                  for n in inv.nodes}
        ranks = {n.name: (a, b) for n, a, b in rank_map(inv, nprocs)}
        for n in inv.nodes:
            self.states[n.name].update(nproc=nprocs[n.name], first_rank=ranks[n.name][0],
                                       last_rank=ranks[n.name][1])
        self.save(state="launching", rank_map=rank_map_text(inv, nprocs), world_size=sum(nprocs.values()))
        self.launch(cluster, nprocs)
        self.save(state="running", started=time.time())
        self.stream(cluster)
        # close before the final record: the foreground returns when it sees it, and by then
        # no SSH session of the run should still be winding down on a node
        cluster.close()
        return self.finish()

    def preflight(self, cluster: Cluster) -> dict[str, int | None]:
        from rich.console import Console

        from orchestrator.checks.preflight import FAST_CHECKS, run_preflight

        report = run_preflight(cluster, self.inv, FAST_CHECKS)
        console = Console(file=io.StringIO(), width=140, record=True, color_system=None)
        report.render(console)
        (self.run.dir / "preflight.txt").write_text(console.export_text())
        self.save(preflight_ok=report.ok)
        if not report.ok and not self.spec.get("force"):
            self.fail("preflight failed (the table above says what to fix); nothing was started. "
                      "--force launches anyway", 1)
        return dict(report.gpus_found)

    def check_free(self, cluster: Cluster) -> None:
        """Two runs must not silently share a node."""
        res = cluster.run(lambda n: agent_cmd(n, "live"), stdin=AGENT, timeout=60)
        busy = {}
        for name, r in res.items():
            if not r.ok:
                self.fail(f"{name}: cannot run the node agent with {self.inv.node(name).python}: "
                          f"{r.describe()} {r.stderr.strip()[-300:]}", 1)
            live = [k for k in json.loads(r.stdout or "[]") if k.endswith("@" + name)]
            if live:
                busy[name] = live
        if busy and not self.spec.get("force"):
            desc = "; ".join(f"{k} is running {', '.join(x.split('@')[0] for x in v)}" for k, v in busy.items())
            self.fail(f"{desc}. Stop it with `clusterctl stop RUN`, or pass --force to share the node", 1)

    def launch(self, cluster: Cluster, nprocs: dict[str, int]) -> None:
        inv, run_id = self.inv, self.run.id
        # torchrun runs the wrapper as the script; it runs `python -u TARGET` as torchrun would have
        target = ["{rundir}/rank_lines.py", *target_argv(inv, self.spec.get("args") or [])]

        def start_cmd(node: Node) -> str:
            return agent_cmd(node, "start", node_key(run_id, node), "-")

        def start_stdin(node: Node) -> bytes:
            """The agent script with the run spec prepended: the spec (env: tokens) stays off argv."""
            argv = torchrun_argv(python=node.python, nnodes=len(inv.nodes), nproc=nprocs[node.name],
                                 node_rank=self.node_rank[node.name], master_addr=inv.master.address,
                                 master_port=inv.master_port, run_id=run_id, target=target,
                                 extra=["--log-dir", "{rundir}/torchrun"])
            spec = {"argv": argv, "cwd": node.workdir, "files": {"rank_lines.py": RANK_LINES},
                    "env": node_env(inv, node, extra={"CLUSTERCTL_RUN_ID": run_id})}
            return f"SPEC_HEX = {json.dumps(spec).encode().hex()!r}\n".encode() + AGENT

        def started(res) -> None:
            for name, r in res.items():
                if not r.ok:
                    self.fail(f"{name}: could not start torchrun: {r.describe()} {r.stderr.strip()[-500:]}")
                info = json.loads(r.stdout.strip().splitlines()[-1])
                self.states[name].update(state="running", pid=info.get("pid"))

        master = inv.master
        try:
            # node 0 first: the others start once its rendezvous store listens
            started(cluster.run(start_cmd, nodes=[master.name], stdin=start_stdin, timeout=60))
            if len(inv.nodes) > 1:
                r = cluster.run(agent_cmd(master, "wait-listening", node_key(run_id, master), inv.master_port, 120),
                                nodes=[master.name], stdin=AGENT, timeout=150)[master.name]
                word = r.stdout.strip()
                if word != "listening":
                    self.save()
                    return  # the master exited or never listened: stream() reports its failure
                started(cluster.run(start_cmd, nodes=[n.name for n in inv.nodes[1:]], stdin=start_stdin, timeout=60))
        except LaunchError:
            self.teardown("launch failed")
            raise
        self.save()

    # ---------------------------------------------------------------- streaming and failure
    def stream(self, cluster: Cluster) -> None:
        """Copy every node's log into the run dir until all nodes are done."""
        run_id = self.run.id
        files = {n.name: open(self.run.node_log(n.name), "ab") for n in self.inv.nodes}
        procs = {}
        for n in self.inv.nodes:
            if self.states[n.name].get("state") != "running":
                continue
            offset = files[n.name].tell()
            procs[n.name] = cluster.connections[n.name].exec(agent_cmd(n, "tail", node_key(run_id, n), offset),
                                                             stdin=AGENT)
        sel = selectors.DefaultSelector()
        fds = {name: (p.fileno() if isinstance(p.fileno(), list) else [p.fileno()]) for name, p in procs.items()}
        for name, p in procs.items():
            for fd in fds[name]:
                sel.register(fd, selectors.EVENT_READ, name)

        def forget(name, which):
            for fd in which:
                try:
                    sel.unregister(fd)
                except (KeyError, ValueError):
                    pass
        try:
            while procs:
                sel.select(0.2)
                for name, p in list(procs.items()):
                    out, err = p.read()
                    if out:
                        files[name].write(out)
                        files[name].flush()
                    if err:
                        print(f"supervisor: {name}: {err.decode(errors='replace').strip()}", flush=True)
                    if hasattr(p, "eof_fds"):
                        forget(name, p.eof_fds())  # an fd at EOF stays readable: stop polling it
                    if p.done() or not cluster.connections[name].alive:
                        forget(name, fds[name])
                        p.close()
                        del procs[name]
                        self.node_ended(cluster, name, p)
        finally:
            sel.close()
            for f in files.values():
                f.close()

    def node_ended(self, cluster: Cluster, name: str, proc) -> None:
        node = self.inv.node(name)
        conn = cluster.connections[name]
        if not conn.alive:
            reason = getattr(conn, "lost_reason", None) or "the SSH connection was lost"
            self.states[name].update(state="lost", exit_code=None, error=reason)
            self.failed(name, None, reason)
            self.save()
            if self.first_failure and self.first_failure["node"] != name:
                self.teardown("lost after the failure")  # start its stopper too
            return
        r = cluster.run(agent_cmd(node, "status", node_key(self.run.id, node)), nodes=[name], stdin=AGENT,
                        timeout=30)[name]
        st = json.loads(r.stdout) if r.ok else {}
        code = st.get("exit_code")
        self.states[name].update(state="finished" if code == 0 else "failed", exit_code=code, ended=time.time(),
                                 error_file=st.get("error_file"))
        if code != 0:
            self.failed(name, code, exit_meaning(code), ended=st.get("ended"))
        self.save()

    def failed(self, name: str, code: int | None, reason: str, ended: float | None = None) -> None:
        """Record the root cause: the first node to fail. Nodes seen in one sweep are ordered by when
        their torchrun ended (node clocks, within CAUSE_WINDOW s), so a peer's secondary
        'connection closed' failure does not take the blame for the node that died first."""
        ff = {"node": name, "exit_code": code, "reason": reason, "at": time.time(), "ended": ended}
        with self.lock:
            cur = self.first_failure
            first = cur is None and not self.stop_requests
            if first:
                self.first_failure = ff
            elif (cur is not None and ended is not None and cur.get("ended") is not None
                  and ended < cur["ended"] and ff["at"] - cur["at"] < CAUSE_WINDOW):
                self.first_failure = ff
        if first:
            print(f"supervisor: {name} failed first ({reason}); stopping every node", flush=True)
            threading.Thread(target=self.teardown, args=(f"{name} failed",), daemon=True).start()

    def teardown(self, why: str) -> None:
        """Stop the run on every node still connected; a second stop request kills at once."""
        grace = 0 if self.stop_requests >= 2 else self.grace
        cluster = self.cluster
        if cluster is None:
            return
        self.save(teardown=why, teardown_at=time.time())
        # every reachable node, the failed one too: its torchrun may be dead while workers linger
        live = [n for n in self.inv.nodes if self.states[n.name].get("state") != "lost"
                and cluster.connections.get(n.name) is not None and cluster.connections[n.name].alive]
        if live:
            cluster.run(lambda n: agent_cmd(n, "stop", node_key(self.run.id, n), grace), stdin=AGENT,
                        nodes=[n.name for n in live], timeout=grace + 30)
        for n in self.inv.nodes:  # nodes we lost: stop them as soon as they answer again
            if self.states[n.name].get("state") == "lost" and n.name not in self.lost_stoppers:
                t = threading.Thread(target=self.stop_lost, args=(n,), daemon=True)
                self.lost_stoppers[n.name] = t
                t.start()

    def stop_lost(self, node: Node, patience: float = 300) -> None:
        deadline = time.time() + patience
        while time.time() < deadline:
            c = SSHConnection(node, accept_new_host_keys=False, connect_timeout=5)
            try:
                c.open()
                p = c.exec(agent_cmd(node, "stop", node_key(self.run.id, node), 0), stdin=AGENT)
                deadline = time.time() + 30
                while not p.done() and time.time() < deadline:
                    p.read()
                    time.sleep(0.1)
                print(f"supervisor: stopped the run on {node.name} after it answered again", flush=True)
                self.states[node.name].update(stopped_after_loss=True)
                self.save()
                return
            except Exception as e:  # noqa: BLE001 - keep trying until the node answers
                print(f"supervisor: {node.name} still unreachable ({e}); retrying", flush=True)
                time.sleep(2)
            finally:
                c.close()

    def finish(self) -> int:
        ff = self.first_failure
        if ff is None and self.stop_requests:
            self.save(state="stopped", exit_code=130, ended=time.time(),
                      summary=f"stopped on request{' (killed)' if self.stop_requests > 1 else ''}")
            return 130
        if ff is None:
            self.save(state="finished", exit_code=0, ended=time.time(), summary="every node finished")
            return 0
        code = ff["exit_code"] if ff["exit_code"] is not None else 255
        self.save(state="failed", exit_code=code, ended=time.time(), first_failure=ff,
                  summary=self.root_cause(ff))
        return code

    def root_cause(self, ff: dict) -> str:
        """One node, one reason: its exit code and meaning, then the failing worker's own words
        (torchrun's error file, else that rank's last log lines, else the node log's last lines)."""
        name = ff["node"]
        st = self.states[name]
        head = (f"{name} (ranks {st.get('first_rank')}-{st.get('last_rank')}) failed first: "
                f"exit code {ff['exit_code']} — {ff['reason']}")
        try:
            with open(self.run.node_log(name), "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - (1 << 18)))
                log = f.read()
        except OSError:
            log = b""
        detail = ""
        wf = worker_failure(log)
        if wf is not None:
            code = wf["exitcode"]
            code = 128 - code if code < 0 else code
            rank = wf["local_rank"] + (st.get("first_rank") or 0)
            head += f"; rank {rank} exited {code} first ({exit_meaning(code)})"
            detail = "\n".join(rank_tail(log, wf["local_rank"], 15))
            hint = exit_hint(code, log.decode(errors="replace"))
            if hint:
                head += "\n" + hint
        if st.get("error_file"):
            try:
                doc = json.loads(st["error_file"])
                msg = doc.get("message", doc)
                if isinstance(msg, dict):
                    extra = msg.get("extraInfo", {})
                    detail = extra.get("py_callstack") or msg.get("message") or detail
                else:
                    detail = str(msg)
            except ValueError:
                detail = st["error_file"][-2000:]
        if not detail:
            detail = "\n".join(log.decode(errors="replace").splitlines()[-15:])
        return head + ("\n" + detail if detail else "")


def main(argv: list[str] | None = None) -> int:
    from orchestrator.cli import quiet_paramiko

    argv = sys.argv[1:] if argv is None else argv
    quiet_paramiko(bool(os.environ.get("CLUSTERCTL_DEBUG")))
    run = Run(argv[0])
    return Supervisor(run).main()


if __name__ == "__main__":
    sys.exit(main())

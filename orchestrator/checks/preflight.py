"""Preflight: every check on every node at once, over the Cluster's existing connections.

    run_preflight(cluster: Cluster, inventory: Inventory, checks: list[str] | None = None,
                  *, connect_timeout: float = 3.0, control_dir: str | None = None) -> PreflightReport
    report.ok -> bool            no check failed (warnings allowed)
    report.asked_again           per extra round, the nodes probed again (their probe could not answer)
    report.gpus_found            {node name: GPUs found, or None when not probed/unknown}
    report.render(console)       node x check table that fits the console, grouped findings, rank map
    report.to_json()             {"ok", "nodes": [{"name", "host", "rank", "checks": [...]}]}

`cluster` must be connected (`with Cluster(inv) as c:`); nothing here opens a connection, so
`train` reuses its own and a node is handshaked once per command. Per node, ONE remote
invocation: the probe script the registry assembles for the chosen checks
(orchestrator/checks/registry.py) over stdin (`sh -s`), its output read by the checks' pure
parsers. port_reachable adds a temporary listener on the master
(orchestrator/remote/portlisten.py, started first, gone after a timeout) and a connect from
each worker inside that worker's probe. ping runs from the control machine meanwhile. A node
whose probe could not answer (a result marked `unanswered`) is probed again: checks/retry.py.
"""

from __future__ import annotations

import secrets
import subprocess
import threading
import time
from typing import Mapping

from orchestrator.checks import Ctx, CheckResult, fail, ok, retry, skip
from orchestrator.checks.gpu import gpus_from_probe
from orchestrator.checks.gpu_health import probe_options
from orchestrator.checks.net import attribute_port_reachable
from orchestrator.checks.ping import ping_all, ping_result
from orchestrator.checks.registry import BY_NAME, CHECKS, fast_checks, ordered, probe_script
from orchestrator.checks.report import NodeReport, PreflightReport
from orchestrator import probe
from orchestrator.errors import CommandFailed, UsageError
from orchestrator.inventory import Inventory, Node
from orchestrator.node import form, portlisten
from orchestrator.node import preflight as preflight_probe
from orchestrator.transfer.files import control_code, private_files, run_outputs
from orchestrator.transport import Cluster, Proc, first_line, wait

PROBE_TIMEOUT = 60.0
# The control machine's own checks: everything else runs in the node's probe.
CONTROL = ("ssh", "ping")
FAST_CHECKS = fast_checks()  # what `clusterctl train` runs before it launches anything


def select_checks(only: str | list[str] | None = None, skip_: str | list[str] | None = None) -> list[str]:
    """--only/--skip comma lists -> check names in table order; unknown names are usage errors."""
    def names(v):
        if v is None:
            return None
        items = v.split(",") if isinstance(v, str) else list(v)
        items = [x.strip() for x in items if x.strip()]
        bad = [x for x in items if x not in CHECKS]
        if bad:
            raise UsageError(f"unknown check {', '.join(map(repr, bad))}; the checks are: {', '.join(CHECKS)}")
        return items

    chosen, dropped = names(only), names(skip_) or []
    return [c for c in CHECKS if (chosen is None or c in chosen) and c not in dropped]


def output_dir(inv: Inventory, node: Node) -> str:
    d = inv.output_dir or inv.train.output_dir or "runs"
    if d.startswith("/") or d.startswith("~"):
        return d
    return node.workdir.rstrip("/") + "/" + d


# ------------------------------------------------------------------ running


def probe_outputs(inv: Inventory, node: Node) -> list[str]:
    """The run's output directories for code_sync's probe: sync's (`run_outputs`, relative to the
    workdir) and an `output_dir:` written as a node's absolute or ~ path, which the node resolves
    (a link to the workdir's own directory, say)."""
    named = [d for d in (inv.output_dir, inv.train.output_dir) if d and d.startswith(("/", "~"))]
    return run_outputs(inv, node) + named


def _probe_command(inv: Inventory, node: Node, checks: list[str], connect_timeout: float,
                   never: tuple[str, ...] = ()) -> str:
    role = "master" if node.rank == 0 else "worker"
    names = ",".join(probe_options(inv, checks))  # the checks, and gpu_health's gpu_diag option
    return preflight_probe.command(
        names, node.workdir, output_dir(inv, node), inv.master_port, node.iface or "", inv.master.address, role,
        node.python, connect_timeout, [a for d in probe_outputs(inv, node) for a in ("--output", d)]
        + [a for g in inv.sync.include for a in ("--include", g)]
        + [a for g in inv.sync.exclude for a in ("--exclude", g)]
        + [a for p in never for a in ("--never", p)])


class _Listener:
    """The master's temporary listener on master_port (port_reachable)."""

    def __init__(self, cluster: Cluster, master: Node, port: int, expected: int, seconds: float):
        self.proc: Proc | None = None
        self.pid: int | None = None
        self.error: str | None = None
        self.conn = None
        conn = cluster.connections.get(master.name)
        if conn is None:
            self.error = f"{master.name} (the master) is unreachable"
            return
        self.conn, self.token = conn, "cc-listen-" + secrets.token_hex(6)
        try:
            self.proc = portlisten.listen(master, port, seconds, expected, self.token).start(conn)
        except Exception as e:  # noqa: BLE001 - any failure here only means the check is skipped
            self.error = f"cannot start the listener: {e}"
            return
        try:
            line = first_line(self.proc, 10.0).strip()
        except CommandFailed as e:  # CommandTimeout too: it ended, or said nothing in time
            line = (e.result.stdout + e.result.stderr).strip()[-300:]
        got = portlisten.read_first(line)
        self.pid = got.pid
        if got.busy:
            self.error = f"master_port {port} is taken on {master.name} (see port_free)"
        elif got.error is not None:
            self.error = f"the listener did not start on {master.name}: {got.error}"

    def close(self):
        """Stop the listener and wait until its port is free again: `train` may bind it next.
        Closing the channel alone is not enough (sshd can keep the pipe open, so the listener's
        heartbeat need not fail), so kill it by the pid it reported, checked against its token."""
        if self.proc is None:
            return
        self.proc.close()
        self.proc = None
        if self.pid is None or self.conn is None:
            return
        pid, token = str(self.pid), self.token
        stop = (f"if grep -qa {token} /proc/{pid}/cmdline 2>/dev/null; then kill {pid} 2>/dev/null; fi; "
                f"i=0; while grep -qa {token} /proc/{pid}/cmdline 2>/dev/null && [ $i -lt 50 ]; do "
                f"sleep 0.1; i=$((i+1)); done")
        try:
            wait(self.conn.exec(stop), 8)
        except Exception:  # noqa: BLE001 - the alarm in the listener is the last resort
            pass


def _ssh_results(cluster: Cluster, nodes: list[Node], reports: dict[str, NodeReport]) -> None:
    """ssh: the Cluster's handshakes (host keys verified by the transport)."""
    for n in nodes:
        if n.name in cluster.connections:
            r = ok("ssh", "local node (no SSH)" if n.is_local else "connected, host key verified")
        else:
            err = cluster.unreachable.get(n.name)
            r = fail("ssh", (err.error if err else "not connected") or "not connected", BY_NAME["ssh"].remedy)
        reports[n.name].results["ssh"] = r


class _Probes:
    """Rounds of the probe script on connected nodes, with the control clock read around each
    node's @@time line (for clock_skew). A later round (nodes asked again, checks/retry.py)
    replaces those nodes' texts; port_reachable gets a fresh listener on the master each round
    that has workers in it."""

    def __init__(self, inv: Inventory, checks: list[str], connect_timeout: float, never: tuple[str, ...] = ()):
        self.inv, self.checks, self.connect_timeout = inv, checks, connect_timeout
        self.never = never  # the inventory's own files inside the workdir: not code on a node either
        self.listener: _Listener | None = None  # the latest round's (its error is port_reachable's)
        self.own_pids: set[int] = set()  # every round's listener: not a conflict on the port
        self.rounds: list[list[str]] = []  # the nodes each round asked
        self.t_send: dict[str, float] = {}
        self.t_recv: dict[str, float] = {}
        self._at_time: set[str] = set()  # nodes whose @@time line arrived: the next line is their clock
        self.texts: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    def command(self, node: Node) -> str:
        # the Cluster's Node may come from a larger inventory (a relaunch's spare): its rank there
        # is not this preflight's, and the role (master or worker) follows this inventory
        node = self.inv.node(node.name)
        self.t_send[node.name] = time.time()
        listening = self.listener is not None and self.listener.error is None
        return _probe_command(self.inv, node, self.checks, self.connect_timeout if listening else 0, self.never)

    def on_line(self, name: str, stream: str, line: str) -> None:
        if stream != "stdout" or name in self.t_recv:
            return
        if name in self._at_time:
            self.t_recv[name] = time.time()
        elif line == "@@time":
            self._at_time.add(name)

    def run(self, cluster: Cluster, nodes: list[Node], timeout: float = PROBE_TIMEOUT, placed: bool = False) -> None:
        """One round on `nodes`. The probe runs nodeinfo from the node code, which is not placed
        first (a round trip per node on every preflight): a node without it answers with
        probe.MISSING, gets it (node/form.py `place`) and is asked again at once, in the same
        round (placed=True); a node whose nodeinfo ran is known to hold it for the commands after."""
        names = [n.name for n in nodes]
        if not placed:
            self.rounds.append(names)
        for name in names:
            self.t_recv.pop(name, None)
            self._at_time.discard(name)
        workers = [n for n in nodes if n.rank != 0]
        if "port_reachable" in self.checks and workers and self.inv.master.name in cluster.connections:
            # it outlives the round's probes (close() ends it): a late worker finds it listening
            self.listener = _Listener(cluster, self.inv.master, self.inv.master_port, len(workers), timeout + 5)
            self.own_pids.update([self.listener.pid] if self.listener.pid else [])
        try:
            res = cluster.run(self.command, stdin=probe_script(self.checks), timeout=timeout, nodes=names,
                              on_line=self.on_line if "clock_skew" in self.checks else None)
        finally:
            if self.listener is not None:
                self.listener.close()
        for name, r in res.items():
            self.errors.pop(name, None)
            if r.exit_code is None or "@@end" not in r.stdout:
                self.errors[name] = r.error or f"probe exited {r.exit_code}: {r.stderr.strip()[-200:]}"
            self.texts[name] = r.stdout
            if "@@python" in r.stdout and probe.MISSING not in r.stdout and name in cluster.connections:
                form.known(cluster.connections[name])
        lacking = [n for n in nodes if probe.MISSING in self.texts.get(n.name, "")]
        if lacking and not placed:
            form.place(cluster, [n.name for n in lacking])
            self.run(cluster, lacking, timeout, placed=True)

    def tries(self, name: str) -> int:
        return sum(name in r for r in self.rounds)

    @property
    def done(self) -> dict[str, str]:
        return {k: v for k, v in self.texts.items() if k not in self.errors}


def _probe_verdicts(cluster: Cluster, nodes: list[Node], reports: dict[str, NodeReport], probes: _Probes,
                    ctx_of: dict[str, Ctx]) -> None:
    checks, done = probes.checks, probes.done
    if not checks:  # only the control machine's checks (ssh, ping) were asked for
        return
    for n in nodes:
        rep = reports[n.name]
        if n.name not in cluster.connections:
            for c in checks:
                rep.results[c] = skip(c, "node unreachable over SSH")
        elif n.name in probes.errors:
            for c in checks:
                rep.results[c] = fail(c, f"the probe did not finish: {probes.errors[n.name]}", unanswered=True) \
                    if c == checks[0] else skip(c, "probe did not finish", unanswered=True)
        else:
            rep.results.update(node_results(checks, probes.texts[n.name], ctx_of[n.name]))
    for c in checks:
        compare = BY_NAME[c].compare
        if compare is not None and done:
            for name, r in compare(done, {k: ctx_of[k] for k in done}).items():
                reports[name].results[c] = r


def _gpus_found(nodes: list[Node], done: dict[str, str], probed_gpus: bool) -> dict[str, int | None]:
    found: dict[str, int | None] = {}
    for n in nodes:
        tool, gpus, _ = gpus_from_probe(done.get(n.name, ""))
        found[n.name] = len(gpus) if gpus is not None else (0 if tool is None and n.name in done
                                                             and probed_gpus else None)
    return found


def run_preflight(cluster: Cluster, inventory: Inventory, checks: list[str] | None = None, *,
                  connect_timeout: float = 3.0, control_dir: str | None = None,
                  code_required: bool = False, control: dict | None = None) -> PreflightReport:
    """control_dir: the directory here whose sync selection code_sync compares every node with
    (transfer/files.py code_source; None: the nodes are compared with each other); `control`:
    its transfer/files.py control_code when the caller has it already (it hashes the tree).
    code_required: an empty workdir fails code_sync even with no control_dir. Nodes whose probe
    could not answer are probed again (a few rounds within a few seconds, checks/retry.py);
    report.asked_again lists them per round."""
    t_start = time.monotonic()
    checks = list(CHECKS) if checks is None else ordered(checks)
    inv = inventory
    nodes = list(inv.nodes)
    reports = {n.name: NodeReport(n) for n in nodes}
    connected = [n for n in nodes if n.name in cluster.connections]
    _ssh_results(cluster, nodes, reports)

    ping_out: dict[str, float | None] = {}
    pinger = None
    if "ping" in checks:
        hosts = [n.host for n in nodes if not n.is_local]
        pinger = threading.Thread(target=lambda: ping_out.update(ping_all(hosts)), daemon=True)
        pinger.start()

    probe_checks = [c for c in checks if c not in CONTROL]
    never = tuple(sorted(private_files(inv, control_dir))) if control_dir is not None else ()
    probes = _Probes(inv, probe_checks, connect_timeout, never)
    extra: dict = {"code_required": code_required}
    if "code_sync" in probe_checks and control_dir is not None:
        extra["control_code"] = control if control is not None else control_code(inv, control_dir)
    if probe_checks and connected:
        probes.run(cluster, connected)
    _verdicts(cluster, nodes, reports, probes, extra)
    if probe_checks and connected:
        _ask_again(cluster, connected, reports, probes, extra)

    if pinger is not None:
        pinger.join(5)
        for n in nodes:
            reports[n.name].results["ping"] = (ok("ping", "local node") if n.is_local else
                                               ping_result(n.host, ping_out.get(n.host), n.name in cluster.connections))
    for rep in reports.values():
        tries = probes.tries(rep.node.name)
        rep.results = {c: retry.still_unanswered(rep.results[c], tries) for c in checks if c in rep.results}
    return PreflightReport(inv, checks, [reports[n.name] for n in nodes],
                           _gpus_found(nodes, probes.done, "gpu_count" in probe_checks), time.monotonic() - t_start,
                           asked_again=probes.rounds[1:])


def _verdicts(cluster: Cluster, nodes: list[Node], reports: dict[str, NodeReport], probes: _Probes,
              extra: dict) -> None:
    """Every probe check's verdict from the latest texts (after each round)."""
    inv, own = probes.inv, frozenset(probes.own_pids)
    ctx_of = {n.name: Ctx(node=n, inventory=inv, is_master=n.rank == 0, own_pids=own,
                          t_send=probes.t_send.get(n.name), t_recv=probes.t_recv.get(n.name), extra=extra)
              for n in nodes}
    _probe_verdicts(cluster, nodes, reports, probes, ctx_of)
    if "port_reachable" in probes.checks:
        _port_reachable(reports, inv, probes.listener, probes.done)


def _ask_again(cluster: Cluster, connected: list[Node], reports: dict[str, NodeReport], probes: _Probes,
               extra: dict) -> None:
    """The extra rounds: nodes with an unanswered result probed again until they answer, the
    rounds run out, or their time does."""
    t0 = time.monotonic()
    for _ in range(retry.ROUNDS):
        again = retry.ask_again({n.name: reports[n.name].results for n in connected})
        timeout = retry.round_timeout(time.monotonic() - t0, PROBE_TIMEOUT)
        if not again or timeout is None:
            return
        time.sleep(retry.PAUSE_S)
        probes.run(cluster, [n for n in connected if n.name in again], timeout)
        _verdicts(cluster, list(probes.inv.nodes), reports, probes, extra)


def node_results(checks: list[str], text: str, ctx: Ctx) -> dict[str, CheckResult]:
    """The per-node verdicts of one node's probe output (the cross-node ones come from the
    checks' `compare`). A check meant for other nodes (master / workers only) is a skip."""
    out = {}
    for c in checks:
        spec = BY_NAME[c]
        if not spec.applies_to(ctx.node, ctx.is_master):
            out[c] = skip(c, "only the master" if spec.nodes == "master" else "workers only")
        elif spec.parse is not None:
            out[c] = spec.parse(text, ctx)
    return out


def probe_locally(inv: Inventory, node: Node, checks: list[str], env: Mapping[str, str] | None = None,
                  timeout: float = PROBE_TIMEOUT) -> str:
    """The same probe, run on this machine (`launch --from-env` checks its own node), the node
    code placed here first (its nodeinfo runs from it; a failure to place it shows as that
    probe's error)."""
    checks = ordered(checks)
    form.place_here(env)
    try:
        p = subprocess.run(["/bin/sh", "-c", _probe_command(inv, node, checks, 0)], input=probe_script(checks),
                           capture_output=True, timeout=timeout, env=dict(env) if env is not None else None)
    except subprocess.TimeoutExpired as e:
        return (e.stdout or b"").decode(errors="replace")
    return p.stdout.decode(errors="replace")


def _port_reachable(reports, inv: Inventory, listener: _Listener | None, done: dict[str, str]) -> None:
    master = inv.master
    workers = {n.name: reports[n.name].results.get("port_reachable") for n in inv.nodes[1:]
               if n.name in done}
    workers = {k: v for k, v in workers.items() if v is not None}
    if master.name not in done and master.name not in reports[master.name].results:
        return
    if len(inv.nodes) == 1:
        reports[master.name].results["port_reachable"] = skip("port_reachable", "single node: no worker")
        return
    if listener is None:
        err = f"{master.name} (the master) is unreachable" if master.name not in done else "no worker reachable"
    else:
        err = listener.error
    m, ws = attribute_port_reachable(workers, master.name, inv.master_port, err)
    if master.name in done:
        reports[master.name].results["port_reachable"] = m
    for k, v in ws.items():
        reports[k].results["port_reachable"] = v

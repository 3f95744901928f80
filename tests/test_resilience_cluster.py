"""Runs that outlive failures, on the real test cluster (gloo on CPU across network namespaces):
a dropped SSH connection, a killed supervisor and torchrun, a stop with a node cut off, and
simultaneous launches on the same nodes."""

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from tests.conftest import VANISHED, ended, scan
from tests.test_train_cluster import DDP, wait_clean, cli, log_has, prepare, rec_of, wait_for

pytestmark = pytest.mark.cluster


def running(run_dir):
    d = rec_of(run_dir)
    return d if d.get("state") == "running" and all(n.get("pid") for n in d.get("nodes", [])) else None


def detach(inv, *script, extra=()):
    r = cli("train", "-i", inv, "--skip-preflight", "--detach", *extra, "--", DDP, *script)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def steps_of(log: bytes, rank: int) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(rb"\]:rank %d step (\d+) sum" % rank, log)]


def supervisor_sockets(pid, host):
    """The supervisor's TCP connections to `host`'s sshd (none once it has ended)."""
    try:
        conns = psutil.Process(pid).net_connections("tcp")
    except VANISHED:
        return []
    return [c for c in conns if c.raddr and c.raddr.ip == host
            and c.raddr.port == 22 and c.status == psutil.CONN_ESTABLISHED]


def test_a_dropped_ssh_connection_is_reconnected_and_every_line_arrives_once(make_cluster, tmp_path, home):
    cluster = make_cluster(3, gpus=0)
    inv = prepare(cluster, tmp_path)
    steps = 80
    run_id = detach(inv, "--steps", str(steps), "--sleep", "0.1")
    run_dir = home / "runs" / run_id
    rec = wait_for(lambda: running(run_dir), 120, "running")
    wait_for(lambda: log_has(run_dir / "nodes" / "node2.log", b"step 5 "), 120, "steps on node2")
    n2 = cluster.nodes[1]
    sup = rec["supervisor_pid"]
    assert supervisor_sockets(sup, n2.host)
    # kill the supervisor's TCP connection to node2 (the kernel sends a reset both ways)
    subprocess.run(["ss", "-K", "dst", n2.host, "dport", "=", "22"], check=True, capture_output=True)
    rec = wait_for(lambda: (lambda d: d if d.get("state") in ("finished", "failed") else None)(rec_of(run_dir)),
                   180, "the run to end")
    assert rec["state"] == "finished" and rec["exit_code"] == 0, rec.get("summary")
    assert "reconnected" in (run_dir / "supervisor.log").read_text()
    for node, rank in (("node1", 0), ("node2", 1), ("node3", 2)):
        copy = (run_dir / "nodes" / f"{node}.log").read_bytes()
        assert steps_of(copy, rank) == list(range(steps)), f"{node}: duplicated or missing steps"
        on_node = cluster.nodes[rank].run(f"cat ~/.clusterctl/node-runs/{run_id}@{node}/log").stdout.encode()
        assert copy == on_node  # byte for byte
    wait_clean(cluster, 20, "every node clean")


def test_killed_supervisor_and_torchrun_leave_no_orphans_and_blame_the_right_node(make_cluster, tmp_path, home):
    cluster = make_cluster(3, gpus=0)
    inv = prepare(cluster, tmp_path)
    run_id = detach(inv, "--steps", "3000", "--sleep", "0.1")
    run_dir = home / "runs" / run_id
    rec = wait_for(lambda: running(run_dir), 120, "running")
    wait_for(lambda: log_has(run_dir / "nodes" / "node2.log", b"step 5 "), 120, "steps on node2")
    os.kill(rec["supervisor_pid"], signal.SIGKILL)
    n2 = cluster.nodes[1]
    torchrun = next(n for n in rec["nodes"] if n["name"] == "node2")["pid"]
    workers = [p for p, cmd in scan(cluster.processes(n2)) if p.pid != torchrun and "ddp_tiny" in cmd]
    assert workers
    os.kill(torchrun, signal.SIGKILL)
    # enforced on the node: no controller is running
    wait_for(lambda: all(ended(p) for p in workers), 5,
             "node2's workers gone")
    wait_clean(cluster, 60, "the whole job gone")
    r = cli("tail", run_id)  # starts a supervisor that adopts the run and records its end
    assert "takes the run over" in r.stderr
    rec = rec_of(run_dir)
    assert rec["state"] == "failed", rec
    assert rec["first_failure"]["node"] == "node2", rec["first_failure"]
    assert rec["summary"].startswith("node2 (rank 1) failed first: exit code 137")
    assert r.returncode == 137
    ranked = [ln for ln in r.stdout.splitlines() if "| rank" in ln]
    assert len(ranked) == len(set(ranked)), "a line was printed twice"


def test_stop_with_a_node_cut_off_fails_naming_it_and_stops_it_once_it_is_back(make_cluster, tmp_path, home):
    cluster = make_cluster(3, gpus=0)
    inv = prepare(cluster, tmp_path)
    run_id = detach(inv, "--steps", "3000", "--sleep", "0.1", extra=("--lost-timeout", "5"))
    run_dir = home / "runs" / run_id
    wait_for(lambda: running(run_dir), 120, "running")
    wait_for(lambda: log_has(run_dir / "nodes" / "node3.log", b"step 5 "), 120, "steps on node3")
    n3 = cluster.nodes[2]
    n3.link_down()
    try:
        st = cli("stop", run_id)
        assert st.returncode == 3, st.stderr  # the exit-code table: a node unreachable
        assert "cannot reach node3, so run" in st.stderr and "could not be confirmed stopped" in st.stderr
        wait_for(lambda: not cluster.processes(cluster.nodes[0]) and not cluster.processes(cluster.nodes[1]),
                 10, "the reachable nodes clean")
        assert cluster.processes(n3)  # cut off: still there, the stop pending
        rec = rec_of(run_dir)
        assert rec["state"] == "stopped" and rec["stop_pending"] == ["node3"]
        s = cli("status", run_id)
        assert "stop pending on node3" in s.stderr
    finally:
        n3.link_up()
    wait_for(lambda: not cluster.processes(n3), 10, "node3's processes gone once its link is back")
    wait_for(lambda: rec_of(run_dir).get("stop_pending") == [], 30, "the pending stop cleared")
    assert rec_of(run_dir)["state"] == "stopped"


def test_two_simultaneous_launches_exactly_one_runs(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    inv = prepare(cluster, tmp_path)
    argv = [sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--skip-preflight", "--detach",
            "--", DDP, "--steps", "1"]
    for trial in range(3):  # each trial is a fresh race for the claim; ~20 s each on two cores
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        outs = [p.communicate(timeout=180) for p in procs]
        codes = sorted(p.returncode for p in procs)
        assert codes == [0, 1], (trial, outs)
        winner = next(o for p, o in zip(procs, outs) if p.returncode == 0)[0].strip()
        loser_err = next(o for p, o in zip(procs, outs) if p.returncode == 1)[1]
        assert f"is running {winner}" in loser_err and "claimed by" in loser_err, loser_err
        wait_for(lambda: rec_of(home / "runs" / winner).get("state") == "finished", 120, "the winner to finish")
        wait_clean(cluster, 15, "clean")
        claims = [n.run("ls ~/.clusterctl/claims/ 2>/dev/null | grep -v lock || true").stdout.split()
                  for n in cluster.nodes]
        assert claims == [[], []], claims  # released at the end

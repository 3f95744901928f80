"""A recovery that survives its own faults, on the real test cluster (gloo on CPU): the supervisor
killed while a spare is prepared and right after a worker's link is cut, then taken over by
`clusterctl tail`; a firewall blip on the master's port while a relaunch's preflight runs; the lost
node's log completed once it answers again; the control machine's disk filled mid-run; the records
of a run that ended before it launched. One 4-node cluster (node4 the spare) for the module."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.runs.space import RESERVE, RESERVE_BYTES, ROOM_BYTES
from tests.cluster import TestCluster, require_root
from tests.conftest import ended, kill_supervisors, pid_ended, scan, wait_for
from tests.test_launch_recovery_cluster import copying_to, sync_big_code, with_spare
from tests.test_train_cluster import DDP, cli, log_has, rec_of, wait_clean

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cl():
    require_root()
    with TestCluster(n=4, gpus=0, name_prefix="ccrf") as cluster:
        yield cluster


@pytest.fixture
def nodes(cl, home):
    """The module's cluster as a test found it, made whole again afterwards: links up, no shaping,
    no firewall rule, nothing of a run left, no claim. (After `home`: a supervisor still carrying
    out a pending stop is alive while the links come back.)"""
    yield cl
    for n in cl.nodes:
        n.link_up()
        n.unshape()
        n.iptables("-F", "INPUT", check=False)
    wait_clean(cl, 60, "the nodes clean after the test")
    for n in cl.nodes:
        n.run("rm -rf ~/.clusterctl/claims ~/gpt_train", check=False)


def detach(inv, *flags, steps=80):
    """A detached run: each attempt trains `steps` steps of 0.1 s from the start (8 s: time to fault
    it after step 5, and a short last attempt)."""
    r = cli("train", "-i", inv, "--detach", "--lost-timeout", "5", *flags, "--", DDP, "--steps", str(steps),
            "--sleep", "0.1")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def node_log(node, run_id, key=None):
    """The node's own log of attempt `key` (the run's first attempt by default)."""
    return node.run(f"cat ~/.clusterctl/node-runs/{key or run_id}@{node.name}/log").stdout.encode()


def kill_supervisor(run_dir):
    pid = rec_of(run_dir)["supervisor_pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: pid_ended(pid), 10, "the supervisor to die")


def stepping(run_dir, node="node2"):
    wait_for(lambda: log_has(run_dir / "nodes" / f"{node}.log", b"step 5 "), 120, f"steps on {node}")


def test_killed_while_the_spare_is_prepared_the_run_taken_over_prepares_it_again_and_finishes(
        nodes, tmp_path, home):
    """node2 cut; the spare node4 is being brought to the run's code (24 MB over a slow link) when
    the supervisor is killed -9. `tail` takes the run over: attempt 2 (never launched) ended by the
    supervisor's death, attempt 3 on the same nodes prepares node4 again, and finishes. Before the
    record said per node whether it was prepared, node4 counted as holding the code: "preflight
    failed on node4 (code_sync ...)", the run failed with a healthy spare."""
    n1, n2, n3, n4 = nodes.nodes
    inv = with_spare(nodes, tmp_path)
    sync_big_code(nodes, tmp_path, inv, 24)
    n4.shape(rate="24mbit", burst="64kb", latency="400ms")  # ~8 s for the code
    run_id = detach(inv, "--max-restarts", "1")
    run_dir = home / "runs" / run_id
    stepping(run_dir)
    n2.link_down()
    wait_for(lambda: copying_to(nodes, n4), 120, "the code copy to node4")
    time.sleep(1)
    kill_supervisor(run_dir)
    r = cli("tail", run_id, timeout=400)
    rec = rec_of(run_dir)
    assert r.returncode == 0 and rec["state"] == "finished", (r.returncode, r.stderr[-3000:])
    a = rec["attempts"]
    assert a[1]["nodes"] == ["node1", "node4", "node3"] and a[1]["prepared"] == ["node4"], a
    assert a[1]["ready"] == [] and a[1]["verdict"] == "supervisor died" and not a[1].get("launched"), a[1]
    assert a[2]["nodes"] == a[1]["nodes"] and a[2]["prepared"] == ["node4"] and a[2]["ready"] == ["node4"], a[2]
    assert a[2]["verdict"] == "finished" and a[2]["preflight_ok"] is True, a[2]
    assert "restarting as attempt 3 of at most 3 on node1, node4, node3; attempt 2 never launched" in r.stderr
    s = cli("status", run_id)
    assert f"{run_id}: finished, attempt 3 of at most 3" in s.stdout, s.stdout  # it said "of at most 2"
    n2.link_up()
    wait_for(lambda: not rec_of(run_dir).get("stop_pending"), 60, "node2's pending stop carried out")


def test_killed_right_after_a_cut_the_run_taken_over_loses_the_node_and_its_log_is_completed_later(
        nodes, tmp_path, home):
    """The supervisor killed a second after node2's link is cut, before the loss was declared:
    `tail` takes the run over at attempt 1 (running), declares node2 lost as a running node's
    silence would be (it did not answer), restarts on the spare and finishes (it failed on
    "node2: cannot create the run's checkpoint directory"). node2's log after the cut (its ranks'
    tracebacks) never reached the copy; once node2 answers again the copy equals its log."""
    n1, n2, n3, n4 = nodes.nodes
    inv = with_spare(nodes, tmp_path)
    run_id = detach(inv, "--max-restarts", "1")
    run_dir = home / "runs" / run_id
    stepping(run_dir)
    n2.link_down()
    time.sleep(1)
    kill_supervisor(run_dir)
    r = cli("tail", run_id, timeout=400)
    rec = rec_of(run_dir)
    assert r.returncode == 0 and rec["state"] == "finished", (r.returncode, r.stderr[-3000:])
    a = rec["attempts"]
    assert a[0]["verdict"] == "node lost" and a[0]["bad_nodes"] == ["node2"], a[0]
    assert a[1]["nodes"] == ["node1", "node4", "node3"] and a[1]["verdict"] == "finished", a[1]
    assert "clusterctl: node2 lost: no answer for 5s to the supervisor that took the run over" in r.stderr, \
        r.stderr[-3000:]

    copy = run_dir / "nodes" / "node2.log"
    cut_at = copy.stat().st_size
    assert rec["stop_pending"] == ["node2"], rec.get("pending_stops")
    n2.link_up()  # its pending stop is carried out: torchrun there says how it was stopped, after the cut
    wait_for(lambda: not rec_of(run_dir).get("stop_pending"), 90, "node2's pending stop carried out")
    on_node = node_log(n2, run_id)
    assert len(on_node) > cut_at and copy.read_bytes() == on_node, (cut_at, len(on_node), on_node[cut_at:][-2000:])
    story = (run_dir / "story.jsonl").read_text()
    assert f"node2: answered again; its log of {run_id} completed ({len(on_node) - cut_at} bytes" in story, \
        story[-2000:]


def test_a_blip_on_the_masters_port_during_the_relaunch_preflight_keeps_the_master(nodes, tmp_path, home):
    """A worker killed on node2 (retried on the same nodes); from attempt 2's start until its first
    preflight round has ended (some 6 s), a DROP on the master's port. The relaunch asks again with
    backoff and launches on the same nodes, node1 the master (it used to fail "node1
    port_reachable ... a firewall drops it" and leave node1 out)."""
    n1, n2, n3, n4 = nodes.nodes
    inv = with_spare(nodes, tmp_path)
    run_id = detach(inv, "--max-restarts", "1")
    run_dir = home / "runs" / run_id
    stepping(run_dir)
    kill_workers(nodes, n2)
    wait_for(lambda: rec_of(run_dir).get("attempt") == 2, 120, "attempt 2")
    n1.iptables("-I", "INPUT", "-p", "tcp", "--dport", "29500", "-j", "DROP")
    try:  # held through the first round: a worker's connect retried after the rule went would pass it
        listener = wait_for(lambda: [p for p, cmd in scan(nodes.processes(n1)) if "cc-listen-" in cmd], 60,
                            "attempt 2's preflight listener on node1")
        wait_for(lambda: all(ended(p) for p in listener), 60, "the preflight's first round to end")
    finally:
        n1.iptables("-D", "INPUT", "-p", "tcp", "--dport", "29500", "-j", "DROP")
    wait_for(lambda: rec_of(run_dir).get("state") in ("finished", "failed", "stopped"), 240, "the run to end")
    rec = rec_of(run_dir)
    a = rec["attempts"]
    assert rec["state"] == "finished", (rec.get("summary"), a)
    assert a[0]["verdict"] in ("killed by signal", "peer failure") and a[1]["nodes"] == ["node1", "node2", "node3"], a
    assert a[1]["verdict"] == "finished" and a[1]["preflight_asked"] >= 2, a[1]
    story = (run_dir / "story.jsonl").read_text()
    assert "attempt 2: preflight failed on a node of attempt 1 (node1 port_reachable" in story \
        and "passed when asked" in story, story[-3000:]


def kill_workers(cluster, node):
    """SIGKILL the job's workers (not torchrun) on `node`: its torchrun then fails the node."""
    workers = [p for p, cmd in scan(cluster.processes(node)) if "ddp_tiny" in cmd and "torchrun" not in cmd
               and "--steps" in cmd]
    assert workers
    for p in workers:
        p.kill()


def fill(path):
    """Write zeros under `path` until its filesystem takes no more."""
    subprocess.run(["dd", "if=/dev/zero", f"of={path / 'filler'}", "bs=1M"], capture_output=True)


@pytest.fixture
def small_home(tmp_path, monkeypatch):
    """CLUSTERCTL_HOME on a 16 MiB tmpfs of its own."""
    h = tmp_path / "small"
    h.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(h)], check=True)
    monkeypatch.setenv("CLUSTERCTL_HOME", str(h))
    try:
        yield h
    finally:
        kill_supervisors(h)
        subprocess.run(["umount", "-l", str(h)], check=False)


def test_a_full_control_disk_is_said_once_the_run_stays_supervised_and_its_copies_catch_up(nodes, tmp_path,
                                                                                           small_home):
    """CLUSTERCTL_HOME filled mid-run: the supervisor lives on (it died of ENOSPC, leaving the job
    unsupervised under a record saying "running"), says the spell once, writes its record once
    there is room, and the log copies catch up byte-identical to the nodes' logs; then it stops the
    job when node2's workers are killed; no temporary file and no reserve is left."""
    inv = with_spare(nodes, tmp_path)
    run_id = detach(inv, "--max-restarts", "0", steps=400)
    run_dir = small_home / "runs" / run_id
    stepping(run_dir)
    pid = rec_of(run_dir)["supervisor_pid"]
    assert (run_dir / RESERVE).stat().st_size == RESERVE_BYTES  # kept from the supervisor's start
    fill(small_home)
    time.sleep(3)  # the copies meet the full disk
    assert not pid_ended(pid), "the supervisor died of the full disk"
    (small_home / "filler").unlink()
    wait_for(lambda: b'"disk_room"' in (run_dir / "story.jsonl").read_bytes(), 60, "room again said")
    kill_workers(nodes, nodes.nodes[1])
    wait_for(lambda: rec_of(run_dir).get("state") == "failed", 60, "the record of the node failure")
    wait_for(lambda: pid_ended(pid), 60, "the supervisor to end")
    rec = rec_of(run_dir)
    # node2 killed; the root cause by the nodes' clocks can be its peer's broken collective under load
    assert rec["attempts"][0]["verdict"] in ("killed by signal", "peer failure") and len(rec["disk_full"]) == 1, rec
    assert "reserve" not in rec["disk_full"][0]
    story = [json.loads(ln) for ln in (run_dir / "story.jsonl").read_text().splitlines()]
    assert [d.get("event") for d in story].count("disk_full") == 1, story
    for n in nodes.nodes[:3]:
        assert (run_dir / "nodes" / f"{n.name}.log").read_bytes() == node_log(n, run_id), n.name
    assert not [p.name for p in run_dir.rglob("*.tmp*")] and not (run_dir / RESERVE).exists()


def test_a_run_that_ends_on_a_still_full_control_disk_writes_its_true_end_at_once(nodes, tmp_path, small_home):
    """The disk filled mid-run and still full when node2's workers are killed: the supervisor
    stops the job, spends the run's reserve on the final record and exits (it waited up to 300 s
    for room, then left the record saying "running"). `status` shows the run's end and nothing of
    the reserve, which is gone."""
    inv = with_spare(nodes, tmp_path)
    run_id = detach(inv, "--max-restarts", "0", steps=400)
    run_dir = small_home / "runs" / run_id
    stepping(run_dir)
    pid = rec_of(run_dir)["supervisor_pid"]
    fill(small_home)
    time.sleep(3)  # the copies meet the full disk
    kill_workers(nodes, nodes.nodes[1])
    killed = time.time()
    wait_clean(nodes, 30, "the job stopped on the node failure, the disk still full")
    wait_for(lambda: rec_of(run_dir).get("state") == "failed", 120, "the final record written on the full disk")
    written = time.time()
    wait_for(lambda: pid_ended(pid), 60, "the supervisor to end")
    st = os.statvfs(small_home)
    assert (small_home / "filler").exists() and st.f_bavail * st.f_frsize < ROOM_BYTES  # still full throughout
    rec = rec_of(run_dir)
    assert rec["attempts"][0]["verdict"] in ("killed by signal", "peer failure"), rec
    assert rec["exit_code"] != 0 and rec["ended"] and rec["disk_full"][-1]["reserve"] is True, rec
    assert not (run_dir / RESERVE).exists() and not [p.name for p in run_dir.rglob("*.tmp*")]
    status = cli("status", run_id)
    assert "failed" in status.stdout and "reserve" not in status.stdout + status.stderr, status.stdout
    runs = cli("runs")
    assert run_id in runs.stdout and "reserve" not in runs.stdout, runs.stdout
    print(f"\nend -> record written: {(run_dir / 'run.json').stat().st_mtime - rec['ended']:.3f}s "
          f"(run.json {(run_dir / 'run.json').stat().st_size} bytes; of the {RESERVE_BYTES} bytes freed "
          f"{st.f_bavail * st.f_frsize} left); workers killed -> record seen failed {written - killed:.1f}s")


def test_runs_that_end_before_they_launch_say_so_failed_and_stopped(nodes, tmp_path, home):
    """The master's port dropped: attempt 1's preflight fails, nothing launched. `status` says
    each node was not started (it said "pending", as if the run would still start them). A stop
    asked while that preflight runs stops the run: recorded stopped, its attempt's verdict
    "stopped" (it was recorded failed, "launch failed", the stop forgotten)."""
    n1 = nodes.nodes[0]
    inv = with_spare(nodes, tmp_path)
    n1.iptables("-I", "INPUT", "-p", "tcp", "--dport", "29500", "-j", "DROP")
    r = cli("train", "-i", inv, "--", DDP, "--steps", "5")
    assert r.returncode == 1 and "preflight failed on" in r.stderr, r.stderr[-2000:]
    failed = next((home / "runs").iterdir()).name
    rec = rec_of(home / "runs" / failed)
    assert rec["state"] == "failed" and rec["attempts"][0]["verdict"] == "launch failed", rec
    s = cli("status", failed)
    assert "pending" not in s.stdout and s.stdout.count("not started") == 3, s.stdout
    assert f"{failed}: failed, attempt 1 of at most 1" in s.stdout, s.stdout

    train = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--detach", "--", DDP,
                              "--steps", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # --detach returns once the launch is through: here, once the stop ended the run
        run_dir = wait_for(lambda: next((d for d in (home / "runs").iterdir() if d.name != failed
                                         and rec_of(d).get("state") == "preflight"), None), 60, "the next preflight")
        s = cli("stop", run_dir.name, timeout=60)
        assert s.returncode == 0, s.stderr
        wait_for(lambda: rec_of(run_dir).get("state") in ("finished", "failed", "stopped"), 60, "the run to end")
    finally:
        train.kill()
    rec = rec_of(run_dir)
    assert rec["state"] == "stopped" and rec["attempts"][0]["verdict"] == "stopped", (rec["state"], rec["attempts"])
    assert cli("status", run_dir.name).stdout.count("not started") == 3

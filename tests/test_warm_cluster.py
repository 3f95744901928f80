"""Warm starts on the real test cluster (runs/warmpool.py, remote/warm.py): the first attempt's
nodes get a warm interpreter right before its launch, and its ranks already fork from it; the spare
gets one a few seconds into the run; a worker killed, then a node cut, restart with every rank, and
torchrun itself, forked from one (torch already imported), on the survivors and on the spare alike;
nothing of them is left once the run ends. With --no-warm every rank starts cold."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_for
from tests.test_launch_recovery_cluster import the_run, with_spare
from tests.test_train_cluster import prepare, rec_of

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
JOB = str(REPO / "tests" / "scripts" / "warm_restart.py")


def start(inv, *flags, steps=400):
    env = {**os.environ, "CLUSTERCTL_WARM_AFTER_S": "1"}
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--skip-preflight",
                             "--lost-timeout", "5", *flags, "--", JOB, "--steps", str(steps), "--sleep", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def warm_ones(cluster, node=None):
    """The run's warm interpreters (their key RUN.warm@NODE) on `node` (every node: None)."""
    out = []
    for p in cluster.processes(node):
        try:
            key = p.environ().get("CLUSTERCTL_RUN_KEY", "")
        except psutil.Error:
            continue
        if ".warm@" in key:
            out.append(p)
    return out


def worker(cluster, node, attempt):
    """The rank process (the fork, or the cold one) of `attempt` on `node`: the one that loaded the job."""
    for p in cluster.processes(node):
        try:
            env, argv = p.environ(), p.cmdline()
        except psutil.Error:
            continue
        if env.get("RANK") and env.get("CLUSTERCTL_ATTEMPT") == str(attempt) and any(JOB in a for a in argv):
            return p
    return None


def starts(log_text):
    """{(attempt, node): warm} from the job's first lines."""
    return {(int(m[2]), m[3]): m[4] == "True" for m in re.finditer(
        r"rank (\d+) attempt (\d+) on (\S+) warm=(\w+) import=", log_text)}


def test_a_killed_worker_then_a_cut_node_restart_with_every_rank_forked_warm_and_nothing_left(make_cluster,
                                                                                               tmp_path, home):
    cluster = make_cluster(3, gpus=0)
    n1, n2, n3 = cluster.nodes
    inv = with_spare(cluster, tmp_path)
    proc = start(inv, "--max-restarts", "2", steps=600)
    out = []
    try:
        run_dir = the_run(home)
        assert wait_for(lambda: all(n.warm_serving() for n in cluster.nodes), 120, "a warm interpreter on every node")
        assert wait_for(lambda: rec_of(run_dir).get("state") == "running", 60, "attempt 1 running")
        w = wait_for(lambda: worker(cluster, n2, 1), 60, "attempt 1's rank on node2")
        time.sleep(1)
        w.send_signal(signal.SIGKILL)  # attempt 2: the same nodes
        assert wait_for(lambda: worker(cluster, n2, 2), 120, "attempt 2's rank on node2")
        assert wait_for(lambda: "rank 1 attempt 2 on node2" in (run_dir / "nodes" / "node2.log").read_text(
            errors="replace"), 120, "attempt 2's rank on node2 started")
        # torchrun itself forked warm too: the process the waiter started noted its fork's pid
        assert n2.run(f"cat ~/.clusterctl/node-runs/{run_dir.name}.a2@node2/torchrun.fork").stdout.strip().isdigit()
        time.sleep(2)
        n2.link_down()  # attempt 3: node1 and the spare
        out = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        n2.link_up()
    rec = rec_of(run_dir)
    assert proc.returncode == 0 and rec["state"] == "finished", out[1][-3000:] if out else ""
    nodes = [a["nodes"] for a in rec["attempts"]]
    assert nodes == [["node1", "node2"], ["node1", "node2"], ["node1", "node3"]], rec["attempts"]
    seen = {}
    for n in ("node1", "node2", "node3"):
        seen.update(starts((run_dir / "nodes" / f"{n}.log").read_text(errors="replace")))
    print(seen)
    assert seen[(1, "node1")] and seen[(1, "node2")], seen  # the first attempt's too: one torch import a node
    assert n1.run(f"cat ~/.clusterctl/node-runs/{run_dir.name}@node1/torchrun.fork").stdout.strip().isdigit()
    assert seen[(2, "node1")] and seen[(2, "node2")], seen  # the survivors' ranks forked warm
    assert seen[(3, "node1")] and seen[(3, "node3")], seen  # and the spare's
    for n in (n1, n3):
        assert n.run(f"cat ~/.clusterctl/node-runs/{run_dir.name}.a3@{n.name}/torchrun.fork").stdout.strip().isdigit()
    sup = (run_dir / "supervisor.log").read_text()
    # the attempt's nodes right before its launch, the spare once the run's progress showed
    assert "warm interpreters: starting on node1, node2 (the ranks fork from them)" in sup, sup[-2000:]
    assert "warm interpreters: starting on node3" in sup, sup[-2000:]
    # once the run ended: none left, on the nodes it can reach (node2 is back: its own goes too)
    assert wait_for(lambda: not warm_ones(cluster), 60, "every warm interpreter gone"), \
        [(p.pid, p.cmdline()[:3]) for p in warm_ones(cluster)]
    assert wait_for(lambda: not any(n.warm_serving(ready=False) for n in cluster.nodes), 30, "their sockets removed")


def test_no_warm_starts_every_rank_cold(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    inv = prepare(cluster, tmp_path)
    proc = start(inv, "--max-restarts", "1", "--no-warm", steps=60)
    try:
        run_dir = the_run(home)
        assert wait_for(lambda: rec_of(run_dir).get("state") == "running" or proc.poll() is not None, 60, "running")
        time.sleep(4)  # past CLUSTERCTL_WARM_AFTER_S and a warm interpreter's start
        assert not warm_ones(cluster) and not any(n.warm_serving(ready=False) for n in cluster.nodes)
        out = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[1][-3000:]
    assert "warm interpreters" not in (run_dir / "supervisor.log").read_text()

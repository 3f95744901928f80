"""The run loop on the real test cluster (gloo on CPU), as users meet it: restarts onto spares that
never trained, a node that comes back after the run moved on, a supervisor replaced mid-recovery,
and a restart that itself fails."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import pid_ended, wait_for

pytestmark = pytest.mark.cluster

REPO = str(Path(__file__).resolve().parent.parent)


def cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def inventory(cluster, tmp_path, steps, ckpt_every=10, spares=1):
    """The shipped trainer with its defaults: its output (out/) inside the workdir, preflight on."""
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    nodes = cluster.inventory()["nodes"]
    for nd in nodes[len(nodes) - spares:]:
        nd["spare"] = True
    return str(cluster.write_inventory(
        tmp_path / "nodes.yaml", nodes=nodes, env={"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
        train={"module": "trainer",
               "args": ["--preset", "nano", "--max-steps", str(steps), "--batch-size", "2", "--block-size", "32",
                        "--log-every", "1", "--ckpt-every", str(ckpt_every), "--eval-steps", "1",
                        "--sample-tokens", "0"]}))


def run_processes(cluster, node, run_id):
    """The pids on `node` whose environment carries one of the run's keys (any attempt)."""
    found = []
    for p in cluster.processes(node):
        try:
            key = p.environ().get("CLUSTERCTL_RUN_KEY", "")
        except Exception:  # noqa: BLE001 - the process ended between listing and reading
            continue
        if key.split("@")[0].split(".a")[0] == run_id:
            found.append(p.pid)
    return found


def rec_of(run_dir):
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def only_run_dir(home):
    return wait_for(lambda: next((p for p in (home / "runs").glob("*") if (p / "run.json").exists()), None)
                    if (home / "runs").exists() else None, 60, "the run directory")


def attempt_running(run_dir, k):
    rec = rec_of(run_dir)
    return rec.get("state") == "running" and rec.get("attempt") == k


def test_a_lost_node_returning_mid_attempt_2_is_cleaned_and_a_failed_restart_leaves_nothing(
        make_cluster, tmp_path, home):
    """node2 cut in attempt 1 comes back while attempt 2 runs: its attempt-1 processes are gone
    within 30 s. Then the spare breaks too, with no restart left: the run ends failed, nothing of
    it is left anywhere once the spare is back, and the next launch on the nodes is accepted."""
    cluster = make_cluster(4, gpus=0)
    n1, n2, n3, n4 = cluster.nodes
    inv = inventory(cluster, tmp_path, 3000, ckpt_every=10)
    r = cli("train", "-i", inv, "--detach", "--max-restarts", "1", "--lost-timeout", "5", timeout=120)
    assert r.returncode == 0, r.stderr
    run_dir = only_run_dir(home)
    run_id = run_dir.name
    wait_for(lambda: list((run_dir / "checkpoints").glob("ckpt_*.pt")), 180, "a checkpoint copied home")
    # frozen, node2's attempt-1 processes cannot notice their peers are gone and end by themselves:
    # only a stop under attempt 1's key, once node2 answers again, ends them
    for pid in run_processes(cluster, n2, run_id):
        os.kill(pid, signal.SIGSTOP)
    n2.link_down()
    wait_for(lambda: attempt_running(run_dir, 2), 180, "attempt 2 running")
    assert rec_of(run_dir)["attempts"][1]["nodes"] == ["node1", "node4", "node3"]
    assert run_processes(cluster, n2, run_id), "node2 should still hold attempt 1's processes while cut off"
    n2.link_up()
    wait_for(lambda: not run_processes(cluster, n2, run_id), 30, "attempt 1's processes on node2 to be stopped")
    n4.link_down()  # the spare breaks: attempt 2 fails, no restart left
    wait_for(lambda: rec_of(run_dir).get("state") in ("failed", "finished", "stopped"), 180, "the run to end")
    rec = rec_of(run_dir)
    assert rec["state"] == "failed", rec
    assert [a["verdict"] for a in rec["attempts"]] == ["node lost", "node lost"], rec["attempts"]
    n4.link_up()
    wait_for(lambda: not any(run_processes(cluster, n, run_id) for n in cluster.nodes), 30,
             "no process of the run on any node")
    # `stop` of the ended run finds nothing left, and says so
    r = cli("stop", run_id)
    assert r.returncode == 0 and "no process of it is left" in r.stderr, r.stderr
    short = inventory(cluster, tmp_path, 5, ckpt_every=100)
    r = cli("train", "-i", short, "--nodes", "node1,node2,node3")
    assert r.returncode == 0, r.stderr[-3000:]


def test_an_adopted_run_after_a_restart_follows_the_spare_and_keeps_copying_checkpoints(
        make_cluster, tmp_path, home):
    """Detached; node2 cut; attempt 2 runs on node1 + the spare; the supervisor is killed -9;
    `clusterctl tail` adopts at attempt 2, the run finishes there, and checkpoints written after
    the adoption still come home."""
    import psutil

    cluster = make_cluster(3, gpus=0)
    n1, n2, n3 = cluster.nodes
    inv = inventory(cluster, tmp_path, 400, ckpt_every=10)
    r = cli("train", "-i", inv, "--detach", "--max-restarts", "1", "--lost-timeout", "5", timeout=120)
    assert r.returncode == 0, r.stderr
    run_dir = only_run_dir(home)
    wait_for(lambda: list((run_dir / "checkpoints").glob("ckpt_*.pt")), 180, "a checkpoint copied home")
    n2.link_down()
    wait_for(lambda: attempt_running(run_dir, 2), 180, "attempt 2 running")
    pid = rec_of(run_dir)["supervisor_pid"]
    psutil.Process(pid).kill()
    wait_for(lambda: pid_ended(pid), 10, "the supervisor to die")
    before = {p.name for p in (run_dir / "checkpoints").glob("ckpt_*.pt")}
    # with the supervisor gone, status asks the nodes about attempt 2 (its key RUN.a2), not attempt 1
    s = cli("status", run_dir.name, "--json")
    assert s.returncode == 0, s.stderr
    now = json.loads(s.stdout)["nodes_now"]
    assert sorted(now) == ["node1", "node3"] and all(v.get("alive") and "exit_code" in v and v["exit_code"] is None for v in now.values()), now
    r = cli("tail", run_dir.name, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = rec_of(run_dir)
    assert rec["state"] == "finished" and rec.get("adopted_at"), rec
    assert rec["attempts"][-1]["nodes"] == ["node1", "node3"] and rec["attempts"][-1]["verdict"] == "finished"
    assert "step 400 | loss" in (run_dir / "nodes" / "node1.log").read_text()
    after = {p.name for p in (run_dir / "checkpoints").glob("ckpt_*.pt")}
    assert "ckpt_00000400.pt" in after and after - before, (before, after)
    assert not list((run_dir / "checkpoints").glob(".*partial*"))

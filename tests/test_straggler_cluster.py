"""Stragglers on the real test cluster (gloo on CPU, the shipped trainer): one node's worker held to
15 % of a core is named, with its node and rank, in the foreground and in `status`; a healthy run
names nobody.

The quota is CFS bandwidth control on the worker's process: cgroup v2's cpu.max where the cpu
controller is on the unified hierarchy, else cgroup v1's cpu.cfs_quota_us (the same kernel
mechanism; on this machine the cpu controller is bound to v1, and v2's unified tree has none).
Without a writable cpu controller the test is skipped rather than faked.
"""

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.cluster.quota import Quota
from tests.conftest import wait_for
from tests.test_train_cluster import cli

pytestmark = pytest.mark.cluster

REPO = str(Path(__file__).resolve().parent.parent)
QUOTA = 0.15  # of one core
# the quota's CFS period: 10 ms, as bench/bench_goodput.py's. With the kernel's default 100 ms the
# rank gets its 15 ms of a nano step in one go and is parked for 85 ms, mostly where it already
# waits in the all-reduce, so its compute per step hardly shows the throttle: the watch named it
# at 1.5x on some runs and not at all within 240 s on others (three slow checks in a row)
PERIOD_US = 10000


def trainer_args(steps, ckpt_every=0):
    return ["--preset", "nano", "--max-steps", str(steps), "--batch-size", "4", "--block-size", "64", "--log-every",
            "10", "--ckpt-every", str(ckpt_every), "--eval-every", "0", "--eval-steps", "1", "--sample-tokens", "0",
            "--output-dir", "out"]


def inventory(cluster, tmp_path, steps, spare=False, ckpt_every=0):
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    nodes = cluster.inventory()["nodes"]
    if spare:
        nodes[-1]["spare"] = True
    return str(cluster.write_inventory(
        tmp_path / "nodes.yaml", nodes=nodes, env={"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
        train={"module": "trainer", "args": trainer_args(steps, ckpt_every)}))


def worker(cluster, node, rank, is_job=lambda argv: "trainer" in argv):
    """The job's process of global `rank` on `node` (the trainer by default; not torchrun; where
    the warm interpreter forked the rank, the fork)."""
    return cluster.job_process(node, lambda env, argv: env.get("RANK") == str(rank) and is_job(argv))


def reached(home, step):
    """Rank 0 logged `step` (in the control machine's copy of node1's log)."""
    logs = list((home / "runs").glob("*/nodes/node1.log")) if (home / "runs").exists() else []
    return any(f"step {step} |" in log.read_text(errors="replace") for log in logs)


def start(inv, *flags):
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--skip-preflight",
                          "--nproc-per-node", "1", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=os.environ.copy())
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    threading.Thread(target=lambda: p.stdout.read(), daemon=True).start()
    return p, err


def run_id_of(err):
    m = next((re.search(r"run (\S+) on \d+ nodes", ln) for ln in err if " on " in ln and "run " in ln), None)
    return m[1] if m else None


def test_a_worker_held_to_15_percent_of_a_core_is_named_a_straggler(cluster4, tmp_path, home):
    inv = inventory(cluster4, tmp_path, 100000)
    p, err = start(inv, "--straggler-window", "20")
    quota = Quota(QUOTA, PERIOD_US, pytest.skip)
    try:
        w = wait_for(lambda: worker(cluster4, cluster4.nodes[2], 2), 120, "rank 2's worker on node3")
        assert wait_for(lambda: reached(home, 30), 180, "step 30")
        quota.add(w.pid)
        line = wait_for(lambda: next((ln for ln in err if "straggler:" in ln), None), 240, "the straggler named")
        m = re.search(r"clusterctl: straggler: node3 rank 2 computes (\d+\.\d)x the median \(([\d.]+) ms vs ([\d.]+) ms "
                      r"over the last 20 steps\)$", line.rstrip())
        assert m and float(m[1]) >= 1.3, line
        print(line)  # the figures the README quotes
        assert not [ln for ln in err if "straggler:" in ln and "node3 rank 2" not in ln], err
        # the ranks' progress came on the nodes' log streams: no agent process was started for it
        sup = next((home / "runs").glob("*/supervisor.log")).read_text()
        # 4 ranks: the small cluster's progress period (runs/scaling.py)
        assert "straggler watch: progress from the nodes' log streams every 2 s" in sup, sup
        st = cli("status", run_id_of(err))
        assert "attempt 1: straggler: node3 rank 2 computes" in st.stderr, st.stderr
    finally:
        quota.close()
        if run_id_of(err):
            cli("stop", run_id_of(err))  # every node stopped and released before the next test
        p.wait(timeout=120)
    assert wait_for(lambda: not [q for q in cluster4.processes() if not q.name().startswith("sshd")], 60,
                    "the run's processes to go")


DDP_COMPUTE = str(Path(REPO) / "tests" / "scripts" / "ddp_compute.py")


def test_a_script_that_reports_no_compute_is_judged_from_the_flight_recorder(cluster4, tmp_path, home):
    """Any script: no clusterctl_step reports, so the watch reads when each rank entered each
    collective (its Flight Recorder, through the hook) on clocks it measured. node3's rank held to
    15 % of a core is named, per collective, and nobody else."""
    for n in cluster4.nodes:
        n.run("mkdir -p ~/gpt_train")
    inv = str(cluster4.write_inventory(tmp_path / "nodes.yaml", env={"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}))
    p, err = start(inv, "--straggler-window", "20", "--", DDP_COMPUTE, "--size", "256")
    quota = Quota(QUOTA, PERIOD_US, pytest.skip)
    try:
        w = wait_for(lambda: worker(cluster4, cluster4.nodes[2], 2, lambda argv: any(a.endswith("ddp_compute.py")
                                                                                   for a in argv)),
                     120, "rank 2's process on node3")
        sup = lambda: next((home / "runs").glob("*/supervisor.log")).read_text()  # noqa: E731
        judged = wait_for(lambda: re.search(r"straggler watch: 4 ranks judged over their last 20 collectives: "
                                            r"median compute ([\d.]+) ms per collective", sup()), 180,
                          "every rank judged from the Flight Recorder")
        print(judged[0])
        quota.add(w.pid)
        line = wait_for(lambda: next((ln for ln in err if "straggler:" in ln), None), 240, "the straggler named")
        m = re.search(r"clusterctl: straggler: node3 rank 2 computes (\d+\.\d)x the median \(([\d.]+) ms vs ([\d.]+) "
                      r"ms over the last 20 collectives\)$", line.rstrip())
        assert m and float(m[1]) >= 1.3, line
        print(line)
        assert not [ln for ln in err if "straggler:" in ln and "node3 rank 2" not in ln], err
    finally:
        quota.close()
        if run_id_of(err):
            cli("stop", run_id_of(err))
        p.wait(timeout=120)
    assert wait_for(lambda: not [q for q in cluster4.processes() if not q.name().startswith("sshd")], 60,
                    "the run's processes to go")


RESUMED_SHORT = str(Path(REPO) / "tests" / "scripts" / "trainer_resumed_short.py")


def test_replace_restarts_without_the_stragglers_node_onto_the_spare(cluster4, tmp_path, home):
    inv = inventory(cluster4, tmp_path, 2500, spare=True, ckpt_every=50)
    # attempt 1 has 2,500 steps to be named a straggler in (it was at step 300-700 when named);
    # attempt 2 resumes and trains to step 1,200
    p, err = start(inv, "--straggler-window", "20", "--on-straggler", "replace", "--max-restarts", "1",
                   "--", RESUMED_SHORT, *trainer_args(2500, 50), "--resumed-max-steps", "1200")
    quota = Quota(QUOTA, PERIOD_US, pytest.skip)
    try:
        w = wait_for(lambda: worker(cluster4, cluster4.nodes[1], 1, lambda argv: RESUMED_SHORT in argv), 120,
                     "rank 1's worker on node2")
        assert wait_for(lambda: reached(home, 60), 180, "step 60")
        quota.add(w.pid)
        assert p.wait(timeout=400) == 0, "".join(err)
    finally:
        quota.close()
        if p.poll() is None and run_id_of(err):
            cli("stop", run_id_of(err))
    [d] = [d for d in (home / "runs").iterdir() if (d / "run.json").exists()]
    rec = json.loads((d / "run.json").read_text())
    a1, a2 = rec["attempts"]
    assert a1["verdict"] == "straggler" and a1["bad_nodes"] == ["node2"] and a1["detail"].startswith("node2 rank 1 ")
    assert a2["nodes"] == ["node1", "node4", "node3"] and a2["verdict"] == "finished" and a2["checkpoint"], a2
    assert rec["left_out"] == ["node2"]
    # attempt 2 resumed from the checkpoint
    resumed = re.findall(r"resuming from \S+ \(step (\d+)\)", (d / "nodes" / "node1.log").read_text())
    assert resumed and int(resumed[-1]) > 0, resumed
    assert any("--on-straggler replace: restarting from the newest checkpoint without node2" in ln for ln in err)
    # the straggler's own exit, throttled, was not waited for once the others had saved and ended
    assert "every other node ended: stopping node2 without waiting for its ranks to exit" in \
        (d / "supervisor.log").read_text()


def test_a_healthy_run_names_nobody(cluster4, tmp_path, home):
    inv = inventory(cluster4, tmp_path, 1500)
    r = cli("train", "-i", inv, "--skip-preflight", "--nproc-per-node", "1", timeout=600)  # the default window: 50
    assert r.returncode == 0, r.stderr
    [d] = [d for d in (home / "runs").iterdir() if (d / "run.json").exists()]
    rec = json.loads((d / "run.json").read_text())
    log = (d / "supervisor.log").read_text()
    assert "straggler:" not in r.stderr and "straggler:" not in log
    assert "straggler" not in rec["attempts"][0]
    # the watch did judge every rank (so naming nobody means something)
    assert re.search(r"straggler watch: 4 ranks judged over their last 50 steps: median compute [\d.]+ ms per "
                     r"step, the slowest rank \d at [\d.]+x", log), log
    rounds = re.search(r"straggler watch: judged every rank (\d+) times; named nobody", log)
    assert rounds and int(rounds[1]) >= 3, log  # long enough for a false alarm to be confirmed

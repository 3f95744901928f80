"""Each node's record across runs on the real test cluster: a script's own error costs its nodes
nothing; three runs in which node2 is lost (its link cut) put three faults against it, and the third
quarantines it on its own; `clusterctl health` lists them; the next run refuses node2."""

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import wait_for
from tests.test_train_cluster import DDP, cli, new_run_dir, prepare, rec_of, wait_clean

pytestmark = pytest.mark.cluster


def newest_run(home, before):
    return wait_for(lambda: next((p for p in (home / "runs").glob("*")
                                  if p.name not in before and (p / "run.json").exists()), None)
                    if (home / "runs").exists() else None, 60, "the run's record")


def lose_node2(cluster, inv, home):
    """A run whose node2 is cut once it trains: it ends failed, node lost. Afterwards node2 is back and
    the ended run's pending stop is carried out (`clusterctl stop`), so the next run finds it free."""
    before = {p.name for p in (home / "runs").glob("*")} if (home / "runs").exists() else set()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--skip-preflight",
                             "--lost-timeout", "3", "--", DDP, "--steps", "100000", "--sleep", "0.2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = newest_run(home, before)
        wait_for(lambda: rec_of(run_dir).get("state") == "running" or proc.poll() is not None, 120, "running")
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(1)
        cluster.nodes[1].link_down()
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.nodes[1].link_up()
    rec = rec_of(run_dir)
    assert rec["state"] == "failed" and rec["attempts"][-1]["verdict"] == "node lost", (rec, err[-3000:])
    r = cli("stop", run_dir.name)
    assert r.returncode == 0, r.stderr
    wait_clean(cluster, 60, "node2's processes stopped once it answers")
    return run_dir.name, err


def test_a_node_lost_in_three_runs_is_quarantined_and_a_scripts_own_error_costs_nothing(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    inv = prepare(cluster, tmp_path)

    # the script's own error on node2's rank: a failed run, no fault against any node
    r = cli("train", "-i", inv, "--skip-preflight", "--", DDP, "--steps", "3", "--fail-rank", "1")
    assert r.returncode != 0 and "script error" in json.dumps(rec_of(new_run_dir(home))), r.stderr[-3000:]
    assert not (home / "node-faults.jsonl").exists() or (home / "node-faults.jsonl").read_text() == ""

    runs = []
    for i in range(3):
        run, err = lose_node2(cluster, inv, home)
        runs.append(run)
        quarantined = [ln for ln in err.splitlines() if "node2 quarantined: 3 faults within 24 h" in ln]
        assert bool(quarantined) == (i == 2), err[-3000:]
    assert "lost (" + runs[0] + "), lost (" + runs[1] + "), lost (" + runs[2] + ")" in quarantined[0]

    faults = [json.loads(ln) for ln in (home / "node-faults.jsonl").read_text().splitlines()]
    assert [(f["node"], f["kind"], f["run"]) for f in faults] == [("node2", "lost", r) for r in runs]

    r = cli("health", "-i", inv, "--json")
    doc = {n["name"]: n for n in json.loads(r.stdout)["nodes"]}
    assert r.returncode == 1, r.stdout + r.stderr
    assert doc["node2"]["quarantined"] and doc["node2"]["reason"].startswith("3 faults within 24 h")
    assert [f["run"] for f in doc["node2"]["faults"]] == runs and doc["node2"]["faults_counted"] == 3
    assert doc["node1"]["faults"] == [] and not doc["node1"]["quarantined"]
    r = cli("health", "-i", inv)
    assert "lost 3 (3 counted)" in r.stdout and "node2 faults:" in r.stdout, r.stdout
    assert [ln.split(" lost in ")[1] for ln in r.stdout.splitlines() if " lost in " in ln] == \
        [f"{run} attempt 1: node2 lost" for run in runs], r.stdout

    # no spare: the next run is refused with the way out
    r = cli("train", "-i", inv, "--skip-preflight", "--", DDP, "--steps", "1")
    assert r.returncode == 1 and "quarantined since" in r.stderr and "--release node2" in r.stderr, r.stderr[-3000:]
    # released, node2 starts afresh: one more loss does not quarantine it again
    assert cli("health", "-i", inv, "--release", "node2").returncode == 0
    run, err = lose_node2(cluster, inv, home)
    assert "quarantined" not in err
    r = cli("health", "-i", inv, "--json")
    doc = {n["name"]: n for n in json.loads(r.stdout)["nodes"]}
    assert not doc["node2"]["quarantined"] and doc["node2"]["faults_counted"] == 1 and len(doc["node2"]["faults"]) == 4

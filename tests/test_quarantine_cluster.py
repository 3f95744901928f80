"""Quarantine on the real test cluster: node2's fake nvidia-smi reports a pending row remap. `train`
finds it in its preflight (gpu_health runs before every launch and restart), quarantines node2 and
launches on node1 and the spare instead; the next run leaves node2 out from the start; `clusterctl
health` lists it until it is released."""

import json

import pytest

from tests.test_train_cluster import DDP, cli

pytestmark = pytest.mark.cluster


def test_a_sick_node_is_quarantined_at_launch_a_spare_takes_its_place_and_it_stays_out_until_released(
        make_cluster, tmp_path, home, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cluster = make_cluster(3, gpus=2)
    node1, node2, node3 = cluster.nodes
    nodes = cluster.inventory()["nodes"]
    nodes[2]["spare"] = True
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train && echo code > ~/gpt_train/README")
    inv = str(cluster.write_inventory(tmp_path / "nodes.yaml", nodes=nodes, checks={"disk_min_gb": 0.1},
                                      train={"nproc_per_node": 1}))
    node2.set_gpus(2, health={1: {"Remapped Rows/Pending": "Yes", "Remapped Rows/Uncorrectable Error": "1"}})

    r = cli("train", "-i", inv, "--", DDP, "--steps", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    told = [ln for ln in r.stderr.splitlines() if ln.startswith("clusterctl: ")]
    assert any(ln.startswith("clusterctl: node2 quarantined: gpu_health: GPU 1: row remapping pending") and
               "clusterctl health --release node2" in ln for ln in told), told
    runs = sorted((home / "runs").iterdir(), key=lambda p: p.stat().st_ctime)
    rec = json.loads((runs[-1] / "run.json").read_text())
    launched = [a for a in rec["attempts"] if a.get("launched")]
    assert [a["nodes"] for a in launched] == [["node1", "node3"]], rec["attempts"]
    assert rec["attempts"][0]["verdict"] == "preflight failed" and "node2" in rec["left_out"]

    # the next run: node2 never enters, node3 takes its place from the start, said once
    r = cli("train", "-i", inv, "--", DDP, "--steps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "node2 (" in r.stderr and "quarantined since" in r.stderr and "node3 takes its place" in r.stderr
    rec = json.loads((sorted((home / "runs").iterdir(), key=lambda p: p.stat().st_ctime)[-1] / "run.json").read_text())
    assert [a["nodes"] for a in rec["attempts"]] == [["node1", "node3"]]

    # health lists it (exit 1), also once its GPUs are repaired, until released
    r = cli("health", "-i", inv, "--json")
    doc = {n["name"]: n for n in json.loads(r.stdout)["nodes"]}
    assert r.returncode == 1 and doc["node2"]["quarantined"] and doc["node2"]["health"] == "fail", r.stdout
    assert doc["node2"]["reason"].startswith("gpu_health: GPU 1: row remapping pending")
    assert doc["node1"]["health"] == "ok" and not doc["node1"]["quarantined"]
    node2.set_gpus(2)
    r = cli("health", "-i", inv)
    assert r.returncode == 1 and "--release" in r.stdout and "quarantined" in r.stdout
    r = cli("health", "-i", inv, "--release", "node2")
    assert r.returncode == 0 and "node2: released (was: gpu_health: GPU 1: row remapping pending" in r.stdout
    r = cli("health", "-i", inv, "--json")
    assert r.returncode == 0 and not any(n["quarantined"] for n in json.loads(r.stdout)["nodes"]), r.stdout
    r = cli("health", "-i", inv, "--release", "nodeX")
    assert r.returncode == 2 and "nodeX not in the inventory" in r.stderr and "Traceback" not in r.stderr

    # with no spare left, a quarantined node stops the launch with the way out; --allow-unhealthy uses it
    node2.set_gpus(2, health={1: {"Remapped Rows/Pending": "Yes", "Remapped Rows/Uncorrectable Error": "1"}})
    two = str(cluster.write_inventory(tmp_path / "two.yaml", nodes=nodes[:2], checks={"disk_min_gb": 0.1},
                                      train={"nproc_per_node": 1}))
    r = cli("train", "-i", two, "--", DDP, "--steps", "1")
    assert r.returncode == 1 and "node2 quarantined" in r.stderr, r.stderr[-3000:]
    r = cli("train", "-i", two, "--", DDP, "--steps", "1")
    assert r.returncode == 1 and "quarantined since" in r.stderr and "--allow-unhealthy" in r.stderr, r.stderr[-3000:]
    node2.set_gpus(2)
    r = cli("train", "-i", two, "--allow-unhealthy", "--", DDP, "--steps", "1")
    assert r.returncode == 0, r.stderr[-3000:]

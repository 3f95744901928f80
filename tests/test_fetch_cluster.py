"""`clusterctl fetch` on the real test cluster: a run on 2 nodes writes files into its checkpoint
and TensorBoard directories, and fetch brings back exactly those bytes, per node."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.cluster

WRITER = str(Path(__file__).parent / "scripts" / "write_artifacts.py")
SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "orchestrator" / "schemas" / "fetch.json").read_text())


def cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def finished_run(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    inv = str(cluster.write_inventory(tmp_path / "nodes.yaml"))
    r = cli("train", "-i", inv, "--skip-preflight", "--", WRITER)
    assert r.returncode == 0, r.stderr
    run_id = next((home / "runs").iterdir()).name
    return cluster, run_id


def test_fetch_brings_back_every_nodes_files_byte_for_byte(finished_run, home):
    cluster, run_id = finished_run
    r = cli("fetch", run_id, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["ok"] and doc["path"] is None and [n["name"] for n in doc["nodes"]] == [n.name for n in cluster.nodes]
    for rank, (node, got) in enumerate(zip(cluster.nodes, doc["nodes"])):
        dest = home / "runs" / run_id / "fetched" / node.name
        assert got["ok"] and got["dest"] == str(dest)
        on_node = tree(node.home / ".clusterctl" / "artifacts" / run_id)
        assert set(on_node) == {f"checkpoints/blob-{rank}.bin", f"tensorboard/sub/events.{rank}"}
        assert len(on_node[f"checkpoints/blob-{rank}.bin"]) == 3 << 20  # many pipe buffers' worth
        assert tree(dest / "artifacts") == on_node
        key = f"{run_id}@{node.name}"
        node_side = tree(node.home / ".clusterctl" / "node-runs" / key)
        assert {"log", "exit_code", "spec.json"} <= set(node_side)
        assert tree(dest / "node-runs" / key) == node_side
        assert got["files"] == len(on_node) + len(node_side)
        assert got["bytes"] == sum(map(len, on_node.values())) + sum(map(len, node_side.values()))
        assert got["stream_bytes"] > got["bytes"]  # tar headers came over the wire too
        assert f"{node.name}: {got['files']} files" in r.stderr


def test_fetch_a_path_of_one_node_into_a_dir_and_refuse_paths_outside(finished_run, home, tmp_path):
    cluster, run_id = finished_run
    second = cluster.nodes[1]
    out = tmp_path / "out"
    r = cli("fetch", run_id, "checkpoints", "--node", second.name, "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert tree(out) == {f"{second.name}/artifacts/checkpoints/blob-1.bin":
                         (second.home / ".clusterctl" / "artifacts" / run_id / "checkpoints" / "blob-1.bin").read_bytes()}
    for bad in ("../..", "checkpoints/../../x"):
        r = cli("fetch", run_id, bad)
        assert r.returncode == 2 and "without `..`" in r.stderr and "Traceback" not in r.stderr
    r = cli("fetch", run_id, "/etc")  # outside the workdir and the home: the node says so
    assert r.returncode == 2 and "lies outside" in r.stderr and "Traceback" not in r.stderr
    r = cli("fetch", run_id, "--node", "nosuch")
    assert r.returncode == 2 and "did not use nosuch" in r.stderr


def test_an_unreachable_node_exits_3_naming_it_and_the_other_is_fetched(finished_run, home):
    cluster, run_id = finished_run
    first, second = cluster.nodes
    second.link_down()
    r = cli("fetch", run_id, "--json")
    assert r.returncode == 3, r.stderr
    assert f"could not reach {second.name}" in r.stderr and "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    by = {n["name"]: n for n in doc["nodes"]}
    assert not doc["ok"] and by[first.name]["ok"] and not by[second.name]["ok"]
    assert by[second.name]["error_kind"] == "connect"
    fetched = home / "runs" / run_id / "fetched"
    assert tree(fetched / first.name / "artifacts") == tree(first.home / ".clusterctl" / "artifacts" / run_id)
    assert not (fetched / second.name / "artifacts").exists()


def test_fetch_takes_an_inventory_to_reach_the_runs_nodes_and_refuses_one_without_them(finished_run, home, tmp_path):
    """-i, as every node-facing command takes it: the run's nodes are reached as that inventory says
    (here node2's port is wrong in it, so node2 is unreachable where the recorded inventory reaches
    it); an inventory without one of the run's nodes is refused before anything is copied."""
    cluster, run_id = finished_run
    first, second = cluster.nodes
    doc = cluster.inventory()
    doc["nodes"][1]["ssh"] = {"port": 2}  # nothing listens there
    wrong = tmp_path / "moved.yaml"
    wrong.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = cli("fetch", run_id, "-i", str(wrong), "--connect-timeout", "3")
    assert r.returncode == 3, r.stderr
    assert f"could not reach {second.name}" in r.stderr and "Traceback" not in r.stderr
    assert cli("fetch", run_id, "-i", str(cluster.write_inventory(tmp_path / "same.yaml"))).returncode == 0
    doc["nodes"] = doc["nodes"][:1]
    wrong.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = cli("fetch", run_id, "-i", str(wrong))
    assert r.returncode == 2, r.stderr
    assert f"has no node named {second.name}, which run {run_id} used" in r.stderr and "Traceback" not in r.stderr

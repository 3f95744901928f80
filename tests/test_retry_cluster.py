"""Retry by the job's own exit code on the real test cluster (gloo on CPU): a worker's exit code
listed in --restart-on-exit-codes restarts the run, on the same nodes; one not listed (the
inventory's train.restart_on_exit_codes names another) is the script's and ends the run."""

import json
from pathlib import Path

import pytest

from tests.test_train_cluster import cli

pytestmark = pytest.mark.cluster

SCRIPT = str(Path(__file__).parent / "scripts" / "exit_code.py")


def inventory(cluster, tmp_path, **train):
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    return str(cluster.write_inventory(tmp_path / "nodes.yaml", env={"OMP_NUM_THREADS": "1"},
                                       **({"train": train} if train else {})))


def record(home, name="run.json"):
    [d] = [p for p in (home / "runs").iterdir() if (p / "run.json").exists()]
    return json.loads((d / name).read_text())


def test_a_listed_exit_code_restarts_the_run_on_the_same_nodes(cluster4, tmp_path, home):
    inv = inventory(cluster4, tmp_path)
    r = cli("train", "-i", inv, "--nodes", "node1,node2", "--skip-preflight", "--nproc-per-node", "1",
            "--max-restarts", "1", "--restart-on-exit-codes", "42,3", "--", SCRIPT, "--code", "3", timeout=300)
    assert r.returncode == 0, r.stderr
    a1, a2 = record(home)["attempts"]
    assert (a1["verdict"], a1["retry"]) == ("exit code", True), a1
    assert a1["detail"] == "node2: a worker exited with 3 (--restart-on-exit-codes)"
    assert a2["nodes"] == a1["nodes"] == ["node1", "node2"] and a2["verdict"] == "finished"
    assert "attempt 1 failed (exit code: node2: a worker exited with 3" in r.stderr


def test_an_exit_code_not_listed_is_the_scripts_and_ends_the_run(cluster4, tmp_path, home):
    inv = inventory(cluster4, tmp_path, restart_on_exit_codes=[4])
    r = cli("train", "-i", inv, "--nodes", "node1,node2", "--skip-preflight", "--nproc-per-node", "1",
            "--max-restarts", "1", "--", SCRIPT, "--code", "3", timeout=300)
    assert r.returncode != 0, r.stderr
    rec = record(home)
    assert len(rec["attempts"]) == 1 and rec["attempts"][0]["verdict"] == "script error", rec["attempts"]
    assert record(home, "spec.json")["restart_on_exit_codes"] == [4]  # the inventory's list was read

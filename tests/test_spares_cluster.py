"""A fresh spare is prepared before a relaunch's preflight: the run's code, relayed node to node
from a surviving node, never the run's outputs (runs/spares.py)."""

import json

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.inventory import load_inventory
from orchestrator.pyenv.nodes import setup_nodes
from orchestrator.runs.spares import prepare_nodes
from orchestrator.sync import sync
from orchestrator.transport import Cluster

pytestmark = pytest.mark.cluster

TRAINER_LEAVES = ("mkdir -p ~/gpt_train/out/logs && echo {0} > ~/gpt_train/out/ckpt_00000010.pt && "
                  "echo {0} > ~/gpt_train/out/logs/events")


def make_source(root):
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "pkg" / "model.py").write_text("x = 1\n")
    (root / ".gitignore").write_text("*.log\n__pycache__/\n")
    (root / "debug.log").write_text("not code\n")


def code_sync(path, capsys, *nodes):
    """clusterctl preflight --only code_sync: its exit code and {node: (status, detail)}."""
    rc = main(["preflight", "-i", str(path), "--only", "code_sync", "--nodes", ",".join(nodes), "--json"])
    doc = json.loads(capsys.readouterr().out)
    return rc, {n["name"]: next((c["status"], c["detail"]) for c in n["checks"] if c["check"] == "code_sync")
                for n in doc["nodes"]}


def test_a_fresh_node_gets_the_runs_code_from_a_donor_and_passes_code_sync(make_cluster, tmp_path, capsys,
                                                                          monkeypatch):
    # outside any git checkout, with no sync.src: code_sync compares the nodes with each other (the
    # run's code), not with this repository nor with the source edited since
    monkeypatch.chdir(tmp_path)
    cl = make_cluster(3, gpus=0)
    n1, n2, n3 = (nd.name for nd in cl.nodes)
    src = tmp_path / "src"
    make_source(src)
    path = cl.write_inventory(tmp_path / "nodes.yaml")
    assert main(["sync", "-i", str(path), "--src", str(src), "--nodes", f"{n1},{n2}"]) == 0
    for i, nd in enumerate(cl.nodes[:2]):  # each node's outputs differ, as training leaves them
        nd.run(TRAINER_LEAVES.format(i))
    cl.nodes[2].run("mkdir -p ~/gpt_train && echo old > ~/gpt_train/stale.py")  # a spare's old tree
    (src / "train.py").write_text("print('edited here since the run started')\n")
    capsys.readouterr()

    rc, got = code_sync(path, capsys, n1, n2, n3)
    assert rc != 0 and got[n3][0] == "fail", got

    said = []
    inv = load_inventory(str(path))
    with Cluster(inv) as c:
        assert prepare_nodes(c, inv, [n3], [n1, n2], said.append) == {}, said
    assert any(n3 in s and "copied from" in s for s in said), said

    rc, got = code_sync(path, capsys, n1, n2, n3)
    assert rc == 0 and {s for s, _ in got.values()} == {"ok"}, got
    files = cl.nodes[2].run("cd ~/gpt_train && find . -type f | sort && cat train.py").stdout
    assert "./train.py" in files and "./pkg/model.py" in files and "./.gitignore" in files, files
    assert "print('train')" in files  # the run's code, not the control machine's edit
    assert "ckpt" not in files and "events" not in files, files  # outputs are never shipped
    assert "stale.py" not in files and "debug.log" not in files, files


def test_without_a_donor_that_serves_the_fresh_node_is_reported(make_cluster, tmp_path, capsys):
    """No donor can list its code and this machine has no copy of the workdir: {node: why}."""
    cl = make_cluster(2, gpus=0)
    n1, n2 = (nd.name for nd in cl.nodes)
    path = cl.write_inventory(tmp_path / "nodes.yaml", workdir="~/never_synced")
    inv = load_inventory(str(path))
    said = []
    with Cluster(inv) as c:
        failed = prepare_nodes(c, inv, [n2], [n1], said.append)
    assert list(failed) == [n2] and "does not exist" in failed[n2] and "no copy" in failed[n2], failed


def test_with_setup_the_fresh_node_gets_the_runs_venv_too(make_cluster, tmp_path, monkeypatch):
    """A setup: section: the spare gets setup's venv (the donors' lock) before its code."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    cl = make_cluster(2, gpus=0)
    n1, n2 = (nd.name for nd in cl.nodes)
    (tmp_path / "requirements.txt").write_text("# nothing beyond the standard library\n")
    raw = cl.inventory(setup={"requirements": str(tmp_path / "requirements.txt"), "venv": "~/venvs/run"})
    del raw["python"]  # with setup: every node runs the venv's python
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    src = tmp_path / "src"
    make_source(src)
    inv = load_inventory(str(path))
    said = []
    with Cluster(inv) as c:
        assert setup_nodes(c, inv.select([n1]), tmp_path / "requirements.txt").ok  # the run's nodes' venv
        assert sync(c, inv.select([n1]), str(src)).ok
        assert prepare_nodes(c, inv, [n2], [n1], said.append) == {}, said
    hashes = [json.loads(nd.run("cat ~/venvs/run/.clusterctl-setup.json").stdout)["hash"] for nd in cl.nodes]
    assert hashes[0] == hashes[1], hashes
    assert "print('train')" in cl.nodes[1].run("cat ~/gpt_train/train.py").stdout


def test_when_no_donor_serves_this_machines_copy_is_pushed(make_cluster, tmp_path, monkeypatch):
    """The donor never got the code: the fresh node gets the control machine's copy of the
    workdir (~ here is a temporary home), outputs left behind."""
    cl = make_cluster(2, gpus=0)
    n1, n2 = (nd.name for nd in cl.nodes)
    path = cl.write_inventory(tmp_path / "nodes.yaml")
    inv = load_inventory(str(path))
    monkeypatch.setenv("HOME", str(tmp_path / "control"))
    make_source(tmp_path / "control" / "gpt_train")
    (tmp_path / "control" / "gpt_train" / "out").mkdir()
    (tmp_path / "control" / "gpt_train" / "out" / "ckpt_00000001.pt").write_text("local run")
    said = []
    with Cluster(inv) as c:
        assert prepare_nodes(c, inv, [n2], [n1], said.append) == {}, said
    assert any("pushing this machine's copy" in s for s in said), said
    files = cl.nodes[1].run("cd ~/gpt_train && find . -type f | sort").stdout
    assert "./train.py" in files and "./pkg/model.py" in files and "ckpt" not in files, files

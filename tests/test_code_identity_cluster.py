"""Code identity against the checkout you stand in, on the real test cluster: `sync` without
--src pushes the git checkout of the current directory, and preflight's code_sync compares every
node with what that sync ships: an edit not synced, an empty or missing workdir fail, naming the
files; preflight itself writes nothing into the workdir, so a second preflight still fails."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import TestCluster, require_root

pytestmark = pytest.mark.cluster

REPO = str(Path(__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def cl():
    require_root()
    with TestCluster(n=2, gpus=0, name_prefix="ccid") as cluster:
        yield cluster


def git(root, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", "-C", str(root), *args], check=True, env=env, capture_output=True)


def checkout(tmp_path):
    """A fresh git checkout with one committed file and a subdirectory to run from."""
    root = tmp_path / "proj"
    (root / "sub").mkdir(parents=True)
    (root / "train.py").write_text("print('v1')\n")
    (root / "sub" / "util.py").write_text("x = 1\n")
    git(tmp_path, "init", "-q", str(root))
    git(root, "add", "-A")
    git(root, "commit", "-qm", "first")
    return root


def cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=180, env=env)


def code_sync(cl, inv, cwd, *extra):
    """preflight's code_sync verdict per node, and the exit code."""
    r = cli("preflight", "-i", inv, "--json", *extra, cwd=cwd)
    doc = json.loads(r.stdout)
    return r.returncode, {n["name"]: next(c for c in n["checks"] if c["check"] == "code_sync") for n in doc["nodes"]}


@pytest.fixture
def inv(cl, tmp_path):
    for nd in cl.nodes:
        nd.run("rm -rf ~/gpt_train")
    yield str(cl.write_inventory(tmp_path / "nodes.yaml", checks={"disk_min_gb": 0.1}))
    for nd in cl.nodes:
        nd.run("rm -rf ~/gpt_train")


def test_sync_without_src_pushes_the_checkout_it_runs_in(cl, inv, tmp_path):
    root = checkout(tmp_path)
    r = cli("sync", "-i", inv, cwd=root / "sub")
    assert r.returncode == 0, r.stderr[-3000:]
    for nd in cl.nodes:
        assert nd.run("cat ~/gpt_train/train.py ~/gpt_train/sub/util.py").stdout == "print('v1')\nx = 1\n"
    rc, verdicts = code_sync(cl, inv, root, "--only", "code_sync")
    assert rc == 0 and {v["status"] for v in verdicts.values()} == {"ok"}, verdicts


def test_a_local_edit_not_synced_fails_naming_the_files(cl, inv, tmp_path):
    root = checkout(tmp_path)
    assert cli("sync", "-i", inv, cwd=root).returncode == 0
    # the trainer's output directory on one node, as a spare or a past run leaves it: not code
    cl.nodes[1].run("mkdir -p ~/gpt_train/out/tb && echo w > ~/gpt_train/out/ckpt.pt && echo e > ~/gpt_train/out/tb/ev")
    rc, verdicts = code_sync(cl, inv, root, "--only", "code_sync")
    assert rc == 0 and {v["status"] for v in verdicts.values()} == {"ok"}, verdicts
    (root / "train.py").write_text("print('v2')\n")  # edited here, not synced
    (root / "new.py").write_text("y = 2\n")  # untracked, not ignored: sync would ship it
    rc, verdicts = code_sync(cl, inv, root, "--only", "code_sync")
    assert rc == 1
    for v in verdicts.values():
        assert v["status"] == "fail" and "changed: train.py" in v["detail"] and "missing: new.py" in v["detail"], v
        assert str(root) in v["detail"] and "clusterctl sync -i " + inv in v["remedy"], v
    assert cli("sync", "-i", inv, cwd=root).returncode == 0
    rc, verdicts = code_sync(cl, inv, root, "--only", "code_sync")
    assert rc == 0, verdicts


def test_an_empty_workdir_fails_and_a_second_preflight_still_fails(cl, inv, tmp_path):
    root = checkout(tmp_path)
    for nd in cl.nodes:
        nd.run("mkdir -p ~/gpt_train")
    for attempt in (1, 2):
        # every check but python_env (the test nodes' torch is what it is): all of them probe the node
        rc, verdicts = code_sync(cl, inv, root, "--skip", "python_env")
        assert rc == 1, (attempt, verdicts)
        for v in verdicts.values():
            assert v["status"] == "fail" and "holds no code" in v["detail"] and "2 files" in v["detail"], (attempt, v)
        for nd in cl.nodes:  # preflight wrote nothing into the workdir
            assert nd.run("find ~/gpt_train -mindepth 1").stdout == "", attempt


def test_a_missing_workdir_fails(cl, inv, tmp_path):
    root = checkout(tmp_path)
    rc, verdicts = code_sync(cl, inv, root, "--only", "code_sync")
    assert rc == 1 and all(v["status"] == "fail" and "does not exist" in v["detail"] for v in verdicts.values())
    for nd in cl.nodes:
        assert nd.run("test -e ~/gpt_train || echo absent").stdout == "absent\n"


def test_an_empty_workdir_fails_outside_a_checkout_too(cl, inv, tmp_path):
    """No checkout here and no sync.src: the nodes are compared with each other, and a workdir
    with no code still fails."""
    for nd in cl.nodes:
        nd.run("mkdir -p ~/gpt_train")
    rc, verdicts = code_sync(cl, inv, tmp_path, "--only", "code_sync")
    assert rc == 1 and all(v["status"] == "fail" and "holds no code" in v["detail"] for v in verdicts.values())


def test_sync_outside_a_checkout_is_one_usage_paragraph(cl, inv, tmp_path):
    r = cli("sync", "-i", inv, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "not inside a git checkout" in r.stderr and "--src" in r.stderr and "Traceback" not in r.stderr


def test_train_refuses_nodes_behind_the_directory_they_were_synced_from(cl, inv, tmp_path, home):
    """`train` from anywhere: the nodes were last synced from the checkout, which was edited since
    and not synced, so the launch fails naming the file and starts nothing; after a sync it runs
    the edited code. (Nodes never synced by clusterctl are compared with each other only.)"""
    root = checkout(tmp_path)
    assert cli("sync", "-i", inv, cwd=root).returncode == 0
    (root / "train.py").write_text("print('v2')\n")  # edited, not synced
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = cli("train", "-i", inv, "--nproc-per-node", "1", "--", "train.py", cwd=elsewhere)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "code_sync" in r.stderr and "changed: train.py" in r.stderr and "nothing was started" in r.stderr, \
        r.stderr[-3000:]
    for nd in cl.nodes:
        assert nd.run("cat ~/gpt_train/train.py").stdout == "print('v1')\n"
    assert cli("sync", "-i", inv, cwd=root).returncode == 0
    r = cli("train", "-i", inv, "--nproc-per-node", "1", "--", "train.py", cwd=elsewhere)
    assert r.returncode == 0 and "node[1-2]/r[0-1] | v2" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])
    # the nodes updated another way since (a git pull there), the checkout untouched: no false alarm
    for nd in cl.nodes:
        nd.run("echo \"print('v3')\" > ~/gpt_train/train.py")
    r = cli("train", "-i", inv, "--nproc-per-node", "1", "--", "train.py", cwd=elsewhere)
    assert r.returncode == 0 and "node[1-2]/r[0-1] | v3" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_the_inventory_in_the_checkout_never_ships_and_its_edits_are_not_code(cl, tmp_path, home):
    """The quickstart keeps nodes.yaml in the checkout, here tracked by git, with the SSH key and
    known_hosts it names beside it, untracked: none of them reaches a node, and editing the
    inventory fails neither preflight's code_sync nor `train`'s check against the synced checkout."""
    root = checkout(tmp_path)
    keys = root / "keys"
    keys.mkdir()
    for src, name in ((cl.identity_file, "id_test"), (Path(f"{cl.identity_file}.pub"), "id_test.pub"),
                      (cl.known_hosts, "known_hosts")):
        shutil.copy(src, keys / name)
    (keys / "id_test").chmod(0o600)
    ssh = {**cl.inventory()["ssh"], "identity_file": "keys/id_test", "known_hosts": str(keys / "known_hosts")}
    cl.write_inventory(root / "nodes.yaml", ssh=ssh, checks={"disk_min_gb": 0.1})
    git(root, "add", "nodes.yaml")
    git(root, "commit", "-qm", "our nodes")
    for nd in cl.nodes:
        nd.run("rm -rf ~/gpt_train")
    r = cli("sync", "-i", "nodes.yaml", cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    for nd in cl.nodes:
        assert nd.run("cd ~/gpt_train && find . -type f | sort").stdout.split() == \
            ["./.clusterctl-code", "./sub/util.py", "./train.py"]
    with open(root / "nodes.yaml", "a") as f:
        f.write("# node3 joins on Monday\n")
    rc, verdicts = code_sync(cl, "nodes.yaml", root, "--only", "code_sync")
    assert rc == 0 and {v["status"] for v in verdicts.values()} == {"ok"}, verdicts
    r = cli("train", "-i", "nodes.yaml", "--nproc-per-node", "1", "--", "train.py", cwd=root)
    assert r.returncode == 0 and "node[1-2]/r[0-1] | v1" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])
    for nd in cl.nodes:
        nd.run("rm -rf ~/gpt_train")

"""clusterctl sync: the file list, the rsync command line, and pushes to the real test cluster
(rsync and tar paths) after which code_sync passes."""

import os
import subprocess

import pytest
import yaml

from orchestrator.checks import load_nodeinfo
from orchestrator.cli import main
from orchestrator.inventory import parse_inventory
from orchestrator.checks.preflight import run_preflight
from orchestrator.sync import file_list, rsync_argv, sync
from orchestrator.transport import Cluster


def make_tree(root, git=False):
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "pkg" / "model.py").write_text("x = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / ".gitignore").write_text("data/\n*.pt\n!keep.pt\n/out\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 100)
    (root / "w.pt").write_text("weights")
    (root / "keep.pt").write_text("kept")
    (root / "out").mkdir()
    (root / "out" / "log").write_text("log")
    (root / "pkg" / "out").mkdir()
    (root / "pkg" / "out" / "x").write_text("not anchored: shipped")
    if git:
        env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                   GIT_COMMITTER_EMAIL="t@t")
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        subprocess.run(["git", "-C", str(root), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(root), "commit", "-qm", "x"], check=True, env=env)
        (root / "untracked.py").write_text("new\n")


EXPECTED = [".gitignore", "keep.pt", "pkg/model.py", "pkg/out/x", "run.sh", "train.py"]


def test_file_list_honours_gitignore(tmp_path):
    make_tree(tmp_path)
    assert file_list(str(tmp_path)) == EXPECTED


def test_git_tree_and_plain_copy_hash_the_same(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_tree(a, git=True)
    make_tree(b)
    (b / "untracked.py").write_text("new\n")
    ni = load_nodeinfo()
    da, db = ni.digest(str(a)), ni.digest(str(b))
    assert da["kind"] == "git" and db["kind"] == "tree"
    assert da["digest"] == db["digest"] and da["dirty"] is True
    assert sorted(file_list(str(a))) == sorted(EXPECTED + ["untracked.py"])
    (b / "run.sh").chmod(0o644)  # the executable bit counts
    assert ni.digest(str(b))["digest"] != da["digest"]


def test_rsync_command_line_carries_the_inventory_ssh_settings():
    inv = parse_inventory(yaml.safe_dump({
        "ssh": {"user": "u", "port": 2222, "identity_file": "/k/id", "known_hosts": "/k/kh",
                "proxy_jump": "jump@bastion:22"},
        "workdir": "~/gpt train", "nodes": [{"name": "a", "host": "10.0.0.1"}]}), "<t>")
    argv = rsync_argv("/src", inv.nodes[0])
    assert argv[-2:] == ["/src/", "u@10.0.0.1:gpt train/"] and "--files-from=-" in argv
    e = argv[argv.index("-e") + 1]
    for want in ("-i /k/id", "-p 2222", "-J jump@bastion:22", "UserKnownHostsFile=/k/kh",
                 "StrictHostKeyChecking=yes", "BatchMode=yes"):
        assert want in e


@pytest.fixture(scope="module")
def cl():
    from tests.cluster import TestCluster, require_root

    require_root()
    with TestCluster(n=3, gpus=0, name_prefix="ccsy") as cluster:
        yield cluster


@pytest.mark.cluster
@pytest.mark.parametrize("method", ["tar", "rsync"])
def test_sync_pushes_and_code_sync_passes(cl, tmp_path, method, capsys):
    src = tmp_path / "src"
    make_tree(src, git=True)
    # a stale file on one node is removed; its ignored data stays
    cl.nodes[1].run("mkdir -p ~/gpt_train/data && echo stale > ~/gpt_train/stale.py && "
                    "echo keep > ~/gpt_train/data/x")
    inv = parse_inventory(yaml.safe_dump(cl.inventory()), "<t>")
    with Cluster(inv) as c:
        before = run_preflight(c, inv, ["code_sync"], control_dir=str(src))
        res = sync(c, inv, str(src), method=method).results
        after = run_preflight(c, inv, ["code_sync"], control_dir=str(src))
        assert c.handshakes == 3
    assert not before.ok
    assert [r.method for r in res] == [method] * 3 and all(r.ok for r in res), res
    assert after.ok, after.to_json()
    out = cl.nodes[1].run("cd ~/gpt_train && ls -a && cat data/x && test -x run.sh && echo X").stdout
    assert "stale.py" not in out and "keep" in out and "X" in out and "w.pt" not in out
    cl.nodes[1].run("rm -rf ~/gpt_train")


@pytest.mark.cluster
def test_sync_command(cl, tmp_path, capsys):
    src = tmp_path / "src"
    make_tree(src)
    path = cl.write_inventory(tmp_path / "nodes.yaml")
    assert main(["sync", "-i", str(path), "--src", str(src)]) == 0
    assert "code_sync passes" in capsys.readouterr().err
    assert main(["sync", "-i", str(path), "--src", str(tmp_path / "missing")]) == 2

"""`clusterctl cp` and `fetch RUN PATH` on the real test cluster (sshd in network namespaces):
binary files byte for byte both ways, also through a node whose sshd offers no sftp; a tree with a
symbolic link and an empty directory; one upload relayed to a node range; a path in a run's
workdir fetched, a missing one an error naming node and path."""

import json
import os
import random
import subprocess
from pathlib import Path

import jsonschema
import pytest

from orchestrator.inventory.ranges import fold
from tests.cluster.sshd import SFTP_SERVER
from tests.test_train_cluster import cli

pytestmark = pytest.mark.cluster

WRITER = str(Path(__file__).parent / "scripts" / "write_artifacts.py")
SCHEMAS = Path(__file__).resolve().parent.parent / "orchestrator" / "schemas"


def tree(root: Path) -> dict[str, object]:
    """rel -> bytes of a file, ("link", target) of a link, "dir" of a directory."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            out[str(p.relative_to(root))] = ("link", os.readlink(p)) if p.is_symlink() else \
                "dir" if p.is_dir() else p.read_bytes()
    return out


def blob() -> bytes:
    """Every byte value, in runs and at random, a few MB."""
    rnd = random.Random(20)
    return bytes(range(256)) * 4096 + rnd.randbytes(2 << 20) + bytes(range(255, -1, -1))


def sftp_offered(cluster, node) -> subprocess.CompletedProcess:
    argv = cluster.ssh_argv(node, "sftp")
    return subprocess.run(argv[:-2] + ["-s"] + argv[-2:], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def nodes(make_cluster, tmp_path, home):
    cluster = make_cluster(3, gpus=0)
    inv = str(cluster.write_inventory(tmp_path / "nodes.yaml"))
    return cluster, inv


def test_a_binary_file_goes_to_a_node_and_back_byte_for_byte_also_without_sftp(nodes, tmp_path):
    cluster, inv = nodes
    plain, bare = cluster.nodes[0], cluster.nodes[1]
    text = bare.sshd_config.read_text()
    bare.sshd_config.write_text(text.replace(f"Subsystem sftp {SFTP_SERVER}\n", ""))
    bare.restart_sshd()
    no = sftp_offered(cluster, bare)
    assert no.returncode != 0 and "subsystem request failed" in no.stderr, no.stderr
    assert sftp_offered(cluster, plain).returncode == 0  # the probe above is not failing for another reason
    data = blob()
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    for node in (plain, bare):
        r = cli("cp", "-i", inv, "--json", str(src), f"{node.name}:in/blob.bin")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        jsonschema.validate(doc, json.loads((SCHEMAS / "cp.json").read_text()))
        assert (node.home / "gpt_train" / "in" / "blob.bin").read_bytes() == data
        back = tmp_path / f"back-{node.name}.bin"
        r = cli("cp", "-i", inv, f"{node.name}:in/blob.bin", str(back))
        assert r.returncode == 0, r.stderr
        assert back.read_bytes() == data, node.name


def test_a_tree_with_a_link_and_an_empty_directory_goes_and_comes_back_as_it_was(nodes, tmp_path):
    cluster, inv = nodes
    node = cluster.nodes[2]
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a" / "b" / "data.bin").write_bytes(blob()[:300_000])
    (src / "top.txt").write_text("top\n")
    os.symlink("a/b/data.bin", src / "link")
    os.symlink("/nonexistent/elsewhere", src / "dangling")
    r = cli("cp", "-i", inv, str(src), f"{node.name}:~/tree")
    assert r.returncode == 0, r.stderr
    assert tree(node.home / "tree") == tree(src)
    assert (node.home / "tree" / "empty").is_dir() and os.readlink(node.home / "tree" / "link") == "a/b/data.bin"
    r = cli("cp", "-i", inv, f"{node.name}:~/tree", str(tmp_path / "out") + "/")  # into a new directory
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "out" / "tree") == tree(src)


def test_one_upload_reaches_a_node_range_and_each_node_holds_the_same_bytes(nodes, tmp_path):
    cluster, inv = nodes
    src = tmp_path / "shard.bin"
    src.write_bytes(blob())
    names = fold([n.name for n in cluster.nodes])
    assert "[" in names  # a range, as a user would write it
    r = cli("cp", "-i", inv, "--json", str(src), f"{names}:data/")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and [n["name"] for n in doc["nodes"]] == [n.name for n in cluster.nodes] and not doc["notes"]
    for node in cluster.nodes:
        assert (node.home / "gpt_train" / "data" / "shard.bin").read_bytes() == src.read_bytes(), node.name
    r = cli("cp", "-i", inv, f"{names}:data/shard.bin", str(tmp_path / "all"))  # and off every node
    assert r.returncode == 0, r.stderr
    for node in cluster.nodes:
        assert (tmp_path / "all" / node.name / "shard.bin").read_bytes() == src.read_bytes()


def test_fetch_takes_a_path_in_a_runs_workdir_and_a_missing_one_is_an_error_naming_node_and_path(nodes, home,
                                                                                               tmp_path):
    cluster, inv = nodes
    first, second = cluster.nodes[0], cluster.nodes[1]
    for n in (first, second):
        n.run("mkdir -p ~/gpt_train/out")
    r = cli("train", "-i", inv, "--skip-preflight", "--nodes", f"{first.name},{second.name}", "--", WRITER,
            "--size", "1000")
    assert r.returncode == 0, r.stderr
    run_id = next((home / "runs").iterdir()).name
    data = blob()
    ckpt = first.home / "gpt_train" / "out" / "ckpt.pt"
    ckpt.write_bytes(data)
    os.chown(ckpt, cluster.pw.pw_uid, cluster.pw.pw_gid)
    second.run("rmdir ~/gpt_train/out")
    r = cli("fetch", run_id, "out", "--node", first.name, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, json.loads((SCHEMAS / "fetch.json").read_text()))
    assert doc["nodes"][0]["source"] == "workdir/out" and doc["nodes"][0]["files"] == 1
    assert (home / "runs" / run_id / "fetched" / first.name / "workdir" / "out" / "ckpt.pt").read_bytes() == data
    r = cli("fetch", run_id, "~/gpt_train/out/ckpt.pt", "--node", first.name, "-o", str(tmp_path / "o"))
    assert r.returncode == 0 and (tmp_path / "o" / first.name / "workdir" / "out" / "ckpt.pt").read_bytes() == data
    r = cli("fetch", run_id, "out-shakespeare-char", "--node", first.name)
    assert r.returncode == 1 and "0 files" not in r.stderr and "Traceback" not in r.stderr
    assert f"out-shakespeare-char does not exist on {first.name}" in r.stderr
    r = cli("fetch", run_id, "out")  # only the first node has it
    assert r.returncode == 1 and f"out does not exist on {second.name}" in r.stderr and "--node" in r.stderr
    for bad in ("/etc", "~/gpt_train/../../../etc"):
        r = cli("fetch", run_id, bad, "--node", first.name)
        assert r.returncode == 2 and "Traceback" not in r.stderr and ("outside" in r.stderr or "`..`" in r.stderr), bad

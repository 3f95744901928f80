"""One meaning of rank, one rule for processes per node, one exit-code table: on the real test
cluster, through the `clusterctl` command line.

- `--nodes` renumbers: the first selected node is rank 0 (the master) in preflight, train and
  netbench.
- `gpus: 0` is a CPU node (one process) even where nvidia-smi reports GPUs; more processes than
  the GPUs found is a usage error (exit 2).
- an unreachable node is exit 3 from every command that contacts nodes.
- an ~/.ssh/config alias is never handed to the nodes as the master address.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import TestCluster, require_root
from tests.conftest import scan, wait_for

pytestmark = pytest.mark.cluster

DDP = str(Path(__file__).parent / "scripts" / "ddp_tiny.py")
CHECKS = {"disk_min_gb": 0.1}


@pytest.fixture(scope="module")
def cpu3():
    """3 CPU nodes (`gpus: 0`, no nvidia-smi), shared by the tests that only use them."""
    require_root()
    with TestCluster(n=3, gpus=0, name_prefix="ccrk") as cluster:
        for nd in cluster.nodes:
            nd.run("mkdir -p ~/gpt_train")
        yield cluster


def cli(*args, timeout=180):
    """`clusterctl ARGS` as a user runs it; a hang fails the test at `timeout`."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())


def last_run(home):
    runs = sorted((home / "runs").iterdir(), key=lambda p: p.stat().st_ctime)
    return json.loads((runs[-1] / "run.json").read_text())


def flat(text):
    """The text with every run of whitespace made one space (the rank map wraps to the terminal)."""
    return " ".join(text.split())


def table_cell(text, node, column):
    """The preflight table's cell for `node` under the column whose last header word is `column`
    (the table folds to the terminal width, so the column may sit in a later block)."""
    header = None
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["node"]:
            header = words
        elif header and words[:1] == [node] and column in header and len(words) == len(header):
            return words[header.index(column)]
    raise AssertionError(f"no {column!r} cell for {node} in:\n{text}")


def checks_of(doc, node):
    n = next(n for n in doc["nodes"] if n["name"] == node)
    return {c["check"]: c for c in n["checks"]}


# ------------------------------------------------------------------ --nodes renumbers


def test_nodes_subset_makes_its_first_node_the_master_in_preflight(cpu3, tmp_path):
    inv = cpu3.write_inventory(tmp_path / "nodes.yaml", checks=CHECKS)
    only = "ssh,port_free,port_reachable,iface"
    r = cli("preflight", "-i", inv, "--nodes", "node2,node3", "--only", only, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert [(n["name"], n["rank"]) for n in doc["nodes"]] == [("node2", 0), ("node3", 1)]
    master = checks_of(doc, "node2")
    assert master["port_free"]["status"] == "ok", master["port_free"]  # checked: node2 listens
    assert master["iface"]["status"] == "ok", master["iface"]  # no route to itself through lo
    assert checks_of(doc, "node3")["port_reachable"]["status"] == "ok"
    r = cli("preflight", "-i", inv, "--nodes", "node3,node2", "--only", only)  # order: the inventory's
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"rank 0 → node2 ({cpu3.nodes[1].host})" in r.stdout and "rank 1 → node3" in r.stdout


def test_nodes_subset_trains_with_its_first_node_as_rank_0(cpu3, tmp_path, home):
    inv = cpu3.write_inventory(tmp_path / "nodes.yaml", checks=CHECKS)
    r = cli("train", "-i", inv, "--nodes", "node2,node3", "--", DDP, "--steps", "2")  # preflight on
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "world size 2 on 2 nodes: rank 0 → node2" in flat(r.stderr)
    assert table_cell(r.stderr, "node2", "free") == "ok", r.stderr  # train's preflight checks the master's port
    assert re.search(r"^node2/r0 +\| rank 0 of 2 on node2 ", r.stdout, re.M), r.stdout
    assert re.search(r"^node3/r1 +\| rank 1 of 2 on node3 ", r.stdout, re.M), r.stdout
    rec = last_run(home)
    assert rec["attempts"][0]["preflight_ok"] is True
    assert [(n["name"], n["rank"], n["first_rank"]) for n in rec["nodes"]] == [("node2", 0, 0), ("node3", 1, 1)]
    assert not cpu3.processes(cpu3.nodes[0])  # node1 was never part of it


def test_netbench_allreduce_on_a_subset_completes(cpu3, tmp_path):
    inv = cpu3.write_inventory(tmp_path / "nodes.yaml")
    r = cli("netbench", "-i", inv, "--nodes", "node2,node3", "--allreduce", "1MB", "--seconds", "0.2",
            "--iters", "1", "--json", timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["master"] == "node2" and [x["node"] for x in doc["links"]] == ["node3"]
    assert doc["allreduce"]["nodes"] == 2 and doc["allreduce"]["nbytes"] == 1_000_000


# ------------------------------------------------------------------ processes per node


def test_gpus_0_is_one_process_per_node_and_too_many_processes_is_a_usage_error(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=8, name_prefix="ccrg")  # nvidia-smi reports 8 GPUs on each
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    cpu = cluster.write_inventory(tmp_path / "cpu.yaml", checks=CHECKS, nodes=[
        {"name": nd.name, "host": nd.host, "iface": nd.iface, "gpus": 0} for nd in cluster.nodes])
    r = cli("preflight", "-i", cpu, "--only", "ssh,gpu_count")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world size 2 on 2 nodes: rank 0 → node1" in flat(r.stdout) and "rank 1 → node2" in r.stdout
    r = cli("train", "-i", cpu, "--", DDP, "--steps", "1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "world size 2 on 2 nodes: rank 0 → node1" in flat(r.stderr)
    assert re.search(r"^node2/r1 +\| rank 1 of 2 on node2 ", r.stdout, re.M), r.stdout
    rec = last_run(home)
    assert rec["world_size"] == 2 and [n["nproc"] for n in rec["nodes"]] == [1, 1]

    gpu = cluster.write_inventory(tmp_path / "gpu.yaml", checks=CHECKS, nodes=[
        {"name": nd.name, "host": nd.host, "iface": nd.iface} for nd in cluster.nodes])  # gpus: unset
    r = cli("train", "-i", gpu, "--nproc-per-node", "16", "--", DDP, "--steps", "1")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    err = " ".join(r.stderr.split())
    assert "node1: 16 processes, 8 GPUs found" in err and "--nproc-per-node 8 or fewer" in err, err
    assert "Traceback" not in r.stderr
    assert last_run(home)["state"] == "failed"
    started = [cmd for nd in cluster.nodes for _, cmd in scan(cluster.processes(nd))
               if any(w in cmd for w in ("torchrun", "node_agent", "ddp"))]
    assert not started, started  # nothing was launched
    # The refused run's SSH sessions (sshd children under the test user) close on their own.
    wait_for(lambda: not any(cluster.processes(nd) for nd in cluster.nodes), 15, "the nodes clean after a refused run")


# ------------------------------------------------------------------ exit code 3


@pytest.fixture(scope="module")
def one_down(tmp_path_factory):
    """2 nodes, node2's sshd stopped: the host answers ping, ssh is refused."""
    require_root()
    with TestCluster(n=2, gpus=2, name_prefix="ccrd") as cluster:
        cluster.nodes[1].stop_sshd()
        yield cluster


COMMANDS = {
    "preflight": ["preflight"],
    "exec": ["exec", "--", "true"],
    "train": ["train", "--", DDP],
    "top": ["top", "--once"],
    "netbench": ["netbench"],
    "sync": ["sync", "--src", "{src}"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unreachable_node_is_exit_3(one_down, tmp_path, home, command):
    inv = one_down.write_inventory(tmp_path / "nodes.yaml", checks=CHECKS)
    (tmp_path / "src").mkdir()
    args = [a.replace("{src}", str(tmp_path / "src")) for a in COMMANDS[command]]
    r = cli(args[0], "-i", inv, "--connect-timeout", "3", *args[1:], timeout=120)
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert "node2" in r.stdout + r.stderr and "refused" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------ ssh_config aliases


def test_ssh_config_alias_trains_with_the_resolved_master_address(cpu3, tmp_path, home):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("".join(f"Host gpu-{nd.name}\n  HostName {nd.host}\n" for nd in cpu3.nodes[:2]))
    inv = cpu3.write_inventory(tmp_path / "nodes.yaml", checks=CHECKS, ssh={
        "user": cpu3.user, "identity_file": str(cpu3.identity_file), "known_hosts": str(cpu3.known_hosts),
        "config_file": str(cfg), "connect_timeout": 5},
        nodes=[{"name": nd.name, "host": f"gpu-{nd.name}", "iface": nd.iface, "gpus": 0} for nd in cpu3.nodes[:2]])
    # the alias resolves nowhere but in that file: not on the control machine, not on a node
    assert cpu3.nodes[1].run("getent hosts gpu-node1", check=False).returncode != 0
    r = cli("train", "-i", inv, "--", DDP, "--steps", "2")  # preflight on: port_reachable too
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"rank 0 → node1 ({cpu3.nodes[0].host})" in r.stderr
    assert re.search(r"^node2/r1 +\| rank 1 step 1 sum 3$", r.stdout, re.M), r.stdout

"""Run ranks of a node subset, the processes-per-node rule, the exit-code table and the master
address of an ssh_config alias: the pure parts, no cluster."""

import yaml

from orchestrator.cli import HELP
from orchestrator.cli.exec import exit_code
from orchestrator.errors import EXIT_CODES, EXIT_UNREACHABLE, UnreachableError, exit_codes_text, with_unreachable
from orchestrator.inventory import parse_inventory
from orchestrator.inventory.sshconfig import config_hostname
from orchestrator.torchrun import nproc_for, nprocs_for, rank_map_text, too_many_procs
from orchestrator.transport import ClusterResult, NodeResult
from orchestrator.transport.base import ErrorKind


def inv_of(nodes, **top):
    return parse_inventory(yaml.safe_dump({"nodes": nodes, **top}), "<test>")


FOUR = [{"name": f"n{i}", "host": f"10.0.0.{i}"} for i in range(1, 5)]


def test_select_renumbers_in_inventory_order_and_the_first_is_the_master():
    inv = inv_of(FOUR)
    sub = inv.select(["n4", "n2"])
    assert [(n.name, n.rank) for n in sub.nodes] == [("n2", 0), ("n4", 1)]
    assert sub.master.name == "n2"
    assert [(n.name, n.rank) for n in inv.nodes] == [("n1", 0), ("n2", 1), ("n3", 2), ("n4", 3)]  # untouched
    assert inv.select(None) is inv


def test_rank_map_of_a_subset_starts_at_its_first_node():
    sub = inv_of(FOUR).select(["n3", "n4"])
    assert rank_map_text(sub, {"n3": 2, "n4": 2}) == \
        "world size 4 on 2 nodes: rank 0-1 → n3 (10.0.0.3), rank 2-3 → n4 (10.0.0.4)"


def test_nproc_rule():
    set8, cpu, unset = inv_of([{"name": "a", "host": "h1", "gpus": 8}, {"name": "b", "host": "h2", "gpus": 0},
                               {"name": "c", "host": "h3"}]).nodes
    assert nproc_for(set8, found_gpus=4) == 8  # the inventory says: it wins over the probe
    assert nproc_for(cpu, found_gpus=8) == 1  # gpus: 0 is a CPU node whatever nvidia-smi reports
    assert nproc_for(unset, found_gpus=8) == 8
    assert nproc_for(unset, found_gpus=0) == 1 and nproc_for(unset, None) == 1
    assert nproc_for(cpu, 8, override=3) == 3 and nproc_for(unset, 8, override="auto") == 8


def test_nprocs_take_the_flag_else_train_nproc_per_node():
    inv = inv_of([{"name": "a", "host": "h1"}], train={"nproc_per_node": 2})
    assert nprocs_for(inv, {"a": 8}) == {"a": 2}
    assert nprocs_for(inv, {"a": 8}, override=4) == {"a": 4}
    assert nprocs_for(inv, {"a": 8}, override="auto") == {"a": 2}


def test_too_many_processes_only_on_gpu_nodes():
    inv = inv_of([{"name": "a", "host": "h1"}, {"name": "b", "host": "h2", "gpus": 0},
                  {"name": "c", "host": "h3", "gpus": 4}, {"name": "d", "host": "h4"}])
    found = {"a": 8, "b": 8, "c": None, "d": 0}
    assert too_many_procs(inv, nprocs_for(inv, found, 16), found) == {
        "a": (16, 8, "found"), "c": (16, 4, "in the inventory")}
    assert too_many_procs(inv, nprocs_for(inv, found, 4), found) == {}  # fewer is fine


def test_master_address_is_the_ssh_config_hostname(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu-a\n  HostName 10.0.0.5\nHost rack-*\n  HostName %h.example.net\n")
    ssh = {"config_file": str(cfg)}
    inv = inv_of([{"name": "a", "host": "gpu-a"}, {"name": "b", "host": "rack-2"},
                  {"name": "c", "host": "gpu-a", "ssh": {"port": 2222}, "address": "192.168.1.9"},
                  {"name": "d", "host": "10.0.0.7"}], ssh=ssh)
    assert [n.address for n in inv.nodes] == ["10.0.0.5", "rack-2.example.net", "192.168.1.9", "10.0.0.7"]
    assert [n.host for n in inv.nodes] == ["gpu-a", "rack-2", "gpu-a", "10.0.0.7"]  # ssh still uses the alias
    assert config_hostname("gpu-a", str(tmp_path / "missing")) == "gpu-a"
    (tmp_path / "bad").write_text("Host x\n  HostName\n")
    assert config_hostname("x", str(tmp_path / "bad")) == "x"


def test_exit_code_table_is_in_the_help():
    text = " ".join(HELP.split())
    for code, meaning in EXIT_CODES:
        assert f"{code} {' '.join(meaning.split())}" in text
    assert exit_codes_text().splitlines()[0] == "  0  ok"


def test_unreachable_wins_over_every_failure():
    assert with_unreachable(["n2"], 1) == EXIT_UNREACHABLE and with_unreachable([], 1) == 1
    e = UnreachableError({"n2": "connection refused"}, "nothing was measured")
    assert e.exit_code == EXIT_UNREACHABLE and str(e) == "cannot reach n2, nothing was measured. n2: connection refused"


def test_exec_exit_code():
    ok, bad = NodeResult("a", 0), NodeResult("b", 7)
    refused = NodeResult("c", None, error="connection refused at u@h:22: is sshd running?", kind=ErrorKind.CONNECT)
    slow = NodeResult("d", None, error="timed out after 1s", kind=ErrorKind.TIMEOUT)
    assert exit_code(ClusterResult(a=ok, b=bad)) == 7
    assert exit_code(ClusterResult(a=ok, b=bad, c=refused)) == EXIT_UNREACHABLE
    assert exit_code(ClusterResult(a=ok, d=slow)) == 124
    assert exit_code(ClusterResult(a=ok)) == 0

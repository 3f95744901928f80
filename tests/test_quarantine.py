"""runs/quarantine.py: the record of sick nodes on the control machine, and how a launch's first
nodes are chosen around them. The launch on the test cluster is in test_quarantine_cluster.py."""

import json
import threading

import pytest

from orchestrator.inventory import parse_inventory
from orchestrator.runs import quarantine

pytestmark = pytest.mark.usefixtures("home")

INV = parse_inventory("nodes:\n  - {name: n1, host: 10.0.0.1}\n  - {name: n2, host: 10.0.0.2}\n"
                      "  - {name: n3, host: 10.0.0.3, spare: true}\n  - {name: n4, host: 10.0.0.4, spare: true}\n")


def test_a_node_is_kept_with_its_first_reason_until_released():
    n1, n2 = INV.nodes[:2]
    assert quarantine.of(INV.nodes) == {}
    added = quarantine.add([n2], {"n2": "gpu_health: GPU 1: row remapping pending"}, "run-1")
    assert [e.node for e in added] == ["n2"]
    assert quarantine.add([n2], {"n2": "gpu_health: later"}, "run-2") == []  # the first reason stays
    held = quarantine.of(INV.nodes)
    assert list(held) == ["n2"] and held["n2"].reason.endswith("row remapping pending") and held["n2"].run == "run-1"
    assert held["n2"].line().startswith("n2 (10.0.0.2) quarantined since ")
    # known by name and host: the same name on another host is another node
    other = parse_inventory("nodes:\n  - {name: n2, host: 10.9.9.9}\n").nodes
    assert quarantine.of(other) == {}
    assert [e.node for e in quarantine.release([n1, n2])] == ["n2"]
    assert quarantine.of(INV.nodes) == {}


def test_writers_at_once_keep_every_entry_and_a_damaged_file_quarantines_nothing():
    threads = [threading.Thread(target=quarantine.add, args=([n], {n.name: "x"}, None)) for n in INV.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(quarantine.of(INV.nodes)) == ["n1", "n2", "n3", "n4"]
    assert sorted(json.loads(quarantine.path().read_text())) == [f"n{i}@10.0.0.{i}" for i in range(1, 5)]
    quarantine.path().write_text("{not json")
    assert quarantine.of(INV.nodes) == {}


def test_only_health_checks_quarantine_and_the_reason_names_them():
    got = quarantine.health_failures({"n1": {"port_free": "busy"},
                                      "n2": {"gpu_health": "GPU 0: Xid 48", "disk": "full"}})
    assert got == {"n2": "gpu_health: GPU 0: Xid 48"}

"""`inventory from-slurm`'s parsers, on outputs recorded from slurm-wlm 22.05 in the test cluster
(tests/cluster/slurm.py). The command itself runs inside real SLURM jobs in test_slurm_cluster.py."""

from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.errors import UsageError
from orchestrator.inventory import parse_inventory
from orchestrator.platforms.slurm import (
    Allocation,
    gres_gpus,
    inventory_yaml,
    parse_job_gres,
    read_allocation,
    requested_gpus,
)

FIX = Path(__file__).parent / "fixtures" / "slurm"


def expand(nodelist):
    """What `scontrol show hostnames` prints for the lists these tests use."""
    return {"node[1-2]": ["node1", "node2"], "node1": ["node1"], "node2": ["node2"]}[nodelist]


def detail(name):
    return lambda job_id: (FIX / f"scontrol_show_job_d_{name}.txt").read_text()


@pytest.mark.parametrize("spec,want", [("2", 2), ("a100:2", 2), ("a100:1,v100:3", 4), ("x", None), ("", None)])
def test_requested_gpus(spec, want):
    assert requested_gpus(spec) == want


@pytest.mark.parametrize("gres,want", [("gpu:2(IDX:0-1)", 2), ("gpu:a100:1(IDX:0),nic:1", 1),
                                       ("gpu:2(IDX:0,2)", 2), ("nic:1", None), ("", None)])
def test_gres_gpus(gres, want):
    assert gres_gpus(gres) == want


def test_parse_job_gres_recorded():
    assert parse_job_gres((FIX / "scontrol_show_job_d_gpus3.txt").read_text()) == [("node1", 2), ("node2", 1)]
    assert parse_job_gres((FIX / "scontrol_show_job_d_gres1.txt").read_text()) == [("node[1-2]", 1)]
    assert parse_job_gres((FIX / "scontrol_show_job_d_nogpu.txt").read_text()) == [("node[1-2]", None)]


BASE = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]"}


@pytest.mark.parametrize("env,fixture,want", [
    ({"SLURM_GPUS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "2"}, None, {"node1": 2, "node2": 2}),
    ({"SLURM_GPUS_ON_NODE": "1"}, None, {"node1": 1, "node2": 1}),          # --gres=gpu:1
    ({"SLURM_GPUS": "3", "SLURM_GPUS_ON_NODE": "2"}, "gpus3", {"node1": 2, "node2": 1}),  # --gpus=3
    ({}, "nogpu", {}),                                                        # no GPU asked for
])
def test_gpus_per_node_sources(env, fixture, want):
    def no_detail(job_id):
        raise AssertionError("the environment was enough")
    alloc = read_allocation({**BASE, **env}, hostnames=expand, detail=detail(fixture) if fixture else no_detail)
    assert alloc.hosts == ("node1", "node2") and alloc.gpus == want


def test_outside_an_allocation_is_a_usage_error(capsys, monkeypatch):
    for k in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(k, raising=False)
    assert main(["inventory", "from-slurm"]) == 2
    err = capsys.readouterr().err
    assert "not inside a SLURM allocation" in err and "Traceback" not in err


def test_no_scontrol_is_a_usage_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="scontrol is not on PATH"):
        read_allocation(BASE)


def test_inventory_from_template_keeps_settings_and_named_nodes(tmp_path):
    tpl = tmp_path / "site.yaml"
    tpl.write_text(yaml.safe_dump({
        "ssh": {"user": "alice", "identity_file": "~/.ssh/id_site"}, "workdir": "/scratch/run",
        "python": "/opt/venv/bin/python", "master_port": 29555, "env": {"OMP_NUM_THREADS": "4"},
        "nodes": [{"name": "node2", "host": "10.0.0.2", "iface": "ib0", "gpus": 8},
                  {"name": "other", "host": "10.0.0.9"}]}))
    alloc = Allocation("7", "node[1-2]", ("node1", "node2"), {"node1": 2, "node2": 2})
    text = inventory_yaml(alloc, str(tpl))
    assert text.startswith("# SLURM job 7 (node[1-2])")
    inv = parse_inventory(text)
    assert [(n.name, n.host, n.gpus, n.iface) for n in inv.nodes] == \
        [("node1", "node1", 2, None), ("node2", "10.0.0.2", 2, "ib0")]
    assert inv.master_port == 29555 and inv.workdir == "/scratch/run" and inv.python == "/opt/venv/bin/python"
    assert inv.nodes[0].ssh.user == "alice" and inv.env == {"OMP_NUM_THREADS": "4"}
    inv = parse_inventory(inventory_yaml(alloc, str(tpl), user="bob", iface="eth0", master_port=29600))
    assert inv.nodes[1].ssh.user == "bob" and {n.iface for n in inv.nodes} == {"eth0"} and inv.master_port == 29600


def test_unknown_gpus_stay_unset():
    inv = parse_inventory(inventory_yaml(Allocation("7", "a,b", ("a", "b"), {})))
    assert [n.gpus for n in inv.nodes] == [None, None]


def test_a_bad_flag_value_is_refused_before_writing(tmp_path):
    alloc = Allocation("7", "a", ("a",), {})
    with pytest.raises(UsageError):
        inventory_yaml(alloc, iface="eth0; rm -rf /")

"""Inventory parsing: every bad input names file:line and key and exits 2."""

import textwrap

import pytest

from orchestrator.cli import main
from orchestrator.errors import EXIT_USAGE, InventoryError
from orchestrator.inventory import hostfile_to_yaml, load_inventory, parse_hostfile, parse_inventory

GOOD = """\
ssh:
  user: train
  port: 22
  identity_file: ~/.ssh/id_ed25519
  connect_timeout: 10
master_port: 29500
workdir: ~/gpt_train
python: python3
env: {NCCL_IB_DISABLE: "1", OMP_NUM_THREADS: 4}
nodes:
  - {name: node1, host: 192.168.1.100, gpus: 8, iface: eth0}
  - name: node2
    host: 192.168.1.101
    gpus: 8
    iface: eth1
    env: {NCCL_DEBUG: INFO}
    ssh: {port: 2222}
"""


def test_good_inventory_resolves_per_node_settings():
    inv = parse_inventory(GOOD, "nodes.yaml")
    n1, n2 = inv.nodes
    assert (n1.rank, n2.rank) == (0, 1)
    assert inv.master is n1
    assert n1.ssh.port == 22 and n2.ssh.port == 2222
    assert n2.ssh.user == "train"  # inherited
    assert n1.env == {"NCCL_IB_DISABLE": "1", "OMP_NUM_THREADS": "4"}
    assert n2.env == {"NCCL_IB_DISABLE": "1", "OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO"}
    assert n2.line == 12
    assert inv.master_port == 29500


def test_example_inventory_and_embedded_default_load():
    inv = load_inventory("inventory.example.yaml")
    assert [n.name for n in inv.nodes] == ["node1", "node2"]
    d = load_inventory(None)
    assert [n.connection for n in d.nodes] == ["local", "local"]
    assert all(n.gpus == 0 for n in d.nodes)


def _err(text: str) -> InventoryError:
    with pytest.raises(InventoryError) as ei:
        parse_inventory(textwrap.dedent(text), "bad.yaml")
    return ei.value


@pytest.mark.parametrize("text,line,needle", [
    # unknown key, top level and inside a node
    ("nodes:\n  - {name: a, host: h1}\nmaster_prot: 29500\n", 3, "unknown key 'master_prot'"),
    ("nodes:\n  - name: a\n    host: h1\n    gpu: 8\n", 4, "unknown key 'gpu'"),
    # wrong type
    ("nodes:\n  - name: a\n    host: h1\n    gpus: eight\n", 4, "gpus"),
    ("master_port: [1]\nnodes:\n  - {name: a, host: h1}\n", 1, "master_port"),
    # port out of range
    ("master_port: 70000\nnodes:\n  - {name: a, host: h1}\n", 1, "master_port: 70000 is not a port"),
    ("ssh: {port: 0}\nnodes:\n  - {name: a, host: h1}\n", 1, "ssh.port"),
    # duplicates
    ("nodes:\n  - {name: a, host: h1}\n  - {name: a, host: h2}\n", 3, "duplicate node name 'a'"),
    ("nodes:\n  - {name: a, host: h1}\n  - {name: b, host: H1}\n", 3, "duplicate host 'H1'"),
    ("nodes:\n  - {name: a, host: h1}\nnodes:\n  - {name: b, host: h2}\n", 3, "duplicate key 'nodes'"),
    # empty / missing node list
    ("nodes: []\n", 1, "node list is empty"),
    ("master_port: 29500\n", 1, "missing required key 'nodes'"),
    # YAML syntax error
    ("nodes:\n  - {name: a, host: h1\n  - {name: b}\n", 3, "YAML syntax error"),
    # values that could carry shell syntax are rejected
    ("nodes:\n  - {name: 'a;rm -rf /', host: h1}\n", 2, "not a valid node name"),
    ("nodes:\n  - {name: a, host: 'h1 && reboot'}\n", 2, "not a valid host"),
    ("nodes:\n  - {name: a, host: '-oProxyCommand=x'}\n", 2, "not a valid host"),
    ("ssh: {user: '$(id)'}\nnodes:\n  - {name: a, host: h1}\n", 1, "not a valid user name"),
    ("nodes:\n  - {name: a, host: h1, iface: 'eth0;ls'}\n", 2, "not a valid interface"),
    ("env: {'BAD-KEY': 1}\nnodes:\n  - {name: a, host: h1}\n", 1, "not a valid identifier"),
    ("nodes:\n  - {name: a, host: h1, workdir: '~root/x'}\n", 2, "~user"),
    # ssh nodes need a host
    ("nodes:\n  - {name: a}\n", 2, "'host' is required"),
    ("train: {args: '--preset tiny'}\nnodes:\n  - {name: a, host: h1}\n", 1, "list of strings"),
])
def test_bad_inventories_name_file_line_and_key(text, line, needle):
    e = _err(text)
    assert needle in str(e), str(e)
    assert e.line == line, str(e)
    assert str(e).startswith(f"bad.yaml:{line}:" if line else "bad.yaml:")
    assert e.exit_code == EXIT_USAGE


def test_empty_file_and_non_mapping():
    assert "empty" in str(_err(""))
    assert "mapping" in str(_err("- a\n- b\n"))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InventoryError, match="inventory file not found"):
        load_inventory(tmp_path / "nope.yaml")


def test_cli_bad_inventory_one_paragraph_exit_2(tmp_path, capsys):
    p = tmp_path / "nodes.yaml"
    p.write_text("nodes:\n  - {name: a, host: h1, gpus: -1}\n")
    assert main(["inventory", "check", "-i", str(p)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{p}:2:" in err and "nodes[0].gpus" in err
    assert "Traceback" not in err
    assert main(["inventory", "check", "-i", str(tmp_path / "missing.yaml")]) == EXIT_USAGE


def test_cli_wrong_flag_is_usage_error(capsys):
    assert main(["inventory", "check", "--fanout", "0"]) == EXIT_USAGE
    assert "Traceback" not in capsys.readouterr().err


def test_hostfile_import_round_trips():
    text = "# DeepSpeed hostfile\nworker-1 slots=4\nworker-2   slots=4  # second\n\n10.0.0.3 slots=2\n"
    nodes = parse_hostfile(text)
    assert nodes == [{"name": "worker-1", "host": "worker-1", "gpus": 4},
                     {"name": "worker-2", "host": "worker-2", "gpus": 4},
                     {"name": "10-0-0-3", "host": "10.0.0.3", "gpus": 2}]
    inv = parse_inventory(hostfile_to_yaml(text, "hostfile", user="train", iface="eth0"))
    assert [n.gpus for n in inv.nodes] == [4, 4, 2]
    assert inv.nodes[0].ssh.user == "train" and inv.nodes[2].iface == "eth0"


@pytest.mark.parametrize("text,needle", [
    ("worker-1 slots=four\n", "cannot parse"),
    ("worker-1 slots=2\nworker-1 slots=2\n", "listed twice"),
    ("# nothing\n", "no hosts"),
    ("bad;host slots=1\n", "not a valid host"),
])
def test_bad_hostfiles(text, needle):
    with pytest.raises(InventoryError, match=needle):
        parse_hostfile(text, "hf")


def test_cli_import_hostfile(tmp_path, capsys):
    hf = tmp_path / "hostfile"
    hf.write_text("a slots=8\nb slots=8\n")
    out = tmp_path / "inv.yaml"
    assert main(["inventory", "import-hostfile", str(hf), "-o", str(out)]) == 0
    assert [n.name for n in load_inventory(out).nodes] == ["a", "b"]

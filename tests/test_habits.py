"""What pdsh/clush/SLURM users expect, without the test cluster: node ranges in the inventory and
--nodes, Ansible import, gathered exec output on local nodes, --json error objects and schemas,
shell completion, and the notify command's environment."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from orchestrator.cli.gather import Gatherer
from orchestrator.errors import InventoryError
from orchestrator.inventory import MAX_NODES, parse_inventory
from orchestrator.inventory.ansible import ansible_to_yaml
from orchestrator.inventory.ranges import range_size
from tests.conftest import write_record

SCHEMAS = Path(__file__).resolve().parent.parent / "orchestrator" / "schemas"


def schema(name):
    return json.loads((SCHEMAS / f"{name}.json").read_text())


def cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def local_range(tmp_path, n):
    p = tmp_path / "local.yaml"
    p.write_text(f"workdir: {tmp_path}\nnodes:\n  - name: n[1-{n}]\n    connection: local\n    gpus: 0\n")
    return str(p)


# ---------------------------------------------------------------- ranges


def test_a_32_node_range_is_32_nodes_in_rank_order_with_hosts_paired():
    inv = parse_inventory(textwrap.dedent("""\
        ssh: {user: ubuntu}
        nodes:
          - name: gpu[01-32]
            host: 10.0.0.[11-42]
            gpus: 8
        """))
    assert [n.name for n in inv.nodes] == [f"gpu{i:02d}" for i in range(1, 33)]
    assert [n.rank for n in inv.nodes] == list(range(32))
    assert [n.host for n in inv.nodes] == [f"10.0.0.{i}" for i in range(11, 43)]
    assert {n.gpus for n in inv.nodes} == {8} and {n.line for n in inv.nodes} == {3}


def test_a_host_template_and_plain_entries_keep_their_order():
    inv = parse_inventory(textwrap.dedent("""\
        nodes:
          - {name: head, host: 10.0.0.1}
          - name: gpu[1-3]
            host: "{name}.cluster"
            address: 192.168.0.[7-9]
        """))
    assert [(n.name, n.host, n.address, n.rank) for n in inv.nodes] == [
        ("head", "10.0.0.1", "10.0.0.1", 0), ("gpu1", "gpu1.cluster", "192.168.0.7", 1),
        ("gpu2", "gpu2.cluster", "192.168.0.8", 2), ("gpu3", "gpu3.cluster", "192.168.0.9", 3)]


@pytest.mark.parametrize("text,line,words", [
    ("nodes:\n  - name: gpu[1-3]\n    host: 10.0.0.[1-2]\n", 3, "is 3 nodes but host"),
    ("nodes:\n  - name: gpu[1-3\n    host: x\n", 2, "not a valid node name"),
    ("nodes:\n  - {name: a, host: a}\n  - name: gpu[1-3]\n    host: \"{name}\"\n    gpus: -1\n", 5, "gpus"),
    ("nodes:\n  - name: gpu[1-3]\n    host: same\n", 2, "duplicate host"),
    ("nodes:\n  - name: gpu[1-100000000]\n    host: \"{name}\"\n", 2, "100,000,000 nodes"),
])
def test_range_errors_point_at_the_range_line(text, line, words):
    with pytest.raises(InventoryError) as e:
        parse_inventory(text, "x.yaml")
    assert e.value.line == line and words in str(e.value)


def test_the_node_bound_applies_after_expansion():
    text = "nodes:\n" + "".join(f"  - name: r{i}n[1-2000]\n    host: \"{{name}}\"\n" for i in range(3))
    with pytest.raises(InventoryError) as e:
        parse_inventory(text, "x.yaml")
    assert f"more than {MAX_NODES:,} nodes" in str(e.value) and e.value.line == 6


def test_range_size_counts_without_expanding():
    assert range_size("n[1-100000000]") == 100_000_000
    assert range_size("n[1-10/2],m[1-3]") == 8
    assert range_size("n[1-2]-[1-3]") == 6


def test_nodes_option_takes_ranges(tmp_path):
    r = cli("inventory", "check", "--json", "-i", local_range(tmp_path, 4), "--nodes", "n[2-3]")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema("inventory-check"))
    assert [(n["name"], n["rank"]) for n in doc["nodes"]] == [("n2", 0), ("n3", 1)]


# ---------------------------------------------------------------- gathered output


def test_exec_gather_prints_one_header_for_eight_identical_nodes(tmp_path):
    r = cli("exec", "-b", "-i", local_range(tmp_path, 8), "--", "uname -s")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"---------------- n[1-8] (8) ----------------\n{os.uname().sysname}\n"


def test_exec_gather_groups_failures_alike(tmp_path):
    r = cli("exec", "-b", "-i", local_range(tmp_path, 3), "--", "echo v; exit 4")
    assert r.returncode == 4
    assert r.stdout == "---------------- n[1-3] (3) ----------------\nv\n"
    assert r.stderr.strip() == "clusterctl: n[1-3]: exit code 4"


def test_exec_gather_marks_stderr(tmp_path):
    r = cli("exec", "-b", "-i", local_range(tmp_path, 2), "--", "echo oops >&2")
    assert r.returncode == 0 and r.stdout == "---------------- n[1-2] (2) ----------------\nstderr: oops\n"


def test_gatherer_groups_by_whole_output_in_node_order():
    g = Gatherer(["a1", "a2", "a3"])
    g("a3", "stdout", "x")
    g("a1", "stdout", "x")
    g("a2", "stdout", "x")
    g("a2", "stdout", "y")
    assert g.render() == ("---------------- a[1,3] (2) ----------------\nx\n"
                          "---------------- a2 (1) ----------------\nx\ny\n")


# ---------------------------------------------------------------- ansible

INI = """\
# GPU hosts
[gpus]
gpu[01:02] ansible_user=ubuntu
gpu09 ansible_host=10.0.0.9 ansible_port=2222 color="dark blue"

[gpus:vars]
ansible_ssh_private_key_file=~/.ssh/id_gpu
ansible_user=root

[head]
ctl ansible_host=10.0.0.1 ansible_python_interpreter=/usr/bin/python3

[cluster:children]
head
gpus
"""

YAML = """\
all:
  vars: {ansible_user: admin}
  children:
    gpus:
      hosts:
        gpu1: {ansible_host: 10.1.0.1}
        gpu2: {ansible_host: 10.1.0.2, ansible_port: 2200}
"""


def test_ansible_ini_hosts_vars_children_and_ranges():
    inv = parse_inventory(ansible_to_yaml(INI, "hosts.ini", group="cluster"))
    got = [(n.name, n.host, n.ssh.user, n.ssh.port, n.ssh.identity_file, n.python) for n in inv.nodes]
    assert got == [("ctl", "10.0.0.1", None, None, None, "/usr/bin/python3"),
                   ("gpu01", "gpu01", "ubuntu", None, "~/.ssh/id_gpu", "python3"),
                   ("gpu02", "gpu02", "ubuntu", None, "~/.ssh/id_gpu", "python3"),
                   ("gpu09", "10.0.0.9", "root", 2222, "~/.ssh/id_gpu", "python3")]
    text = ansible_to_yaml(INI, "hosts.ini", group="gpus")
    assert "# Ansible variables not used: color" in text
    assert [n.name for n in parse_inventory(text).nodes] == ["gpu01", "gpu02", "gpu09"]


def test_ansible_yaml_with_group_vars():
    inv = parse_inventory(ansible_to_yaml(YAML, "hosts.yml"))
    assert [(n.name, n.host, n.ssh.user, n.ssh.port) for n in inv.nodes] == [
        ("gpu1", "10.1.0.1", "admin", None), ("gpu2", "10.1.0.2", "admin", 2200)]


def test_ansible_unknown_group_and_bad_line_are_user_errors(tmp_path):
    p = tmp_path / "hosts.ini"
    p.write_text(INI)
    r = cli("inventory", "import-ansible", str(p), "--group", "nope")
    assert r.returncode == 2 and "no group 'nope'" in r.stderr and "Traceback" not in r.stderr
    p.write_text("[gpus]\ngpu1 ansible_port\n")
    r = cli("inventory", "import-ansible", str(p))
    assert r.returncode == 2 and f"{p}:2: expected key=value" in r.stderr


# ---------------------------------------------------------------- --json: errors and schemas


@pytest.mark.parametrize("args,code", [
    (["exec", "--json", "-i", "/nonexistent.yaml", "--", "true"], 2),
    (["exec", "--json", "--nodes", "x[1-", "--", "true"], 2),
    (["preflight", "--json", "--only", "nonsense"], 2),
    (["status", "--json", "no-such-run"], 2),
    (["stop", "--json", "no-such-run"], 2),
    (["fetch", "--json", "no-such-run"], 2),
    (["fetch", "--json", "no-such-run", "../x"], 2),
    (["render", "slurm", "--json", "-i", "/nonexistent.yaml"], 2),
    (["setup", "--json"], 2),  # the embedded inventory has no setup: section
])
def test_a_user_error_under_json_is_an_error_object(tmp_path, args, code):
    r = cli(*args, env={"CLUSTERCTL_HOME": str(tmp_path / "home")})
    assert r.returncode == code, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema("error"))
    assert doc["error"]["exit_code"] == code and doc["error"]["message"] in r.stderr


@pytest.mark.parametrize("target,extra", [("slurm", []), ("k8s", ["--image", "img:1"])])
def test_render_json(tmp_path, target, extra):
    r = cli("render", target, "--json", "-i", local_range(tmp_path, 2), *extra)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema("render"))
    assert doc["nodes"] == ["n1", "n2"] and doc["target"] == target and doc["text"]


def test_plan_json():
    r = cli("plan", "--json", "--preset", "nano")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema("plan"))


def test_every_schema_is_a_valid_schema():
    names = sorted(p.stem for p in SCHEMAS.glob("*.json"))
    assert {"exec", "preflight", "train", "tail", "stop", "status", "runs", "top", "sync", "render",
            "inventory-check", "plan", "netbench", "fetch", "error", "setup"} <= set(names)
    for name in names:
        jsonschema.Draft202012Validator.check_schema(schema(name))


# ---------------------------------------------------------------- completion


def complete(words, cword, env=None):
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, _CLUSTERCTL_COMPLETE="bash_complete", COMP_WORDS=words,
                                COMP_CWORD=str(cword), **(env or {})))
    return [ln.split(",", 1)[1] for ln in r.stdout.splitlines() if "," in ln]


def test_completion_of_node_names_and_run_ids(tmp_path):
    inv = local_range(tmp_path, 3)
    assert complete(f"clusterctl exec -i {inv} --nodes ", 5) == ["n[1-3]", "n1", "n2", "n3"]
    assert complete(f"clusterctl exec -i {inv} --nodes n1,n", 5) == ["n1,n1", "n1,n2", "n1,n3"]
    home = tmp_path / "home"
    for rid in ("alpha-1", "beta-2"):
        (home / "runs" / rid).mkdir(parents=True)
        (home / "runs" / rid / "run.json").write_text(json.dumps({"id": rid, "state": "finished", "created": 1}))
    assert complete("clusterctl tail al", 2, {"CLUSTERCTL_HOME": str(home)}) == ["alpha-1"]
    assert set(complete("clusterctl stop ", 2, {"CLUSTERCTL_HOME": str(home)})) == {"alpha-1", "beta-2"}


# ---------------------------------------------------------------- notify


def _ended_run(home, monkeypatch, **rec):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(home))
    from orchestrator.runs.spec import RunSpec
    from orchestrator.runs.store import Run, new_run_id

    run = Run.create(new_run_id("n"), RunSpec(cwd=str(home)))
    write_record(run, **rec)
    return run


def test_notify_gets_the_run_in_its_environment(tmp_path, monkeypatch):
    from orchestrator.runs.notify import notify_end, save_notify

    run = _ended_run(tmp_path, monkeypatch, state="failed", exit_code=3,
                     first_failure={"node": "gpu2", "exit_code": 3, "reason": "exited 3"})
    out = tmp_path / "env.txt"
    save_notify(run, f'env | grep ^CLUSTERCTL_ | sort > {out}; echo "$CLUSTERCTL_FAILURE" >> {out}')
    said = []
    assert notify_end(run, said.append) == 0
    text = out.read_text()
    assert f"CLUSTERCTL_RUN_ID={run.id}\n" in text and "CLUSTERCTL_STATUS=failed\n" in text
    assert "CLUSTERCTL_EXIT_CODE=3\n" in text and text.endswith("gpu2: exited 3 (exit code 3)\n")


def test_notify_failure_and_timeout_are_logged_not_raised(tmp_path, monkeypatch):
    from orchestrator.runs.notify import notify_end, save_notify

    run = _ended_run(tmp_path, monkeypatch, state="finished", exit_code=0)
    save_notify(run, "echo nope; exit 7")
    said = []
    assert notify_end(run, said.append) == 7
    assert any("nope" in s for s in said) and any("exited 7" in s for s in said)
    save_notify(run, "sleep 30")
    said = []
    assert notify_end(run, said.append, timeout=0.5) is None
    assert any("killed" in s for s in said)

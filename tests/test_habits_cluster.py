"""Node ranges, Ansible import, gathered output, every command's --json and --notify on the real
test cluster (4 nodes: a 32-node cluster is too heavy for the shared 2-core test machine, so the
32-node expansion is checked without nodes in test_habits.py)."""

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.cluster

SCHEMAS = Path(__file__).resolve().parent.parent / "orchestrator" / "schemas"
DDP = str(Path(__file__).parent / "scripts" / "ddp_tiny.py")


def schema(name):
    return json.loads((SCHEMAS / f"{name}.json").read_text())


def cli(*args, home, timeout=240):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, CLUSTERCTL_HOME=str(home)))


def json_of(r, name):
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema(name))
    return doc


def json_lines(r, name):
    docs = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
    for d in docs:
        jsonschema.validate(d, schema(name))
    return docs


def range_inventory(cluster, path):
    """The cluster as one range entry: node[1-4] on consecutive addresses."""
    doc = cluster.inventory()
    hosts = [n["host"] for n in doc["nodes"]]
    first, last = ipaddress.ip_address(hosts[0]), ipaddress.ip_address(hosts[-1])
    assert [str(first + i) for i in range(len(hosts))] == hosts
    prefix = hosts[0].rsplit(".", 1)[0]
    doc["nodes"] = [{"name": f"node[1-{len(hosts)}]", "host": f"{prefix}.[{first.packed[-1]}-{last.packed[-1]}]",
                     "gpus": doc["nodes"][0]["gpus"]}]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


@pytest.fixture
def setup(cluster4, tmp_path):
    for n in cluster4.nodes:
        n.run("mkdir -p ~/gpt_train")
    return cluster4, range_inventory(cluster4, tmp_path / "ranged.yaml"), tmp_path / "home"


def test_a_range_inventory_preflights_as_its_nodes_and_nodes_selects(setup):
    cluster, inv, home = setup
    r = cli("preflight", "--json", "-i", inv, "--only", "ssh,gpu_count", home=home)
    doc = json_of(r, "preflight")
    assert [(n["name"], n["rank"], n["host"]) for n in doc["nodes"]] == [
        (nd.name, i, nd.host) for i, nd in enumerate(cluster.nodes)]
    assert r.returncode == 0, r.stdout
    r = cli("preflight", "--json", "-i", inv, "--only", "ssh,gpu_count", "--nodes", "node[2-3]", home=home)
    assert [(n["name"], n["rank"]) for n in json_of(r, "preflight")["nodes"]] == [("node2", 0), ("node3", 1)]


def test_exec_gather_on_the_cluster(setup):
    _, inv, home = setup
    r = cli("exec", "-b", "-i", inv, "--", "uname", "-s", home=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "---------------- node[1-4] (4) ----------------\nLinux\n"
    r = cli("exec", "-b", "-i", inv, "--", "hostname", home=home)
    assert r.stdout.count("----------------") == 8  # every node says its own name: 4 blocks


def ansible_files(cluster, tmp_path):
    inv = cluster.inventory()
    ssh = inv["ssh"]
    ini = ["[gpus]"] + [f"{n['name']} ansible_host={n['host']}" for n in inv["nodes"]]
    ini += ["", "[gpus:vars]", f"ansible_user={ssh['user']}", f"ansible_port={ssh['port']}",
            f"ansible_ssh_private_key_file={ssh['identity_file']}", f"ansible_python_interpreter={inv['python']}"]
    (tmp_path / "hosts.ini").write_text("\n".join(ini) + "\n")
    yml = {"all": {"children": {"gpus": {
        "hosts": {n["name"]: {"ansible_host": n["host"]} for n in inv["nodes"]},
        "vars": {"ansible_user": ssh["user"], "ansible_port": ssh["port"],
                 "ansible_ssh_private_key_file": ssh["identity_file"],
                 "ansible_python_interpreter": inv["python"]}}}}}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(yml))
    return [tmp_path / "hosts.ini", tmp_path / "hosts.yml"]


def test_ansible_inventories_import_and_preflight(setup, tmp_path):
    cluster, _, home = setup
    for src in ansible_files(cluster, tmp_path):
        out = tmp_path / f"{src.name}.clusterctl.yaml"
        r = cli("inventory", "import-ansible", str(src), "--group", "gpus", "-o", str(out), home=home)
        assert r.returncode == 0, r.stderr
        doc = yaml.safe_load(out.read_text())
        doc["ssh"]["known_hosts"] = str(cluster.known_hosts)  # Ansible keeps host keys elsewhere
        out.write_text(yaml.safe_dump(doc))
        r = cli("preflight", "--json", "-i", str(out), "--only", "ssh,gpu_count", home=home)
        got = json_of(r, "preflight")
        assert r.returncode == 0, r.stdout
        assert [(n["name"], n["rank"]) for n in got["nodes"]] == [(nd.name, i) for i, nd in enumerate(cluster.nodes)]


def env_file(path):
    return dict(ln.split("=", 1) for ln in path.read_text().splitlines() if "=" in ln)


def test_train_json_and_notify_for_a_run_that_succeeds_and_one_that_fails(setup, tmp_path):
    _, inv, home = setup
    note = tmp_path / "note.env"
    notify = f"env | grep ^CLUSTERCTL_ > {note}"
    r = cli("train", "--json", "-i", inv, "--nodes", "node[1-2]", "--skip-preflight", "--notify", notify,
            "--", DDP, "--steps", "2", home=home)
    assert r.returncode == 0, r.stderr
    docs = json_lines(r, "train")
    end = docs[-1]
    assert end["event"] == "end" and end["ok"] and end["state"] == "finished"
    assert {(d["node"], d["rank"]) for d in docs[:-1] if d["line"].startswith("rank ")} == {
        ("node1", 0), ("node1", 1), ("node2", 2), ("node2", 3)}  # 2 GPUs each: 2 processes per node
    assert {k: v for k, v in env_file(note).items() if k != "CLUSTERCTL_HOME"} | {"CLUSTERCTL_RUN_ID": ""} == {
        "CLUSTERCTL_RUN_ID": "", "CLUSTERCTL_STATUS": "finished", "CLUSTERCTL_EXIT_CODE": "0", "CLUSTERCTL_FAILURE": ""}
    assert env_file(note)["CLUSTERCTL_RUN_ID"] == end["run_id"]
    ok_id = end["run_id"]

    note.unlink()
    r = cli("train", "--json", "-i", inv, "--nodes", "node[1-2]", "--skip-preflight", "--notify", notify,
            "--", DDP, "--steps", "20", "--fail-rank", "3", home=home)
    end = json_lines(r, "train")[-1]
    assert r.returncode == end["exit_code"] != 0, r.stderr
    assert not end["ok"] and end["state"] == "failed"
    env = env_file(note)
    assert env["CLUSTERCTL_STATUS"] == "failed" and env["CLUSTERCTL_EXIT_CODE"] == str(end["exit_code"])
    assert env["CLUSTERCTL_FAILURE"].startswith("node2") and env["CLUSTERCTL_RUN_ID"] == end["run_id"]

    # the other run commands, on these records
    docs = json_lines(cli("tail", "--json", "--no-follow", ok_id, home=home), "tail")
    assert docs[-1]["run_id"] == ok_id and any(d.get("line", "").startswith("rank 1") for d in docs)
    assert json_of(cli("status", "--json", ok_id, home=home), "status")["id"] == ok_id
    assert [x["id"] for x in json_of(cli("runs", "--json", home=home), "runs")][-2] == ok_id
    r = cli("stop", "--json", ok_id, home=home)
    assert r.returncode == 0 and json_of(r, "stop")["state"] == "finished"


def test_node_commands_json_follow_their_schemas(setup, tmp_path):
    _, inv, home = setup
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    doc = yaml.safe_load(Path(inv).read_text())
    doc["workdir"] = "~/habits_sync"  # not the shared cluster's ~/gpt_train, which sync would mirror src into
    synced = tmp_path / "synced.yaml"
    synced.write_text(yaml.safe_dump(doc))
    r = cli("sync", "--json", "-i", str(synced), "--src", str(src), home=home)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json_of(r, "sync")["ok"]
    r = cli("top", "--once", "--json", "-i", inv, home=home)
    assert r.returncode == 0 and len(json_of(r, "top")["nodes"]) == 4
    r = cli("exec", "--json", "-i", inv, "--nodes", "node[3-4]", "--", "hostname", home=home)
    doc = json_of(r, "exec")
    assert [(n["name"], n["rank"], n["stdout"].strip()) for n in doc["nodes"]] == [("node3", 0, "node3"),
                                                                                 ("node4", 1, "node4")]
    r = cli("netbench", "--json", "-i", inv, "--nodes", "node[1-2]", "--seconds", "0.3", "--iters", "1", home=home)
    assert r.returncode == 0, r.stderr
    json_of(r, "netbench")
    r = cli("exec", "--json", "-i", inv, "--nodes", "node9", "--", "true", home=home)
    assert r.returncode == 2 and "node9" in json_of(r, "error")["error"]["message"]

"""Preflight on the real test cluster: each check fails for its real cause on exactly the right
node, and nothing fails on the healthy ones.

One 4-node cluster for the module (faults are repaired by each test), so the whole file runs
in seconds after the cluster is up."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.inventory import parse_inventory
from orchestrator.checks.preflight import _probe_command, run_preflight
from orchestrator.checks.registry import CHECKS, probe_script
from orchestrator.checks.firewall import parse_firewall
from orchestrator.checks import Ctx
from orchestrator.transport import Cluster
from tests.cluster import TestCluster, require_root
from tests.conftest import cmdline, scan, wait_for

pytestmark = pytest.mark.cluster

CODE = "print('train')\n"


@pytest.fixture(scope="module")
def cl():
    require_root()
    with TestCluster(n=4, gpus=2, name_prefix="ccpf") as cluster:
        for nd in cluster.nodes:
            write_code(nd)
        yield cluster


def write_code(nd, text=CODE):
    nd.run(f"mkdir -p ~/gpt_train && printf %s {text!r} > ~/gpt_train/train.py && "
           "printf 'data/\\n' > ~/gpt_train/.gitignore")


def inventory(cl, **over):
    doc = cl.inventory(checks={"disk_min_gb": 0.1}, **over)
    return parse_inventory(yaml.safe_dump(doc), "<test>")


# The test nodes have fake NVIDIA GPUs and this venv's CPU torch: python_env fails there by
# design (test_python_env_needs_a_cuda_torch_on_gpu_nodes); the other tests leave it out.
NOT_ENV = [c for c in CHECKS if c != "python_env"]


def preflight(cl, inv=None, checks=NOT_ENV):
    inv = inv or inventory(cl)
    with Cluster(inv) as c:
        report = run_preflight(c, inv, checks)
        assert c.handshakes == len(c.connections)  # one handshake per reachable node, never two
    return report


def bad(report, statuses=("fail",)):
    return {(n.node.name, r.check) for n in report.nodes for r in n.results.values() if r.status in statuses}


def result(report, node, check):
    return next(n for n in report.nodes if n.node.name == node).results[check]


def test_healthy_cluster_all_ok_one_handshake_per_node(cl, tmp_path, capsys):
    path = cl.write_inventory(tmp_path / "nodes.yaml", checks={"disk_min_gb": 0.1})
    inv = parse_inventory(path.read_text(), str(path))
    with Cluster(inv) as c:
        report = run_preflight(c, inv)
        assert c.handshakes == 4
    # everything ok but python_env: a CPU torch cannot drive the (fake) NVIDIA GPUs
    assert bad(report, ("fail", "warn")) == {(f"node{i}", "python_env") for i in range(1, 5)}, report.to_json()
    env = result(report, "node1", "python_env")
    assert "CPU-only build" in env.detail and "https://download.pytorch.org/whl/cu12x" in env.remedy
    assert report.gpus_found == {f"node{i}": 2 for i in range(1, 5)}
    assert "rank 0-1 → node1" in report.rank_map() and "world size 8" in report.rank_map()
    assert result(report, "node2", "port_reachable").status == "ok"
    assert "4/4" not in result(report, "node1", "port_reachable").detail  # 3 workers
    # the command compares code_sync with what `sync` would push from here: the nodes' code
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text(cl.nodes[0].run("cat ~/gpt_train/train.py").stdout)
    (tmp_path / "code" / ".gitignore").write_text("data/\n")
    path = cl.write_inventory(tmp_path / "nodes.yaml", checks={"disk_min_gb": 0.1}, sync={"src": "code"})
    rc = main(["preflight", "-i", str(path), "--json", "--skip", "python_env"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"] is True, [(n["name"], c) for n in doc["nodes"] for c in n["checks"] if c["status"] != "ok"]
    assert [n["name"] for n in doc["nodes"]] == ["node1", "node2", "node3", "node4"]
    assert [c["check"] for c in doc["nodes"][0]["checks"]] == NOT_ENV
    # the listener is gone: nothing of ours left listening on the master (sshd may still be
    # reaping the session that ran it, so this waits for the condition rather than asserting at once)
    wait_for(lambda: not [p for p, (cmd, name, conns) in scan(cl.processes(cl.nodes[0]),
                                                              lambda p: (cmdline(p), p.name(), p.net_connections()))
                          if "portlisten" in cmd or (name.startswith("python") and any(x.laddr.port == 29500
                                                                                    for x in conns))],
             5, "the port listener to be gone from the master")


def test_train_subset_reuses_connections(cl):
    inv = inventory(cl)
    with Cluster(inv) as c:
        r1 = run_preflight(c, inv, ["ssh", "gpu_count", "port_free", "port_reachable", "code_sync"])
        r2 = run_preflight(c, inv, ["gpu_count"])
        assert c.handshakes == 4
    assert r1.ok and r2.ok
    assert [x for x in r1.nodes[0].results] == ["ssh", "gpu_count", "port_free", "port_reachable", "code_sync"]


def test_clock_skew_on_one_node(cl):
    nd = cl.nodes[2]
    nd.set_clock_skew(30)
    try:
        report = preflight(cl)
    finally:
        nd.set_clock_skew(0)
    assert bad(report) == {("node3", "clock_skew")}
    skew = re.match(r"([+-][\d.]+)s ", result(report, "node3", "clock_skew").detail)
    assert skew and abs(float(skew.group(1)) - 30) < 1, result(report, "node3", "clock_skew").detail  # 29.985 is 30
    assert "timedatectl" in result(report, "node3", "clock_skew").remedy


def test_clock_skew_warn_threshold(cl):
    nd = cl.nodes[1]
    nd.set_clock_skew(-2.5)
    try:
        report = preflight(cl, checks=["clock_skew"])
    finally:
        nd.set_clock_skew(0)
    assert bad(report, ("fail", "warn")) == {("node2", "clock_skew")}
    assert result(report, "node2", "clock_skew").status == "warn"


def test_fewer_gpus_than_inventory(cl):
    nd = cl.nodes[1]
    inv = inventory(cl)  # says 2 GPUs everywhere
    nd.set_gpus(1)
    try:
        report = preflight(cl, inv)
    finally:
        nd.set_gpus(2)
    assert bad(report) == {("node2", "gpu_count")}
    r = result(report, "node2", "gpu_count")
    assert "1 GPU" in r.detail and "gpus: 1" in r.remedy
    # the inventory's gpus: decides the processes (what train would launch); gpu_count fails on it
    assert report.gpus_found["node2"] == 1 and "rank 2-3 → node2" in report.rank_map()


def test_gpu_held_by_leftover_process(cl):
    nd = cl.nodes[3]
    nd.set_gpus(2, processes=[(4242, "python", 30000, 1)])
    try:
        report = preflight(cl, checks=["gpu_count", "gpu_idle"])
    finally:
        nd.set_gpus(2)
    assert bad(report) == {("node4", "gpu_idle")}
    assert "pid 4242" in result(report, "node4", "gpu_idle").detail
    assert "GPU 1" in result(report, "node4", "gpu_idle").detail


def test_gpu_memory_held_by_a_process_the_node_cannot_see(cl):
    nd = cl.nodes[2]
    nd.set_gpus(2, memory_used=30000)  # no process listed: another container's job
    try:
        report = preflight(cl, checks=["gpu_count", "gpu_idle"])
    finally:
        nd.set_gpus(2)
    assert bad(report, ("fail", "warn")) == {("node3", "gpu_idle")}
    r = result(report, "node3", "gpu_idle")
    assert r.status == "warn" and "GPU 0 30000 MiB" in r.detail and "GPU 1 30000 MiB" in r.detail


def test_idle_gpus_cost_one_nvidia_smi(cl):
    # the process list is only asked for when some GPU has memory in use
    nd = cl.nodes[1]
    inv = inventory(cl)
    cmd = _probe_command(inv, inv.nodes[1], ["gpu_count", "gpu_idle"], 0)
    probe = probe_script(["gpu_count", "gpu_idle"]).decode()
    idle = nd.run(cmd, input=probe).stdout
    nd.set_gpus(2, processes=[(4242, "python", 30000, 1)])
    try:
        busy = nd.run(cmd, input=probe).stdout
    finally:
        nd.set_gpus(2)
    assert "@@nvidia-gpus" in idle and "@@nvidia-apps" not in idle
    assert "@@nvidia-apps" in busy and "4242" in busy


def test_ufw_is_not_run_by_a_user_without_root(cl):
    # the test user has no sudo: ufw could only say "need root", so its config is read instead
    nd = cl.nodes[1]
    ufw, ran = nd.bin_dir / "ufw", nd.bin_dir / "ufw-ran"
    ufw.write_text(f"#!/bin/sh\ntouch {ran}\necho 'Status: active'\n")
    ufw.chmod(0o755)
    nd.bin_dir.chmod(0o777)  # so the fake, run as the test user, could leave its mark
    inv = inventory(cl)
    try:
        out = nd.run(_probe_command(inv, inv.nodes[1], ["firewall"], 0),
                     input=probe_script(["firewall"]).decode()).stdout
        report = preflight(cl, inv, ["firewall"])
    finally:
        ufw.unlink()
        nd.bin_dir.chmod(0o755)
    assert "@@ufw-conf" in out and "@@ufw\n" not in out
    assert not ran.exists()
    assert result(report, "node2", "firewall").status in ("ok", "skip")


def test_iptables_drop_on_master_port(cl):
    master = cl.nodes[0]
    rule = ["INPUT", "-p", "tcp", "--dport", "29500", "-j", "DROP"]
    master.iptables("-A", *rule)
    try:
        report = preflight(cl)
        # no worker got through, so the temporary listener waited: it must still be gone when
        # preflight returns (train binds the port next)
        left = master.run(["ss", "-Hltn", "sport = :29500"], as_user=False).stdout
        # the firewall check names the rule when it may read it (root on the node)
        out = master.run(["sh", "-s", "--", "firewall", "~/gpt_train", "~/gpt_train/runs", "29500", "eth0",
                          master.host, "master", sys.executable, "0"], as_user=False,
                         input=probe_script(["firewall"]).decode()).stdout
    finally:
        master.iptables("-D", *rule)
    assert left.strip() == "", left
    assert bad(report) == {("node1", "port_reachable")}
    m = result(report, "node1", "port_reachable")
    assert "timed out" in m.detail and "29500" in m.remedy
    assert {result(report, w, "port_reachable").status for w in ("node2", "node3", "node4")} == {"warn"}
    assert report.asked_again == []  # a timeout is the DROP's answer: never asked again
    inv = inventory(cl)
    fw = parse_firewall(out, Ctx(node=inv.nodes[0], inventory=inv, is_master=True))
    assert fw.status == "warn" and "29500" in fw.detail, (fw, out)


def test_a_reject_rule_is_refused_on_every_try_and_still_fails(cl):
    """A refusal is asked again (the listener may have been late), but a REJECT rule refuses
    every time: the workers are probed twice more and port_reachable still fails."""
    master = cl.nodes[0]
    rule = ["INPUT", "-p", "tcp", "--dport", "29500", "-j", "REJECT", "--reject-with", "tcp-reset"]
    master.iptables("-A", *rule)
    try:
        report = preflight(cl, checks=["ssh", "port_free", "port_reachable"])
    finally:
        master.iptables("-D", *rule)
    assert report.asked_again == [["node2", "node3", "node4"]] * 2
    assert bad(report) == {("node1", "port_reachable")}
    assert "refused" in result(report, "node1", "port_reachable").detail
    assert "(the same on 3 tries)" in result(report, "node2", "port_reachable").detail


def test_a_relaunch_on_a_subset_probes_its_own_master_as_the_master(cl):
    """A relaunch runs preflight on a subset of the run's Cluster (a spare in the lost master's
    place): the subset's first node is the master there, whatever its rank in the Cluster."""
    full = inventory(cl)
    sub = full.select(["node2", "node3", "node4"])
    assert sub.master.name == "node2" and full.node("node2").rank == 1
    with Cluster(full) as c:
        report = run_preflight(c, sub, ["port_free", "port_reachable"])
    assert bad(report, ("fail", "warn")) == set(), report.to_json()
    assert result(report, "node2", "port_free").status == "ok"
    assert result(report, "node2", "port_reachable").detail == "2/2 workers connected to 29500"
    assert report.asked_again == []


def test_a_probe_that_could_not_answer_is_asked_again_and_passes(cl):
    """ss fails on the master's first probe only (as when it cannot open its netlink socket):
    the master is probed once more and its answer stands."""
    master = cl.nodes[0]
    fake = master.bin_dir / "ss"
    fake.write_text('#!/bin/sh\nonce="$HOME/.ss-failed-once"\n'
                    'if [ ! -e "$once" ]; then : > "$once"; echo "Cannot open netlink socket" >&2; exit 1; fi\n'
                    'exec /usr/bin/ss "$@"\n')
    fake.chmod(0o755)
    try:
        report = preflight(cl, checks=["ssh", "gpu_count", "port_free", "port_reachable"])
    finally:
        fake.unlink()
        master.run("rm -f ~/.ss-failed-once")
    assert report.asked_again == [["node1"]]
    assert bad(report, ("fail", "warn")) == set(), report.to_json()
    assert result(report, "node1", "port_free").detail == "nothing else listens on 29500"


def test_process_already_listening_on_master_port(cl):
    master = cl.nodes[0]
    p = master.popen([sys.executable, "-c", "import socket,time; s=socket.socket(); "
                      "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 29500)); "
                      "s.listen(); print('up', flush=True); time.sleep(60)"], stdout=-1, stderr=-1)
    try:
        assert p.stdout.readline().strip() == b"up", p.stderr.read() if p.stderr else ""
        report = preflight(cl)
        pids = {x.pid for x, cmd in scan(cl.processes(master)) if "time.sleep(60)" in cmd}
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert bad(report) == {("node1", "port_free")}
    r = result(report, "node1", "port_free")
    assert any(f"pid {pid}" in r.detail for pid in pids), (r, pids)
    assert "kill" in r.remedy


def test_worker_with_different_workdir(cl):
    nd = cl.nodes[2]
    write_code(nd, "print('changed')\n")
    nd.run("mkdir -p ~/gpt_train/data && echo big > ~/gpt_train/data/x")  # ignored: no effect
    try:
        report = preflight(cl)
    finally:
        write_code(nd)
    assert bad(report) == {("node3", "code_sync")}
    assert "sync" in result(report, "node3", "code_sync").remedy


def test_ignored_files_do_not_count(cl):
    nd = cl.nodes[1]
    nd.run("mkdir -p ~/gpt_train/data && echo big > ~/gpt_train/data/x")
    try:
        report = preflight(cl, checks=["code_sync"])
    finally:
        nd.run("rm -rf ~/gpt_train/data")
    assert report.ok


def test_worker_with_different_torch(cl):
    nd = cl.nodes[3]
    nd.run("mkdir -p ~/fake/torch && echo \"__version__ = '2.0.0'\" > ~/fake/torch/version.py && "
           "touch ~/fake/torch/__init__.py && "
           f"printf '#!/bin/sh\\nPYTHONPATH=$HOME/fake exec {sys.executable} \"$@\"\\n' > ~/fakepy && "
           "chmod +x ~/fakepy")
    doc = cl.inventory(checks={"disk_min_gb": 0.1})
    doc["nodes"][3]["python"] = "~/fakepy"
    for nd_doc in doc["nodes"]:
        nd_doc["gpus"] = 0  # CPU nodes: a CPU torch is right, only the versions differ
    report = preflight(cl, parse_inventory(yaml.safe_dump(doc), "<t>"), ["python_env"])
    assert bad(report) == {("node4", "python_env")}
    r = result(report, "node4", "python_env")
    assert "torch 2.0.0" in r.detail and "2.13" in r.detail


def test_missing_python_is_a_python_env_finding(cl):
    doc = cl.inventory(checks={"disk_min_gb": 0.1})
    doc["nodes"][1]["python"] = "/nonexistent/python3"
    for nd_doc in doc["nodes"]:
        nd_doc["gpus"] = 0  # CPU nodes: a CPU torch is right (gpu_count only warns)
    report = preflight(cl, parse_inventory(yaml.safe_dump(doc), "<t>"), ["python_env", "code_sync", "gpu_count"])
    assert bad(report) == {("node2", "python_env")}
    assert result(report, "node2", "code_sync").status == "skip"


def test_stopped_sshd(cl):
    nd = cl.nodes[1]
    nd.stop_sshd()
    try:
        report = preflight(cl)
    finally:
        nd.start_sshd()
    assert bad(report) == {("node2", "ssh")}
    n2 = next(n for n in report.nodes if n.node.name == "node2")
    assert "refused" in n2.results["ssh"].detail
    assert n2.results["ping"].status == "ok"  # the host is up, only sshd is gone
    assert {r.status for c, r in n2.results.items() if c not in ("ssh", "ping")} == {"skip"}
    assert report.gpus_found["node2"] is None


def test_missing_iface(cl):
    doc = cl.inventory(checks={"disk_min_gb": 0.1})
    doc["nodes"][2]["iface"] = "eth9"
    report = preflight(cl, parse_inventory(yaml.safe_dump(doc), "<t>"))
    assert bad(report) == {("node3", "iface")}
    assert "eth9 does not exist" in result(report, "node3", "iface").detail


def test_only_skip_and_exit_codes(cl, tmp_path, capsys):
    path = cl.write_inventory(tmp_path / "nodes.yaml")
    assert main(["preflight", "-i", str(path), "--only", "ssh,bogus"]) == 2
    assert main(["preflight", "-i", str(path), "--only", "gpu_count,iface", "--skip", "iface", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["check"] for c in doc["nodes"][0]["checks"]] == ["gpu_count"]
    cl.nodes[3].set_gpus(1)
    try:
        assert main(["preflight", "-i", str(path), "--only", "gpu_count"]) == 1
    finally:
        cl.nodes[3].set_gpus(2)
    out = capsys.readouterr().out
    assert "gpus: 1" in out and "node4" in out


def fake_torch(nd, name, version_py, dist_info=None):
    """~/NAME: a python that finds a torch/version.py of our own first (what nodeinfo reads)."""
    nd.run(f"mkdir -p ~/{name}-site/torch && printf %b {version_py!r} > ~/{name}-site/torch/version.py && "
           f"touch ~/{name}-site/torch/__init__.py"
           + (f" && mkdir -p ~/{name}-site/{dist_info}" if dist_info else "")
           + f" && printf '#!/bin/sh\\nPYTHONPATH=$HOME/{name}-site exec {sys.executable} \"$@\"\\n' > ~/{name} && "
           f"chmod +x ~/{name}")


def test_python_env_needs_a_cuda_torch_on_gpu_nodes(cl):
    report = preflight(cl, checks=["gpu_count", "python_env"])
    assert bad(report) == {(f"node{i}", "python_env") for i in range(1, 5)}
    r = result(report, "node3", "python_env")
    assert "CPU-only build" in r.detail and "2 NVIDIA GPUs" in r.detail
    assert "--index-url https://download.pytorch.org/whl/cu12x" in r.remedy and "gpus: 0" in r.remedy
    # a CUDA build with the pip NCCL on every node passes (torch's version file, as a wheel has it)
    for nd in cl.nodes:
        fake_torch(nd, "cudapy", "__version__ = '2.13.0+cu126'\ncuda = '12.6'\nhip = None\n",
                   "nvidia_nccl_cu12-2.26.2.dist-info")
    good = preflight(cl, inventory(cl, python="~/cudapy"), ["gpu_count", "python_env"])
    assert good.ok, good.to_json()
    assert "cuda 12.6 nccl 2.26.2" in result(good, "node2", "python_env").detail
    # the same CPU torch on a node declared a CPU node (gpus: 0) is right
    doc = cl.inventory(checks={"disk_min_gb": 0.1})
    doc["nodes"][1]["gpus"] = 0
    cpu = preflight(cl, parse_inventory(yaml.safe_dump(doc), "<t>"), ["gpu_count", "python_env"])
    assert result(cpu, "node2", "python_env").status == "ok"
    g = result(cpu, "node2", "gpu_count")
    assert g.status == "warn" and "one CPU process" in g.detail


def test_small_dev_shm_on_one_node(cl):
    nd = cl.nodes[1]
    nd.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", "/dev/shm"], as_user=False)
    try:
        report = preflight(cl, checks=["shm"])
    finally:
        nd.run(["umount", "/dev/shm"], as_user=False)
    assert bad(report, ("fail", "warn")) == {("node2", "shm")}
    r = result(report, "node2", "shm")
    assert r.status == "fail" and "64 MiB" in r.detail and "--shm-size" in r.remedy


def test_read_only_output_dir_fails_preflight_and_train_refuses(cl, tmp_path, monkeypatch):
    nd = cl.nodes[2]
    nd.run("mkdir -p ~/gpt_train/runs && chmod 555 ~/gpt_train/runs")
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "cchome"))
    path = cl.write_inventory(tmp_path / "nodes.yaml", checks={"disk_min_gb": 0.1})
    try:
        report = preflight(cl, checks=["output_dir"])
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(path), "--",
                            "train.py"], capture_output=True, text=True, timeout=120, env=os.environ.copy())
        left = [cmd for x in cl.nodes for _, cmd in scan(cl.processes(x)) if "train.py" in cmd]
    finally:
        nd.run("chmod 755 ~/gpt_train/runs && rm -rf ~/gpt_train/runs")  # other checks may have left their marker
    assert bad(report) == {("node3", "output_dir")}
    f = result(report, "node3", "output_dir")
    assert "Permission denied" in f.detail and "gpt_train/runs" in f.detail
    assert r.returncode == 1, r.stdout + r.stderr
    assert "output_dir" in r.stderr and "node3" in r.stderr and "nothing was started" in r.stderr
    assert "torch.distributed.run" not in r.stderr and not left

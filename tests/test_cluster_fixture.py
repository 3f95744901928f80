"""The test cluster itself: real OpenSSH on network namespaces, and every fault it can inject."""

import os
import subprocess
import time

import psutil
import pytest

from tests.cluster import TestCluster, host
from tests.conftest import scan

pytestmark = pytest.mark.cluster


def ssh(cluster, node, *cmd, timeout=20, connect_timeout=3):
    return subprocess.run(cluster.ssh_argv(node, *cmd, connect_timeout=connect_timeout),
                          capture_output=True, text=True, timeout=timeout)


def test_plain_openssh_reaches_every_node_by_its_hostname(cluster4):
    for node in cluster4.nodes:
        out = ssh(cluster4, node, "hostname")
        assert out.returncode == 0, out.stderr
        assert out.stdout == f"{node.name}\n"
    assert [n.host for n in cluster4.nodes] == [n.host for n in sorted(
        cluster4.nodes, key=lambda n: tuple(map(int, n.host.split("."))))]


def test_session_gets_node_path_own_home_and_fast_name_lookups(cluster4):
    node = cluster4.nodes[1]
    out = ssh(cluster4, node, "echo $PATH; pwd; getent hosts node1 control; "
              "start=$(date +%s%N); getent hosts no-such-host; echo rc=$?; "
              "echo $(( ($(date +%s%N) - start) / 1000000 ))")
    path, home, node1, control, rc, lookup_ms = out.stdout.splitlines()
    assert path.split(":")[0] == str(node.bin_dir)
    assert home == f"/home/{cluster4.user}"
    assert node1.split() == [cluster4.nodes[0].host, "node1"]
    assert control.split() == [cluster4.host_ip, "control"]
    assert rc == "rc=2"
    assert int(lookup_ms) < 500  # an unknown name fails at once, never waits on a resolver


def test_each_node_has_its_own_home_at_the_same_path(cluster4):
    a, b = cluster4.nodes[:2]
    a.run("mkdir -p ~/gpt_train && echo from-a > ~/gpt_train/marker")
    assert (a.home / "gpt_train" / "marker").read_text() == "from-a\n"
    assert b.run("cat ~/gpt_train/marker", check=False).returncode != 0
    assert ssh(cluster4, a, "cat gpt_train/marker").stdout == "from-a\n"
    a.run("rm -rf ~/gpt_train")


def test_fake_nvidia_smi_answers_like_the_real_one(cluster4):
    node = cluster4.nodes[0]
    query = ("nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,utilization.gpu,"
             "temperature.gpu,power.draw --format=csv,noheader,nounits")
    lines = ssh(cluster4, node, query).stdout.splitlines()
    assert len(lines) == 2
    fields = lines[0].split(", ")
    assert fields[:2] == ["0", "NVIDIA H100 80GB HBM3"]
    # the recorded idle H100 (tests/fixtures/gpus/nvidia_query_gpu_h100_590_idle.csv)
    assert fields[2].startswith("GPU-") and fields[3:] == ["81559", "0", "0", "41", "69.85"]
    listed = ssh(cluster4, node, "nvidia-smi --list-gpus").stdout.splitlines()
    assert listed[1] == f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {lines[1].split(', ')[2]})"
    with_units = ssh(cluster4, node, "nvidia-smi --query-gpu=memory.used,name --format=csv")
    assert with_units.stdout.splitlines()[:2] == ["memory.used [MiB], name",
                                                  "0 MiB, NVIDIA H100 80GB HBM3"]
    assert "NVIDIA-SMI" in ssh(cluster4, node, "nvidia-smi").stdout
    apps = "nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits"
    assert ssh(cluster4, node, apps).stdout == ""


def test_set_gpus_reports_processes_and_zero_gpus_means_no_nvidia_smi(make_cluster):
    cluster = make_cluster(2, gpus=[8, 0])
    a, b = cluster.nodes
    a.set_gpus(4, processes=[(4242, "python train.py", 2048, 3)])
    apps = a.run("nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid "
                 "--format=csv,noheader,nounits").stdout.strip().split(", ")
    uuids = a.run("nvidia-smi --query-gpu=uuid,memory.used --format=csv,noheader,nounits").stdout
    assert apps[:3] == ["4242", "python train.py", "2048"]
    assert uuids.splitlines()[3] == f"{apps[3]}, 2048"
    assert ssh(cluster, b, "command -v nvidia-smi").returncode == 1


def test_test_user_python_imports_torch_on_a_node(cluster4):
    out = ssh(cluster4, cluster4.nodes[3],
              f"{cluster4.python} -c 'import os, torch; print(os.getuid(), torch.__version__)'",
              timeout=60)
    assert out.returncode == 0, out.stderr
    uid, version = out.stdout.split()
    assert int(uid) == cluster4.pw.pw_uid != 0 and version


def test_nodes_reach_each_other(cluster4):
    out = cluster4.nodes[1].run(["ping", "-c1", "-W2", "node1"], check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # and a real TCP connection from node2 to node1's sshd
    probe = f"exec 3<>/dev/tcp/{cluster4.nodes[0].host}/22 && head -c 7 <&3"
    assert cluster4.nodes[1].run(probe, timeout=10).stdout == "SSH-2.0"


def test_stop_sshd_refuses_connections_and_start_restores(make_cluster):
    cluster = make_cluster(2)
    node = cluster.nodes[0]
    node.stop_sshd()
    out = ssh(cluster, node, "true")
    assert out.returncode == 255 and "refused" in out.stderr
    assert ssh(cluster, cluster.nodes[1], "hostname").stdout == "node2\n"
    node.start_sshd()
    assert ssh(cluster, node, "hostname").stdout == "node1\n"


def test_link_down_makes_a_node_unreachable_and_link_up_restores(make_cluster):
    cluster = make_cluster(2)
    node = cluster.nodes[0]
    node.link_down()
    t0 = time.monotonic()
    out = ssh(cluster, node, "true", connect_timeout=2)
    assert out.returncode == 255 and time.monotonic() - t0 < 10
    assert cluster.nodes[1].run(["ping", "-c1", "-W1", node.host], check=False).returncode != 0
    node.link_up()
    assert ssh(cluster, node, "hostname", connect_timeout=5).stdout == "node1\n"


def test_iptables_drop_inside_a_node(make_cluster):
    cluster = make_cluster(1)
    node = cluster.nodes[0]
    node.iptables("-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "DROP")
    assert "dpt:22" in node.iptables("-L", "INPUT", "-n").stdout
    out = ssh(cluster, node, "true", connect_timeout=2)
    assert out.returncode == 255 and "timed out" in out.stderr
    node.iptables("-F", "INPUT")
    assert ssh(cluster, node, "hostname").stdout == "node1\n"


def test_clock_skew_shows_over_ssh_and_can_be_removed(make_cluster):
    cluster = make_cluster(2)
    node = cluster.nodes[0]
    node.set_clock_skew(3600)
    skewed = int(ssh(cluster, node, "date +%s").stdout) - time.time()
    assert 3590 < skewed < 3610
    assert abs(int(ssh(cluster, cluster.nodes[1], "date +%s").stdout) - time.time()) < 5
    assert abs(int(node.run("date +%s").stdout) - time.time() - 3600) < 10
    node.set_clock_skew(0)
    assert abs(int(ssh(cluster, node, "date +%s").stdout) - time.time()) < 5


def test_tc_shaping_is_applied_both_ways(make_cluster):
    cluster = make_cluster(1)
    node = cluster.nodes[0]
    node.shape(rate="8mbit", burst="32kb", latency="100ms")
    inside = node.run(["tc", "qdisc", "show", "dev", "eth0"], as_user=False).stdout
    outside = host.run(["tc", "qdisc", "show", "dev", node.veth]).stdout
    assert "tbf" in inside and "rate 8Mbit" in inside
    assert "tbf" in outside and "rate 8Mbit" in outside
    # 1 MB through an 8 Mbit/s link takes about a second
    t0 = time.monotonic()
    out = ssh(cluster, node, "head -c 1000000 /dev/zero", timeout=30)
    assert len(out.stdout) == 1000000 and time.monotonic() - t0 > 0.7
    node.unshape()
    assert "tbf" not in node.run(["tc", "qdisc", "show", "dev", "eth0"], as_user=False).stdout


def test_processes_are_found_per_node_and_teardown_leaves_nothing(make_cluster):
    cluster = make_cluster(2)
    a, b = cluster.nodes
    ssh(cluster, a, "nohup sleep 300 >/dev/null 2>&1 &")
    def cmdlines():
        return [argv for _, argv in scan(cluster.processes(a), lambda p: p.cmdline())]

    # nohup is seen for a moment before it execs sleep; wait for the exec, not just a process
    deadline = time.monotonic() + 10
    while cmdlines() != [["sleep", "300"]] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cmdlines() == [["sleep", "300"]]
    assert cluster.processes(b) == []
    pids = [p.pid for p in cluster.processes(a)]
    names = [n.ns for n in cluster.nodes]
    cluster.close()
    assert not any(alive(pid) for pid in pids)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in netns for name in names)
    assert not os.path.exists(f"/sys/class/net/{cluster.bridge}")
    assert not any(os.path.exists(f"/etc/netns/{name}") for name in names)
    assert not cluster.base_dir.exists()


def test_own_pids_give_each_node_its_own_proc_and_an_init_that_reaps(make_cluster):
    """own_pids (bench/bench_scale.py's): a node's /proc shows its own processes alone, as a real
    machine's; an orphan that ends is reaped by the node's init, never left a zombie; sshd stops
    and starts as on any node; and closing the cluster leaves nothing of a node behind."""
    cluster = make_cluster(2, own_pids=True)
    a, b = cluster.nodes
    ssh(cluster, a, "nohup sleep 300 >/dev/null 2>&1 &")
    deadline = time.monotonic() + 10
    while ["sleep", "300"] not in [argv for _, argv in scan(cluster.processes(a), lambda p: p.cmdline())]:
        assert time.monotonic() < deadline, "sleep 300 never started on node1"
        time.sleep(0.05)
    assert "sleep 300" in ssh(cluster, a, "ps -eo args").stdout
    assert "sleep 300" not in ssh(cluster, b, "ps -eo args").stdout
    # an orphan that ends: its parent exits first, it is handed to the node's init, which reaps it
    ssh(cluster, a, "sh -c '(sleep 0.3; exit 0) & exit 0'")
    time.sleep(1.5)
    assert not [p for p, st in scan(cluster.processes(a), lambda q: q.status()) if st == psutil.STATUS_ZOMBIE]
    a.stop_sshd()
    assert ssh(cluster, a, "true").returncode == 255
    a.start_sshd()
    assert ssh(cluster, a, "hostname").stdout == "node1\n"
    pids = [p.pid for p in cluster.processes(a)]
    cluster.close()
    assert pids and not any(alive(pid) for pid in pids)


def test_a_crashed_runs_leftovers_are_removed_at_next_start(tmp_path):
    from tests.cluster import require_root
    require_root()
    script = ("import os, sys; sys.path.insert(0, sys.argv[1]); "
              "from tests.cluster import TestCluster; "
              "c = TestCluster(n=2, gpus=0, name_prefix='ccts').start(); "
              "print(c.bridge, *[n.ns for n in c.nodes], flush=True); os._exit(1)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([cluster_python(), "-c", script, root], capture_output=True, text=True,
                         timeout=60)
    bridge, *names = out.stdout.split()
    assert os.path.exists(f"/sys/class/net/{bridge}")  # the crash left it behind
    with TestCluster(n=1, gpus=0, name_prefix="ccts"):
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(name in netns for name in names)
    assert not os.path.exists(f"/sys/class/net/{bridge}")


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cluster_python():
    import sys
    return sys.executable

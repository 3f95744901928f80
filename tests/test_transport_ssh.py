"""The SSH transport and `clusterctl exec` against real OpenSSH servers on the test cluster."""

import json
import os
import subprocess

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.errors import EXIT_UNREACHABLE
from orchestrator.inventory import parse_inventory
from orchestrator.transport import Cluster
from tests.conftest import wait_for

pytestmark = pytest.mark.cluster


def inv_of(cluster, **over):
    return parse_inventory(yaml.safe_dump(cluster.inventory(**over)), "test-inventory")


def run_while_cut(c, node, after, commands, timeout=45):
    """c.run(commands) while `node`'s link goes down `after` s in; the link is up again after."""
    import threading

    cut = threading.Timer(after, node.link_down)
    cut.start()
    try:
        return c.run(commands, timeout=timeout)
    finally:
        cut.join()
        node.link_up()


def test_exec_prints_every_hostname_with_its_prefix(make_cluster, tmp_path, capsys):
    cluster = make_cluster(4)
    path = cluster.write_inventory(tmp_path / "nodes.yaml")
    assert main(["exec", "-i", str(path), "--", "hostname"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == [f"node{i} | node{i}" for i in range(1, 5)]

    # one node's sshd stopped: the other three still answer, exit non-zero naming it
    cluster.nodes[2].stop_sshd()
    rc = main(["exec", "-i", str(path), "--connect-timeout", "3", "--", "hostname"])
    out, err = capsys.readouterr()
    assert rc == EXIT_UNREACHABLE
    assert sorted(out.splitlines()) == ["node1 | node1", "node2 | node2", "node4 | node4"]
    assert "node3" in err and f"connect to host {cluster.nodes[2].host} port 22: Connection refused" in err
    assert "is sshd running" in err

    rc = main(["exec", "-i", str(path), "--json", "--connect-timeout", "3", "--", "hostname"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == EXIT_UNREACHABLE and doc["ok"] is False and doc["exit_code"] == EXIT_UNREACHABLE
    by = {n["node"]: n for n in doc["nodes"]}
    assert by["node3"]["exit_code"] is None and "Connection refused" in by["node3"]["error"]
    assert by["node4"]["stdout"] == "node4\n"
    cluster.nodes[2].start_sshd()


def test_one_handshake_per_node_for_many_commands(cluster4):
    with Cluster(inv_of(cluster4)) as c:
        for _ in range(3):
            r = c.run("hostname")
            assert r.all_ok
        assert c.handshakes == len(cluster4.nodes)
        # AES-GCM is negotiated with OpenSSH: bulk copies (checkpoints, code) cost less CPU both ends
        assert {x.transport.remote_cipher for x in c.connections.values()} == {"aes128-gcm@openssh.com"}
        assert [r[n.name].stdout.strip() for n in cluster4.nodes] == [n.name for n in cluster4.nodes]


def test_unknown_host_key_is_refused_with_the_remedy(cluster4, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inv = inv_of(cluster4, ssh={**cluster4.inventory()["ssh"], "known_hosts": str(empty)})
    with Cluster(inv) as c:
        assert not c.connections
        for n in cluster4.nodes:
            err = c.unreachable[n.name].error
            assert "unknown host key" in err
            assert f"ssh-keyscan -t ssh-ed25519 {n.host} >> {empty}" in err
            assert "--accept-new-host-keys" in err
    assert empty.read_text() == ""  # nothing was trusted silently

    # accept-new records the keys, and a second run verifies against them
    with Cluster(inv, accept_new_host_keys=True) as c:
        assert c.run("true").all_ok
    recorded = empty.read_text()
    assert all(n.host in recorded for n in cluster4.nodes)
    with Cluster(inv) as c:
        assert c.run("true").all_ok


def test_changed_host_key_is_refused_loudly(cluster4, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    other = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    kh = tmp_path / "known_hosts"
    node = cluster4.nodes[0]
    good = [ln for ln in open(cluster4.known_hosts).read().splitlines() if ln.split()[0] != node.host]
    kh.write_text("\n".join(good + [f"{node.host} {other}"]) + "\n")
    inv = inv_of(cluster4, ssh={**cluster4.inventory()["ssh"], "known_hosts": str(kh)})
    with Cluster(inv, accept_new_host_keys=True) as c:  # accept-new never overrides a changed key
        err = c.unreachable[node.name].error
        assert "HAS CHANGED" in err and f"ssh-keygen -R {node.host}" in err
        assert set(c.connections) == {n.name for n in cluster4.nodes[1:]}


def test_link_down_is_unreachable_within_the_timeout_others_go_on(make_cluster):
    cluster = make_cluster(3)
    cluster.nodes[1].link_down()
    inv = inv_of(cluster)
    with Cluster(inv, connect_timeout=2) as c:
        r = c.run("hostname")
    assert r["node1"].ok and r["node3"].ok
    # as ssh says it: ARP unanswered ("No route to host"), or the 2 s ran out first
    assert "No route to host" in r["node2"].error or "Connection timed out after 2s" in r["node2"].error, r["node2"]
    assert r.worst_exit_code == 255


def test_connection_lost_mid_command_is_reported_not_hung(make_cluster):
    cluster = make_cluster(2)
    inv = inv_of(cluster)
    with Cluster(inv, lost_timeout=4) as c:
        # take the node's link down while a command runs: TCP alone would take minutes to
        # notice, the liveness probe notices within lost_timeout and the run ends
        r = run_while_cut(c, cluster.nodes[1], 1.0, lambda n: "sleep 60" if n.rank == 1 else "sleep 2")
    assert r["node1"].ok
    assert r["node2"].exit_code is None
    # lost on evidence (transport/liveness.py): node1 answered, node2's port gave no handshake
    assert "does not answer" in r["node2"].error and "while node1 does" in r["node2"].error, r["node2"].error
    assert r["node2"].duration < 40  # ended by the liveness probe, not the 45 s command timeout


def test_inventory_values_never_reach_a_shell_unquoted(cluster4, tmp_path):
    # an env value full of shell syntax arrives byte-for-byte
    evil = "$(touch /tmp/pwned-cc) `id` ; rm -rf ~ 'x' \"y\""
    from orchestrator import shell
    inv = inv_of(cluster4, env={"EVIL": evil})
    with Cluster(inv) as c:
        r = c.run(lambda n: shell.exports(n.env) + ' printf %s "$EVIL"')
    assert all(x.stdout == evil for x in r.values())
    assert not os.path.exists("/tmp/pwned-cc")


def test_exec_unreachable_only_exit_code(make_cluster, tmp_path, capsys):
    cluster = make_cluster(2)
    for n in cluster.nodes:
        n.stop_sshd()
    path = cluster.write_inventory(tmp_path / "nodes.yaml")
    rc = main(["exec", "-i", str(path), "--connect-timeout", "2", "--", "true"])
    assert rc == EXIT_UNREACHABLE
    assert "Traceback" not in capsys.readouterr().err


def test_ssh_config_alias_user_port_and_identity_are_honoured(cluster4, tmp_path):
    node = cluster4.nodes[1]
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host gpu-box\n  HostName {node.host}\n  User {cluster4.user}\n  Port 22\n"
                   f"  IdentityFile {cluster4.identity_file}\n"
                   f"  UserKnownHostsFile {cluster4.known_hosts}\n")
    inv = parse_inventory(yaml.safe_dump({
        # no user, no identity in the inventory: everything comes from the ssh config
        "ssh": {"config_file": str(cfg), "known_hosts": str(cluster4.known_hosts)},
        "nodes": [{"name": "box", "host": "gpu-box"}]}))
    with Cluster(inv) as c:
        r = c.run("hostname; whoami")
    assert r["box"].stdout.split() == [node.name, cluster4.user], r["box"]


def test_ssh_agent_keys_are_used(cluster4, tmp_path):
    agent = subprocess.run(["ssh-agent", "-s"], capture_output=True, text=True, check=True).stdout
    env = dict(os.environ)
    for part in agent.replace("\n", ";").split(";"):
        if "=" in part and not part.strip().startswith("export"):
            k, v = part.strip().split("=", 1)
            env[k] = v
    try:
        inv = parse_inventory(yaml.safe_dump({
            "ssh": {"user": cluster4.user, "known_hosts": str(cluster4.known_hosts)},  # no identity_file
            "nodes": [{"name": "n", "host": cluster4.nodes[0].host}]}))
        old = os.environ.get("SSH_AUTH_SOCK")
        os.environ["SSH_AUTH_SOCK"] = env["SSH_AUTH_SOCK"]
        try:
            with Cluster(inv) as c:  # an empty agent: no key to offer
                assert "Permission denied: authentication failed" in c.unreachable["n"].error
            subprocess.run(["ssh-add", str(cluster4.identity_file)], env=env, check=True, capture_output=True)
            with Cluster(inv) as c:
                assert c.run("true").all_ok, c.unreachable
        finally:
            if old is None:
                os.environ.pop("SSH_AUTH_SOCK", None)
            else:
                os.environ["SSH_AUTH_SOCK"] = old
    finally:
        subprocess.run(["kill", env["SSH_AGENT_PID"]], check=False)


def test_proxy_jump_reaches_a_node_the_controller_cannot(make_cluster):
    cluster = make_cluster(2)
    jump, target = cluster.nodes
    # the target drops the control machine's packets: only the jump host can reach it
    target.iptables("-A", "INPUT", "-s", cluster.host_ip, "-j", "DROP")
    direct = inv_of(cluster)
    with Cluster(direct.select(["node2"]), connect_timeout=2) as c:
        assert "node2" in c.unreachable
    inv = parse_inventory(yaml.safe_dump(cluster.inventory(nodes=[
        {"name": "node2", "host": target.host, "ssh": {"proxy_jump": f"{cluster.user}@{jump.host}"}}])))
    with Cluster(inv) as c:
        r = c.run("hostname")
    assert r["node2"].stdout == "node2\n", r["node2"]


def test_an_ssh_proc_offers_a_list_of_fds_and_types_a_lost_connection(make_cluster):
    from orchestrator.errors import ConnectionLost
    from orchestrator.transport import ErrorKind, stream

    cluster = make_cluster(1)
    with Cluster(inv_of(cluster), lost_timeout=3) as c:
        conn = c.connections["node1"]
        p = conn.exec("hostname")
        assert isinstance(p.fds(), list) and len(p.fds()) == 1
        assert stream([p], timeout=30)["node1"].stdout == "node1\n"
        assert p.lost_reason() is None and conn.lost_reason is None
        r = run_while_cut(c, cluster.nodes[0], 1.0, "sleep 60")["node1"]  # cut while the command runs
        assert r.kind is ErrorKind.LOST and "connection lost" in r.error, r
        assert isinstance(r.exception(), ConnectionLost)
        with pytest.raises(ConnectionLost):
            conn.exec("true")


def test_a_larger_clusters_suspect_and_probe_times_are_the_ones_used(make_cluster):
    """A cluster given longer suspect and probe times (runs/scaling.py, past 64 nodes) makes a
    silent node a suspect only after its own suspect time, and probes it with its own timeout."""
    import re
    cluster = make_cluster(2)
    inv = inv_of(cluster)
    with Cluster(inv, lost_timeout=60, suspect_s=5.0, probe_s=0.5) as c:
        r = run_while_cut(c, cluster.nodes[1], 1.0, lambda n: "sleep 60" if n.rank == 1 else "sleep 8")
    err = r["node2"].error or ""
    assert "(no TCP handshake within 0.5s) while node1 does" in err, err
    silent = float(re.search(r"no answer for ([\d.]+)s", err).group(1))
    assert silent >= 5.0, err  # not a suspect before its suspect time (the default is 2 s)


def _wakeups(tid: int) -> int:
    """How many times thread `tid` of this process went to sleep and was woken (voluntary switches)."""
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches for thread {tid}")


def test_an_idle_connection_s_reader_is_not_woken_ten_times_a_second_and_still_ends_on_close(make_cluster):
    """paramiko's reader thread polls its socket every 0.1 s by default: at 64 nodes that is 640
    wake-ups a second in the supervisor for nothing. An open connection's reader waits up to
    IDLE_READ_S (a wake-up a second, plus one per ping's answer), still answers a command at once,
    and its thread still ends when the connection is closed."""
    import time

    from orchestrator.transport import ssh

    cluster = make_cluster(1)
    with Cluster(inv_of(cluster), lost_timeout=60) as c:  # pings every PING_S (1 s): one answer a second
        conn = c.connections["node1"]
        t = conn.transport
        assert t.sock.gettimeout() == ssh.IDLE_READ_S
        before = _wakeups(t.native_id)
        time.sleep(4.0)
        woken = _wakeups(t.native_id) - before
        # 0.1 s polls alone would be ~40 in 4 s; a second's poll and a ping's answer each second ~8
        assert woken <= 20, f"the reader thread was woken {woken} times in 4 s"
        assert c.run("hostname")["node1"].stdout == "node1\n"
    t.join(ssh.IDLE_READ_S + 5)
    assert not t.is_alive(), "the reader thread outlived its closed connection"


def test_a_node_that_streams_bytes_is_not_pinged_and_is_still_found_lost_when_cut(make_cluster):
    """Bytes read from a node's channel answer for it as a ping would: while it prints every 0.2 s
    its connection sends no ping. Once its link is cut the bytes stop, the pings start again, and
    the node is found lost on evidence as a silent one is."""
    import time

    cluster = make_cluster(2)
    with Cluster(inv_of(cluster), lost_timeout=8) as c:
        conn = c.connections["node2"]
        t = conn.transport
        pings, real = [], t.global_request
        t.global_request = lambda *a, **kw: (pings.append(time.monotonic()), real(*a, **kw))[1]
        started = time.monotonic()
        r = run_while_cut(c, cluster.nodes[1], 4.0,
                          lambda n: "while :; do echo tick; sleep 0.2; done" if n.rank == 1 else "sleep 6")
    streaming = [p for p in pings if started + 1.5 < p < started + 3.5]  # after the first ping, before the cut
    assert streaming == [], f"{len(streaming)} pings while the node was printing"
    assert r["node1"].ok
    assert r["node2"].stdout.count("tick") >= 10
    assert "does not answer" in r["node2"].error and "while node1 does" in r["node2"].error, r["node2"].error


def test_a_reopened_connection_counts_no_bytes_of_the_transport_it_replaced(make_cluster):
    """Bytes a node sent answer for it as a ping would (`data_at`), but only on the transport they
    came over: a reopened connection starts with none, and a proc of the old transport read
    afterwards does not count for the new one."""
    cluster = make_cluster(1)
    with Cluster(inv_of(cluster), lost_timeout=60) as c:
        conn = c.connections["node1"]
        old = conn.exec("echo before; sleep 0.5; echo after")
        assert c.run("echo hi")["node1"].stdout == "hi\n"
        assert conn.data_at > float("-inf")
        wait_for(lambda: old.chan.recv_ready(), 10, "the old channel's first line, not read yet")
        conn.reopen()
        assert conn.data_at == float("-inf")
        out, _ = old.read()  # what the old transport's channel still holds: not the new one's answer
        assert out.startswith(b"before\n"), out
        assert conn.data_at == float("-inf")
        assert c.run("echo again")["node1"].stdout == "again\n"
        assert conn.data_at > float("-inf")

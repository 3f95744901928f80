"""A node whose host key changes mid-run: refused, and then left alone enough that its admin can
still log in. Each try to reach it closes its connection at once and the tries back off (1 s to
60 s), so its sshd never holds more than a few unauthenticated connections, even under OpenSSH's
default MaxStartups (10:30:100) and LoginGraceTime (120 s); the run record names the key change;
SIGTERM ends the supervisor within its grace, the first one and an adopted one alike."""

import re
import signal
import subprocess
import threading
import time

import psutil
import pytest
import yaml

from orchestrator.errors import AuthRefused, HostKeyError
from orchestrator.inventory import parse_inventory
from orchestrator.transport import SSHConnection
from tests.cluster import host
from tests.conftest import pid_ended, wait_for
from tests.test_train_cluster import DDP, cli, log_has, prepare, rec_of

pytestmark = pytest.mark.cluster

GRACE = 5
WATCH_S = 60  # how long the refused node is watched after its key changed
PREAUTH = re.compile(r"^sshd: .*\[(accepted|net|preauth)\]")


def preauth_count(node) -> int:
    """Connections not (yet) authenticated on the node's sshd. OpenSSH 9 runs each as two processes,
    the monitor (`sshd: [accepted]`) and its unprivileged child (`sshd: [net]`): a connection is
    counted once, by its monitor, the pre-auth process whose parent is not one itself."""
    preauth = {}
    for pid in host.pids_in_netns({node.netns_inode}):
        try:
            p = psutil.Process(pid)
            if PREAUTH.match(" ".join(p.cmdline())):
                preauth[pid] = p.ppid()
        except psutil.Error:
            continue
    return sum(parent not in preauth for parent in preauth.values())


def change_host_key(node) -> str:
    """A new host key for the node's sshd, restarted, and the sessions open under the old one cut
    (the run's connection drops). Returns the new public key line."""
    pub = host.write_keypair(node.host_key, node.name)
    node.restart_sshd()
    listener = int(node.pid_file.read_text())
    for pid in host.pids_in_netns({node.netns_inode}):
        try:
            p = psutil.Process(pid)
            if p.name() == "sshd" and listener not in (pid, p.ppid()):  # a session of the old sshd's
                p.kill()
        except psutil.Error:
            continue
    return pub


def fingerprint(pub: str, tmp_path) -> str:
    f = tmp_path / "new_key.pub"
    f.write_text(pub + "\n")
    return subprocess.run(["ssh-keygen", "-lf", str(f)], capture_output=True, text=True, check=True).stdout.split()[1]


def login(cluster, node, known_hosts) -> bool:
    argv = cluster.ssh_argv(node, "true")
    argv[argv.index(f"UserKnownHostsFile={cluster.known_hosts}")] = f"UserKnownHostsFile={known_hosts}"
    return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0


def watch_node(cluster, node, known_hosts, seconds):
    """Every 0.2 s the node's unauthenticated sshd connections, less the admin's own login while one
    is under way; every 3 s a fresh `ssh` login (sequential, like an admin). Returns (most pre-auth
    connections of the supervisor's seen at once, logins ok, logins tried)."""
    most, ok, tried, stop, admin = [0], [0], [0], threading.Event(), threading.Event()

    def sample():
        while not stop.is_set():
            most[0] = max(most[0], preauth_count(node) - admin.is_set())
            time.sleep(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tried[0] += 1
        admin.set()
        try:
            ok[0] += login(cluster, node, known_hosts)
        finally:
            time.sleep(0.3)  # its monitor may outlive the ssh client by a sample
            admin.clear()
        time.sleep(2.7)
    stop.set()
    t.join(5)
    return most[0], ok[0], tried[0]


def sigterm_ends_within_grace(pid: int) -> float:
    t0 = time.monotonic()
    psutil.Process(pid).send_signal(signal.SIGTERM)
    wait_for(lambda: pid_ended(pid), GRACE + 10, f"supervisor {pid} to end after SIGTERM")
    return time.monotonic() - t0


def test_changed_host_key_mid_run_is_backed_off_closed_and_named(make_cluster, tmp_path, home):
    cluster = make_cluster(3, gpus=0)
    victim = cluster.nodes[1]
    cfg = victim.sshd_config.read_text()  # OpenSSH's defaults: MaxStartups 10:30:100, LoginGraceTime 120
    victim.sshd_config.write_text(re.sub(r"^(MaxStartups|LoginGraceTime) .*\n", "", cfg, flags=re.M))
    victim.restart_sshd()
    inv = prepare(cluster, tmp_path)
    r = cli("train", "-i", inv, "--skip-preflight", "--detach", "--lost-timeout", "10", "--grace", str(GRACE),
            "--", DDP, "--steps", "100000", "--sleep", "0.1")
    assert r.returncode == 0, r.stderr
    run_dir = home / "runs" / r.stdout.strip()
    wait_for(lambda: rec_of(run_dir).get("state") == "running", 120, "running")
    wait_for(lambda: log_has(run_dir / "nodes" / "node2.log", b"step 3"), 120, "steps on node2")

    pub = change_host_key(victim)
    known = tmp_path / "admin_known_hosts"  # the admin knows the new key
    known.write_text(f"{victim.host} {pub}\n")
    sshd_log_at = victim.sshd_log.stat().st_size
    most, ok, tried = watch_node(cluster, victim, known, WATCH_S)
    # connections from this machine, less the admin's logins: the supervisor's tries
    tries = victim.sshd_log.read_bytes()[sshd_log_at:].count(f"Connection from {cluster.host_ip} ".encode()) - tried

    rec = rec_of(run_dir)
    assert rec["state"] == "failed", rec.get("state")
    pending = {p["node"]: p for p in rec.get("pending_stops", [])}
    assert "node2" in pending, rec.get("pending_stops")
    fp = fingerprint(pub, tmp_path)
    assert "host key changed" in pending["node2"]["why"] and fp in pending["node2"]["why"], pending["node2"]
    assert most <= 2, f"{most} unauthenticated connections of the supervisor's at once on the refused node"
    assert ok == tried, f"only {ok} of {tried} fresh ssh logins to the refused node got in"
    # refused (reconnect within --lost-timeout, then the pending stop), backing off: not one a second
    assert tries <= 12, f"{tries} connections to the refused node in {WATCH_S}s"

    status = cli("status", run_dir.name)
    assert f"host key changed (it presented {fp})" in status.stderr, status.stderr

    took = sigterm_ends_within_grace(rec["supervisor_pid"])
    print(f"in {WATCH_S}s after the key change: at most {most} unauthenticated connections of the supervisor's at once, "
          f"{ok}/{tried} logins in, {tries} tries by the supervisor; SIGTERM ended it in {took:.2f}s")
    assert took <= GRACE + 3, f"the supervisor took {took:.1f}s to end after SIGTERM"
    cli("status", run_dir.name)  # the supervisor is gone and a stop pending: a replacement adopts the run
    adopted = wait_for(lambda: (lambda d: d.get("supervisor_pid") if d.get("adopted_at") and
                                d.get("supervisor_pid") != rec["supervisor_pid"] else None)(rec_of(run_dir)),
                       30, "an adopted supervisor")
    wait_for(lambda: (rec_of(run_dir).get("pending_stops") or [{}])[0].get("tries", 0) > pending["node2"]["tries"],
             30, "the adopted supervisor's first try")
    took = sigterm_ends_within_grace(adopted)
    print(f"SIGTERM ended the adopted supervisor in {took:.2f}s")
    assert took <= GRACE + 3, f"the adopted supervisor took {took:.1f}s to end after SIGTERM"
    assert preauth_count(victim) <= 2


def test_a_refused_key_or_host_key_leaves_no_connection_on_the_node(make_cluster, tmp_path):
    """Each refused connect closes its socket before it returns: the node's sshd holds nothing of
    it (paramiko's client stayed connected, unauthenticated, until the node's LoginGraceTime)."""
    cluster = make_cluster(1, gpus=0)
    node = cluster.nodes[0]
    stranger = tmp_path / "stranger_key"
    host.write_keypair(stranger, "not authorized")
    other_kh = tmp_path / "known_hosts"
    other_kh.write_text(f"{node.host} {host.write_keypair(tmp_path / 'other_host_key', 'x')}\n")
    cases = [("identity_file", str(stranger), AuthRefused, "authentication refused"),
             ("known_hosts", str(other_kh), HostKeyError, "host key changed")]
    for key, value, kind, brief in cases:
        ssh = {**cluster.inventory()["ssh"], key: value}
        inv = parse_inventory(yaml.safe_dump(cluster.inventory(ssh=ssh)), "t")
        for _ in range(5):
            c = SSHConnection(inv.nodes[0])
            with pytest.raises(kind) as e:
                c.open()
            assert e.value.brief.startswith(brief), e.value.brief
            assert e.value.refused
        wait_for(lambda: preauth_count(node) == 0, 5, f"no connection left on the node after {brief}")

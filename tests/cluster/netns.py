"""A real multi-host test cluster: one network namespace + sshd per node.

Each node is a network namespace on a host bridge with its own address, its own hostname (UTS
namespace), its own /etc/hosts and resolv.conf (/etc/netns/NS/, bind-mounted by `ip netns
exec`), its own home for the test user (a per-node host dir bind-mounted over /home/USER in a
private mount namespace), and an sshd with its own host key. A small "anchor" process (`sleep`)
holds each node's namespaces so sshd can be stopped and started without losing them; everything
else enters them with nsenter.
"""

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

from tests.cluster import host
from tests.cluster.node import TestNode

DEFAULT_USER = "ccnode"
_checked_pythons = set()


def require_root():
    """Skip the calling test unless we may create network namespaces."""
    if os.geteuid() != 0:
        import pytest
        pytest.skip("needs root to create network namespaces for the test cluster "
                    "(run the suite as root, as CI does)")


def _exit_on_sigterm():
    """Turn a plain SIGTERM (CI timeout, kill) into SystemExit so context managers and atexit
    tear the cluster down; leave any handler someone else installed alone."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class TestCluster:
    """N test nodes. Use as a context manager; close() is also registered with atexit."""

    __test__ = False

    def __init__(self, n, gpus=8, workdir="~/gpt_train", name_prefix="cct", user=DEFAULT_USER,
                 python=None, start_timeout=60.0, own_pids=False):
        if not 1 <= n <= host.MAX_NODES:
            raise ValueError(f"n must be 1..{host.MAX_NODES}, got {n}")
        gpus = list(gpus) if isinstance(gpus, (list, tuple)) else [gpus] * n
        if len(gpus) != n:
            raise ValueError(f"gpus has {len(gpus)} entries for {n} nodes")
        self.n = n
        self.name_prefix = name_prefix
        self.workdir = workdir
        self.user = user
        self.python = python or sys.executable
        self.start_timeout = start_timeout
        self._gpus = gpus
        # each node in a PID namespace of its own, its /proc showing its own processes as a real
        # machine's does (else every node's /proc shows every node's). The nodes' pids are then
        # their own: what a node reports (proc.json, a hook's FIFO) is not this machine's pid, so
        # only callers that find processes from here (bench/bench_scale.py) ask for it
        self.own_pids = own_pids
        self.nodes = []
        self.slot = None
        self._state = None
        self._started = False

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        if os.geteuid() != 0:
            raise PermissionError("TestCluster needs root (network namespaces, sshd, bridges)")
        me = psutil.Process()
        self._state = {"pid": me.pid, "create_time": me.create_time(), "prefix": self.name_prefix}
        atexit.register(self.close)
        _exit_on_sigterm()
        with host.host_lock():
            host.clean_stale(self.name_prefix)
            self.pw = host.ensure_user(self.user)
            self._state["uid"] = self.pw.pw_uid
            self.slot = host.claim_slot(self._state)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self):
        net = host.SLOTS[self.slot]
        self.id = f"{self.name_prefix}{os.getpid()}s{self.slot}"
        self.host_ip = str(net.network_address + 1)
        self.bridge = f"{self.name_prefix[:6]}br{self.slot}"
        self.base_dir = host.BASE_DIR / self.id
        self.nodes = [TestNode(self, i, f"node{i + 1}",
                               str(net.network_address + host.FIRST_NODE_OFFSET + i), self._gpus[i])
                      for i in range(self.n)]
        self._state.update(namespaces=[nd.ns for nd in self.nodes], bridge=self.bridge,
                           veths=[nd.veth for nd in self.nodes], base_dir=str(self.base_dir))
        host.save_state(self._state)  # before creating anything, so a crash leaves a record
        self._check_python()
        self._write_files()
        self._create_network(net.prefixlen)
        self._start_anchors(net.prefixlen)
        deadline = time.monotonic() + self.start_timeout
        for node in self.nodes:
            node._spawn_sshd()
        for node in self.nodes:
            node._wait_sshd(deadline)
        self._started = True

    def _check_python(self):
        if self.python in _checked_pythons:
            return
        probe = ("import importlib.util, sys; "
                 "sys.exit(0 if importlib.util.find_spec('torch') else 3)")
        proc = subprocess.run(
            ["setpriv", f"--reuid={self.pw.pw_uid}", f"--regid={self.pw.pw_gid}", "--clear-groups",
             "--", self.python, "-c", probe],
            capture_output=True, text=True, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": "/"})
        if proc.returncode != 0:
            raise RuntimeError(
                f"test user {self.user!r} cannot run {self.python} with torch importable "
                f"(exit {proc.returncode}: {proc.stderr.strip()[-500:]}). The interpreter, its "
                "venv and every parent directory must be world-readable (not under /root).")
        _checked_pythons.add(self.python)

    def _write_files(self):
        self.base_dir.mkdir(parents=True, mode=0o755)
        self.base_dir.chmod(0o755)
        host.BASE_DIR.chmod(0o755)
        self.identity_file = self.base_dir / "id_ed25519"
        client_pub = host.write_keypair(self.identity_file, f"clusterctl-tests@{self.id}")
        hosts = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{self.host_ip}\tcontrol"]
        hosts += [f"{nd.host}\t{nd.name}" for nd in self.nodes]
        hosts_text = "\n".join(hosts) + "\n"
        known = []
        uid, gid = self.pw.pw_uid, self.pw.pw_gid
        for node in self.nodes:
            for d in (node.dir, node.bin_dir):
                d.mkdir(mode=0o755)
            ssh_dir = node.home / ".ssh"
            ssh_dir.mkdir(parents=True, mode=0o700)
            (ssh_dir / "authorized_keys").write_text(client_pub + "\n")
            for path in (node.home, ssh_dir, ssh_dir / "authorized_keys"):
                os.chown(path, uid, gid)
            known.append(f"{node.host} {host.write_keypair(node.host_key, node.name)}")
            node.write_sshd_config()
            node.set_gpus(node.gpus)
            etc = host.NETNS_ETC / node.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_text)
            # Nothing answers on 127.0.0.1:53 inside the node: lookups fail at once, never hang.
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            (etc / "hostname").write_text(node.name + "\n")
        self.known_hosts = self.base_dir / "known_hosts"
        self.known_hosts.write_text("\n".join(known) + "\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir

    def _create_network(self, prefixlen):
        lines = [f"link add {self.bridge} type bridge stp_state 0 forward_delay 0",
                 f"addr add {self.host_ip}/{prefixlen} dev {self.bridge}",
                 f"link set {self.bridge} up"]
        for node in self.nodes:
            lines += [f"netns add {node.ns}",
                      f"link add {node.veth} type veth peer name {node.iface} netns {node.ns}",
                      f"link set {node.veth} master {self.bridge}",
                      f"link set {node.veth} up"]
        host.run(["ip", "-batch", "-"], input="\n".join(lines) + "\n")
        for node in self.nodes:
            node.netns_inode = host.netns_inode(node.ns)

    def _start_anchors(self, prefixlen):
        # with own_pids the shell is the node's init: a loop in the foreground, so it reaps the
        # orphans handed to it (sleep infinity would leave them zombies); --kill-child: the
        # namespace, and everything in it, ends with the anchor
        rest = 'exec /bin/sh -c "while :; do sleep 3600; done"' if self.own_pids else "exec sleep infinity"
        script = ('printf "addr add %s dev eth0\\nlink set eth0 up\\nlink set lo up\\n" "$1" '
                  '| ip -batch - && hostname "$2" && mount --bind "$3" "$4" '
                  f'&& echo ready && {rest} >/dev/null 2>&1')
        pids = ["--pid", "--fork", "--mount-proc", "--kill-child"] if self.own_pids else []
        for node in self.nodes:
            node.anchor = subprocess.Popen(
                ["ip", "netns", "exec", node.ns, "unshare", "--uts", *pids, "--", "/bin/sh", "-c", script,
                 "anchor", f"{node.host}/{prefixlen}", node.name, str(node.home), self.pw.pw_dir],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)
        for node in self.nodes:
            line = node.anchor.stdout.readline()
            node.anchor.stdout.close()
            if line.strip() != b"ready":
                node.anchor.wait(5)
                err = node.anchor.stderr.read().decode(errors="replace").strip()
                raise RuntimeError(f"setting up {node.name} ({node.ns}) failed: {err}")
            node.anchor.stderr.close()

    def close(self):
        """Tear everything down; safe to call twice and after a failed start."""
        state, self._state = self._state, None
        if state is None:
            return
        atexit.unregister(self.close)
        for node in self.nodes:
            for proc in (node.sshd, node.anchor):
                if proc is not None and proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGKILL)
        host.destroy(state)
        for node in self.nodes:
            for proc in (node.sshd, node.anchor):
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(5)
            node.sshd = None
        self._started = False

    # --- queries ---------------------------------------------------------------------------
    def processes(self, node=None):
        """The test user's processes in one node's network namespace (all nodes if None)."""
        nodes = [node] if node is not None else self.nodes
        inodes = {nd.netns_inode for nd in nodes}
        found = []
        for pid in host.pids_in_netns(inodes):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.uids().real == self.pw.pw_uid and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        return found

    def job_process(self, node, match):
        """The process running a rank's script on `node`: of the test user's processes there that
        carry a RANK (torchrun, whose command line names the script too, does not) and that
        `match(environ, argv)` accepts, the one that runs it. Where the run's warm interpreter
        forked the rank (every attempt of a run with --max-restarts), the fork, the warm
        interpreter's child, not the process torchrun started, which waits beside it (a signal
        reaches the fork through it; a CPU quota does not); None while that one still waits for
        its fork (it carries CLUSTERCTL_WARM, the fork does not). Else the topmost (a data
        loader's workers carry the rank's command line too). None when none matches."""
        found, waiting = [], False
        for p in self.processes(node):
            with contextlib.suppress(psutil.Error):
                env = p.environ()
                if "RANK" in env and match(env, p.cmdline()):
                    found.append(p)
                    if ".warm@" in p.parent().environ().get("CLUSTERCTL_RUN_KEY", ""):
                        return p
                    waiting = waiting or "CLUSTERCTL_WARM" in env
        pids = {p.pid for p in found}
        tops = [p for p in found if p.ppid() not in pids]
        return None if waiting or not tops else tops[0]

    def kill_user_processes(self):
        """SIGKILL the test user's processes on every node (e.g. between tests)."""
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def inventory(self, **overrides):
        inv = {
            "ssh": {"user": self.user, "port": 22, "identity_file": str(self.identity_file),
                    "known_hosts": str(self.known_hosts), "connect_timeout": 5},
            "master_port": 29500,
            "workdir": self.workdir,
            "python": self.python,
            "env": {},
            "nodes": [{"name": nd.name, "host": nd.host, "gpus": nd.gpus, "iface": nd.iface}
                      for nd in self.nodes],
        }
        inv.update(overrides)
        return inv

    def write_inventory(self, path, **overrides):
        path = Path(path)
        path.write_text(yaml.safe_dump(self.inventory(**overrides), sort_keys=False))
        return path

    def ssh_argv(self, node, *cmd, connect_timeout=5):
        """Plain OpenSSH client argv for `node` with strict host-key checking."""
        return ["ssh", "-i", str(self.identity_file), "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                "-o", "IdentitiesOnly=yes", "-o", f"ConnectTimeout={connect_timeout}",
                "-F", "/dev/null", f"{self.user}@{node.host}", *cmd]

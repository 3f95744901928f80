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
import pwd
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

from . import host
from .fakes import gpu_state, install_nvidia_smi
from .sshd import render_config, session_env

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


class TestNode:
    __test__ = False  # not a pytest test class

    def __init__(self, cluster, index, name, host_ip, gpus):
        self.cluster = cluster
        self.index = index
        self.name = name
        self.host = host_ip
        self.gpus = gpus
        self.iface = "eth0"
        self.ns = f"{cluster.id}-{index + 1}"
        self.veth = f"{cluster.name_prefix[:4]}{cluster.slot}v{index + 1}"
        self.dir = cluster.base_dir / name
        self.home = self.dir / "home"
        self.bin_dir = self.dir / "bin"
        self.sshd_config = self.dir / "sshd_config"
        self.host_key = self.dir / "ssh_host_ed25519_key"
        self.pid_file = self.dir / "sshd.pid"
        self.sshd_log = self.dir / "sshd.log"
        self.clock_skew = 0.0
        self.anchor = None  # Popen of the process holding this node's namespaces
        self.sshd = None  # Popen of sshd -D

    def __repr__(self):
        return f"TestNode({self.name} {self.host} ns={self.ns})"

    # --- processes inside the node -------------------------------------------------------
    def _enter(self, as_user):
        argv = ["nsenter", "-t", str(self.anchor.pid), "-n", "-m", "-u"]
        if as_user:
            user = self.cluster.pw
            argv += ["-S", str(user.pw_uid), "-G", str(user.pw_gid), f"--wd={user.pw_dir}"]
        return argv

    def env(self, as_user=True):
        """The environment of an ssh session on this node (PATH with bin_dir, faketime)."""
        user = self.cluster.pw if as_user else pwd.getpwuid(0)
        env = {"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
               "SHELL": "/bin/bash", "LANG": "C.UTF-8"}
        env.update(session_env(self.bin_dir, self.clock_skew, root=not as_user))
        return env

    def _argv(self, cmd, as_user):
        cmd = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else [str(c) for c in cmd]
        env = self.env(as_user)
        # The environment is set by env(1) *after* the uid switch: libfaketime preloaded into
        # the root nsenter would create a semaphore the test user then cannot open.
        return self._enter(as_user) + ["--", "/usr/bin/env", "-i"] + \
            [f"{k}={v}" for k, v in env.items()] + cmd

    def run(self, cmd, as_user=True, check=True, timeout=30, input=None):
        """Run cmd (argv list, or a string for bash -c) inside the node, like an ssh session."""
        return subprocess.run(self._argv(cmd, as_user), input=input, capture_output=True,
                              text=True, check=check, timeout=timeout)

    def popen(self, cmd, as_user=True, **kwargs):
        """Start cmd inside the node in the background (caller waits/kills it)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self._argv(cmd, as_user), **kwargs)

    def processes(self):
        """The test user's processes in this node's network namespace."""
        return self.cluster.processes(self)

    # --- sshd ------------------------------------------------------------------------------
    def write_sshd_config(self):
        self.sshd_config.write_text(render_config(
            address=self.host, port=22, host_key=self.host_key, pid_file=self.pid_file,
            user=self.cluster.user, bin_dir=self.bin_dir, clock_skew=self.clock_skew))

    def _spawn_sshd(self):
        self.pid_file.unlink(missing_ok=True)
        self.sshd = subprocess.Popen(
            self._enter(False) + ["--", "/usr/sbin/sshd", "-D", "-f", str(self.sshd_config),
                                  "-E", str(self.sshd_log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)

    def _wait_sshd(self, deadline):
        # sshd -D writes its PidFile once its listen socket is bound.
        while not self.pid_file.exists():
            if self.sshd.poll() is not None:
                err = self.sshd.stderr.read().decode(errors="replace")
                log = self.sshd_log.read_text() if self.sshd_log.exists() else ""
                raise RuntimeError(f"sshd on {self.name} exited {self.sshd.returncode}: "
                                   f"{err.strip()} {log.strip()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {self.name} not listening after timeout")
            time.sleep(0.005)

    def start_sshd(self, timeout=10.0):
        if self.sshd is not None and self.sshd.poll() is None:
            return
        self._spawn_sshd()
        self._wait_sshd(time.monotonic() + timeout)

    def stop_sshd(self, timeout=5.0):
        """Stop the listening sshd (sessions already open stay, as with a real sshd)."""
        if self.sshd is None:
            return
        if self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(timeout)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait()
        self.sshd.stderr.close()
        self.sshd = None
        self.pid_file.unlink(missing_ok=True)

    def restart_sshd(self):
        self.stop_sshd()
        self.start_sshd()

    # --- faults ----------------------------------------------------------------------------
    def link_down(self):
        host.run(["ip", "-n", self.ns, "link", "set", self.iface, "down"])

    def link_up(self):
        host.run(["ip", "-n", self.ns, "link", "set", self.iface, "up"])
        # Peers that tried to reach us while down hold a FAILED neighbour entry and would answer
        # the next connect with "No route to host". Any broadcast ARP request from us refreshes
        # those entries everywhere on the bridge: forget our own cache, then ping the host once.
        host.run(["ip", "-n", self.ns, "neigh", "flush", "dev", self.iface], check=False)
        host.run(["nsenter", "-t", str(self.anchor.pid), "-n", "--", "ping", "-c1", "-W2",
                  self.cluster.host_ip], check=False)

    def iptables(self, *args, check=True):
        """Run iptables inside the node's network namespace."""
        return host.run(["nsenter", "-t", str(self.anchor.pid), "-n", "--", "iptables",
                         *map(str, args)], check=check)

    def set_clock_skew(self, seconds: float):
        """Skew the wall clock of new ssh sessions (libfaketime via sshd SetEnv); 0 removes it."""
        self.clock_skew = float(seconds)
        self.write_sshd_config()
        if self.sshd is not None:
            self.restart_sshd()

    def shape(self, rate="1gbit", burst="256kb", latency="50ms"):
        """tc tbf on both directions of the node's link (node-side eth0 and host-side veth)."""
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        host.run(["tc", "-n", self.ns, "qdisc", "replace", "dev", self.iface, *tbf])
        host.run(["tc", "qdisc", "replace", "dev", self.veth, *tbf])

    def unshape(self):
        host.run(["tc", "-n", self.ns, "qdisc", "del", "dev", self.iface, "root"], check=False)
        host.run(["tc", "qdisc", "del", "dev", self.veth, "root"], check=False)

    def set_gpus(self, n, processes=(), **kw):
        """Rewrite the fake nvidia-smi: n GPUs (0 removes nvidia-smi), processes as
        (pid, name, used_mib[, gpu_index]); more knobs in fakes.gpu_state (model, broken...)."""
        self.gpus = n
        install_nvidia_smi(self.bin_dir, gpu_state(self.name, n, processes, **kw) if n else None)


class TestCluster:
    """N test nodes. Use as a context manager; close() is also registered with atexit."""

    __test__ = False

    def __init__(self, n, gpus=8, workdir="~/gpt_train", name_prefix="cct", user=DEFAULT_USER,
                 python=None, start_timeout=60.0):
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
        script = ('printf "addr add %s dev eth0\\nlink set eth0 up\\nlink set lo up\\n" "$1" '
                  '| ip -batch - && hostname "$2" && mount --bind "$3" "$4" '
                  '&& echo ready && exec sleep infinity >/dev/null 2>&1')
        for node in self.nodes:
            node.anchor = subprocess.Popen(
                ["ip", "netns", "exec", node.ns, "unshare", "--uts", "--", "/bin/sh", "-c", script,
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

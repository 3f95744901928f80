"""One test node: processes inside its namespaces, its sshd, and the faults it can suffer."""

import pwd
import subprocess
import time

import psutil

from tests.cluster import host
from tests.cluster.fakes import gpu_state, install_nvidia_smi, install_rocm_smi, rocm_state
from tests.cluster.sshd import render_config, session_env


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
        if self.cluster.own_pids:  # the node's PID namespace: the one the anchor's children are in
            argv.append(f"--pid=/proc/{self.anchor.pid}/ns/pid_for_children")
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

    def _listening(self) -> bool:
        """Whether sshd -D wrote its PidFile (once its listen socket is bound): the whole line, not
        the file alone (created empty, the pid written after)."""
        try:
            text = self.pid_file.read_text()
        except FileNotFoundError:
            return False
        return text.endswith("\n") and text.strip().isdigit()

    def _wait_sshd(self, deadline):
        while not self._listening():
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
            if self.cluster.own_pids:  # nsenter forked into the node's PID namespace: sshd is its child
                for child in psutil.Process(self.sshd.pid).children():
                    child.terminate()
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

    def warm_serving(self, ready: bool = True) -> bool:
        """Whether a run's warm interpreter listens here (its socket, remote/warm.py's WARM_DIR);
        with `ready`, one that has imported torch (no `importing` mark beside its socket: one
        listens from its start)."""
        cond = '[ -S "$d/sock" ]' + (' && [ ! -e "$d/importing" ]' if ready else "")
        return self.run(f'for d in ~/.clusterctl/warm/*; do {cond} && echo "$d"; done 2>/dev/null || true'
                        ).stdout.strip() != ""

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

    def set_gpus(self, n, processes=(), vendor="nvidia", **kw):
        """Rewrite the fake GPU tool: n GPUs (0 removes it), processes as (pid, name, used_mib[,
        gpu_index]); vendor "amd" installs a fake rocm-smi instead of nvidia-smi. More knobs in
        fakes.gpu_state / fakes.rocm_state (recording, utilization, broken...)."""
        self.gpus = n
        amd = vendor == "amd" and n
        install_nvidia_smi(self.bin_dir, gpu_state(self.name, n, processes, **kw) if n and not amd else None)
        install_rocm_smi(self.bin_dir, rocm_state(n, processes, **kw) if amd else None)

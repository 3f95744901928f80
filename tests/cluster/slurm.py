"""A real SLURM (Debian's slurm-wlm) on a TestCluster: slurmctld + munged on the host side of
the bridge, one `slurmd -D -N nodeI` inside each node's namespaces.

    with TestCluster(n=2, gpus=2) as cluster, Slurm(cluster) as slurm:
        job = slurm.sbatch(script_path)            # submitted from node1 as the test user
        info = slurm.wait_job(job, timeout=120)    # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

Everything lives under the cluster's base_dir/slurm and is private to this cluster: its own
slurm.conf (clients find it through SLURM_CONF), its own munge key and socket, its own
slurmctld port, one spool directory and pid file per node (`%n`). Processes are tracked by
parentage (proctrack/linuxproc, task/none), so no cgroup is needed: `ip netns exec` remounts
/sys, so a node sees no cgroup hierarchy at all. GPUs are a `gres` with a count per node (no
device files), which is enough for --gpus-per-node and SLURM_GPUS_ON_NODE.

The nodes run the job with PATH starting at one path, `bin_path`, that every node's mount
namespace maps to its own fake-GPU bin directory: SLURM carries the submitting environment to
every node, so a per-node directory in PATH would hand node1's nvidia-smi to node2.
"""

import contextlib
import os
import pwd
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

SLURMCTLD_BASE_PORT = 16817  # + the cluster's address slot: clusters running at once never share it
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def _pdeath(argv):
    """Run argv so it dies with this process (a crashed test leaves no daemon on the host)."""
    return ["setpriv", "--pdeathsig", "KILL", "--", *argv]


def host_cgroup_v1():
    """[(directory under /sys/fs/cgroup, mount options)] of the host's cgroup v1 hierarchies
    (the unified v2 one of a hybrid host left out: slurmd refuses "hybrid mode")."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, fstype, opts, *_ = line.split()
        if fstype == "cgroup" and where.startswith("/sys/fs/cgroup/"):
            found.append((where[len("/sys/fs/cgroup/"):], opts))
    return found


class SlurmError(RuntimeError):
    pass


class Slurm:
    __test__ = False

    def __init__(self, cluster, gpus_per_node=None, start_timeout=60.0):
        self.cluster = cluster
        self.gpus = cluster.nodes[0].gpus if gpus_per_node is None else gpus_per_node
        self.start_timeout = start_timeout
        self.dir = cluster.base_dir / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.munge_dir = self.dir / "munge"  # key, seed, log, pid: the munge user's only
        self.socket = self.dir / "munge-run" / "munge.socket"
        self.bin_path = self.dir / "bin"  # each node's bin_dir, bind-mounted in its mount namespace
        self.port = SLURMCTLD_BASE_PORT + cluster.slot
        self.munged = None
        self.slurmctld = None
        self.slurmd = {}
        self.v1 = host_cgroup_v1()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # --- lifecycle -------------------------------------------------------------------------
    def start(self):
        try:
            self._write_files()
            self._start_munged()
            self._start_slurmctld()
            for node in self.cluster.nodes:
                self._start_slurmd(node)
            self.wait_idle(self.start_timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _write_files(self):
        munge = pwd.getpwnam("munge")
        for d, mode in ((self.dir, 0o755), (self.munge_dir, 0o700), (self.socket.parent, 0o755),
                        (self.bin_path, 0o755), (self.dir / "state", 0o700), (self.dir / "spool", 0o755),
                        (self.dir / "log", 0o755)):
            d.mkdir(mode=mode, parents=True, exist_ok=True)
            d.chmod(mode)
        key = self.munge_dir / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        for p in (self.munge_dir, self.socket.parent, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        self.conf.write_text(self.render_conf())
        # slurmd drops a GPU without a device file; empty files named like NVIDIA's will do
        # (nothing opens them: no cgroup confines devices here).
        devs = self.dir / "dev"
        devs.mkdir(mode=0o755, exist_ok=True)
        for i in range(self.gpus):
            (devs / f"nvidia{i}").touch()
        files = f"{devs}/nvidia[0-{self.gpus - 1}]" if self.gpus > 1 else f"{devs}/nvidia0"
        (self.dir / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.nodelist()} Name=gpu File={files}\n" if self.gpus else "")
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n" if self.v1 else "")
        for node in self.cluster.nodes:
            (self.dir / "spool" / node.name).mkdir(mode=0o755, exist_ok=True)

    def nodelist(self):
        return ",".join(nd.name for nd in self.cluster.nodes)

    def render_conf(self):
        c = self.cluster
        d = self.dir
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        nodes = "\n".join(f"NodeName={nd.name} NodeAddr={nd.host} NodeHostname={nd.name} "
                          f"CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN{gres}"
                          for nd in c.nodes)
        return f"""\
# generated by tests/cluster/slurm.py for test cluster {c.id}
ClusterName={re.sub(r'[^a-z0-9]', '', c.id.lower())[:30]}
SlurmctldHost=control({c.host_ip})
SlurmctldPort={self.port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/spool/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
GresTypes=gpu
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
SchedulerType=sched/backfill
{nodes}
PartitionName=test Nodes={self.nodelist()} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

    def _spawn(self, argv, log_name):
        log = open(self.dir / "log" / log_name, "ab")
        try:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        finally:
            log.close()

    def _start_munged(self):
        m = self.munge_dir
        # the uid switch first: changing credentials clears a parent-death signal set before it
        self.munged = self._spawn([
            "setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "--", *_pdeath([
                "munged", "-F", f"--socket={self.socket}", f"--key-file={m}/munge.key",
            f"--log-file={m}/munged.log", f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"])],
            "munged.out")
        self._wait(lambda: self.socket.exists(), 10, "munged's socket", self.munged)

    def _start_slurmctld(self):
        with socket.socket() as s:  # slurmctld binds every address: make sure the port is ours
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("", self.port))
            except OSError as e:
                raise SlurmError(f"slurmctld port {self.port} is taken ({e.strerror})") from e
        # slurmctld runs only where the hostname is its SlurmctldHost: give it a UTS namespace
        # named "control" (the name the nodes' /etc/hosts give the host side of the bridge).
        self.slurmctld = self._spawn(_pdeath([
            "unshare", "--uts", "--", "sh", "-c", 'hostname control && exec "$@"', "slurmctld",
            "slurmctld", "-D", "-i", "-f", str(self.conf)]), "slurmctld.out")
        self._wait(lambda: (self.dir / "slurmctld.pid").exists(), 20, "slurmctld", self.slurmctld)

    def _mount_node(self, node):
        """In the node's mount namespace: bin_path -> the node's bin_dir, and the host's cgroup
        hierarchies, which slurmd 22.05 insists on finding even when no plugin uses them."""
        node.run(["mount", "--bind", str(node.bin_dir), str(self.bin_path)], as_user=False)
        if self.v1:
            args = [x for dir_, opts in self.v1 for x in (dir_, opts)]
            node.run(["sh", "-c", 'mount -t tmpfs -o mode=755 cgroup_root /sys/fs/cgroup && '
                      'while [ $# -gt 0 ]; do mkdir "/sys/fs/cgroup/$1" && '
                      'mount -t cgroup -o "$2" cgroup "/sys/fs/cgroup/$1" && shift 2 || exit 1; done',
                      "mount-cgroups", *args], as_user=False)
        else:
            node.run(["mount", "-t", "cgroup2", "cgroup2", "/sys/fs/cgroup"], as_user=False)

    def _start_slurmd(self, node):
        self._mount_node(node)
        self.slurmd[node.name] = self._spawn(_pdeath(
            node._enter(False) + ["--", "slurmd", "-D", "-N", node.name, "-f", str(self.conf)]),
            f"slurmd-{node.name}.out")

    def close(self):
        """Stop every daemon (slurmd first: it kills the job steps it still runs)."""
        procs = list(self.slurmd.values()) + [self.slurmctld, self.munged]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            if proc is None:
                continue
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.slurmd, self.slurmctld, self.munged = {}, None, None

    # --- waits -----------------------------------------------------------------------------
    def _wait(self, pred, timeout, what, proc=None):
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if proc is not None and proc.poll() is not None:
                raise SlurmError(f"{what} exited {proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout}s waiting for {what}:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self, tail=3000):
        out = []
        for p in sorted((self.dir / "log").glob("*")) + [self.munge_dir / "munged.log"]:
            with contextlib.suppress(OSError):
                out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def node_states(self):
        """{node name: state} as slurmctld sees them ("idle", "alloc", "down*", ...)."""
        r = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        if r.returncode != 0:
            return {}
        return dict(ln.split() for ln in r.stdout.splitlines() if ln.strip())

    def wait_idle(self, timeout=60.0):
        want = {nd.name for nd in self.cluster.nodes}

        def ready():
            for name, proc in self.slurmd.items():
                if proc.poll() is not None:
                    raise SlurmError(f"slurmd on {name} exited {proc.returncode}:\n{self.logs()}")
            states = self.node_states()
            return set(states) == want and all(s == "idle" for s in states.values())

        self._wait(ready, timeout, "every node idle", self.slurmctld)

    # --- clients ---------------------------------------------------------------------------
    def env(self):
        """The environment of a SLURM client (and so of the job) on a node."""
        return {"SLURM_CONF": str(self.conf), "PATH": f"{self.bin_path}:{SYSTEM_PATH}"}

    def client(self, argv, check=True, timeout=30):
        """A SLURM command on the host, as root (sinfo, scontrol, scancel)."""
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": str(self.conf)}
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        if check and r.returncode != 0:
            raise SlurmError(f"{shlex.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def on_node(self, node, argv, timeout=60, check=True, extra_env=None):
        """Run argv on `node` as the test user with SLURM's client environment (a login shell)."""
        env = {**self.env(), **(extra_env or {})}
        cmd = "cd ~ && exec env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + \
            " " + shlex.join(argv)
        return node.run(cmd, check=check, timeout=timeout)

    def sbatch(self, script, node=None, args=(), extra_env=None):
        """Submit `script` from `node` (default node1) as the test user; return the job id."""
        node = node or self.cluster.nodes[0]
        r = self.on_node(node, ["sbatch", "--parsable", *args, str(script)], check=False,
                         extra_env=extra_env)
        if r.returncode != 0:
            raise SlurmError(f"sbatch {script} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id):
        """`scontrol show job -o` as a dict (JobState, ExitCode, NodeList, ...)."""
        out = self.client(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id, timeout, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                  "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")):
        """Wait until the job is in one of `states` (default: ended); return its record."""
        def ended():
            job = self.job(job_id)
            return job if job.get("JobState") in states else None

        return self._wait(ended, timeout, f"job {job_id} to reach {'/'.join(states)}", self.slurmctld)

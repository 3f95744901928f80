"""Host-side plumbing for the test cluster: the test user, keys, address slots, stale cleanup.

Every cluster instance gets a /20 "slot" inside 10.213.0.0/16 (slot 0: host 10.213.0.1, nodes
10.213.0.11 upward; slot 1: 10.213.16.1 / 10.213.16.11 ...), so several clusters (a session
cluster plus a function-scoped one, or two test runs) never share an address. A state file per
slot under STATE_DIR names its owner (pid + start time) and everything it created, so a later
run can remove what a crashed run left behind.
"""

import contextlib
import fcntl
import ipaddress
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

import psutil
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

NETWORK = ipaddress.ip_network("10.213.0.0/16")
SLOT_PREFIXLEN = 20
SLOTS = list(NETWORK.subnets(new_prefix=SLOT_PREFIXLEN))
FIRST_NODE_OFFSET = 11
MAX_NODES = SLOTS[0].num_addresses - FIRST_NODE_OFFSET - 1
STATE_DIR = Path("/run/clusterctl-testcluster")
BASE_DIR = Path("/tmp/clusterctl-testcluster")  # not $TMPDIR: the test user must reach it
LOCK_FILE = STATE_DIR / "lock"
NETNS_ETC = Path("/etc/netns")
NETNS_RUN = Path("/run/netns")


def run(cmd, check=True, input=None, timeout=60):
    """Run a host command quietly; raise with its stderr when it fails."""
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def ip_batch(lines, check=True):
    """Run many `ip` commands in one process (-force: go on after an error)."""
    if lines:
        run(["ip", "-force", "-batch", "-"], check=check, input="\n".join(lines) + "\n")


@contextlib.contextmanager
def host_lock():
    STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_user(name):
    """Create the non-root test login user if missing; '*' password so sshd doesn't see it locked."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        run(["useradd", "--no-create-home", "--home-dir", f"/home/{name}", "--shell", "/bin/bash",
             "--user-group", "--password", "*", name])
        entry = pwd.getpwnam(name)
    shadow = run(["getent", "shadow", name]).stdout.split(":")
    if len(shadow) > 1 and shadow[1].startswith("!"):
        run(["usermod", "--password", "*", name])
    Path(entry.pw_dir).mkdir(mode=0o755, parents=True, exist_ok=True)  # the bind-mount target
    return entry


def write_keypair(path: Path, comment: str) -> str:
    """Write an OpenSSH ed25519 private key (0600) and .pub; return the public key line."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    path.with_name(path.name + ".pub").write_text(f"{public} {comment}\n")
    return public


def owner_alive(state) -> bool:
    try:
        return psutil.Process(state["pid"]).create_time() == state["create_time"]
    except (psutil.Error, KeyError):
        return False


def claim_slot(owner_state) -> int:
    """Under the host lock: pick a free slot, record it. Caller holds host_lock()."""
    used = set()
    for path in STATE_DIR.glob("slot*.json"):
        used.add(int(path.stem[4:]))
    addrs = run(["ip", "-o", "-4", "addr", "show"]).stdout
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", addrs):
        addr = ipaddress.ip_address(m.group(1))
        for i, net in enumerate(SLOTS):
            if addr in net:
                used.add(i)
    for i in range(len(SLOTS)):
        if i not in used:
            owner_state["slot"] = i
            save_state(owner_state)
            return i
    raise RuntimeError(f"all {len(SLOTS)} test-cluster address slots in {NETWORK} are in use")


def save_state(state):
    path = STATE_DIR / f"slot{state['slot']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def netns_inode(ns) -> int:
    return os.stat(NETNS_RUN / ns).st_ino


def pids_in_netns(inodes):
    """pid -> netns inode for every process whose network namespace is one of `inodes`."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ino = os.stat(f"/proc/{entry.name}/ns/net").st_ino
            except OSError:
                continue
            if ino in inodes:
                found[int(entry.name)] = ino
    return found


def kill_netns_processes(namespaces, timeout=5.0):
    """SIGKILL every process living in these namespaces and wait until they are gone."""
    inodes = set()
    for ns in namespaces:
        with contextlib.suppress(OSError):
            inodes.add(netns_inode(ns))
    deadline = time.monotonic() + timeout
    while inodes:
        pids = pids_in_netns(inodes)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(pids)} survived SIGKILL in {sorted(namespaces)}")
        time.sleep(0.02)


def destroy(state):
    """Remove everything a cluster state names; tolerate pieces that are already gone."""
    namespaces = state.get("namespaces", [])
    kill_netns_processes(namespaces)
    lines = [f"link del {veth}" for veth in state.get("veths", [])]
    lines += [f"netns del {ns}" for ns in namespaces if (NETNS_RUN / ns).exists()]
    existing = set(os.listdir("/sys/class/net"))
    lines = [ln for ln in lines if not ln.startswith("link del ") or ln.split()[-1] in existing]
    if state.get("bridge") in existing:
        lines.append(f"link del {state['bridge']}")
    ip_batch(lines, check=False)
    for ns in namespaces:
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    if "uid" in state:
        remove_faketime_litter(state["uid"])
    if state.get("base_dir"):
        shutil.rmtree(state["base_dir"], ignore_errors=True)
    if "slot" in state:
        (STATE_DIR / f"slot{state['slot']}.json").unlink(missing_ok=True)


def remove_faketime_litter(uid):
    """libfaketime 0.9.10 leaves /dev/shm/faketime_shm_PID + sem.faketime_sem_PID behind for
    every process that exec()s or is killed; remove the test user's ones whose pid is gone."""
    for entry in os.scandir("/dev/shm"):
        m = re.fullmatch(r"(?:faketime_shm|sem\.faketime_sem)_(\d+)", entry.name)
        with contextlib.suppress(OSError):
            if m and entry.stat().st_uid == uid and not psutil.pid_exists(int(m.group(1))):
                os.unlink(entry.path)


def clean_stale(prefix):
    """Remove what dead runs left: their recorded slots, and stray namespaces with our prefix."""
    for path in STATE_DIR.glob("slot*.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if not owner_alive(state):
            try:
                destroy(state)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                # A leftover we cannot remove must not stop this run; its slot stays taken.
                warnings.warn(f"test cluster: could not remove stale {path.name}: {exc}")
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)s\d+-\d+$")
    names = set(os.listdir(NETNS_RUN)) if NETNS_RUN.exists() else set()
    names |= set(os.listdir(NETNS_ETC)) if NETNS_ETC.exists() else set()
    stale = [n for n in names if (m := pattern.match(n)) and not psutil.pid_exists(int(m.group(1)))]
    if stale:
        destroy({"namespaces": stale})
    dir_pattern = re.compile(rf"^{re.escape(prefix)}(\d+)s\d+$")
    for entry in (os.scandir(BASE_DIR) if BASE_DIR.exists() else []):
        if (m := dir_pattern.match(entry.name)) and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)

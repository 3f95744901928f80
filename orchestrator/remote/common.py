"""What every program shipped to the nodes shares, written once: orchestrator/probe.py `program`
sends this file's text in front of the program's own, so on a node these are that program's
globals, and the control machine loads the same text as a module (probe.py `common`), so both
sides of the wire read one rule. Stdlib only, and nothing imported at the top but os:
nodeinfo.py starts under -S on every node and counts each import. The programs behind it do not
define these names again (tests/test_remote_common.py looks).

  stop grace         MAX_GRACE, stop_grace: how long a stop waits between SIGTERM and SIGKILL
  checkpoints        checkpoint_step (the names the trainer writes), checkpoint_parts,
                     checkpoint_kind (finished on a node), checkpoint_verified (checked here)
  sha256             sha256_file, Hashed (a stream hashed and counted as it passes)
  tar                tar_member_ok (the one member rule), extract_member, send_tar (to a relay)
  files              write_atomic, safe_name
  rank failures      RANK_FAILED, note_rank_failure (the node agent's RankLines), first_rank_failure (the
                     node agent's status): when a rank first exited non-zero, by the node's clock
  file modes         private_files (each program's first call), own_dir, current_umask, GROUP_ENV;
                     run_dirs: a run's artifact directories (under ARTIFACTS), made
  processes          marked_pids: this user's processes found by an environment marker (a
                     run's: RUN_KEY, its directory under NODE_RUNS); proc_environ: chosen
                     variables of one process's environment
  progress           PROGRESS, progress: a long step's name (and bytes) on stderr, as it starts
                     (setup's install), read back by node/wire.py `progress_of`
"""
import os

# ------------------------------------------------------------------ stop grace

MAX_GRACE = 300.0  # the stop grace is stretched to 2x the last checkpoint save, up to this


def stop_grace(grace, save_seconds=0.0):
    """The seconds between SIGTERM and SIGKILL: at least 2x the job's last checkpoint save, up
    to MAX_GRACE (a longer grace asked for explicitly is kept)."""
    return max(float(grace), min(2 * float(save_seconds), MAX_GRACE))


# ------------------------------------------------------------------ checkpoints

CKPT_PREFIX, CKPT_FILE, SIDECAR, MANIFEST = "ckpt_", ".pt", ".sha256", "MANIFEST.sha256"


def checkpoint_step(name):
    """The step of a checkpoint's name as the trainer writes it, else None: ckpt_NNNNNNNN.pt (a
    file, complete once its .sha256 sidecar sits beside it) or ckpt_NNNNNNNN (an FSDP directory,
    complete once its MANIFEST.sha256 lists every file)."""
    stem = name[:-len(CKPT_FILE)] if name.endswith(CKPT_FILE) else name
    digits = stem[len(CKPT_PREFIX):]
    if stem.startswith(CKPT_PREFIX) and len(digits) == 8 and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


def checkpoint_parts(name):
    """The entries one checkpoint is made of in its directory: a file and its sidecar, or the
    directory."""
    return (name, name + SIDECAR) if name.endswith(CKPT_FILE) else (name,)


def checkpoint_kind(d, name):
    """"file" or "dir" once checkpoint `name` in directory d is finished as the trainer marks it
    (a file's sidecar is written before the file is renamed into place, a directory is renamed
    once its manifest is in it), else None. Its bytes are not read: see checkpoint_verified."""
    if checkpoint_step(name) is None:
        return None
    path = os.path.join(d, name)
    if name.endswith(CKPT_FILE):
        return "file" if os.path.exists(path + SIDECAR) else None
    return "dir" if os.path.isdir(path) else None


def checkpoint_verified(path, digest=None):
    """Whether the checkpoint at `path` holds what its marks say: the file matches its sidecar, or
    every file its directory's MANIFEST names is there and matches. digest(path) -> hex sha256
    (sha256_file by default; a caller that hashed the files as they were written passes its own)."""
    digest = digest or sha256_file
    try:
        if os.path.isdir(path):
            with open(os.path.join(path, MANIFEST)) as f:
                lines = f.read().splitlines()
            for line in lines:
                want, name = line.split("  ", 1)
                if digest(os.path.join(path, name)) != want:
                    return False
            return bool(lines)
        with open(path + SIDECAR) as f:
            want = (f.read().split() or [""])[0]
        return digest(path) == want
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------ sha256


def sha256_file(path):
    """The hex sha256 of a file's bytes, read in 1 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Hashed:
    """Bytes passing by, hashed (sha256) and counted; as a write-only file (for tarfile) each
    write goes to `out` first."""

    def __init__(self, out=None):
        import hashlib

        self.out, self.sha, self.total = out, hashlib.sha256(), 0

    def update(self, data):
        self.sha.update(data)
        self.total += len(data)

    def write(self, data):
        if self.out is not None:
            self.out(data)
        self.update(data)
        return len(data)

    def hexdigest(self):
        return self.sha.hexdigest()


# ------------------------------------------------------------------ tar


def tar_member_ok(member, root, links=False):
    """The one rule for a tar member unpacked below the directory `root`: a relative name with no
    `..` part that stays below root even through a link unpacked before it; a regular file or a
    directory, or with links=True (a sync ships the code's symbolic links as they are) a symbolic
    link. Never a device, a FIFO or a hard link."""
    name = member.name
    if not name or name.startswith("/") or ".." in name.split("/"):
        return False
    if not (member.isfile() or member.isdir() or (links and member.issym())):
        return False
    root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root, name))
    return path == root or path.startswith(root + os.sep)


def extract_member(tar, member, root, links=False):
    """Unpack a member that passed tar_member_ok below root, through tarfile's own filter where
    this Python has one ("data"; "tar" for a stream with links, which may point anywhere). A code
    stream (links=True) keeps each file's mtime (a later sync compares mtimes) and its mode less
    the umask (0755 lands 0700: the owner's execute bit stays); a data stream's files and every
    directory take this node's umask (private_files), never the member's wider mode."""
    import tarfile

    kw = {"filter": "tar" if links else "data"} if hasattr(tarfile, "data_filter") else {}
    tar.extract(member, root, set_attrs=links and member.isfile(), **kw)
    if member.isfile() or member.isdir():  # never wider than this program's umask, whatever the member says
        base = 0o777 if member.isdir() else member.mode if links else 0o666
        os.chmod(os.path.join(root, member.name), base & 0o777 & ~current_umask())


def send_tar(host, port, token, connect_timeout, idle, add):
    """Stream a tar to a relay.py `recv` listening at host:port: present its one-time token, then
    the tar, whose members add(tar) adds. -> the Hashed stream as sent (its bytes and sha256, for
    the control machine to announce). ConnectionError when host:port cannot be reached."""
    import socket
    import tarfile

    try:
        sock = socket.create_connection((host, int(port)), timeout=connect_timeout)
    except OSError as e:
        raise ConnectionError(f"cannot reach {host}:{port}: {e.strerror or e}") from None
    sock.settimeout(idle)
    sock.sendall(token.encode() + b"\n")
    sink = Hashed(sock.sendall)
    with tarfile.open(fileobj=sink, mode="w|", bufsize=1 << 20) as tar:
        add(tar)
    sock.shutdown(socket.SHUT_WR)
    sock.close()
    return sink


# ------------------------------------------------------------------ files


def write_atomic(path, text):
    """Write `text` (str, or bytes as they are) to path.tmp, fsync it, and rename it over `path`:
    a reader sees the old file or the whole new one."""
    tmp = path + ".tmp"
    with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def safe_name(name):
    """A run id, run key or node name usable as one path component: not empty, no "/", no
    leading "."."""
    return bool(name) and "/" not in name and not name.startswith(".")


# ------------------------------------------------------------------ rank failures

RANK_FAILED = "failed."  # + LOCAL_RANK, in the node's run directory: "TIME RC" (node clock)


def note_rank_failure(rundir, local_rank, rc, at):
    """The waiter's note (agent_lines.py RankLines) that a rank ended with rc != 0 at `at`
    (time.time(), the moment it was seen to end)."""
    write_atomic(os.path.join(rundir, RANK_FAILED + str(local_rank)), f"{at:.6f} {rc}\n")


def first_rank_failure(rundir):
    """When a rank of the run first ended with a non-zero exit code (the earliest note of
    note_rank_failure in rundir; notes being written or unreadable are skipped), or None."""
    try:
        names = os.listdir(rundir)
    except OSError:
        return None
    times = []
    for name in names:
        if name.startswith(RANK_FAILED) and not name.endswith(".tmp"):
            try:
                with open(os.path.join(rundir, name)) as f:
                    times.append(float(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
    return min(times, default=None)


# ------------------------------------------------------------------ file modes

# What clusterctl writes on a node is the user's alone: directories 0700, files 0600. With the
# inventory's share_with_group the control machine puts GROUP_ENV=1 in front of a program's command
# line, and what it writes is also readable by the user's group: 0750, 0640.
GROUP_ENV = "CLUSTERCTL_SHARE_WITH_GROUP"
PRIVATE_UMASK, GROUP_UMASK = 0o077, 0o027
USER_UMASK = None  # the umask the program started with (the user's): the job's processes get it back


def umask_for(share_with_group):
    return GROUP_UMASK if share_with_group else PRIVATE_UMASK


def private_files():
    """The first call of every shipped program: from here on
    what the program creates takes umask_for(GROUP_ENV=1 in its environment). Keeps the umask it
    found, the user's (an SSH session's, or a local node's: transport/local.py), in USER_UMASK
    and returns it."""
    global USER_UMASK
    found = os.umask(umask_for(os.environ.get(GROUP_ENV) == "1"))
    if USER_UMASK is None:
        USER_UMASK = found
    return found


def user_umask():
    """The umask the program found when it started (private_files), the user's; None before."""
    return USER_UMASK


def current_umask():
    """The umask in force. Reading it means setting it: for that moment it is PRIVATE_UMASK, so a
    file another thread creates meanwhile is never wider than it would have been."""
    mask = os.umask(PRIVATE_UMASK)
    os.umask(mask)
    return mask


def run_dirs(run_id):
    """The run's artifact directories on this node (ARTIFACTS/RUN_ID/{checkpoints, tensorboard,
    replicas}), made when missing, each dir on the way the user's own: {kind: absolute path}.
    artifacts.py `prepare` prints it; the node agent's `claim ... dirs` answers it with the claim."""
    if not safe_name(run_id):
        raise SystemExit("bad run id")
    for top in (os.path.dirname(ARTIFACTS), ARTIFACTS, os.path.join(ARTIFACTS, run_id)):
        own_dir(top)  # ~/.clusterctl, artifacts/, RUN_ID/: 0700 (0750 under share_with_group)
    return {sub: own_dir(os.path.join(ARTIFACTS, run_id, sub)) for sub in ("checkpoints", "tensorboard", "replicas")}


def own_dir(path):
    """Directory `path` (made with its parents when missing) with the mode the umask gives a new
    one: 0700, or 0750 under share_with_group. One an older clusterctl made 0755 is tightened, and
    a private one opened to the group when the setting changes; a set-group-ID bit is kept (the
    directory's group then owns what is made in it), and a directory of another user is left as
    it is. -> path"""
    os.makedirs(path, exist_ok=True)
    mode = 0o777 & ~current_umask()
    st = os.stat(path)
    if st.st_uid == os.getuid() and st.st_mode & 0o777 != mode:
        os.chmod(path, (st.st_mode & 0o7000) | mode)
    return path


# ------------------------------------------------------------------ processes

ENV_READ = 16 << 10  # one read of /proc/PID/environ


def environ_of(f):
    """An open (unbuffered) /proc/PID/environ read up to its first two NULs in a row: a warm fork
    shows ~200 KB, its own few KB of variables then NULs (bench/bench_env_scan.py: 4.4x less CPU)."""
    out = b""
    while True:
        chunk = f.read(ENV_READ)
        if not chunk:
            return out
        seen = max(0, len(out) - 1)
        out += chunk
        end = out.find(b"\0\0", seen)
        if end >= 0:
            return out[:end + 1]


def proc_environ(pid, names):
    """A process's variables `names` as it started ({name: value}); {} if gone or not ours."""
    try:
        with open(f"/proc/{pid}/environ", "rb", buffering=0) as f:
            block = environ_of(f)
    except OSError:
        return {}
    return {k: vals[-1] for k in names if (vals := env_values(block, k))}


def env_values(block, name):
    """The values of `name` in a /proc/PID/environ block, in order, found by searching it rather
    than splitting it: a rank forked from the warm interpreter shows the zygote's whole padded
    block (~200 KB, mostly NULs), which a split turns into ~200,000 items to look at in Python."""
    tag = b"\0" + name.encode() + b"="
    block = b"\0" + block
    out, i = [], block.find(tag)
    while i >= 0:
        start = i + len(tag)
        end = block.find(b"\0", start)
        out.append(block[start:end if end >= 0 else len(block)].decode(errors="replace"))
        i = block.find(tag, start)
    return out


RUN_KEY = "CLUSTERCTL_RUN_KEY"  # the environment marker every process of a run carries (node_agent.py)
NODE_RUNS = os.path.expanduser("~/.clusterctl/node-runs")  # KEY/: what one attempt leaves on a node
ARTIFACTS = os.path.expanduser("~/.clusterctl/artifacts")  # RUN_ID/: a run's checkpoints, TensorBoard files, replicas


def split_key(key):
    """A node run key RUN_ID[.aK|.warm]@NODE -> (RUN_ID, what, NODE): what is "" for the run's own
    key, "aK" for attempt K's, "warm" for the run's warm interpreter's (warm.py)."""
    head, _, node = key.rpartition("@")
    run, dot, tail = head.rpartition(".")
    if dot and (tail == "warm" or (tail[:1] == "a" and tail[1:].isdigit())):
        return run, tail, node
    return head, "", node


def prctl(option, arg):
    """Linux's prctl(2) through libc (PR_SET_PDEATHSIG 1, PR_SET_CHILD_SUBREAPER 36) -> it took."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - not Linux, or no libc: the run key still finds the processes
        return False


def marked_pids(var, want):
    """The pids of this user's live processes (zombies left out, this one too) whose environment
    sets `var` to a value for which want(value) is true: a run's processes are found by the
    marker they inherit, never by name. A process that ends while the scan reads it is skipped."""
    me, uid, out = os.getpid(), os.getuid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_uid != uid:
                    continue
                env = environ_of(f)
            if not any(want(v) for v in env_values(env, var)):
                continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except (OSError, IndexError):
            continue  # gone meanwhile (or not ours to read)
        out.append(int(name))
    return out


# ------------------------------------------------------------------ progress
PROGRESS = "clusterctl-progress: "  # a stderr line: this, then {"step": what, "bytes": N or null}


def progress(step, nbytes=None):
    """Say on stderr that `step` starts (the control side shows it while the command runs)."""
    import json
    import sys

    sys.stderr.write(PROGRESS + json.dumps({"step": step, "bytes": nbytes}) + "\n")
    sys.stderr.flush()

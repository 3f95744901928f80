"""clusterctl's node agent: a module of the node code (probe.py `node_code`: `PYTHON -c BOOT CODE
node_agent CMD ARGS`), stdlib only; write_atomic, marked_pids, stop_grace and safe_name come from
common.py, the stream's frames from artifacts.py.

Everything a run leaves on a node lives in ~/.clusterctl/node-runs/KEY/, KEY = RUN_ID@NODE
(two `connection: local` nodes share one machine and one home):
  spec.json   what was started (argv, env, cwd)
  proc.json   pid/pgid of torchrun, the waiter's pid, start time
  log         torchrun's stdout+stderr, raw bytes (the controller copies it byte for byte)
  ended       when torchrun ended (node clock), written the moment the waiter reaped it
  exit_code   written atomically by the waiter once torchrun ended and nothing of the run is left
  error.json  torchrun's error file (TORCHELASTIC_ERROR_FILE), when it wrote one
  stop        a stop request {"grace", "at", "peer_failed"}: the waiter carries it out even when
              the `stop` that wrote it lost its connection half way
  save_seconds  how long the job's last checkpoint took (the trainer writes it; the stop grace
              covers it)
and ~/.clusterctl/claims/NODE, the node's claim {"run", "key", "who", "since", "renewed"}: one run at a
time, held by every attempt of it (RUN.aK@NODE) and stale once they ended (claim_stale).
All of it is the user's alone, 0700/0600 (0750/0640 under share_with_group; spec.json, which holds
the inventory's env, 0600 always): private_files. torchrun gets the user's own umask back.

The waiter (the parent of torchrun) is a child subreaper: a worker orphaned by a dead torchrun is
reparented to it, and once torchrun ended by any means, the waiter kills what is left of the run
(its process group, then every process carrying the run key). No controller is involved.

Every process of a run carries CLUSTERCTL_RUN_KEY=KEY (and CLUSTERCTL_RUN_ID=RUN_ID) in its
environment, so the run is found again by id (scanning /proc/*/environ of this user's
processes), never by name pattern.

  start KEY SPEC_JSON_HEX|-    detach torchrun (own session), print {"pid", "pgid"}; with -, the
                               spec's JSON is on stdin (off the command line)
  stop KEY GRACE [peer-failed] SIGTERM the run, SIGKILL after GRACE s; print {"left": n}. With
                               peer-failed (the run goes down because another node's part
                               died: no collective can complete, so nothing is left to save),
                               SIGKILL at once unless a process of the run is writing a
                               checkpoint (then as without it)
  status KEY                   print the run's state as JSON
  tail KEY OFFSET [status]     stream the log from OFFSET until the run ended and all is sent;
                               with status, then `status`'s JSON on stderr after STATUS_MARK
  tail KEY OFFSET stream CKPTDIR|- TBDIR OFFSETS_HEX [PROGRESS_S]
                               the same as framed records on stdout, with the node's new
                               checkpoints and TensorBoard bytes and, last, the status (Stream);
                               with PROGRESS_S > 0, also every rank's progress (`snapshot ...
                               progress`'s document) asked every PROGRESS_S s in this process,
                               for the straggler watch (absent or 0: none)
  live                         print the keys of runs still alive on this node
  claim NODE KEY WHO           take the node for run KEY, or renew KEY's own claim: print {"ok": true,
                               ...} or {"ok": false, the holder's record}; a stale claim is replaced
  release NODE KEY             drop the node's claim if run KEY holds it
  claims                       print {NODE: claim + "stale"} for every claim on this machine
  wait-listening KEY PORT S    wait until TCP PORT listens ("listening"), the run ends
                               ("exited") or S seconds pass ("timeout")
  snapshot KEY N WAIT [progress] each rank's /proc state and what its hook (remote/hook/
                               sitecustomize.py, in RUNDIR/py on the job's PYTHONPATH) answers
                               to request N within WAIT s: its Python stacks and Flight Recorder
                               (with `progress`: only the compute time of its newest steps;
                               the straggler watch has these from `tail ... stream PROGRESS_S`
                               instead, and asks this way only of a node with no stream)
  reach S HOST:PORT...         whether each HOST:PORT takes a TCP connection within S s
"""
import glob
import json
import os
import signal
import sys
import time

from .common import (
    NODE_RUNS, PRIVATE_UMASK, RUN_KEY, first_rank_failure, marked_pids, note_rank_failure,
    own_dir, private_files, proc_environ, safe_name, stop_grace, user_umask, write_atomic,
)

BASE = NODE_RUNS  # common.py
CLAIMS = os.path.expanduser("~/.clusterctl/claims")
CLAIM_START_S = 900  # a claim whose run started nothing on the node is held this long after it was taken or
# renewed (preflight, restore, a spare's preparation), unless the controller releases it first
TORCHRUN_EXIT_S = 3.0  # on a stop, torchrun's time to exit on its own once its workers are gone:
# its monitor interval is 0.1 s, then its exit barrier (the other nodes, stopped at the same moment)
# and ~1 s of CPU tearing its interpreter down. Signalled sooner, it records a failure (1, 143)
# for a run whose ranks saved and ended well; later, a torchrun stuck in a barrier holds the stop.
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
STATUS_MARK = "clusterctl-status "  # `tail KEY OFFSET status`: its last stderr line, before the JSON
PROGRESS_WAIT_S = 5.0  # how long the stream's progress request waits for the ranks' answers
HOOK = "hook"  # RUNDIR/hook: the ranks' snapshot FIFOs (PID.fifo) and answers (PID.N.json)
# the Flight Recorder in every rank: its entries are what `snapshot` reads, and an NCCL collective
# timeout dumps them into RUNDIR/hook (TORCH_FR_BUFFER_SIZE is torch >= 2.5's name; the older
# TORCH_NCCL_TRACE_BUFFER_SIZE is left out: 2.13 warns on every rank that it is deprecated)
FLIGHT_RECORDER = (("TORCH_FR_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"))


def rundir(run_id):
    if not safe_name(run_id):
        sys.exit("bad run id")
    return os.path.join(BASE, run_id)


def read(path, default=None):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def run_pids(run_id, match=None):
    """This user's processes whose environment carries CLUSTERCTL_RUN_KEY=key (or, with
    `match`, a run key for which match(key) is true)."""
    return marked_pids(RUN_KEY, match or (lambda key: key == run_id))


def pgid_of(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def start(run_id, spec_hex="-"):
    # "-": the spec (JSON) is on stdin, so it (the inventory's env: tokens, keys) never shows on a
    # command line in `ps` on the node
    if spec_hex == "-":
        spec = json.loads(sys.stdin.buffer.read().decode() or "null")
        if not isinstance(spec, dict):
            sys.exit("no spec: expected the spec's JSON on stdin")
    else:
        spec = json.loads(bytes.fromhex(spec_hex).decode())
    d = rundir(run_id)
    own_dir(os.path.dirname(BASE))  # ~/.clusterctl: an older clusterctl's 0755 is tightened
    own_dir(BASE)
    os.mkdir(d)  # 0700 (0750 under share_with_group): private_files' umask
    umask = os.umask(PRIVATE_UMASK)  # spec.json holds the inventory's env: the user's eyes only, always
    try:
        write_atomic(os.path.join(d, "spec.json"), json.dumps(spec))
    finally:
        os.umask(umask)
    r, w = os.pipe()
    if os.fork() > 0:  # the caller: wait for the waiter to report torchrun's pid
        os.close(w)
        data = b""
        deadline = time.time() + 30
        while time.time() < deadline:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            data += chunk
        if not data:
            sys.exit("the run did not start: " + (read(os.path.join(d, "log"), "") or "")[-2000:])
        print(data.decode().strip(), flush=True)
        return
    os.close(r)
    os.setsid()  # leave the SSH session: a dropped connection must not kill the run
    if os.fork() > 0:
        os._exit(0)
    waiter(d, run_id, spec, w)


def hook_env(d, text, env):
    """RUNDIR/py/sitecustomize.py in front of the job's PYTHONPATH, its FIFOs and answers in
    RUNDIR/hook, and the Flight Recorder on (a value the user set is kept): every rank can be
    asked for its stacks and collectives (`snapshot`), and a collective timeout dumps there."""
    os.makedirs(os.path.join(d, "py"), exist_ok=True)
    os.makedirs(os.path.join(d, HOOK), exist_ok=True)
    write_atomic(os.path.join(d, "py", "sitecustomize.py"), text)
    env["PYTHONPATH"] = os.path.join(d, "py") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CLUSTERCTL_HOOK_DIR"] = os.path.join(d, HOOK)
    for var, value in FLIGHT_RECORDER:
        env.setdefault(var, value)
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(d, HOOK, "fr_trace_"))


def default_signals():
    """An ignored signal stays ignored across exec: give the run back SIGTERM (its graceful stop),
    and the user's umask: what the job writes is the user's, not clusterctl's (private_files)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if user_umask() is not None:
        os.umask(user_umask())


def prctl(option, arg):
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - not Linux, or no libc: the run key still finds the processes
        return False


def waiter(d, run_id, spec, notify_fd):
    import subprocess

    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # release the SSH channel's pipes
        os.dup2(devnull, fd)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the waiter outlives torchrun to record its exit
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphaned workers become our children, not init's
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    env[RUN_KEY] = run_id
    env["CLUSTERCTL_RUN_ID"] = run_id.split("@")[0]
    env["CLUSTERCTL_NODE_DIR"] = d  # where the job may leave save_seconds
    env["TORCHELASTIC_ERROR_FILE"] = os.path.join(d, "error.json")
    env.setdefault("PYTHONUNBUFFERED", "1")
    cwd = os.path.expanduser(spec.get("cwd") or "~")
    for name, text in spec.get("files", {}).items():  # helpers the command runs
        write_atomic(os.path.join(d, os.path.basename(name)), text)
    log = open(os.path.join(d, "log"), "ab", buffering=0)
    lines = None
    if spec.get("hook"):  # the snapshot hook in every rank (remote/hook/sitecustomize.py)
        hook_env(d, spec["hook"], env)
        lines = RankLines.open(d, log.fileno(), env)
    argv = [os.path.expanduser(spec["argv"][0])] + [d + a[len("{rundir}"):] if a.startswith("{rundir}/")
                                                    else a for a in spec["argv"][1:]]
    try:
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_signals)
    except OSError as e:
        log.write(f"clusterctl: cannot start {spec['argv'][0]!r} in {cwd}: {e}\n".encode())
        write_atomic(os.path.join(d, "exit_code"), "127")
        os.write(notify_fd, json.dumps({"pid": None, "error": str(e)}).encode())
        os._exit(0)
    # SIGCHLD stays pending (not discarded) until supervise() takes it: torchrun's end is seen at
    # once instead of at the next poll; blocked only now, so torchrun does not inherit the mask
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    if lines is not None:  # its thread inherits the mask: SIGCHLD stays supervise()'s
        lines.start()
    info = {"pid": p.pid, "pgid": p.pid, "waiter": os.getpid(), "started": time.time()}
    write_atomic(os.path.join(d, "proc.json"), json.dumps(info))
    os.write(notify_fd, json.dumps(info).encode())
    os.close(notify_fd)
    rc = supervise(d, run_id, info)
    write_atomic(os.path.join(d, "ended"), repr(time.time()))
    # torchrun is gone, by any means: nothing of the run may outlive it on this node
    info["waiter"] = os.getpid()
    end_run(run_id, info, grace=2.0)
    reap_until_gone(run_id, 5.0)
    if lines is not None:  # every rank's last lines are in the log before the exit code says it ended
        lines.finish(LINES_DRAIN_S)
    write_atomic(os.path.join(d, "exit_code"), str(recorded_exit(d, rc, lines, argv, log)))
    os._exit(0)


def supervise(d, run_id, info):
    """Wait for torchrun (reaping the orphans handed to us meanwhile) and carry out a stop
    request found in the run directory; torchrun's wait status as Popen reports it."""
    stopping = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 1
        if pid == info["pid"]:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if pid:
            continue  # an orphaned worker, reaped
        if stopping is None:
            req = read(os.path.join(d, "stop"))
            if req is not None:
                req = json.loads(req)
                stopping = threading_start(end_run, run_id, info, float(req.get("grace", 5)),
                                           bool(req.get("peer_failed")))
        signal.sigtimedwait({signal.SIGCHLD}, 0.2)  # a child ended, or time to look for a stop request


LINES_SOCK = "lines.sock"  # RUNDIR/lines.sock: where each rank's hook hands over its output pipes
LINES_ENV = "CLUSTERCTL_LINES"  # its path, in the job's environment
LINES_DRAIN_S = 5.0  # once nothing of the run is left, how long its pipes' last bytes are waited for
MAX_LINE = 1 << 16  # a "line" longer than this without a newline is cut, never held forever


def unix_path(path):
    """`path` as an AF_UNIX address: one too long for sun_path (108 bytes) is reached through a
    descriptor of its directory (kept open)."""
    if len(path.encode()) < 100:
        return path
    return f"/proc/self/fd/{os.open(os.path.dirname(path), os.O_RDONLY)}/{os.path.basename(path)}"


def zombie_status(pid):
    """How process `pid` ended, as Popen reports it (-N: signal N), read from /proc/PID/stat while
    it is a zombie its parent has not reaped yet; None once it is gone (or is another process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] not in "ZX" or len(fields) < 50:
        return None
    status = int(fields[49])  # exit_code, in waitpid's form
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


class RankLines:
    """The ranks' output in the run's log as whole lines tagged `[default<LOCAL_RANK>]:`, written
    by a thread of the waiter: no process beside a rank.

    Before the script runs, each rank's hook (remote/hook/sitecustomize.py) makes two pipes, puts
    their write ends on its stdout and stderr and sends the read ends here over RUNDIR/lines.sock
    (SCM_RIGHTS) with its LOCAL_RANK. This thread reads every rank's pipes and writes complete
    lines only, one write() per batch, into the log (O_APPEND): lines from different ranks and
    streams never tear or merge, a line longer than MAX_LINE is cut, a last line without a newline
    is completed. torchrun's own --tee cannot promise that: it re-reads worker files with
    readline() and prints a partial line at EOF (a flush mid-line, a tqdm bar) as if it were
    whole. The read ends are held here, so what a rank wrote before it died is read all the same.

    A rank's end is seen here too, on a pidfd taken while its hook waits for the hand-over's
    answer. A rank that ended with a non-zero status has the moment noted (note_rank_failure),
    before its output is drained: the root cause of a failed run is the node whose rank failed
    first (the node agent's status reports the earliest). The status is read from /proc while the
    rank is a zombie (torchrun reaps it at its next poll, every 0.1 s). Where torchrun reaped it
    first (a busy node), what the hook said decides: an uncaught exception or sys.exit with a non-zero code is a
    failure, an end through Python's finalization without either is not, os._exit(N) is what N
    says, and an end without any of these (a signal, a crash) is one, its code noted as "?".
    """

    @classmethod
    def open(cls, d, log_fd, env):
        """Listen on RUNDIR/lines.sock and name it in the job's `env`; None (said in the log)
        where it cannot: the ranks then write to the log as torchrun does, untagged."""
        import socket

        path = os.path.join(d, LINES_SOCK)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            srv.bind(unix_path(path))
            srv.listen(64)
        except OSError as e:
            srv.close()
            os.write(log_fd, f"clusterctl: rank lines untagged: cannot listen on {path}: {e}\n".encode())
            return None
        env[LINES_ENV] = path
        return cls(d, log_fd, srv)

    def __init__(self, d, log_fd, srv):
        import selectors

        self.d, self.log, self.srv = d, log_fd, srv
        self.sel = selectors.DefaultSelector()
        self.sel.register(srv, selectors.EVENT_READ, (self.accept, None))
        self.pipes = {}  # read end -> [prefix, bytes not yet a whole line]
        self.alive = {}  # pidfd -> the rank: {"pid", "local", "said"}
        self.ends = {}  # LOCAL_RANK -> how its newest process ended (0, an exit code, "?")
        self.until = None  # set by finish(): drain what is left until then, take no new rank
        self.thread = None

    def start(self):
        self.thread = threading_start(self.serve)

    def finish(self, seconds):
        self.until = time.time() + seconds
        if self.thread is not None:
            self.thread.join(seconds + 1.0)

    def serve(self):
        while self.until is None or ((self.pipes or self.alive) and time.time() < self.until):
            if self.until is not None:
                self.close_listener()
            events = self.sel.select(0.2)
            # a rank's end before its output: its failure is noted at the moment it is seen
            events.sort(key=lambda e: e[0].data[0] != self.ended)
            for key, _ in events:
                if key.fd in self.sel.get_map():  # not closed by an earlier event of this batch
                    key.data[0](key.fileobj, key.data[1])
        self.close_listener()
        for fd in list(self.pipes):
            self.close_pipe(fd)

    def ended_well(self, nproc):
        """Every one of the node's `nproc` ranks handed its output over and exited 0, none left."""
        return bool(nproc) and not self.alive and sorted(self.ends, key=int) == [str(i) for i in range(nproc)] \
            and all(rc == 0 for rc in self.ends.values())

    def close_listener(self):
        """No new rank once the job ended: the socket closed and its name gone from the run
        directory (a dead socket file is litter, and no one's to read)."""
        if self.srv is None:
            return
        self.sel.unregister(self.srv)
        self.srv.close()
        self.srv = None
        try:
            os.unlink(os.path.join(self.d, LINES_SOCK))
        except OSError:
            pass

    def accept(self, srv, _):
        import selectors
        import socket
        import struct

        try:
            conn, _ = srv.accept()
        except OSError:
            return
        fds = []
        try:
            conn.settimeout(5)
            msg, fds, _, _ = socket.recv_fds(conn, 64, 2)
            pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            if len(fds) != 2 or not msg.strip().isdigit():
                raise OSError("not a rank's hand-over")
            pidfd = os.pidfd_open(pid)
            conn.sendall(b"k")
        except OSError:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        rank = {"pid": pid, "local": msg.strip().decode(), "said": b""}
        for fd in fds:
            os.set_inheritable(fd, False)
            self.pipes[fd] = [b"[default" + msg.strip() + b"]:", b""]
            self.sel.register(fd, selectors.EVENT_READ, (self.read, None))
        self.alive[pidfd] = rank
        self.sel.register(pidfd, selectors.EVENT_READ, (self.ended, rank))
        conn.setblocking(False)
        self.sel.register(conn, selectors.EVENT_READ, (self.said, rank))

    def said(self, conn, rank):
        """What the hook says of the rank's end, a line each (hooks_word)."""
        try:
            data = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        rank["said"] += data
        if not data:
            self.sel.unregister(conn)
            conn.close()

    def ended(self, pidfd, rank):
        at = time.time()
        self.sel.unregister(pidfd)
        os.close(pidfd)
        del self.alive[pidfd]
        rc = zombie_status(rank["pid"])
        if rc is None:  # reaped by torchrun already: the hook's word
            rc = hooks_word(rank["said"])
        self.ends[rank["local"]] = rc
        if rc != 0:
            try:
                note_rank_failure(self.d, rank["local"], rc, at)
            except OSError:  # best effort: the node's end time still orders the failure
                pass

    def read(self, fd, _):
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self.close_pipe(fd)
            return
        prefix, held = self.pipes[fd]
        held += chunk
        cut = held.rfind(b"\n") + 1
        if not cut and len(held) >= MAX_LINE:
            cut = len(held)
        if cut:
            lines = held[:cut].split(b"\n")
            if lines[-1] == b"":
                lines.pop()
            write_all(self.log, b"".join(prefix + ln + b"\n" for ln in lines))
        self.pipes[fd][1] = held[cut:]

    def close_pipe(self, fd):
        prefix, held = self.pipes.pop(fd)
        self.sel.unregister(fd)
        os.close(fd)
        if held:  # the rank ended without a final newline
            write_all(self.log, prefix + held + b"\n")


def recorded_exit(d, rc, lines, argv, log):
    """The node's exit code from torchrun's wait status (killed by signal N -> 128+N), except
    where a stop ended torchrun after every rank here had exited 0: torchrun was still leaving
    (its exit barrier waits for the other nodes' torchruns, and loses the store when node 0's
    leaves first), and the job ended well; its signal is not the job's verdict (said in the log)."""
    if rc in (-signal.SIGTERM, -signal.SIGKILL) and lines is not None and os.path.exists(os.path.join(d, "stop")) \
            and lines.ended_well(nproc_of(argv)):
        log.write(f"clusterctl: the stop ended torchrun (signal {-rc}) after every rank on this node had "
                  f"exited 0; exit code 0 recorded, the ranks' own\n".encode())
        return 0
    return 128 - rc if rc < 0 else rc


def nproc_of(argv):
    """The ranks a node's torchrun starts (its --nproc-per-node), or None when argv does not say."""
    for i, a in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            value = argv[i + 1] if a == flag and i + 1 < len(argv) else a[len(flag) + 1:] \
                if a.startswith(flag + "=") else None
            if value is not None:
                return int(value) if value.isdigit() else None
    return None


def hooks_word(said):
    """A rank's exit code as its hook told it (lines: e an uncaught exception, sN sys.exit(N) with
    N non-zero, oN os._exit(N), x Python's finalization); "?" for an end it could not tell (a
    signal, a crash): a failure whose code torchrun alone saw."""
    words = said.decode(errors="replace").split()
    if "e" in words:
        return 1
    for w in reversed(words):
        if w[:1] in ("s", "o") and w[1:].lstrip("-").isdigit():
            return int(w[1:])
    return 0 if "x" in words else "?"


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def threading_start(fn, *args):
    import threading

    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def reap_until_gone(run_id, seconds):
    """Reap our children until no process of the run is left (or `seconds` pass)."""
    def gone():
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        return not [p for p in run_pids(run_id) if p != os.getpid()]

    wait_until(gone, time.time() + seconds)


def save_seconds(d):
    try:
        return float(read(os.path.join(d, "save_seconds"), "") or 0)
    except ValueError:
        return 0.0


def wait_until(done, until):
    """Poll done() until it is true or the time `until` passes, every 10 ms at first, then
    less often (each poll may scan /proc); done()'s last value."""
    step = 0.01
    while not (ok := done()) and time.time() < until:
        time.sleep(min(step, max(0.0, until - time.time())))
        step = min(step * 2, 0.1)
    return ok


def writing_checkpoint(pids):
    """Whether one of `pids` has a file open for writing under a temporary name (a path part
    ending in .tmp or holding .tmp.): a checkpoint being written, to be renamed into place whole
    (trainer/checkpoint.py writes ckpt_N.pt.tmp.PID, and FSDP shards into ckpt_N.tmp/)."""
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                flags = int((read(f"/proc/{pid}/fdinfo/{fd}", "") or "").split("flags:")[1].split()[0], 8)
            except (OSError, IndexError, ValueError):
                continue  # closed meanwhile
            if path.startswith("/") and flags & 3 and any(part.endswith(".tmp") or ".tmp." in part
                                                           for part in path.split("/")):
                return True
    return False


def end_run(run_id, info, grace, peer_failed=False):
    """SIGTERM the run's workers (the trainer checkpoints), then torchrun, SIGKILL what is left
    after `grace` s. Processes are found by the run key; the waiter `info["waiter"]` is spared.
    peer_failed: another node's part of the run died, so no collective (and no collective
    checkpoint) can complete: SIGKILL at once, unless a checkpoint is being written here (then
    it gets the grace to finish it, as on any stop)."""
    waiter, torchrun = info.get("waiter"), info.get("pid")

    def targets():
        return [p for p in run_pids(run_id) if p != waiter]

    def workers():
        return [p for p in targets() if p != torchrun]

    def signal_all(sig):
        pids = targets()
        # the group only while a process of this run is still in it: a pgid can be reused
        if info.get("pgid") and any(pgid_of(p) == info["pgid"] for p in pids):
            try:
                os.killpg(info["pgid"], sig)
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    deadline = time.time() + float(grace)
    if peer_failed and not writing_checkpoint(targets()):
        deadline = time.time()
    # the workers first, with the whole grace: they stop (the trainer checkpoints) and torchrun,
    # seeing them done, exits on its own with their verdict; torchrun is signalled itself only
    # when it has no workers (yet), or once the grace is over
    started = workers() if deadline > time.time() else []
    for pid in started:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    if started and wait_until(lambda: not workers(), deadline):
        # workers done: torchrun exits on its own with their verdict, the code recorded
        wait_until(lambda: not targets() or workers(), time.time() + TORCHRUN_EXIT_S)
    signal_all(signal.SIGTERM if deadline > time.time() else signal.SIGKILL)
    if not wait_until(lambda: not targets(), deadline):
        signal_all(signal.SIGKILL)
        wait_until(lambda: not targets(), time.time() + 5)
    return len(targets())


def stop(run_id, grace, mode=""):
    if mode not in ("", "peer-failed"):
        sys.exit(f"unknown stop mode {mode!r}: expected peer-failed")
    d = rundir(run_id)
    if not os.path.isdir(d):
        print(json.dumps({"left": len(run_pids(run_id))}))
        return
    grace = stop_grace(grace, save_seconds(d))
    if read(os.path.join(d, "stop")) is None:  # first: the waiter finishes the stop if we are cut off
        write_atomic(os.path.join(d, "stop"), json.dumps({"grace": grace, "at": time.time(),
                                                          "peer_failed": mode == "peer-failed"}))
    info = json.loads(read(os.path.join(d, "proc.json"), "{}") or "{}")
    left = end_run(run_id, info, grace, mode == "peer-failed")
    # the waiter records the exit code once torchrun is reaped and the run is cleaned up
    wait_until(lambda: read(os.path.join(d, "exit_code")) is not None, time.time() + 8)
    if read(os.path.join(d, "exit_code")) is None and not run_pids(run_id):
        write_atomic(os.path.join(d, "exit_code"), "137")
    print(json.dumps({"left": left}))


def status(run_id):
    print(json.dumps(status_doc(run_id)))


def status_doc(run_id):
    d = rundir(run_id)
    info = json.loads(read(os.path.join(d, "proc.json"), "{}") or "{}")
    code = read(os.path.join(d, "exit_code"))
    err = read(os.path.join(d, "error.json"))
    try:  # when torchrun ended, node clock
        ended = float(read(os.path.join(d, "ended"), "") or os.path.getmtime(os.path.join(d, "exit_code")))
    except (OSError, ValueError):
        ended = None
    size, last = 0, ""
    try:
        with open(os.path.join(d, "log"), "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
            last = lines[-1] if lines else ""
    except OSError:
        pass
    return {"exists": os.path.isdir(d), "pid": info.get("pid"), "started": info.get("started"),
            "exit_code": None if code is None else int(code), "alive": len(run_pids(run_id)),
            "log_size": size, "last_line": last, "error_file": err, "ended": ended,
            "rank_failed": first_rank_failure(d),
            "save_seconds": save_seconds(d), "stop_requested": read(os.path.join(d, "stop")) is not None}


def vanished(d, run_id):
    """The waiter was killed before it could record an exit code, and nothing of the run is left."""
    info = json.loads(read(os.path.join(d, "proc.json"), "{}") or "{}")
    if not info.get("waiter"):
        return False
    try:
        os.kill(info["waiter"], 0)
        return False
    except OSError:
        return not run_pids(run_id)


def tail(run_id, offset, report="", *watch):
    """The log from `offset` until the run ended and every byte is out; with report=status,
    then `status`'s JSON as the last stderr line, after STATUS_MARK (saves asking again); with
    report=stream, framed records instead (see Stream)."""
    if report not in ("", "status", "stream") or len(watch) not in ((3, 4) if report == "stream" else (0,)):
        sys.exit(f"unknown tail report {report!r}: expected status, or stream CKPTDIR|- TBDIR OFFSETS_HEX "
                 "[PROGRESS_S]")
    d = rundir(run_id)
    path = os.path.join(d, "log")
    sink = Stream(run_id, *watch) if report == "stream" else Plain(report)
    pos = int(offset)
    deadline = time.time() + 30
    while not os.path.exists(path):  # the run may be a moment from starting
        if time.time() > deadline:
            sys.exit("no log for run " + run_id)
        time.sleep(0.05)
    idle_since = time.time()
    with open(path, "rb") as f:
        f.seek(pos)
        while True:
            chunk = f.read(1 << 20)
            if chunk:
                pos = sink.log(pos, chunk)
                idle_since = time.time()
                continue
            ended = os.path.exists(os.path.join(d, "exit_code"))
            if not ended and time.time() - idle_since > 2:  # quiet: is anyone left to write?
                idle_since = time.time()
                ended = vanished(d, run_id)
            if ended:
                chunk = f.read()  # whatever landed between the last read and the exit
                if not chunk:
                    sink.end(status_doc(run_id))
                    return
                pos = sink.log(pos, chunk)
                continue
            sink.tick()
            time.sleep(0.02)


class Plain:
    """`tail`'s raw output: the log bytes as they are; with report=status, the end after STATUS_MARK."""

    def __init__(self, report):
        self.report, self.out = report, sys.stdout.buffer

    def log(self, pos, chunk):
        self.out.write(chunk)
        self.out.flush()
        return pos + len(chunk)

    def tick(self):
        pass

    def end(self, doc):
        if self.report:
            sys.stderr.write(STATUS_MARK + json.dumps(doc) + "\n")


class Stream(Plain):
    """`tail KEY OFFSET stream CKPTDIR|- TBDIR OFFSETS_HEX [PROGRESS_S]`: one stream for everything
    the control machine takes from a running node. Records (artifacts.py `frame`): the log's bytes
    by offset, the complete checkpoints in CKPTDIR whenever they change, TensorBoard bytes past
    OFFSETS_HEX (artifacts.py `since`'s frames), looked for every SCAN_S s in this one process,
    with PROGRESS_S every rank's progress (`snapshot_doc`, asked every PROGRESS_S s), and last the
    run's status, by artifacts.py's rules (the ones its `poll` applies)."""

    def __init__(self, run_id, ckpt_dir, tb_dir, offsets_hex, progress_s="0"):
        super().__init__("stream")
        from . import artifacts  # only the stream needs its rules: the agent's other verbs start without them

        self.art = artifacts
        self.ckpt_dir, self.tb_dir, self.last = ckpt_dir, tb_dir, {}
        self.have = json.loads(bytes.fromhex(offsets_hex).decode()) if offsets_hex != "-" else {}
        self.next_scan = 0.0
        self.run_id, self.progress_s = run_id, float(progress_s)
        self.next_ask = time.time() + self.progress_s  # the ranks' hooks are made as they start: not at once
        self.asking = None  # the thread asking the ranks now
        self.answers = []  # its finished documents, for the main thread to write (list ops are atomic)

    def log(self, pos, chunk):
        self.out.write(self.art.frame({"t": self.art.FRAME_LOG, "offset": pos}, chunk))
        self.out.flush()
        self.tick()  # a log that never pauses still gets its checkpoints seen
        return pos + len(chunk)

    def tick(self, now=False):
        self.progress()
        if not now and time.time() < self.next_scan:
            return
        self.next_scan = time.time() + self.art.SCAN_S
        for rec in self.art.stream_records(self.ckpt_dir, self.tb_dir, self.have, self.last):
            self.out.write(rec)
        self.out.flush()

    def progress(self):
        """Write the progress answers that came in; every PROGRESS_S s, ask again on a thread of
        its own (a hook waited for must not hold up the log), never two requests at once."""
        if self.progress_s <= 0:
            return
        while self.answers:
            doc = self.answers.pop(0)
            self.out.write(self.art.frame({"t": self.art.FRAME_PROGRESS}, json.dumps(doc).encode()))
            self.out.flush()
        if (self.asking is not None and self.asking.is_alive()) or time.time() < self.next_ask:
            return
        self.next_ask = time.time() + self.progress_s
        self.asking = threading_start(self.ask, time.time_ns() // 1_000_000)  # unique on the node, as elsewhere

    def ask(self, request):
        try:
            doc = snapshot_doc(self.run_id, request, PROGRESS_WAIT_S, "progress")
        except Exception as e:  # noqa: BLE001 - said in the record; the stream goes on
            doc = {"ranks": [], "time": time.time(), "error": f"{type(e).__name__}: {e}"}
        self.answers.append(doc)

    def end(self, doc):
        self.tick(now=True)  # what the run wrote last
        self.out.write(self.art.frame({"t": self.art.FRAME_END}, json.dumps(doc).encode()))
        self.out.flush()


def live():
    out = []
    for run_id in sorted(os.listdir(BASE)) if os.path.isdir(BASE) else []:
        d = os.path.join(BASE, run_id)
        if read(os.path.join(d, "exit_code")) is None and run_pids(run_id):
            out.append(run_id)
    print(json.dumps(out))


def proc_stat(pid):
    """(state, ppid, cpu seconds) of a process from /proc/PID/stat; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_io(pid):
    """Bytes the process read from and wrote to storage (/proc/PID/io; None where unreadable)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            got = dict(line.split(": ") for line in f.read().splitlines() if ": " in line)
        return int(got["read_bytes"]) + int(got["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def rank_procs(run_id, torchrun_pid, hook=None):
    """{pid: {"rank", "local_rank", "state", "ppid", "cpu_s", "wchan", "tree_cpu_s", "io", "at"}} for each
    rank of the run on this node: of the processes with that RANK that are not torchrun (a rank's
    data-loader workers carry its RANK too), the topmost one whose hook listens in `hook`, else the
    topmost; tree_cpu_s and io (disk bytes) are those of all of them together, read at `at` (the
    hang watch's sign that a rank works: runs/judge/hangrule.py)."""
    found = {}
    for pid in run_pids(run_id):
        if pid == torchrun_pid:
            continue
        env = proc_environ(pid, ("RANK", "LOCAL_RANK"))
        st = proc_stat(pid)
        if "RANK" not in env or st is None:
            continue
        found[pid] = {"pid": pid, "rank": int(env["RANK"]) if env["RANK"].isdigit() else env["RANK"],
                      "local_rank": env.get("LOCAL_RANK"), "state": st[0], "ppid": st[1], "cpu_s": st[2],
                      "wchan": (read(f"/proc/{pid}/wchan", "") or "").strip()}
    out = {}
    for rank in dict.fromkeys(p["rank"] for p in found.values()):
        group = [pid for pid, p in found.items() if p["rank"] == rank]
        pick = [pid for pid in group if hook and os.path.exists(os.path.join(hook, f"{pid}.fifo"))] or group
        tops = [pid for pid in pick if found[pid]["ppid"] not in pick]
        pid = min(tops or pick)
        ios = [disk_io(p) for p in group]
        out[pid] = dict(found[pid], at=time.time(), tree_cpu_s=round(sum(found[p]["cpu_s"] for p in group), 3),
                        io=sum(i for i in ios if i is not None) if any(i is not None for i in ios) else None)
    return out


def open_fifo(path, until):
    """(fd, "") of a rank's request FIFO opened for writing, else (None, why). While the hook
    answers another request (the straggler watch's, the hang watch's) nobody reads it (ENXIO):
    it reads again within moments, so that is waited for, until `until` (time.time())."""
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK), ""
        except OSError as e:
            if e.errno != 6 or time.time() > until:
                return None, "" if e.errno in (2, 6) else f" ({e.strerror})"
        time.sleep(0.05)


def snapshot(run_id, request, wait, what="stacks"):
    """Prints `snapshot_doc`."""
    print(json.dumps(snapshot_doc(run_id, request, wait, what)))


def snapshot_doc(run_id, request, wait, what="stacks"):
    """Every rank of the run on this node: its /proc state, and what its hook answers to request
    N within `wait` s (its threads' Python stacks, its Flight Recorder; with what=progress, its
    newest steps only). A dead process is not asked, nor a stopped (T) one for its stacks (a hang's
    culprit: py-spy reads it from outside); a stopped one is asked for its progress, which it
    answers once it runs again within `wait` (a rank throttled by stops is a straggler, not a
    hang). {"ranks": [...], "time"}."""
    d = rundir(run_id)
    hook = os.path.join(d, HOOK)
    info = json.loads(read(os.path.join(d, "proc.json"), "{}") or "{}")
    ranks = rank_procs(run_id, info.get("pid"), hook)
    asked = {}
    # how long a busy hook (answering another asker's request) is waited for: half the wait, at least
    # 3 s; a rank spinning in Python lends its hook the GIL in 5 ms slices, so an answer can take seconds
    busy_until = time.time() + max(3.0, float(wait) / 2)
    for pid, p in ranks.items():
        if p["state"] in "ZX" or (p["state"] in "Tt" and what != "progress"):
            p["error"] = "not asked: the process is stopped" if p["state"] in "Tt" else "not asked: it ended"
            continue
        drop_stale_answers(hook, pid)
        if os.path.exists(os.path.join(hook, f"{pid}.exiting")):  # its script ended (the hook's atexit)
            p["exiting"], p["error"] = True, "not asked: it is exiting (its script ended)"
            continue
        fd, why = open_fifo(os.path.join(hook, f"{pid}.fifo"), busy_until)
        if fd is None:
            p["error"] = "no hook answers in it" + why
            continue
        tag = ("p" if what == "progress" else "") + str(int(request))
        try:
            os.write(fd, tag.encode() + b"\n")  # a line: another asker's may arrive in the same read
        finally:
            os.close(fd)
        asked[pid] = os.path.join(hook, f"{pid}.{tag}.json")
    wait_until(lambda: all(os.path.exists(a) for a in asked.values()), time.time() + float(wait))
    for pid, path in asked.items():
        try:
            with open(path) as f:
                ranks[pid]["answer"] = json.load(f)
            os.unlink(path)
        except (OSError, ValueError):
            ranks[pid]["error"] = f"no answer within {float(wait):g}s"
        st = proc_stat(pid)  # after the wait: a process stopped meanwhile says so
        if st is not None:  # the tree's CPU grows by what the rank spent meanwhile: never less than the rank's
            grew = max(0.0, st[2] - ranks[pid]["cpu_s"])
            ranks[pid]["state"], ranks[pid]["cpu_s"] = st[0], st[2]
            ranks[pid]["tree_cpu_s"] = round(ranks[pid].get("tree_cpu_s", 0.0) + grew, 3)
    silent = [pid for pid, p in ranks.items() if "answer" not in p and p["state"] not in "ZX"]
    if what != "progress" and silent:  # ranks whose hook did not answer (stopped, holding the GIL): py-spy
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, len(silent))) as pool:  # at once: each may take PY_SPY_S
            for pid, (found, why) in zip(silent, pool.map(py_spy_stacks, silent)):
                ranks[pid]["pyspy"] = found if found is not None else why
    return {"ranks": sorted(ranks.values(), key=lambda p: str(p["rank"])), "time": time.time()}


PY_SPY_S = 10.0  # one py-spy dump's limit
STALE_ANSWER_S = 120.0  # a hook's answer file nobody read for this long: its asker gave up on it


def drop_stale_answers(hook, pid):
    """Answers the rank wrote after their asker stopped waiting (a rank stopped past the wait
    answers when it runs again): removed once old, so the hook directory does not fill up."""
    cut = time.time() - STALE_ANSWER_S
    for path in glob.glob(os.path.join(hook, f"{pid}.*.json")):
        try:
            if os.stat(path).st_mtime < cut:
                os.unlink(path)
        except OSError:
            pass


def py_spy_stacks(pid):
    """The process's Python stacks read from outside by py-spy (`dump --nonblocking`: the process
    is not paused, so a stopped one stays stopped), in the hook's shape (outermost frame first,
    the main thread first) -> (stacks, None), or (None, why not): py-spy not installed (next to
    this python or on PATH), or ptrace not allowed (Ubuntu's kernel.yama.ptrace_scope=1 forbids
    it on a process that is not this one's descendant, unless root)."""
    import shutil
    import subprocess

    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    exe = exe if os.access(exe, os.X_OK) else shutil.which("py-spy")
    if exe is None:
        return None, "py-spy is not installed"
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid), "--json", "--nonblocking"], capture_output=True,
                           timeout=PY_SPY_S, stdin=subprocess.DEVNULL)
        doc = json.loads(r.stdout) if r.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return None, "py-spy: %s" % (type(e).__name__,)
    if not isinstance(doc, list):
        err = r.stderr.decode(errors="replace").strip().splitlines()
        return None, "py-spy: " + (err[-1][:200] if err else "exit %d" % r.returncode)
    import sysconfig

    libs = tuple({os.path.realpath(v) + os.sep for k, v in sysconfig.get_paths().items()
                  if k in ("stdlib", "platstdlib", "purelib", "platlib")})  # as the hook marks library frames
    threads = []
    for t in doc:
        frames = [{"file": f.get("filename"), "line": f.get("line"), "func": f.get("name"), "code": "",
                   "lib": os.path.realpath(f.get("filename") or "").startswith(libs)}
                  for f in reversed(t.get("frames") or [])]
        threads.append({"thread": t.get("thread_name") or str(t.get("thread_id")),
                        "main": t.get("thread_name") == "MainThread", "frames": frames})
    threads.sort(key=lambda t: not t["main"])
    return threads, None


def reach(timeout, *targets):
    """Whether this node can open a TCP connection to each HOST:PORT within `timeout` s (refused
    counts: the host answered). Prints {target: "ok" | why}."""
    import socket
    import threading

    out = {}

    def one(target):
        host, _, port = target.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=float(timeout)).close()
            out[target] = "ok"
        except ConnectionRefusedError:
            out[target] = "ok"
        except (OSError, ValueError) as e:
            out[target] = str(e) or type(e).__name__

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(float(timeout) + 2)
    print(json.dumps({t: out.get(t, "no answer") for t in targets}))


def node_name_ok(name):
    if not safe_name(name):
        sys.exit("bad node name")
    return os.path.join(CLAIMS, name)


def family(key):
    """match(k) for the run keys of `key`'s run on its node: RUN@NODE and every attempt RUN.aK@NODE."""
    run, _, node = key.rpartition("@")

    def match(k):
        head, _, at = k.rpartition("@")
        return at == node and (head == run or (head.startswith(run + ".a") and head[len(run) + 2:].isdigit()))

    return match


def claim_stale(doc):
    """A claim is stale once no process of its run (any attempt) is left on this node, and either
    every attempt that ran here ended after the claim was last renewed (the controller renews it
    as each attempt begins, so one ended before the next starts is still held), or nothing ran
    here within CLAIM_START_S of the renewal (a node claimed and then lost or left out, whose
    release never reached it)."""
    key = doc.get("key", "")
    if not key or "/" in key:
        return False
    mine = family(key)
    if run_pids(key, mine):
        return False
    renewed = max(float(doc.get("since") or 0), float(doc.get("renewed") or 0))
    ran = [os.path.join(BASE, k) for k in (os.listdir(BASE) if os.path.isdir(BASE) else ()) if mine(k)]
    ends = [ended_at(d) for d in ran]
    if ends and all(e is not None for e in ends) and max(ends) >= renewed:
        return True
    return time.time() - renewed > CLAIM_START_S


def ended_at(d):
    """When the run in directory d ended, by this node's clock (the waiter's `ended`, else when its
    exit code was written: a file's mtime is the file server's clock on a shared home); None
    while it has no exit code."""
    try:
        written = os.path.getmtime(os.path.join(d, "exit_code"))
    except OSError:
        return None
    try:
        return float(read(os.path.join(d, "ended"), "") or written)
    except ValueError:
        return written


def _locked_claim(path):
    """Hold the node's claim lock; yields the claim held now ({} when none or unreadable)."""
    import contextlib
    import fcntl

    @contextlib.contextmanager
    def held():
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                doc = json.loads(read(path, "") or "{}")
            except ValueError:
                doc = {}
            yield doc

    return held()


def claim(node, key, who):
    """Take the node for run KEY, or renew the run's own claim (a new attempt begins here). Check
    and write happen under an exclusive lock on the node, so of two claims at once exactly one
    wins; a stale claim is replaced."""
    path = node_name_ok(node)
    os.makedirs(CLAIMS, mode=0o700, exist_ok=True)
    with _locked_claim(path) as held:
        if held and held.get("key") != key and not claim_stale(held):
            print(json.dumps({"ok": False, **held}))
            return
        if held.get("key") != key:
            held = {"run": key.split("@")[0], "key": key, "who": who, "since": time.time()}
        else:
            held["renewed"] = time.time()
        write_atomic(path, json.dumps(held))
        print(json.dumps({"ok": True, **held}))


def release(node, key):
    path = node_name_ok(node)
    if not os.path.isdir(CLAIMS):
        print(json.dumps({"released": False}))
        return
    with _locked_claim(path) as held:
        if held.get("key") == key:
            os.unlink(path)
    print(json.dumps({"released": held.get("key") == key}))


def claims():
    out = {}
    for name in sorted(os.listdir(CLAIMS)) if os.path.isdir(CLAIMS) else []:
        if name.endswith(".lock") or name.startswith(".") or ".tmp" in name:
            continue
        try:
            doc = json.loads(read(os.path.join(CLAIMS, name), "") or "{}")
        except ValueError:
            continue
        if doc:
            out[name] = dict(doc, stale=claim_stale(doc))
    print(json.dumps(out))


def is_listening(port):
    want = "%04X" % int(port)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (read(table, "") or "").splitlines()[1:]:
            parts = line.split()
            if parts[1].rsplit(":", 1)[1] == want and parts[3] == "0A":
                return True
    return False


def wait_listening(run_id, port, seconds):
    d = rundir(run_id)
    deadline = time.time() + float(seconds)
    while time.time() < deadline:
        if is_listening(port):
            print("listening")
            return
        if read(os.path.join(d, "exit_code")) is not None:
            print("exited")
            return
        time.sleep(0.1)
    print("timeout")


def main(argv):
    private_files()
    cmd, args = argv[0], argv[1:]
    {"start": start, "stop": stop, "status": status, "tail": tail, "live": live,
     "wait-listening": wait_listening, "claim": claim, "release": release,
     "claims": claims, "snapshot": snapshot, "reach": reach}[cmd](*args)

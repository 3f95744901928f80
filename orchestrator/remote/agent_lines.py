"""The node agent's RankLines: the ranks' output written into the run's log as whole lines tagged
by local rank, by a thread of the waiter (agent_waiter.py), and each rank's end as it happens
(note_rank_failure); with the helpers it alone uses (unix_path, zombie_status, hooks_word).
"""
import os
import time

from .agent_base import threading_start
from .common import note_rank_failure

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
        """Every one of the node's `nproc` ranks handed its output over and exited 0, none left
        (asked from other threads of the waiter too: what this one holds, copied first)."""
        ends = dict(self.ends)
        return bool(nproc) and not self.alive and sorted(ends, key=int) == [str(i) for i in range(nproc)] \
            and all(rc == 0 for rc in ends.values())

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

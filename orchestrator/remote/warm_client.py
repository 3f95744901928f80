"""The rank's side of the warm interpreter (warm.py), loaded by the hook (hook/sitecustomize.py
`_warm`) from the run directory, where the waiter writes this file beside the hook as
clusterctl_warm.py: stdlib only, nothing of the package. `ask` sends this process's command line,
directory, environment, umask and stdin/stdout/stderr; once the fork is made, this process stays
where it was started (torchrun's worker, or the waiter's torchrun), passes on every signal it can
catch and ends as the fork ended.
"""
import os
import sys

TORCHRUN = ("-m", "torch.distributed.run")  # how the waiter starts torchrun (remote/agent_waiter.py)
WARM_WAIT_S = 2.0  # how long the rank waits for the warm interpreter's fork before it starts cold
IMPORTING = "importing"  # beside the socket while the warm interpreter imports torch (it listens from its start)
IMPORT_WAIT_S = 60.0  # the rank's wait then: its fork comes sooner than a cold start's imports beside the warm one's
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT")


def mark_of(path):
    """The IMPORTING mark of the warm interpreter whose socket is `path`."""
    return os.path.join(os.path.dirname(path), IMPORTING)


def importing(path):
    """The warm interpreter listening on `path` still imports (its mark is there)."""
    return os.path.exists(mark_of(path))


def is_torchrun(orig_argv):
    """Whether this command line is torchrun's as the waiter starts it: python [-u] -m torch.distributed.run."""
    args = list(orig_argv[1:])
    while args[:1] == ["-u"]:
        args.pop(0)
    return tuple(args[:2]) == TORCHRUN


def ask(path, die_with_parent, note=None):
    """A rank whose node keeps a warm interpreter (CLUSTERCTL_WARM: its socket) has it fork the
    rank (remote/warm.py) instead of importing torch again, and so does torchrun: this process
    sends its command line, directory, environment and stdin/stdout/stderr, then stays as its
    parent's child (torchrun's worker, the waiter's torchrun), passing on each signal it can catch
    to the fork and ending as the fork ended; `note`: a file the fork's pid is written to (the
    waiter's stop tells torchrun from its workers by it). Nothing answers within WARM_WAIT_S
    (IMPORT_WAIT_S while it imports), it went away, or the command line is not one the fork can
    run: this process goes on cold."""
    import json
    import signal
    import socket

    if not os.path.exists(path):
        return
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(WARM_WAIT_S)
        fd = os.open(os.path.dirname(path), os.O_RDONLY)  # a socket path is short: through its directory
        try:
            conn.connect(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
        finally:
            os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        req = {"argv": list(sys.orig_argv), "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask}
        socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2])
        if importing(path):
            conn.settimeout(IMPORT_WAIT_S)
        reply = b""
        while not reply.endswith(b"\n"):
            got = conn.recv(64)
            if not got:
                break
            reply += got
    except OSError:
        conn.close()
        return
    first, _, rest = reply.partition(b"\n")
    if not first.startswith(b"pid "):
        conn.close()
        return  # refused: cold
    pid = int(first[4:])
    try:  # from here this process is the fork's stand-in, whatever happens
        if note:
            _write(note, "%d\n" % pid)
        _forward_to(pid, die_with_parent)  # before "go": a signal once the script runs reaches the fork
        conn.sendall(b"go\n")
        _stand_in_for(pid, conn, rest)
    finally:  # forked: whatever happens here, this process must never run the rank as well
        try:
            os.kill(pid, signal.SIGKILL)
        finally:
            os._exit(1)


def _write(path, text):
    tmp = "%s.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _forward_to(pid, die_with_parent):
    """Every signal this process can catch passed on to the fork `pid`; this process dies with its parent."""
    import signal

    die_with_parent()

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)


def _stand_in_for(pid, conn, rest):
    """The parent's child while the fork `pid` runs in its place: its end mirrored."""
    import signal

    conn.settimeout(None)
    while b"\n" not in rest:
        try:
            got = conn.recv(64)
        except InterruptedError:
            continue
        except OSError:
            got = b""
        if not got:
            break
        rest += got
    line = rest.partition(b"\n")[0]
    status = int(line[7:]) if line.startswith(b"status ") else None
    if status is None:  # the warm interpreter went away: so did the fork (it dies with it)
        os._exit(137)
    if os.WIFSIGNALED(status):  # ended by the same signal (torchrun reports it as the fork's)
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status))


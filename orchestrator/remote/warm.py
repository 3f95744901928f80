"""A run's warm interpreter on a node: it imports what every rank and torchrun import (torch) once,
then forks a rank (or torchrun) for each request on its Unix socket, so a restarted rank starts in
a fraction of a second.

The process torchrun started asks before its script runs (warm_client.py, from the hook): its
command line, directory, environment, umask and stdin/stdout/stderr (SCM_RIGHTS). The fork takes
all of it (`become`), the environment also where /proc/PID/environ shows it (the rank is found by
its run key like any other; the zygote's padded environment, PAD_ENV, leaves the room), runs the
hook as a fresh rank does, then the script as `python` would. The asker stays as torchrun's
worker, passes signals on and ends as the fork ended. A fork whose asker went away is killed; a
fork dies with the zygote (PR_SET_PDEATHSIG). Replies, a line each: `pid N`, then `status W`.

  warm RUN_ID NODE   the spec's JSON on stdin ({"python", "env", "cwd", "preload"}): the run's
                     warm interpreter here, on ~/.clusterctl/warm/RUN_ID@NODE/sock (the waiter
                     hands it to the ranks as CLUSTERCTL_WARM), marked RUN_ID.warm@NODE (no
                     attempt's key: an attempt's end leaves it). `listening` once its socket is
                     there, `ready` once torch is imported (it listens from its start, beside an
                     `importing` mark until then: a rank that asks meanwhile waits for its
                     fork rather than start cold); it lives while the control machine holds the
                     command's connection open, or a rank forked from it runs (`serve`). One
                     that served the run here before (started by a supervisor that has since
                     been replaced) gives up the socket's name to it and ends once its forks
                     have. What dead ones left here (a directory of a run nobody listens for:
                     killed while importing) goes first.
  warm check RUN_ID NODE   print {"serving": bool, "importing": bool}: whether one serves the run
                           here now, or listens while it still imports.
"""
import json
import os
import select
import signal
import socket
import sys

from .agent_claims import CLAIMS
from .common import prctl, split_key
from .warm_client import importing
from .warm_fork import become, env_block, env_bytes, own_environ, target
from .warm_socket import answers, bound, early_socket, gone, imported, sweep

PAD_ENV = "CLUSTERCTL_WARM_PAD"  # the zygote's padding: the forks' environments are written over it
PAD_BYTES = 192 << 10  # room for a rank's environment (a node's env with NCCL's and torchrun's variables: ~8 KB)
MAX_REQUEST = 1 << 20  # a request's JSON, at most


def claimed(run_id, node):
    """Whether the node's claim (agent_claims.py) is held by run `run_id` now."""
    try:
        with open(os.path.join(CLAIMS, node)) as f:
            return json.loads(f.read() or "{}").get("run") == run_id
    except (OSError, ValueError, AttributeError):
        return False


def listen(path, early=None):
    """(the listening socket and its name's inode (`early`, else bound now), its name in its
    directory, now the cwd; the signals' wake-up pipe)."""
    here, name = os.path.split(path)
    listener, ino = early or bound(path)
    os.chdir(here)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: ENDING.append(1))
    return listener, ino, name, wake_r


ENDING = []  # SIGTERM came


def serve(path, preload="torch", run_id=None, node=None):
    """Import `preload` (comma-separated modules), listen on `path` (bound in its directory: a
    socket path is short), fork a rank per request; say `listening` once the socket is there
    (before the imports), `ready` once they ended. Ends on SIGTERM, or, once no fork runs, when
    stdout's reader is gone (the control machine let go) or, given the run and the node, when the
    node's claim was the run's and is no longer (the run ended, or the node was left out of it,
    while its connection to the control machine was cut)."""
    import importlib

    # the padding's text gone, its room kept (a fork writes its environment there): a scan for a
    # run's processes reads a block up to its first two NULs (common.environ_of), not 200 KB of it
    own_environ({k: v for k, v in os.environ.items() if not k.startswith(PAD_ENV)})
    early = early_socket(path)
    try:  # the socket is there (this one's, or the one serving already): the launch may go on
        os.write(1, b"listening\n")
    except OSError:
        pass
    try:
        for module in filter(None, preload.split(",")):
            importlib.import_module(module)
        if cuda_loaded():  # a fork must start with no CUDA state: its rank initialises its own
            sys.stderr.write("clusterctl: no warm interpreter: importing torch loaded CUDA's driver\n")
            early = gone(early, path)
            return
    except BaseException:
        early = gone(early, path)
        raise
    finally:
        imported(path)
    z = Zygote(*listen(path, early))
    ours = False  # the node's claim was seen held by the run
    while not ENDING and (z.held or z.forks):
        if run_id and node and not z.forks:
            now = claimed(run_id, node)
            z.held, ours = z.held and not (ours and not now), ours or now
            if not z.held:
                break
        for fd, _ in z.poller.poll(5000):
            z.on(fd)
        reap(z.forks, z.conns, z.poller)
        if not z.named():  # the socket's name was taken away (a newer one serves): go when idle
            z.held = False
    for pid in z.forks:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:  # its socket, unless a newer one's took the name, and the run's directory here
        if z.named():
            os.unlink(z.name)
        os.rmdir(os.getcwd())
    except OSError:
        pass


def cuda_loaded():
    """CUDA's driver is in this process (a fork could not use CUDA then)."""
    try:
        with open("/proc/self/maps") as f:
            return "libcuda.so" in f.read()
    except OSError:
        return False


class Zygote:
    """The listening socket, the askers' connections and the forks, polled with stdout (whose
    reader going away lets the zygote go: `held`)."""

    def __init__(self, listener, ino, name, wake_r):
        self.listener, self.ino, self.name, self.wake_r = listener, ino, name, wake_r
        self.poller = select.poll()
        self.poller.register(listener, select.POLLIN)
        self.poller.register(wake_r, select.POLLIN)
        self.poller.register(1, 0)  # only its POLLERR/POLLHUP: the reader of stdout went away
        self.conns = {}  # fd -> (pid, its asker's connection)
        self.forks = {}  # pid -> its asker's connection
        try:
            os.write(1, b"ready\n")
            self.held = True
        except OSError:
            self.held = False

    def named(self):
        """Its socket still has the name (not removed, not another's)."""
        try:
            return os.stat(self.name).st_ino == self.ino
        except OSError:
            return False

    def on(self, fd):
        if fd == 1:
            self.held = False
            self.poller.unregister(1)
        elif fd == self.listener.fileno():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            pid = take(conn, self.listener, self.wake_r, self.forks)
            if pid:
                self.forks[pid] = conn
                self.conns[conn.fileno()] = (pid, conn)
                self.poller.register(conn, select.POLLIN)
        elif fd == self.wake_r:
            try:
                os.read(self.wake_r, 512)
            except BlockingIOError:
                pass
        elif fd in self.conns:  # an asker's connection: it went away (nothing else is ever sent)
            pid, _ = self.conns.pop(fd)
            self.poller.unregister(fd)
            if pid in self.forks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def take(conn, listener, wake_r, forks):
    """One request: fork the rank; its pid (0: refused, said on the connection)."""
    conn.settimeout(10)
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
        req = json.loads(data)
        if len(fds) != 3 or target(req["argv"]) is None:
            raise ValueError("not a rank this interpreter can start")
        start, end = env_block()
        if env_bytes(req["env"]) > end - start:
            raise ValueError("its environment does not fit where /proc/PID/environ shows it")
    except (OSError, ValueError, KeyError) as e:
        try:
            conn.sendall(f"no {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
        conn.close()
        return 0
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(go_w)
            listener.close()
            os.close(wake_r)
            for c in forks.values():
                c.close()
            conn.close()
            signal.set_wakeup_fd(-1)
            prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a fork dies with the zygote
            if os.read(go_r, 1) != b"g":  # the asker did not take it: it starts cold, this one never ran
                os._exit(0)
            os.close(go_r)
            become(req, fds)
        except BaseException as e:  # noqa: BLE001 - the fork must never return into the zygote's loop
            try:
                os.write(2, f"clusterctl: the warm start failed: {type(e).__name__}: {e}\n".encode())
            finally:
                os._exit(127)
    os.close(go_r)
    for fd in fds:
        os.close(fd)
    went = committed(conn, pid)
    os.write(go_w, b"g" if went else b"n")
    os.close(go_w)
    conn.settimeout(None)
    if not went:
        conn.close()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return 0
    return pid


def committed(conn, pid):
    """Tell the asker its fork's pid; whether it commits (`go`) before the fork runs a line."""
    went = b""
    try:
        conn.sendall(f"pid {pid}\n".encode())
        while len(went) < 3 and not went.endswith(b"\n"):  # a stream socket may give it in pieces
            got = conn.recv(3 - len(went))
            if not got:
                break
            went += got
    except OSError:
        pass
    return went == b"go\n"


def reap(forks, conns, poller):
    """Tell each ended fork's asker how it ended."""
    while forks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        conn = forks.pop(pid, None)
        if conn is None:
            continue
        if conns.pop(conn.fileno(), None) is not None:
            poller.unregister(conn.fileno())
        try:
            conn.sendall(f"status {status}\n".encode())
        except OSError:
            pass
        conn.close()


WARM_DIR = "~/.clusterctl/warm"  # RUN_ID@NODE/sock: a run's warm interpreter on this node
PAD_PART = 100_000  # one padding variable (Linux takes at most 128 KiB in one)
ARGV_PAD = 4096  # a last, blank argument: room for a fork's command line (warm_fork.own_cmdline)


def socket_path(run_id, node):
    return os.path.join(os.path.expanduser(WARM_DIR), f"{run_id}@{node}", "sock")


def for_key(key):
    """The socket of the warm interpreter serving attempt `key` (RUN_ID[.aK]@NODE) here, when
    there is one (the waiter hands it to the ranks as CLUSTERCTL_WARM), else None."""
    run, _what, node = split_key(key)
    path = socket_path(run, node)
    return path if os.path.exists(path) else None


def start(run_id, node):
    """`warm RUN_ID NODE`: the interpreter execs itself as the run's zygote (its environment set
    at exec, padded, so each fork's fits where /proc/PID/environ reads it)."""
    from .common import private_files, safe_name

    if not safe_name(run_id) or not safe_name(node):
        sys.exit("bad run id or node name")
    try:
        spec = json.loads(sys.stdin.buffer.read() or b"{}")
        if not isinstance(spec, dict) or not isinstance(spec.get("env", {}), dict):
            raise ValueError(spec)
    except ValueError:
        sys.exit('warm: the spec on stdin is not a JSON object {"python", "env", "cwd", "preload"}')
    private_files()
    path = socket_path(run_id, node)
    sweep(os.path.dirname(os.path.dirname(path)))  # what dead ones of earlier runs left here
    os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
    # one serving the run here already was started by a supervisor no longer holding it (this
    # one adopted the run): the new one takes the socket's name, the old one ends once its forks have
    env = {**os.environ, **{k: str(v) for k, v in spec.get("env", {}).items()},
           "CLUSTERCTL_RUN_KEY": f"{run_id}.warm@{node}", "CLUSTERCTL_RUN_ID": run_id,
           "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}  # torch's check for GPUs by NVML: no CUDA state to fork
    for k in [k for k in env if k in ("RANK", "LOCAL_RANK", "CLUSTERCTL_WARM")]:
        del env[k]
    env.update({f"{PAD_ENV}{i}": "x" * PAD_PART for i in range(PAD_BYTES // PAD_PART + 1)})
    if spec.get("cwd"):
        try:
            os.chdir(os.path.expanduser(spec["cwd"]))
        except OSError:
            pass
    orig = list(sys.orig_argv)
    i = orig.index("-c")
    python = os.path.expanduser(spec.get("python") or orig[0])
    try:
        os.execve(python, [python, *orig[1:i + 3], "warm", "serve", path, str(spec.get("preload", "torch")),
                           run_id, node, " " * ARGV_PAD], env)
    except OSError as e:
        sys.exit(f"warm: cannot start {python}: {e.strerror}")


def main(argv):
    args = argv[1:-1] if argv[:1] == ["serve"] and not argv[-1].strip() else argv[1:]  # ARGV_PAD's blanks
    if argv[:1] == ["serve"] and len(args) in (2, 4):
        serve(*args)
        return 0
    if argv[:1] == ["check"] and len(argv) == 3:  # whether one serves the run here
        path = socket_path(argv[1], argv[2])
        listens, still = answers(path), importing(path)
        print(json.dumps({"serving": listens and not still, "importing": listens and still}))
        return 0
    if len(argv) == 2:
        return start(*argv)
    sys.exit("usage: warm RUN_ID NODE (the spec's JSON on stdin) | warm check RUN_ID NODE")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

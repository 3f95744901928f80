"""Connections to nodes and the fan-out engine.

The transport is a small interface (fabric `Remote`, pyinfra connectors):
a `Connection` opens once and `exec`s commands, returning a `Proc` whose
output is read through one selectable fd.  `SSHConnection` (paramiko, via
fabric for ~/.ssh/config, ProxyJump and agent keys) and `LocalConnection`
(subprocess on the control machine) are the two implementations; everything
above is connection-agnostic.

`Cluster` holds one connection per node for the life of a command, opened in
parallel with a bounded fan-out, and runs commands on all nodes at once with
one select loop that turns bytes into whole lines per node and stream.
"""

from __future__ import annotations

import binascii
import errno
import fcntl
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import paramiko

from .errors import ConnectError, HostKeyError
from .inventory import Inventory, Node

DEFAULT_FANOUT = 64
DEFAULT_CONNECT_TIMEOUT = 10.0
KEEPALIVE_S = 5
DEFAULT_LOST_TIMEOUT = 30.0
SWEEP_S = 0.2  # how often every running command is checked for deadlines and lost links  # a node silent this long (no answer to keepalives) is lost

# on_line(node_name, stream ("stdout"|"stderr"), line_without_newline)
LineCallback = Callable[[str, str, str], None]


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class NodeResult:
    node: str
    exit_code: int | None  # None: never ran to completion (unreachable, timed out, lost)
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    error: str | None = None  # connection/timeout problem, not a non-zero exit

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    @property
    def reachable(self) -> bool:
        return self.exit_code is not None or (self.error or "").startswith("timed out")

    def describe(self) -> str:
        if self.error:
            return self.error
        return f"exit code {self.exit_code}"


class ClusterResult(dict):
    """node name -> NodeResult, in rank order, with fabric-style views."""

    @property
    def ok(self) -> dict[str, NodeResult]:
        return {k: v for k, v in self.items() if v.ok}

    @property
    def failed(self) -> dict[str, NodeResult]:
        return {k: v for k, v in self.items() if not v.ok}

    @property
    def all_ok(self) -> bool:
        return all(v.ok for v in self.values())

    @property
    def worst_exit_code(self) -> int:
        """Like `pdsh -S`: the largest exit code; a node that never answered counts as 255 (ssh's)."""
        codes = [255 if v.exit_code is None else v.exit_code for v in self.values()]
        return max(codes, default=0)


# ------------------------------------------------------------------ processes


class Proc:
    """A running command. Output is read non-blockingly after `fileno()` polls readable."""

    node: str
    started: float

    def fileno(self) -> int | list[int]: ...
    def read(self) -> tuple[bytes, bytes]: ...
    def done(self) -> bool: ...
    def exit_code(self) -> int | None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


class _SSHProc(Proc):
    def __init__(self, node: str, chan: paramiko.Channel, conn: "SSHConnection | None" = None):
        self.node, self.chan, self.started, self.conn = node, chan, time.monotonic(), conn
        self._fd = chan.fileno()

    def lost_reason(self) -> str | None:
        return self.conn.lost_reason if self.conn is not None else None

    def fileno(self):
        return self._fd

    def read(self):
        out = err = b""
        c = self.chan
        while c.recv_ready():
            out += c.recv(1 << 20)
        while c.recv_stderr_ready():
            err += c.recv_stderr(1 << 20)
        return out, err

    def done(self):
        c = self.chan
        return ((c.exit_status_ready() or c.closed) and (c.eof_received or c.closed)
                and not c.recv_ready() and not c.recv_stderr_ready())

    def exit_code(self):
        if not self.chan.exit_status_ready():
            return None
        code = self.chan.recv_exit_status()
        return None if code == -1 else code

    def kill(self):
        self.chan.close()

    def close(self):
        self.chan.close()


def _nonblock(fd: int) -> None:
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)


class _LocalProc(Proc):
    def __init__(self, node: str, popen: subprocess.Popen):
        self.node, self.p, self.started = node, popen, time.monotonic()
        self._open = {popen.stdout.fileno(): "out", popen.stderr.fileno(): "err"}
        self._fds = list(self._open)
        for fd in self._fds:
            _nonblock(fd)

    def fileno(self):
        return self._fds

    def read(self):
        chunks = {"out": b"", "err": b""}
        for fd, which in list(self._open.items()):
            while True:
                try:
                    data = os.read(fd, 1 << 20)
                except BlockingIOError:
                    break
                if not data:
                    del self._open[fd]
                    break
                chunks[which] += data
        return chunks["out"], chunks["err"]

    def eof_fds(self) -> list[int]:
        return [fd for fd in self._fds if fd not in self._open]

    def done(self):
        return not self._open and self.p.poll() is not None

    def exit_code(self):
        rc = self.p.poll()
        if rc is None:
            return None
        return 128 - rc if rc < 0 else rc  # killed by signal N -> 128+N, like a shell

    def kill(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self):
        for f in (self.p.stdout, self.p.stderr, self.p.stdin):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        if self.p.poll() is None:
            self.kill()
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


# ------------------------------------------------------------------ connections


class Connection:
    """One node, opened once, reused for everything a command does."""

    def __init__(self, node: Node):
        self.node = node

    def open(self) -> None: ...
    def exec(self, command: str, *, stdin: bytes | None = None) -> Proc: ...
    def close(self) -> None: ...

    @property
    def alive(self) -> bool:
        return True


class LocalConnection(Connection):
    """`connection: local`: run on the control machine, no SSH (Ansible's local)."""

    def open(self):
        pass

    def exec(self, command, *, stdin=None):
        p = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE if stdin is not None
                             else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)  # cwd: where clusterctl runs
        if stdin is not None:
            def feed():
                try:
                    p.stdin.write(stdin)
                    p.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            threading.Thread(target=feed, daemon=True).start()
        return _LocalProc(self.node.name, p)

    def close(self):
        pass


_known_hosts_lock = threading.Lock()
_known_hosts_cache: dict[Path, tuple[tuple[int, int, int], list[tuple[int, list[str], str]]]] = {}


def known_host_keys(path: Path, name: str) -> list[paramiko.PKey]:
    """The keys known_hosts lists for `name` ("host", or "[host]:port" off port 22), hashed
    entries included, in file order; [] when the file does not exist.

    paramiko's HostKeys.load checks every line against every earlier one, so each connection
    loading a 256-line known_hosts cost 50 ms of CPU, all of it again for every node (12 s for
    256 nodes). Here the file is split into lines once per change (cached by inode, size and
    mtime) and only the lines naming this host become key objects."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return []
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _known_hosts_lock:
        cached = _known_hosts_cache.get(path)
    if cached is None or cached[0] != stamp:
        lines = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if line and not line.startswith("#"):
                    lines.append((lineno, line.split(None, 1)[0].split(","), line))
        cached = (stamp, lines)
        with _known_hosts_lock:
            _known_hosts_cache[path] = cached
    keys = []
    for lineno, names, line in cached[1]:
        if not any(h == name or h.startswith("|1|") and _hashed_match(name, h) for h in names):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
        except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey):
            continue  # a damaged line is skipped, as ssh does
        if entry is not None:
            keys.append(entry.key)
    return keys


def _hashed_match(name: str, entry: str) -> bool:
    import hmac

    try:
        return hmac.compare_digest(paramiko.HostKeys.hash_host(name, entry), entry)
    except (ValueError, TypeError, IndexError, binascii.Error):
        return False  # a malformed |1|salt|hash


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys with the exact remedy; `accept_new` = StrictHostKeyChecking=accept-new."""

    def __init__(self, node: str, port: int, known_hosts: Path, accept_new: bool):
        self.node, self.port, self.known_hosts, self.accept_new = node, port, known_hosts, accept_new

    def missing_host_key(self, client, hostname, key):
        fp = key.fingerprint if hasattr(key, "fingerprint") else key.get_name()
        if self.accept_new:
            client.get_host_keys().add(hostname, key.get_name(), key)
            entry = f"{hostname} {key.get_name()} {key.get_base64()}\n"
            with _known_hosts_lock:
                self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with open(self.known_hosts, "a") as f:
                    f.write(entry)
            return
        host = hostname.strip("[]").rsplit("]:", 1)[0] if hostname.startswith("[") else hostname
        port_opt = f"-p {self.port} " if self.port != 22 else ""
        raise HostKeyError(
            self.node,
            f"unknown host key for {hostname} ({key.get_name()} {fp}). clusterctl verifies host keys "
            f"like ssh does. Check the fingerprint, then add it with:\n"
            f"    ssh-keyscan {port_opt}-t {key.get_name()} {host} >> {self.known_hosts}\n"
            f"or trust keys on first use with --accept-new-host-keys.")


class SSHConnection(Connection):
    def __init__(self, node: Node, *, accept_new_host_keys: bool = False,
                 connect_timeout: float | None = None, lost_timeout: float = DEFAULT_LOST_TIMEOUT):
        super().__init__(node)
        self.accept_new = accept_new_host_keys
        self.connect_timeout = connect_timeout or node.ssh.connect_timeout or DEFAULT_CONNECT_TIMEOUT
        self.lost_timeout = lost_timeout
        self.lost_reason: str | None = None
        self._conn = None
        self._closing = threading.Event()

    def _known_hosts_path(self) -> Path:
        return Path(os.path.expanduser(self.node.ssh.known_hosts or "~/.ssh/known_hosts"))

    def _make(self, host: str, user: str | None, port: int | None, gateway=None):
        import fabric

        s = self.node.ssh
        cfg_kwargs = {}
        if s.config_file:
            cfg_kwargs["runtime_ssh_path"] = os.path.expanduser(s.config_file)
        config = fabric.Config(**cfg_kwargs)
        connect_kwargs = {"banner_timeout": self.connect_timeout, "auth_timeout": self.connect_timeout,
                          "channel_timeout": self.connect_timeout}
        if s.identity_file:
            connect_kwargs["key_filename"] = [os.path.expanduser(s.identity_file)]
        c = fabric.Connection(host, user=user, port=port, config=config, gateway=gateway,
                              connect_timeout=self.connect_timeout, connect_kwargs=connect_kwargs)
        self._secure(c)
        return c

    def _secure(self, c) -> None:
        """Replace fabric's AutoAddPolicy on this hop and every gateway hop, and give each hop's
        client the known_hosts entries for its own host (see known_host_keys)."""
        while c is not None and not isinstance(c, (str, bool)):
            kh = self._known_hosts_path()  # the inventory's, else ~/.ssh/known_hosts
            name = c.host if c.port == 22 else f"[{c.host}]:{c.port}"  # as paramiko looks it up
            try:
                keys = known_host_keys(kh, name)
            except OSError as e:
                raise ConnectError(self.node.name, f"cannot read known_hosts {kh}: {e}") from None
            seen: set[str] = set()
            for key in keys:
                if key.get_name() not in seen:  # the first line for a key type wins, as in ssh
                    seen.add(key.get_name())
                    c.client.get_host_keys().add(name, key.get_name(), key)
            c.client.set_missing_host_key_policy(
                _HostKeyPolicy(self.node.name, c.port, kh, self.accept_new))
            c = c.gateway

    def open(self):
        s, n = self.node.ssh, self.node
        gateway = None
        if s.proxy_jump:
            for hop in s.proxy_jump.split(","):
                user, _, hostport = hop.rpartition("@")
                host, _, port = hostport.partition(":")
                gateway = self._make(host, user or None, int(port) if port else None, gateway)
        self._conn = self._make(n.host, s.user, s.port, gateway)
        try:
            self._conn.open()
        except HostKeyError:
            raise
        except BaseException as e:  # noqa: BLE001 - classified into one sentence below
            self.close()
            raise ConnectError(n.name, _explain_connect_error(e, self._conn, self.connect_timeout)) from e
        threading.Thread(target=self._watch, name=f"liveness-{n.name}", daemon=True).start()

    def _watch(self) -> None:
        """Detect a silent peer (link down, host frozen): TCP alone takes minutes to notice.
        Every KEEPALIVE_S a global request that OpenSSH must answer (it replies 'failure' to
        unknown requests); a reply missing for `lost_timeout` closes the transport, which ends
        every channel on it."""
        t = self._conn.transport
        while not self._closing.wait(KEEPALIVE_S) and t.is_active():
            done = threading.Event()

            def ping():
                try:
                    t.global_request("keepalive@openssh.com", wait=True)
                finally:
                    done.set()

            threading.Thread(target=ping, daemon=True).start()
            if not done.wait(self.lost_timeout) and t.is_active() and not self._closing.is_set():
                self.lost_reason = f"no answer from the node for {self.lost_timeout:g}s (connection lost)"
                t.close()
                return

    @property
    def alive(self) -> bool:
        t = self._conn.transport if self._conn else None
        return bool(t and t.is_active())

    @property
    def transport(self) -> paramiko.Transport:
        return self._conn.transport

    def exec(self, command, *, stdin=None):
        if not self.alive:
            raise ConnectError(self.node.name, self.lost_reason or "the SSH connection was lost")
        chan = self._conn.transport.open_session(timeout=self.connect_timeout)
        chan.exec_command(command)
        if stdin:
            chan.sendall(stdin)
        chan.shutdown_write()
        return _SSHProc(self.node.name, chan, self)

    def close(self):
        self._closing.set()
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - closing a dead connection may raise anything
                pass


def _explain_connect_error(e: BaseException, conn, timeout: float) -> str:
    where = f"{conn.user}@{conn.host}:{conn.port}"
    if isinstance(e, paramiko.BadHostKeyException):
        return (f"WARNING: THE HOST KEY OF {conn.host} HAS CHANGED (expected {e.expected_key.get_name()} "
                f"{e.expected_key.fingerprint}, got {e.key.fingerprint}). Someone could be intercepting "
                f"the connection, or the machine was reinstalled. If you know why, remove the old key with "
                f"`ssh-keygen -R {conn.host}` and add the new one; clusterctl refuses to connect until then.")
    if isinstance(e, paramiko.AuthenticationException):
        return (f"authentication failed for {where}: add your public key to that user's "
                f"~/.ssh/authorized_keys (ssh-copy-id), or set ssh.user / ssh.identity_file in the inventory")
    if isinstance(e, paramiko.SSHException) and "No authentication methods" in str(e):
        return (f"authentication failed for {where}: no key to offer. Set ssh.identity_file in the "
                f"inventory, add the key to ssh-agent (ssh-add), or name it in ~/.ssh/config")
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return f"connection refused at {where}: is sshd running and listening on port {conn.port}?"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return (f"no answer from {where} within {timeout:g}s: the host is down, the address is wrong, "
                f"or a firewall drops port {conn.port}")
    if isinstance(e, socket.gaierror):
        return f"cannot resolve host name {conn.host!r}: check the inventory or /etc/hosts"
    if isinstance(e, OSError) and e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return f"no route to {conn.host}: check the address and the network link"
    if isinstance(e, OSError) and e.errno == errno.ECONNREFUSED:
        return f"connection refused at {where}: is sshd running?"
    if isinstance(e, paramiko.SSHException):
        return f"SSH handshake with {where} failed: {e}"
    return f"cannot connect to {where}: {type(e).__name__}: {e}"


def connection_for(node: Node, **kw) -> Connection:
    if node.is_local:
        return LocalConnection(node)
    return SSHConnection(node, **kw)


# ------------------------------------------------------------------ the engine


class _Lines:
    """Turns a byte stream into whole lines; never tears a line across calls."""

    __slots__ = ("buf",)

    def __init__(self):
        self.buf = b""

    def feed(self, data: bytes) -> list[str]:
        self.buf += data
        if b"\n" not in data:
            return []
        *lines, self.buf = self.buf.split(b"\n")
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]

    def flush(self) -> list[str]:
        if not self.buf:
            return []
        ln, self.buf = self.buf.decode("utf-8", "replace").rstrip("\r"), b""
        return [ln]


@dataclass
class _Run:
    proc: Proc
    deadline: float | None
    out: list[bytes] = field(default_factory=list)
    err: list[bytes] = field(default_factory=list)
    lines_out: _Lines = field(default_factory=_Lines)
    lines_err: _Lines = field(default_factory=_Lines)


def stream(procs: Iterable[Proc], *, on_line: LineCallback | None = None, timeout: float | None = None,
           capture: bool = True, stop: threading.Event | None = None,
           on_done: Callable[[NodeResult], None] | None = None,
           pending: Callable[[], Proc | None] | None = None,
           fanout: int = DEFAULT_FANOUT) -> dict[str, NodeResult]:
    """Drive running procs to completion with one select loop.

    Lines go to `on_line` whole, per node and per stream; a proc past `timeout`
    is closed and reported as timed out; `stop` ends everything early; `pending`
    is asked for more procs as slots free up (fan-out capping)."""
    sel = selectors.DefaultSelector()
    runs: dict[str, _Run] = {}
    results: dict[str, NodeResult] = {}

    def add(p: Proc):
        fds = p.fileno()
        for fd in fds if isinstance(fds, list) else [fds]:
            sel.register(fd, selectors.EVENT_READ, p.node)
        runs[p.node] = _Run(p, None if timeout is None else time.monotonic() + timeout)

    def emit(r: _Run, out: bytes, err: bytes):
        if capture:
            if out:
                r.out.append(out)
            if err:
                r.err.append(err)
        if on_line:
            for ln in r.lines_out.feed(out) if out else ():
                on_line(r.proc.node, "stdout", ln)
            for ln in r.lines_err.feed(err) if err else ():
                on_line(r.proc.node, "stderr", ln)

    def finish(name: str, error: str | None = None):
        r = runs.pop(name)
        fds = r.proc.fileno()
        for fd in fds if isinstance(fds, list) else [fds]:
            try:
                sel.unregister(fd)
            except (KeyError, ValueError):
                pass
        if on_line:
            for ln in r.lines_out.flush():
                on_line(name, "stdout", ln)
            for ln in r.lines_err.flush():
                on_line(name, "stderr", ln)
        code = None if error else r.proc.exit_code()
        r.proc.close()
        if code is None and not error:
            lost = r.proc.lost_reason() if isinstance(r.proc, _SSHProc) else None
            error = lost or "the connection closed before the command reported an exit code"
        res = NodeResult(name, code, b"".join(r.out).decode("utf-8", "replace"),
                         b"".join(r.err).decode("utf-8", "replace"),
                         time.monotonic() - r.proc.started, error)
        results[name] = res
        if on_done:
            on_done(res)

    def refill():
        while pending is not None and len(runs) < fanout and (p := pending()) is not None:
            add(p)

    for p in procs:
        add(p)
    refill()
    def check(name: str, r: _Run, now: float) -> None:
        if r.proc.done():
            emit(r, *r.proc.read())
            finish(name)
        elif r.deadline is not None and now > r.deadline:
            emit(r, *r.proc.read())
            r.proc.kill()
            finish(name, f"timed out after {timeout:g}s")
        elif isinstance(r.proc, _SSHProc) and not r.proc.chan.get_transport().is_active():
            emit(r, *r.proc.read())
            finish(name, r.proc.lost_reason() or "the SSH connection was lost")
        elif stop is not None and stop.is_set():
            r.proc.kill()
            finish(name, "stopped")

    last_sweep = time.monotonic()
    try:
        while runs:
            # Only the procs whose fd fired are read and checked; a sweep over all of them every
            # SWEEP_S catches deadlines, lost transports and stop requests. (Checking every proc on
            # every event would cost O(nodes^2) per command at 256 nodes.)
            fired = {key.data for key, _ in sel.select(timeout=SWEEP_S)}
            now = time.monotonic()
            for name in fired:
                r = runs.get(name)
                if r is None:
                    continue
                emit(r, *r.proc.read())
                if isinstance(r.proc, _LocalProc):
                    for fd in r.proc.eof_fds():  # an fd at EOF stays readable: stop polling it
                        try:
                            sel.unregister(fd)
                        except (KeyError, ValueError):
                            pass
                check(name, r, now)
            if now - last_sweep >= SWEEP_S:
                last_sweep = now
                for name, r in list(runs.items()):
                    if name not in fired:
                        check(name, r, now)
            refill()
    finally:
        for r in runs.values():
            r.proc.kill()
            r.proc.close()
        sel.close()
    return results


class Cluster:
    """One connection per node, opened in parallel, reused for the whole command."""

    def __init__(self, inventory: Inventory, *, fanout: int = DEFAULT_FANOUT,
                 accept_new_host_keys: bool = False, connect_timeout: float | None = None,
                 lost_timeout: float = DEFAULT_LOST_TIMEOUT):
        if fanout < 1:
            raise ValueError("fanout must be at least 1")
        self.inventory = inventory
        self.fanout = fanout
        self.accept_new_host_keys = accept_new_host_keys
        self.connect_timeout = connect_timeout
        self.lost_timeout = lost_timeout
        self.connections: dict[str, Connection] = {}
        self.unreachable: dict[str, NodeResult] = {}
        self.handshakes = 0  # counted, so tests can prove one handshake per node per command

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.inventory.nodes

    def connect(self) -> ClusterResult:
        """Open every node's connection (skipping those already open)."""
        todo = [n for n in self.nodes if n.name not in self.connections]

        def one(node: Node) -> NodeResult:
            t0 = time.monotonic()
            c = connection_for(node, accept_new_host_keys=self.accept_new_host_keys,
                               connect_timeout=self.connect_timeout, lost_timeout=self.lost_timeout)
            try:
                c.open()
            except ConnectError as e:
                msg = str(e).removeprefix(f"{node.name}: ")
                return NodeResult(node.name, None, duration=time.monotonic() - t0, error=msg)
            self.connections[node.name] = c
            if not node.is_local:
                self.handshakes += 1
            return NodeResult(node.name, 0, duration=time.monotonic() - t0)

        results = {}
        if todo:
            with ThreadPoolExecutor(max_workers=min(self.fanout, len(todo)),
                                    thread_name_prefix="connect") as ex:
                for r in ex.map(one, todo):
                    results[r.node] = r
        for name, r in results.items():
            if r.error:
                self.unreachable[name] = r
            else:
                self.unreachable.pop(name, None)
        return ClusterResult((n.name, results.get(n.name) or NodeResult(n.name, 0)) for n in self.nodes)

    def run(self, command: str | Callable[[Node], str], *, timeout: float | None = 60,
            stdin: bytes | Callable[[Node], bytes | None] | None = None,
            on_line: LineCallback | None = None, nodes: Iterable[str] | None = None,
            capture: bool = True, stop: threading.Event | None = None,
            on_done: Callable[[NodeResult], None] | None = None) -> ClusterResult:
        """Run on every (selected) connected node at once; at most `fanout` in flight.
        Unreachable nodes appear in the result with their connection error."""
        wanted = [n for n in self.nodes if nodes is None or n.name in set(nodes)]
        queue = [n for n in wanted if n.name in self.connections]
        results: dict[str, NodeResult] = {}
        for n in wanted:
            if n.name in self.unreachable:
                results[n.name] = self.unreachable[n.name]
            elif n.name not in self.connections:
                results[n.name] = NodeResult(n.name, None, error="not connected")

        def start(node: Node) -> Proc | None:
            cmd = command(node) if callable(command) else command
            data = stdin(node) if callable(stdin) else stdin
            try:
                return self.connections[node.name].exec(cmd, stdin=data)
            except (ConnectError, paramiko.SSHException, OSError, EOFError) as e:
                msg = str(e).removeprefix(f"{node.name}: ")
                results[node.name] = NodeResult(node.name, None, error=msg or "the SSH connection was lost")
                return None

        it = iter(queue)

        def pending() -> Proc | None:
            for node in it:
                p = start(node)
                if p is not None:
                    return p
            return None

        results.update(stream((), on_line=on_line, timeout=timeout, capture=capture, stop=stop,
                              on_done=on_done, pending=pending, fanout=self.fanout))
        return ClusterResult((n.name, results[n.name]) for n in wanted)

    def close(self):
        for c in self.connections.values():
            c.close()
        self.connections.clear()

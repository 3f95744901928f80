"""SSH connections (paramiko, via fabric for ~/.ssh/config, ProxyJump and agent keys)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import paramiko

from orchestrator.errors import AuthRefused, ClusterctlError, ConnectError, ConnectionLost, HostKeyError, UsageError
from orchestrator.inventory import Node
from orchestrator.inventory.hosts import check_proxy_jump, split_hop, unbracket
from orchestrator.transport.base import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_LOST_TIMEOUT,
    Connection,
    Proc,
)
from orchestrator.transport.faults import Fault, explain
from orchestrator.transport.known_hosts import _HostKeyPolicy, host_entries
from orchestrator.transport.liveness import PING_S, SILENCES, Heard, Silence

AEAD_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
# paramiko's reader thread polls its socket with a 0.1 s timeout (Transport._active_check_timeout),
# only to look at flags it could see as well once a second: 10 wake-ups a second per idle
# connection, 640 at 64 nodes, ~3 % of a core in the supervisor. Once open, the socket waits this
# long instead. Data still wakes it at once; a closed transport's thread ends within this (its
# close() does not wait for it), and a rekey or a blocked write notices a close within it too.
IDLE_READ_S = 1.0


def _transport(sock, **kw) -> paramiko.Transport:
    """paramiko's Transport, offering AES-GCM first: one AEAD pass per packet instead of AES-CTR
    plus a separate HMAC, less CPU at both ends of a bulk copy (bench/bench_copy_cost.py)."""
    t = paramiko.Transport(sock, **kw)
    opts = t.get_security_options()
    opts.ciphers = tuple(c for c in AEAD_CIPHERS if c in opts.ciphers) + \
        tuple(c for c in opts.ciphers if c not in AEAD_CIPHERS)
    return t


class _SSHProc(Proc):
    def __init__(self, node: str, chan: paramiko.Channel, conn: "SSHConnection"):
        self.node, self.chan, self.started, self.conn = node, chan, time.monotonic(), conn
        self._fd = chan.fileno()

    def fds(self) -> list[int]:
        return [self._fd]  # paramiko's one pipe for the channel, stdout and stderr alike

    def lost_reason(self) -> str | None:
        return self.conn.lost_reason

    def read(self):
        out = err = b""
        c = self.chan
        while c.recv_ready():
            out += c.recv(1 << 20)
        while c.recv_stderr_ready():
            err += c.recv_stderr(1 << 20)
        if (out or err) and c.get_transport() is self.conn.transport_now():  # the node answers: its
            self.conn.data_at = time.monotonic()  # connection's next ping can wait (SSHConnection._watch)
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

    def send(self, data):
        try:
            self.chan.sendall(data)
            return True
        except (paramiko.SSHException, OSError, EOFError):  # the channel or its transport is closed
            return False


class SSHConnection(Connection):
    def __init__(self, node: Node, *, accept_new_host_keys: bool = False,
                 connect_timeout: float | None = None, lost_timeout: float = DEFAULT_LOST_TIMEOUT,
                 heard: Heard | None = None):
        super().__init__(node)
        self.accept_new = accept_new_host_keys
        self.connect_timeout = connect_timeout or node.ssh.connect_timeout or DEFAULT_CONNECT_TIMEOUT
        self.lost_timeout = lost_timeout
        self._lost: str | None = None  # set by the liveness watch when the peer went silent
        self.heard = heard  # the cluster's answered pings: None, the silence alone decides a loss
        self.evidence: str | None = None  # why the node is lost now (transport/liveness.py), not only silent
        self._conn = None
        self._closing = threading.Event()
        self.last_heard = time.monotonic()  # the node's last answer (open, a keepalive reply, its bytes)
        self.data_at = float("-inf")  # when bytes from the node were last read from one of its channels

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
                          "channel_timeout": self.connect_timeout, "transport_factory": _transport}
        if s.identity_file:
            connect_kwargs["key_filename"] = [os.path.expanduser(s.identity_file)]
        return fabric.Connection(host, user=user, port=port, config=config, gateway=gateway,
                                 connect_timeout=self.connect_timeout, connect_kwargs=connect_kwargs)

    def _gateway(self, target):
        """The ProxyJump hops in front of `target`, last hop outermost: the inventory's ssh.proxy_jump,
        else the ssh_config's ProxyJump for the node, parsed here (fabric reads `[fe80::1]:22` as a
        host name), else its ProxyCommand; False for none. UsageError for an ssh_config ProxyJump that cannot be used."""
        jump = self.node.ssh.proxy_jump or target.ssh_config.get("proxyjump")
        if not jump or jump.lower() == "none":
            return target.ssh_config.get("proxycommand") or False  # a command string, as fabric takes it
        try:
            check_proxy_jump(jump)
        except ValueError as e:
            raise UsageError(f"{self.node.name}: the ssh config's ProxyJump cannot be used: {e}") from None
        gateway = None  # the first hop may have its own ProxyJump in the ssh config (fabric's rule)
        for hop in jump.split(","):
            user, host, port = split_hop(hop)
            gateway = self._make(unbracket(host), user, int(port) if port else None, gateway)
        return gateway

    def _secure(self, c) -> None:
        """Replace fabric's AutoAddPolicy on this hop and every gateway hop with one that decides
        on the presented key from the known_hosts entries for that hop's own host (see
        known_hosts.py), and make each hop's handshake use a key type listed for it."""
        kh = self._known_hosts_path()  # the inventory's, else ~/.ssh/known_hosts
        while c is not None and not isinstance(c, (str, bool)):
            name = c.host if c.port == 22 else f"[{c.host}]:{c.port}"  # as ssh looks it up
            try:
                entries = host_entries(kh, name)
            except OSError as e:
                raise ConnectError(self.node.name, f"cannot read known_hosts {kh}: {e}") from None
            disabled = entries.disabled_algorithms()
            if disabled:
                c.connect_kwargs["disabled_algorithms"] = disabled
            c.client.set_missing_host_key_policy(
                _HostKeyPolicy(self.node.name, c.port, entries, self.accept_new))
            c = c.gateway

    def open(self):
        """Connect, or raise ConnectError (HostKeyError, AuthRefused: the node refused us) with
        every socket of this try already closed: a node's sshd keeps an unauthenticated connection
        until its LoginGraceTime, and a few left behind fill its MaxStartups for everyone."""
        s, n = self.node.ssh, self.node
        self._conn = self._make(n.host, s.user, s.port, gateway=False)
        try:
            self._conn.gateway = self._gateway(self._conn)
            self._secure(self._conn)
            self._conn.open()
            self._quiet_readers()
        except BaseException as e:  # noqa: BLE001 - classified into one sentence below
            hop = self._failed_hop()
            self.close()
            if isinstance(e, (ClusterctlError, KeyboardInterrupt)):
                raise
            raise _classified(n.name, e, hop, self.connect_timeout) from e
        self.last_heard = time.monotonic()
        self._watch(self._closing)

    def _quiet_readers(self) -> None:
        """Each open transport of the chain (ProxyJump hops and the node) polls its socket every
        IDLE_READ_S, not every 0.1 s (see IDLE_READ_S)."""
        c = self._conn
        while c is not None and not isinstance(c, (str, bool)):
            t = c.client.get_transport()
            if t is not None and t.is_active() and hasattr(t.sock, "settimeout"):
                t.sock.settimeout(IDLE_READ_S)
            c = c.gateway

    def _failed_hop(self):
        """The first connection of the chain (ProxyJump hops first, the node last) not open."""
        chain, c = [], self._conn
        while c is not None and not isinstance(c, (str, bool)):
            chain.append(c)
            c = c.gateway
        for c in reversed(chain):
            t = c.client.get_transport()
            if t is None or not t.is_active():
                return c
        return self._conn

    def reopen(self, timeout: float | None = None) -> None:
        """Replace a lost connection with a new one to the same node, same settings and host-key
        checks; raises ConnectError like `open`. Procs of the old connection stay lost. `timeout`
        caps this attempt's connect timeout (at least 1 s)."""
        self.close()
        self._closing = threading.Event()
        self._lost, self._conn, self.evidence = None, None, None
        self.data_at = float("-inf")  # bytes the old transport read answer nothing for the new one
        configured = self.connect_timeout
        if timeout is not None:
            self.connect_timeout = max(1.0, min(configured, timeout))
        try:
            self.open()
        finally:
            self.connect_timeout = configured

    def _watch(self, closing: threading.Event) -> None:
        """Detect a silent peer (link down, host frozen): TCP alone takes minutes to notice.
        A pinger sends a global request that OpenSSH must answer (it replies 'failure' to
        unknown requests) every PING_S, the next once the last is answered; bytes from the node
        on any of its channels within that time answer as well as a ping would, and no ping is
        sent then. A ping unanswered for SUSPECT_S with the evidence of transport/liveness.py
        (other nodes answered since, this node's kernel answers no TCP handshake) closes the
        transport at once, with `evidence` set: the node is lost. Unanswered for half of
        `lost_timeout` it closes the transport too; the other half is for reconnecting
        (runs/logs/streams.py): the node is lost once it has been silent for `lost_timeout` in
        all. Closing ends every channel on it. The unanswered pings of every connection are
        looked at by one thread (liveness.SILENCES), not one per connection."""
        t = self._conn.transport
        every = min(PING_S, self.lost_timeout / 4)  # a short lost_timeout is not outwaited by the pings
        check = Silence(self, t, closing, every)

        def pinger():
            while not closing.is_set() and t.is_active():
                quiet = time.monotonic() - self.data_at
                if quiet < every:  # the node spoke since the last ping: that is its answer
                    self._answered(self.data_at)
                    closing.wait(every - quiet)
                    continue
                check.sent = time.monotonic()
                try:
                    t.global_request("keepalive@openssh.com", wait=True)  # returns when the transport closes
                except (paramiko.SSHException, EOFError, OSError):  # closed under the ping: nothing to say
                    return
                if not t.is_active():
                    return
                self._answered(time.monotonic())
                check.sent = None
                closing.wait(every)

        threading.Thread(target=pinger, daemon=True, name=f"ping-{self.node.name}").start()
        SILENCES.add(check)

    def declare_lost(self, why: str, transport: paramiko.Transport, evidence: bool = False) -> None:
        """The node is lost (transport/liveness.py decided, `evidence`: on evidence, else on the
        silence): `why` is the reason its calls give; the silent `transport` is closed, ending
        every channel on it."""
        self._lost = why
        if evidence:
            self.evidence = why
        transport.close()

    def _answered(self, at: float) -> None:
        self.last_heard = at
        if self.heard is not None:
            self.heard.mark(self.node.name, at)

    @property
    def alive(self) -> bool:
        t = self._conn.transport if self._conn else None
        return bool(t and t.is_active())

    @property
    def lost_reason(self) -> str | None:
        if self._lost is not None:
            return self._lost
        if self._conn is not None and self._conn.transport is not None and not self.alive:
            return "the SSH connection was closed" if self._closing.is_set() else "the SSH connection was lost"
        return None

    @property
    def transport(self) -> paramiko.Transport:
        return self._conn.transport

    def transport_now(self) -> paramiko.Transport | None:
        """The open transport (None while there is none): a proc of one replaced by `reopen` is not its."""
        return None if self._conn is None else self._conn.transport

    def exec(self, command, *, stdin=None, keep_stdin=False):
        if not self.alive:
            raise ConnectionLost(self.node.name, self.lost_reason or "the SSH connection was lost")
        try:
            chan = self._conn.transport.open_session(timeout=self.connect_timeout)
            chan.exec_command(command)
            if stdin is None or isinstance(stdin, (bytes, bytearray, memoryview)):
                _send_chunks(chan, [stdin] if stdin else [])
                if not keep_stdin:
                    chan.shutdown_write()
            else:  # an iterable of chunks, fed from a thread so the caller's read loop keeps running
                threading.Thread(target=_send_stdin, args=(chan, stdin), daemon=True,
                                 name=f"stdin-{self.node.name}").start()
        except (paramiko.SSHException, OSError, EOFError) as e:  # the transport died under us
            raise ConnectionLost(self.node.name, self.lost_reason or f"the SSH connection was lost ({e})") from e
        return _SSHProc(self.node.name, chan, self)

    def close(self):
        """Close this connection and every ProxyJump hop's, however far their connect got."""
        self._closing.set()
        c = self._conn
        while c is not None and not isinstance(c, (str, bool)):
            for shut in (c.close, c.client.close):  # fabric's close() skips a connection whose
                try:                                 # connect() raised; paramiko's closes its socket
                    shut()
                except Exception:  # noqa: BLE001 - closing a dead connection may raise anything
                    pass
            c = c.gateway


STDIN_CHUNK = 1 << 20


def _send_chunks(chan: paramiko.Channel, chunks) -> None:
    """Send each chunk in memoryview slices of at most STDIN_CHUNK: paramiko's sendall re-slices
    what it is given for every packet, so a whole bytes object would cost O(size^2)."""
    for chunk in chunks:
        view = memoryview(chunk)
        for i in range(0, len(view), STDIN_CHUNK):
            chan.sendall(view[i:i + STDIN_CHUNK])


def _send_stdin(chan: paramiko.Channel, chunks) -> None:
    """Feed a stream of chunks, then EOF. A producer that fails ends the stream early (the
    command sees EOF; the producer reports its own error)."""
    try:
        _send_chunks(chan, chunks)
    except Exception:  # noqa: BLE001 - a closed channel or a failed producer: the command sees EOF
        pass
    finally:
        try:
            chan.shutdown_write()
        except Exception:  # noqa: BLE001 - the channel may already be gone
            pass


def _classified(node: str, e: BaseException, conn, timeout: float) -> ConnectError:
    """The typed error for a failed connect, in ssh's words (faults.py): a refusal (host key,
    authentication) is told apart from a node that is down, so a retry can wait longer for a
    person to act."""
    fault, text = explain(e, conn.host, conn.port, conn.user, timeout)
    if fault is Fault.HOST_KEY_CHANGED:
        return HostKeyError(node, text, verdict="changed", fingerprint=e.key.fingerprint)
    if fault is Fault.AUTH:
        return AuthRefused(node, text)
    return ConnectError(node, text)

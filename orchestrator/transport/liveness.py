"""When a silent node is lost: on evidence within seconds, else after `lost_timeout` of silence.

Every SSH connection pings its node once a second (a global request OpenSSH must answer), unless
bytes came from the node since the last ping (they answer as well). One thread looks at every
connection's unanswered ping (SILENCES below). A ping unanswered for SUSPECT_S makes the node a
suspect, and two facts decide at once:

  - the control machine is answered: another node of the same cluster had a ping answered after
    the suspect's ping went out, so neither this machine's network nor its scheduling is what
    is slow (a loaded control machine delays every answer alike, and then nobody is a suspect
    for long: their answers come);
  - the node's own kernel does not answer: a new TCP connection to the address the SSH session
    runs over gets no handshake within PROBE_S (a timeout, no route, network unreachable). A
    kernel answers a handshake even when sshd or the whole machine is too busy to run a
    process, so a loaded node is not taken for a lost one; a refused connection is an answer.

Both true: the node is lost now (a cut link, a powered-off or panicked machine). Either false
(a connection through a ProxyJump or ProxyCommand has no address to probe; a cluster of one
has no other node to compare with): the silence decides, as before, after `lost_timeout`.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

PING_S = 1.0  # a ping every second: a silence is noticed within SUSPECT_S + PING_S of the cut
SUSPECT_S = 2.0  # a ping unanswered this long makes its node a suspect
PROBE_S = 1.0  # the suspect's kernel must answer a TCP handshake within this


class Heard:
    """When each node of one cluster last had a ping answered (time.monotonic()), shared by the
    cluster's connections: the evidence that the control machine is being answered. It carries
    the cluster's `suspect_s` and `probe_s` too (a larger cluster's are longer: runs/scaling.py)."""

    def __init__(self, suspect_s: float = SUSPECT_S, probe_s: float = PROBE_S):
        self.suspect_s, self.probe_s = suspect_s, probe_s
        self._lock = threading.Lock()
        self._at: dict[str, float] = {}

    def mark(self, name: str, at: float) -> None:
        with self._lock:
            self._at[name] = at

    def others_since(self, name: str, since: float) -> list[str]:
        """The other nodes answered after `since`, by name."""
        with self._lock:
            return sorted(n for n, t in self._at.items() if n != name and t > since)


def probe(address: tuple, timeout: float = PROBE_S) -> str | None:
    """Why `address` (host, port) does not answer a TCP handshake, or None when it does (a
    refused connection included: the node's kernel answered)."""
    try:
        socket.create_connection(address[:2], timeout=timeout).close()
        return None
    except ConnectionRefusedError:
        return None
    except socket.timeout:
        return f"no TCP handshake within {timeout:g}s"
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN):
            return e.strerror.lower() if e.strerror else str(e)
        return None  # anything else says nothing about the node


def evidence(name: str, address: tuple | None, heard: Heard | None, sent: float) -> str | None:
    """Why the node `name`, whose ping sent at `sent` is unanswered, is lost now; None when the
    facts do not say so (the silence then decides). `address`: what its session's socket is
    connected to, None behind a gateway."""
    if address is None or heard is None:
        return None
    answered = heard.others_since(name, sent)
    if not answered:
        return None
    why = probe(address, heard.probe_s)
    if why is None:
        return None
    waited = time.monotonic() - sent
    shown = ", ".join(answered[:3]) + (f" and {len(answered) - 3} more" if len(answered) > 3 else "")
    host = f"[{address[0]}]" if ":" in address[0] else address[0]
    return (f"no answer for {waited:.1f}s and its SSH port {host}:{address[1]} does not answer ({why}) "
            f"while {shown} {'does' if len(answered) == 1 else 'do'}")


def peer_address(transport) -> tuple | None:
    """The (host, port) a direct SSH session's socket is connected to; None behind a gateway
    (a ProxyJump channel or a ProxyCommand has no address of the node to probe)."""
    sock = getattr(transport, "sock", None)
    if not isinstance(sock, socket.socket):
        return None
    try:
        return sock.getpeername()
    except OSError:
        return None


class Silence:
    """One connection's unanswered ping, looked at by SILENCES: `conn` an SSHConnection
    (transport/ssh.py, whose pinger sets `sent`), `t` its paramiko transport."""

    def __init__(self, conn, t, closing: threading.Event, every: float):
        self.conn, self.t, self.closing, self.every = conn, t, closing, every
        self.sent: float | None = None  # when the unanswered ping went out (the pinger's)
        self.probed: float | None = None  # the ping whose node was probed: one probe per unanswered ping
        self.probing = False  # a probe's answer is awaited: the evidence, when it has some, is the reason given
        self.slow = conn.lost_timeout / 2
        self.address = peer_address(t) if conn.heard is not None else None

    def check(self) -> bool:
        """Close the transport of a node silent too long; False once this connection is done."""
        t, closing, heard = self.t, self.closing, self.conn.heard
        if closing.is_set() or not t.is_active():
            return False
        since = self.sent
        if since is None:
            return True
        waited = time.monotonic() - since
        if waited >= (heard.suspect_s if heard is not None else SUSPECT_S) and self.probed != since:
            self.probed, self.probing = since, True  # the probe waits for a TCP handshake: not on this thread
            threading.Thread(target=self._probe, args=(since,), daemon=True,
                             name=f"probe-{self.conn.node.name}").start()
        if waited >= self.slow and not self.probing:
            self.conn.declare_lost(f"no answer from the node for {self.slow:g}s (connection lost)", t)
            return False
        return True

    def _probe(self, since: float) -> None:
        try:
            why = evidence(self.conn.node.name, self.address, self.conn.heard, since)
            if why is not None and self.sent == since and self.t.is_active() and not self.closing.is_set():
                self.conn.declare_lost(why, self.t, evidence=True)
        finally:
            self.probing = False


class Silences:
    """One thread looking at every open connection's unanswered ping, each at half its ping
    interval: at 64 nodes a thread per connection woke 128 times a second (~0.7 % of a core in
    the supervisor). Started with the first connection, it ends with the last."""

    def __init__(self):
        self.lock = threading.Lock()
        self.checks: set[Silence] = set()
        self.thread: threading.Thread | None = None

    def add(self, check: Silence) -> None:
        with self.lock:
            self.checks.add(check)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, daemon=True, name="liveness")
                self.thread.start()

    def _loop(self) -> None:
        while True:
            with self.lock:
                if not self.checks:
                    self.thread = None
                    return
                checks = list(self.checks)
            time.sleep(min(c.every for c in checks) / 2)
            done = [c for c in checks if not c.check()]
            with self.lock:
                self.checks.difference_update(done)


SILENCES = Silences()

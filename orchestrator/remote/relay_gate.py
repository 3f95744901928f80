"""The relay's port (relay.py `recv`): listen where the other nodes reach this one (listen), and let
in only the upstream that presents the token (Gate, accept_upstream), from its addresses only when
they are known (plain_ip, resolve), so that neither a slow client nor a flood keeps it out.
"""
import hmac
import socket
import sys
import time

from .relay_wire import Failed

TOKEN_S = 5.0  # a connection has this long to present the 33-byte token, whatever else arrives
MAX_PENDING = 64  # connections not yet authenticated; past this the oldest is dropped
LISTEN_BACKLOG = 512  # connections the kernel holds until accepted (the loop takes them all at once)


class Gate:
    """The connections to a relay's port not yet authenticated (accept_upstream's state)."""

    def __init__(self, lsock, want, allowed=None):
        import selectors

        self.lsock, self.want, self.read_event = lsock, want, selectors.EVENT_READ
        self.allowed = allowed  # the upstream's addresses: any other source is closed unread (None: any)
        self.sel = selectors.DefaultSelector()
        self.pending = {}  # socket -> [bytes so far, when it must have sent the token]
        lsock.setblocking(False)
        self.sel.register(lsock, self.read_event)

    def drop(self, conn):
        self.sel.unregister(conn)
        self.pending.pop(conn, None)
        conn.close()

    def expire(self, now):
        for conn in [c for c, (_, until) in self.pending.items() if until <= now]:
            self.drop(conn)

    def take_all(self):
        """Accept everything waiting (a flood must not fill the backlog), the oldest dropped past
        MAX_PENDING."""
        while True:
            try:
                conn, peer = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            if self.allowed is not None and plain_ip(peer[0]) not in self.allowed:
                conn.close()  # not the upstream: nothing is read from it
                continue
            conn.setblocking(False)
            if len(self.pending) >= MAX_PENDING:
                self.drop(min(self.pending, key=lambda c: self.pending[c][1]))
            self.pending[conn] = [b"", time.monotonic() + TOKEN_S]
            self.sel.register(conn, self.read_event)

    def read(self, conn):
        """conn once it presented the whole token (then no longer pending), else None."""
        try:
            part = conn.recv(len(self.want) - len(self.pending[conn][0]))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            part = b""
        got = self.pending[conn][0] + part
        if part and len(got) < len(self.want):  # no early word on a wrong prefix: compared whole only
            self.pending[conn][0] = got
            return None
        if part and hmac.compare_digest(got, self.want):
            self.sel.unregister(conn)
            del self.pending[conn]
            return conn
        self.drop(conn)
        return None

    def close(self):
        for conn in list(self.pending):
            self.drop(conn)
        self.sel.close()
        self.lsock.setblocking(True)


def accept_upstream(lsock, token, idle, allowed=None):
    """The first connection that presents `token` within TOKEN_S of connecting; others are closed
    (at once, unread, when they do not come from one of the `allowed` addresses). Every connection is read at once, none in turn (selectors): a client that trickles bytes or
    never sends any holds only its own slot for TOKEN_S, a flood of connections only the oldest
    of MAX_PENDING slots, so neither keeps the real upstream out."""
    deadline = time.monotonic() + idle
    gate = Gate(lsock, token.encode() + b"\n", allowed)
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise Failed(f"no upstream node connected within {idle:g}s")
            gate.expire(now)
            soonest = min([deadline] + [until for _, until in gate.pending.values()])
            for key, _ in gate.sel.select(max(0.0, soonest - now)):
                if key.fileobj is lsock:
                    gate.take_all()
                elif key.fileobj in gate.pending and (conn := gate.read(key.fileobj)) is not None:
                    conn.setblocking(True)
                    conn.settimeout(idle)
                    return conn
    finally:
        gate.close()


def plain_ip(text):
    """An address as compared here: no %scope, an IPv4-mapped IPv6 address as its IPv4 one."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return text
    return str(ip.ipv4_mapped) if ip.version == 6 and ip.ipv4_mapped else str(ip)


def resolve(name):
    """The addresses `name` resolves to here: getaddrinfo's, as plain_ip writes them; None when it
    does not resolve."""
    try:
        return {plain_ip(info[4][0]) for info in socket.getaddrinfo(name.strip("[]"), None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return None


def listen(address):
    """A socket listening on an ephemeral port of `address`, the one the other nodes use to reach
    this node, so the port is not offered on its other networks. When that address is not one of
    this node's own (a NAT in between, a name that resolves elsewhere or to several addresses, of
    which the peers may pick any) or none is given: every address."""
    infos = socket.getaddrinfo(address.strip("[]"), 0, type=socket.SOCK_STREAM) if address else []
    if len({info[4][0] for info in infos}) == 1:
        try:
            return socket.create_server(infos[0][4], family=infos[0][0], backlog=LISTEN_BACKLOG)
        except OSError:
            pass
    if address:
        sys.stderr.write(f"relay: {address} is not one address of this node; listening on every address\n")
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    return socket.create_server(("", 0), family=family, dualstack_ipv6=family == socket.AF_INET6,
                                backlog=LISTEN_BACKLOG)

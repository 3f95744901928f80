"""clusterctl's sync relay: receive a tar stream, forward it to the next node, write it into the
workdir. Stdlib only; shipped as `python3 -c <this> MODE ...`, never installed, with
remote/common.py in front of it (probe.py `program`): the tar member rule, Hashed, send_tar,
checkpoint names and marked_pids come from there.

    recv XFER WORKDIR [--listen ADDR]
                            the relay; its stdin is the control protocol below. It listens on
                            ADDR, the address the other nodes use for this one (every address
                            when ADDR is not this node's own, or not given)
    changed WORKDIR         stdin: NUL-terminated "SIZE MTIME PATH" records of the files a sync
                            would ship; prints "changed BYTES FILES" (files whose size or mtime
                            differ here) and "rsync yes|no"; creates WORKDIR
    send XFER DIR NAME...   stream checkpoints NAME (a file with its .sha256, or a directory) from
                            DIR on this node to another node's `recv`; stdin: "to HOST PORT TOKEN";
                            stdout: "sent BYTES SHA256" for the control machine to announce
    stop XFER WORKDIR       end this user's processes of transfer XFER (found by the environment
                            marker CLUSTERCTL_XFER=XFER, never by name) and remove its staging dir

The `recv` protocol. Stdin (the node's own SSH channel, so no key or secret is placed on a node):
    token HEX                  what an upstream node must send first on the TCP connection
    next HOST PORT TOKEN | last    where to forward the stream (and the token to present there)
    source stdin | tcp [FROM]  stdin: framed data follows here (4-byte big-endian length, then
                               that many bytes; length 0 ends); tcp: accept it on the port, from
                               FROM's addresses only when given (others closed before a byte is read)
    sha256 HEX                 the stream's digest, announced by the control machine
Stdout, one event a line: "port P" (listening on ephemeral port P), "linked" or
"link-failed WHY", "progress BYTES", "forward-failed WHY", "done BYTES FILES".

The stream is extracted into WORKDIR/.clusterctl-relay-XFER while it passes through, and moved
into WORKDIR only when its sha256 matches the announced one, so a corrupted stream changes nothing.
Every wait has a timeout (--idle seconds without progress, --connect-timeout for the downstream).
"""
import hmac
import os
import select
import shutil
import socket
import struct
import sys
import time

from .common import (
    checkpoint_parts, checkpoint_step, extract_member, Hashed, marked_pids, private_files, send_tar,
    tar_member_ok,
)

CHUNK = 1 << 20
CORRUPT_ENV = "CLUSTERCTL_RELAY_CORRUPT_AT"  # test knob: flip the forwarded byte at this offset


class Failed(Exception):
    pass


def emit(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Stdin:
    """fd 0 read with a timeout per wait: lines and length-prefixed frames."""

    def __init__(self, idle):
        self.buf, self.idle, self.eof = bytearray(), idle, False

    def _fill(self):
        if self.eof:
            return False
        if not select.select([0], [], [], self.idle)[0]:
            raise Failed(f"nothing from the control machine for {self.idle:g}s")
        data = os.read(0, CHUNK)
        self.eof = not data
        self.buf += data
        return bool(data)

    def line(self):
        while b"\n" not in self.buf:
            if not self._fill():
                raise Failed("the control machine closed the connection mid-protocol")
        i = self.buf.index(b"\n")
        out = bytes(self.buf[:i]).decode()
        del self.buf[:i + 1]
        return out.split()

    def exact(self, n):
        while len(self.buf) < n:
            if not self._fill():
                raise Failed("the stream from the control machine ended early")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def frame(self):
        (n,) = struct.unpack(">I", self.exact(4))
        return self.exact(n) if n else b""


def expect(words, key, count):
    if not words or words[0] != key or len(words) != count:
        raise Failed(f"protocol error: expected {key!r}, got {' '.join(words)[:80]!r}")
    return words[1:]


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


class Pass:
    """The stream as a file for tarfile: each chunk is hashed and forwarded before it is read."""

    def __init__(self, pull, down, idle):
        self.pull, self.down, self.idle = pull, down, idle
        self.seen, self.pending = Hashed(), b""
        self.forward_error = None
        self.corrupt_at = int(os.environ.get(CORRUPT_ENV, "-1"))
        self.last_report = 0.0

    def next_chunk(self):
        data = self.pull()
        if not data:
            return False
        if self.down is not None:
            self.forward(data)
        self.seen.update(data)
        now = time.monotonic()
        if now - self.last_report > 0.25:
            self.last_report = now
            emit(f"progress {self.seen.total}")
        self.pending = data
        return True

    def forward(self, data):
        done = self.seen.total
        if done <= self.corrupt_at < done + len(data):
            i = self.corrupt_at - done
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
        try:
            self.down.sendall(data)
        except OSError as e:  # the downstream fails on its own; this node keeps its copy
            self.forward_error = f"forwarding to the next node failed: {e}"
            emit("forward-failed " + self.forward_error)
            self.down.close()
            self.down = None

    def read(self, n=-1):
        if not self.pending and not self.next_chunk():
            return b""
        if n < 0 or n >= len(self.pending):
            out, self.pending = self.pending, b""
        else:
            out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def drain(self):
        self.pending = b""
        while self.next_chunk():
            self.pending = b""


def extract(stream, staging):
    """Unpack the tar stream into staging (its files, symbolic links and directories, an empty one
    too); returns the number of files and links."""
    import tarfile

    root = os.path.realpath(staging)
    count = 0
    with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK) as tar:
        for m in tar:
            if not tar_member_ok(m, root, links=True):
                raise Failed("refusing unsafe path in the stream: " + m.name)
            if m.isfile() or m.issym() or m.isdir():
                extract_member(tar, m, root, links=True)
                count += not m.isdir()
    return count


def install(staging, workdir):
    """Move every staged file over its place in workdir (same filesystem: renames)."""
    for d, dirs, files in os.walk(staging):
        rel = os.path.relpath(d, staging)
        dest_dir = workdir if rel == "." else os.path.join(workdir, rel)
        os.makedirs(dest_dir, exist_ok=True)
        # checksum files last: a checkpoint's .sha256 or MANIFEST.sha256 marks it complete
        for name in sorted(files, key=lambda n: n.endswith(".sha256")) + \
                [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            dest = os.path.join(dest_dir, name)
            if os.path.isdir(dest) and not os.path.islink(dest):
                raise Failed(f"cannot replace the directory {dest} with a file")
            os.replace(os.path.join(d, name), dest)


def link_downstream(words, connect_timeout):
    if words == ["last"]:
        return None
    host, port, token = expect(words, "next", 4)
    try:
        down = socket.create_connection((host, int(port)), timeout=connect_timeout)
        down.sendall(token.encode() + b"\n")
    except OSError as e:
        why = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e))
        emit(f"link-failed {host}:{port}: {why}")
        return None
    emit("linked")
    return down


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


def recv(xfer, workdir, idle, connect_timeout, address=None):
    inp = Stdin(idle)
    try:
        lsock = listen(address)
    except OSError:  # `address` does not resolve here
        lsock = listen(None)
    emit(f"port {lsock.getsockname()[1]}")
    (token,) = expect(inp.line(), "token", 2)
    down = link_downstream(inp.line(), connect_timeout)
    words = inp.line()
    source, *upstream = expect(words, "source", len(words) if 2 <= len(words) <= 3 else 2)
    if source == "tcp":
        up = accept_upstream(lsock, token, idle, resolve(upstream[0]) if upstream else None)

        def pull():
            return up.recv(CHUNK)
    else:
        pull = inp.frame
    lsock.close()
    stream = Pass(pull, down, idle)
    staging = os.path.join(workdir, ".clusterctl-relay-" + xfer)
    os.makedirs(staging)
    try:
        try:
            files = extract(stream, staging)
            error = None
        except Exception as e:  # noqa: BLE001 - keep forwarding for the nodes downstream
            files, error = 0, f"writing the files failed: {e}"
        stream.drain()
        if down is not None:
            down.close()
        (announced,) = expect(inp.line(), "sha256", 2)
        got = stream.seen.hexdigest()
        if got != announced:
            raise Failed(f"the stream received here ({stream.seen.total} bytes, sha256 {got[:16]}) does not "
                         f"match the one the control machine sent (sha256 {announced[:16]}): it was "
                         "corrupted on the way; nothing was written into the workdir")
        if error:
            raise Failed(error)
        install(staging, workdir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    emit(f"done {stream.seen.total} {files}")


def send(xfer, src, names, idle, connect_timeout):
    """Connect to the receiving relay named on stdin, present its token, stream a tar of `names`
    (at the lowest CPU priority: it runs beside the training)."""
    os.nice(19)

    for name in names:
        if checkpoint_step(name) is None or not os.path.exists(os.path.join(src, name)):
            raise Failed(f"no checkpoint {name} in {src}")
    host, port, token = expect(Stdin(idle).line(), "to", 4)

    def add(tar):
        for name in names:
            for rel in checkpoint_parts(name):
                if os.path.exists(os.path.join(src, rel)):
                    tar.add(os.path.join(src, rel), arcname=rel, filter=lambda m: m if m.isfile() or m.isdir() else None)

    sent = send_tar(host, port, token, connect_timeout, idle, add)
    emit(f"sent {sent.total} {sent.hexdigest()}")


def changed(workdir):
    os.makedirs(workdir, exist_ok=True)
    data = sys.stdin.buffer.read()
    nbytes = nfiles = 0
    for rec in data.split(b"\0"):
        if not rec:
            continue
        size, mtime, path = rec.split(b" ", 2)
        try:
            st = os.lstat(os.path.join(workdir.encode(), path))
            same = st.st_size == int(size) and int(st.st_mtime) == int(mtime)
        except OSError:
            same = False
        if not same:
            nbytes, nfiles = nbytes + int(size), nfiles + 1
    emit(f"changed {nbytes} {nfiles}")
    emit("rsync " + ("yes" if shutil.which("rsync") else "no"))


def stop(xfer, workdir):
    """SIGTERM this user's processes carrying CLUSTERCTL_XFER=xfer; remove the staging dir."""
    import signal

    n = 0
    for pid in marked_pids("CLUSTERCTL_XFER", lambda value: value == xfer):
        try:
            os.kill(pid, signal.SIGTERM)
            n += 1
        except OSError:
            pass
    shutil.rmtree(os.path.join(workdir, ".clusterctl-relay-" + xfer), ignore_errors=True)
    emit(f"stopped {n}")


def run(argv):
    opts = {"--idle": 120.0, "--connect-timeout": 5.0, "--listen": None}
    while len(argv) >= 2 and argv[-2] in opts:
        opts[argv[-2]] = argv[-1] if argv[-2] == "--listen" else float(argv[-1])
        argv = argv[:-2]
    if len(argv) == 3 and argv[0] == "recv" and argv[1].replace("-", "").isalnum():
        os.makedirs(argv[2], exist_ok=True)
        recv(argv[1], os.path.realpath(argv[2]), opts["--idle"], opts["--connect-timeout"], opts["--listen"])
    elif len(argv) >= 4 and argv[0] == "send" and argv[1].replace("-", "").isalnum():
        send(argv[1], os.path.realpath(os.path.expanduser(argv[2])), argv[3:], opts["--idle"], opts["--connect-timeout"])
    elif len(argv) == 2 and argv[0] == "changed":
        changed(argv[1])
    elif len(argv) == 3 and argv[0] == "stop" and argv[1].replace("-", "").isalnum():
        stop(argv[1], argv[2])
    else:
        sys.stderr.write("usage: relay.py recv XFER WORKDIR | send XFER DIR NAME... | changed WORKDIR | stop XFER WORKDIR\n")
        return 2
    return 0


def main(argv):
    private_files()  # what it installs, a node's code and replicas, is the user's alone (or the group's too)
    try:
        return run(argv)
    except socket.timeout:
        sys.stderr.write("relay: the stream stalled (no data within the idle timeout)\n")
        return 1
    except (Failed, OSError) as e:
        sys.stderr.write(f"relay: {e}\n")
        return 1

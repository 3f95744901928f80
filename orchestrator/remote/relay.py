"""clusterctl's sync relay: receive a tar stream, forward it to the next node, write it into the
workdir. A program of the node code, stdlib only. This module holds the verbs; the protocol's
reading and events are relay_wire.py's, the port and its token gate relay_gate.py's, the tar
pass-through relay_stream.py's; the tar member rule, Hashed, send_tar, checkpoint names and
marked_pids common.py's.

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
import os
import shutil
import socket
import sys

from .common import checkpoint_parts, checkpoint_step, marked_pids, private_files, send_tar
from .relay_gate import accept_upstream, listen, resolve
from .relay_stream import Pass, extract, install
from .relay_wire import CHUNK, Failed, Stdin, emit, expect


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

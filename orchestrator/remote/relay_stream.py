"""The relay's tar pass-through (relay.py `recv`): each chunk of the stream hashed and forwarded to
the next node before it is read (Pass), unpacked into the staging directory (extract) and moved
into the workdir once its sha256 matches the announced one (install).
"""
import os
import time

from .common import Hashed, extract_member, tar_member_ok
from .relay_wire import CHUNK, Failed, emit

CORRUPT_ENV = "CLUSTERCTL_RELAY_CORRUPT_AT"  # test knob: flip the forwarded byte at this offset


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

"""The relay's protocol with the control machine (relay.py and its modules): stdin read with a
timeout per wait as lines and length-prefixed frames (Stdin, expect), the events it prints a line
each (emit), and Failed, the error that ends a relay with its reason on stderr.
"""
import os
import select
import struct
import sys

CHUNK = 1 << 20


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

"""A tar stream unpacked below a directory as its bytes arrive: no temporary archive, each file
written once.

Bytes go in with `feed` (from the transport's reader thread) and come out as files on the
unpacker's own thread; a pipe between them bounds what is in flight to the pipe's buffer.
tarfile reads the pipe as a forward-only file (`_Forward`) in its normal mode, which reads each
member's data straight from the pipe; its stream mode re-joins and re-slices a buffer on every
read. Only
plain files and directories are taken, none outside the directory (remote/common.py's member
rule, the nodes' own): any other member ends the extraction with an error, and the rest of the stream is still read so the sender never blocks.
With `tree=True` (a copy of a tree: `cp`, `fetch` of a path) symbolic links are taken too, as
links (the same rule with links=True), and each file keeps its mode less the umask (a script stays
executable). With `checksums=True` each file's sha256 is taken as it is written (`digests`), so a caller checking
checksums need not read the file back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tarfile
import threading
from pathlib import Path, PurePosixPath

from orchestrator.probe import common

PIPE = 1 << 20  # bytes in flight between the transport thread and the unpacker
READ = 1 << 16  # each file copy step: small enough to stay in cache between hashing and writing
JOIN_S = 120.0  # after the last byte: how long the files may take to land


class _Forward:
    """A pipe read as a file that only moves forward: tell(), and seek() to a later offset by
    reading past the bytes in between. Enough for tarfile's non-stream reader, which then reads
    each member's data straight from the pipe."""

    def __init__(self, f):
        self.f, self.pos = f, 0

    def read(self, n=-1):
        b = self.f.read(n)
        self.pos += len(b)
        return b

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        if whence == 1:
            offset += self.pos
        elif whence != 0:
            raise OSError("a stream cannot seek from its end")
        if offset < self.pos:
            raise OSError(f"a stream cannot seek back (to {offset} from {self.pos})")
        while self.pos < offset and self.read(min(offset - self.pos, PIPE)):
            pass
        return self.pos


class Unpacker:
    def __init__(self, dest: Path, *, checksums: bool = False, tree: bool = False, name: str = "unpack"):
        self.dest, self.checksums, self.tree = dest, checksums, tree
        self.files = 0  # files written
        self.bytes = 0  # bytes of those files
        self.stream_bytes = 0  # bytes of the tar stream fed in
        self.digests: dict[Path, str] = {}  # with checksums=True: file written → its sha256
        self.error: str | None = None
        self.first: str | None = None  # the first member's name (a tree's top entry)
        r, w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # Linux: a 1 MiB pipe, fewer thread switches
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE)
        self._r, self._w = os.fdopen(r, "rb", buffering=PIPE), os.fdopen(w, "wb", buffering=PIPE)
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def feed(self, data: bytes) -> None:
        self.stream_bytes += len(data)
        try:
            self._w.write(data)
        except (BrokenPipeError, ValueError):
            pass  # the reader stopped, on an error it recorded

    def close(self, timeout: float = JOIN_S) -> str | None:
        """End of the stream: wait for the files to land. Returns what went wrong, or None.
        Closing again returns the same."""
        try:
            self._w.close()
        except BrokenPipeError:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.error = self.error or f"unpacking did not finish within {timeout:g}s of the last byte"
        return self.error

    def _run(self) -> None:
        try:
            member_ok = common().tar_member_ok
            with tarfile.open(fileobj=_Forward(self._r), mode="r:") as tar:
                for m in tar:
                    if not member_ok(m, self.dest, links=self.tree):
                        raise tarfile.TarError(f"refusing tar member {m.name!r}")
                    self.first = self.first or m.name
                    parts = PurePosixPath(m.name).parts
                    dst = self.dest.joinpath(*parts)
                    if m.isdir():
                        dst.mkdir(parents=True, exist_ok=True)
                        continue
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    if m.issym():
                        self._link(m.linkname, dst)
                        continue
                    self._write(tar.extractfile(m), dst)
                    if self.tree:
                        os.chmod(dst, m.mode & 0o777 & ~common().current_umask())
                    self.files += 1
                    self.bytes += m.size
        except (OSError, tarfile.TarError) as e:
            self.error = self.error or str(e)
        finally:
            while self._r.read(PIPE):  # drain: the transport thread must never block on us
                pass
            self._r.close()

    def _link(self, target: str, dst: Path) -> None:
        """A symbolic link at dst (what was there before, not a directory, replaced)."""
        if dst.is_symlink() or dst.exists() and not dst.is_dir():
            dst.unlink()
        os.symlink(target, dst)
        self.files += 1

    def _write(self, src, dst: Path) -> None:
        h = hashlib.sha256() if self.checksums else None
        with open(dst, "wb") as out:
            while chunk := src.read(READ):
                if h is not None:
                    h.update(chunk)
                out.write(chunk)
        if h is not None:
            self.digests[dst] = h.hexdigest()

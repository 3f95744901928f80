"""The sync stream: an uncompressed tar produced file by file in bounded chunks.

No whole-archive object exists anywhere: headers are built with tarfile.TarInfo, file contents
are read CHUNK bytes at a time, and the stream's sha256 and length are computed as it goes.
(Uncompressed: the data a training job ships is mostly incompressible, and gzip at level 1
runs at ~100 MB/s on one core, slower than the links it would save.)
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import tarfile
from typing import Iterator

CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE


def _header(rel: str, st: os.stat_result, link: str | None) -> bytes:
    info = tarfile.TarInfo(rel)
    info.mtime = int(st.st_mtime)
    info.mode = stat.S_IMODE(st.st_mode)
    if link is not None:
        info.type, info.linkname = tarfile.SYMTYPE, link
    elif stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    else:
        info.size = st.st_size
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _contents(f, size: int) -> Iterator[bytes]:
    """Exactly `size` bytes of f (a file that shrank since its header is padded with zeros),
    then the padding to a whole tar block."""
    left = size
    while left:
        data = f.read(min(CHUNK, left))
        if not data:
            data = bytes(min(CHUNK, left))
        left -= len(data)
        yield data
    if size % BLOCK:
        yield bytes(BLOCK - size % BLOCK)


class TarStream:
    """Iterate for the chunks of a tar of `files` (relative to src); afterwards `.sha256` and
    `.bytes` describe exactly what was produced, and `.skipped` lists files that vanished or
    could not be read. A directory in `files` is left out, or with dirs=True sent as a directory
    entry (an empty one arrives too). `names` renames entries in the stream: {rel: name}."""

    def __init__(self, src: str, files: list[str], chunk: int = CHUNK, *, dirs: bool = False,
                 names: dict[str, str] | None = None):
        self.src, self.files, self.chunk = src, files, chunk
        self.dirs, self.names = dirs, names or {}
        self._sha = hashlib.sha256()
        self.bytes = 0
        self.skipped: list[str] = []

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def _raw(self) -> Iterator[bytes]:
        for rel in self.files:
            path, name = os.path.join(self.src, rel), self.names.get(rel, rel)
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    yield _header(name, st, os.readlink(path))
                    continue
                if stat.S_ISDIR(st.st_mode) and self.dirs:
                    yield _header(name, st, None)
                if not stat.S_ISREG(st.st_mode):
                    continue
                f = open(path, "rb")
            except OSError:
                self.skipped.append(rel)
                continue
            with f:
                st = os.fstat(f.fileno())
                yield _header(name, st, None)
                yield from _contents(f, st.st_size)
        yield bytes(2 * BLOCK)  # end of archive

    def __iter__(self) -> Iterator[bytes]:
        """Small pieces (headers, small files) are coalesced up to `chunk` bytes."""
        buf = bytearray()
        for piece in self._raw():
            if len(piece) >= self.chunk:
                if buf:
                    yield from self._out(bytes(buf))
                    buf.clear()
                yield from self._out(piece)
            else:
                buf += piece
                if len(buf) >= self.chunk:
                    yield from self._out(bytes(buf))
                    buf.clear()
        if buf:
            yield from self._out(bytes(buf))

    def _out(self, data: bytes) -> Iterator[bytes]:
        self._sha.update(data)
        self.bytes += len(data)
        yield data


def framed(chunks) -> Iterator[bytes]:
    """Length-prefixed frames (4-byte big-endian), then an empty frame: the relay's stdin format."""
    for c in chunks:
        yield struct.pack(">I", len(c))
        yield c
    yield struct.pack(">I", 0)


def estimate(src: str, files: list[str]) -> tuple[int, int]:
    """(bytes of the files, approximate bytes of their tar stream) for progress and ETA."""
    data = stream = 0
    for rel in files:
        try:
            st = os.lstat(os.path.join(src, rel))
        except OSError:
            continue
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        data += size
        stream += BLOCK + (size + BLOCK - 1) // BLOCK * BLOCK + (BLOCK * 2 if len(rel) > 99 else 0)
    return data, stream + 2 * BLOCK

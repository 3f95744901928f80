"""Room on the control machine's disk for a run's files, as the supervisor's writes find it.

A full disk ($CLUSTERCTL_HOME on a small filesystem, a log that filled it) must not take the
supervisor down: the job would train on with nobody to stop it when a node fails. So a write that
fails for want of room (ENOSPC, EDQUOT) is not an error of the run. The first one is said once
(`on_full`), then: the log copies, the per-rank files and the checkpoint copies stop (the nodes
keep everything), the record and the story are kept in memory (runs/record.py Book), and the
supervisor goes on watching, failing fast and stopping from memory. A thread looks for room every
CHECK_S s; once there is ROOM_BYTES again, `on_room` runs (the record and story written, the log
copies caught up from the nodes) and the gap is kept (`gaps`, the record's disk_full).

A run that ends while the disk is still full would have nowhere to write its final record. So
the supervisor keeps a reserve beside run.json (RESERVE, RESERVE_BYTES of incompressible bytes,
made when it starts and kept by a supervisor that takes the run over): at the end, with the disk
full, `spend_reserve` deletes it and runs on_room at once (the gap marked `"reserve": true`), so
the final record is written then, not once room comes (up to PATIENCE_S, after which it was lost).
The reserve is removed when the supervisor ends, whatever the disk, and is no file of the run's.
"""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from pathlib import Path
from typing import Callable

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
CHECK_S = 2.0  # how often a full disk is looked at again
ROOM_BYTES = 1 << 20  # free space that counts as room again (the record and a few lines of each log)
PATIENCE_S = 300.0  # how long a supervisor whose run ended waits for room to write the record
RESERVE = ".space-reserve"  # beside run.json: freed at the end to write the final record on a full disk
RESERVE_BYTES = 256 << 10  # the end's writes: run.json (a few KiB per attempt), the story's held lines, a few log lines


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL


class Space:
    """The run directory's disk, full or not. `full(e, what)` is told each failed write; it says
    whether the failure was the disk's (then the caller drops or keeps in memory what it wrote)."""

    def __init__(self, path: Path, check_s: float = CHECK_S):
        self.path, self.check_s = path, check_s
        self.since: float | None = None  # time.time() the disk was found full
        self.what: list[str] = []  # what could not be written meanwhile
        self.gaps: list[dict] = []  # {"since", "until", "what"} of each full spell that ended
        self.on_full: list[Callable[[str, OSError], None]] = []  # (what, the error): said once per spell
        self.on_room: list[Callable[[dict], None]] = []  # (the gap) once there is room again
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._room = threading.Event()  # set while not full (after on_room has run)
        self._room.set()

    @property
    def is_full(self) -> bool:
        return self.since is not None

    def full(self, e: BaseException, what: str) -> bool:
        """A write of `what` failed with `e`: True when for want of room (noted; the first of a
        spell is told to on_full and the watch for room starts), False for any other failure."""
        if not is_disk_full(e):
            return False
        with self._lock:
            first = self.since is None
            if first:
                self.since = time.time()
                self._room.clear()
            if what not in self.what:
                self.what.append(what)
            if first and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._watch, daemon=True, name="disk-room")
                self._thread.start()
        if first:
            for f in list(self.on_full):
                f(what, e)  # type: ignore[arg-type]
        return True

    def room(self) -> bool:
        """Whether the disk has ROOM_BYTES free for this user now."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize >= ROOM_BYTES

    def _watch(self) -> None:
        while not self._closed.wait(self.check_s):
            if self.room():
                self.ended()
                return

    def ended(self, reserve: bool = False) -> None:
        """There is room again (or the reserve was freed: `reserve`): the spell is kept as a gap
        and on_room runs (here, on the caller's thread; a write that fails again starts a new spell)."""
        with self._lock:
            if self.since is None:
                return
            gap = {"since": self.since, "until": time.time(), "what": list(self.what)}
            if reserve:
                gap["reserve"] = True
            self.gaps.append(gap)
            self.since, self.what = None, []
        try:
            for f in list(self.on_room):
                f(gap)
        finally:
            self._room.set()

    def keep_reserve(self) -> bool:
        """Make the reserve unless it is there whole (a supervisor that takes the run over keeps
        the first one's). Bytes that compress or deduplicate to nothing would reserve nothing on
        some filesystems, so they are random. -> whether there is one (no room for it: none)."""
        p = self.path / RESERVE
        try:
            if p.stat().st_size >= RESERVE_BYTES:
                return True
        except FileNotFoundError:
            pass
        try:
            with open(p, "wb", buffering=0) as f:
                write_all(f, os.urandom(RESERVE_BYTES))
                os.fsync(f.fileno())
            return True
        except OSError:
            p.unlink(missing_ok=True)
            return False

    def spend_reserve(self) -> bool:
        """With the disk full: delete the reserve and run on_room now, on this thread (the run has
        ended; what it must write fits in what the reserve held). -> whether there was one to spend."""
        try:
            (self.path / RESERVE).unlink()
        except FileNotFoundError:
            return False
        self.ended(reserve=True)
        return True

    def drop_reserve(self) -> None:
        (self.path / RESERVE).unlink(missing_ok=True)

    def wait_room(self, timeout: float) -> bool:
        """Wait (up to `timeout`) until the disk is not full and on_room has run; whether it is so."""
        return self._room.wait(timeout)

    def close(self) -> None:
        self._closed.set()


def end_writes(space: Space, unsaved: Callable[[], bool], say: Callable[[str], None],
               patience: float = PATIENCE_S) -> None:
    """The run has ended. With the disk full its reserve is spent on the final writes at once;
    with no reserve, or one too small for the record (`unsaved()` still), wait up to `patience`
    for room."""
    if not space.is_full:
        return
    spent = space.spend_reserve()
    if space.is_full and (not spent or unsaved()):
        say(f"waiting up to {patience:g}s for room on this machine's disk to write the run's record")
        space.wait_room(patience)


def write_all(f, data: bytes) -> None:
    """Write `data` whole to an unbuffered binary file (a write on a nearly full disk may take
    only part of it); OSError when the disk takes no more, what landed before it stays."""
    view = memoryview(data)
    while view:
        n = f.write(view)
        if not n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


class LogStream(io.TextIOBase):
    """Text onto a file descriptor (the supervisor's log) that a full disk cannot break: a line
    that finds no room is dropped, where print() would raise in whatever thread said it."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd
        self.dropped = 0  # characters that found no room

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, s: str) -> int:
        data = memoryview(s.encode("utf-8", "replace"))
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:
            self.dropped += len(s)
        return len(s)

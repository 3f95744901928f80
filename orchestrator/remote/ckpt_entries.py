"""A checkpoint directory's entries (ckptdir.py and its modules): each top-level entry's files and
their identities (inode, size, mtime, ctime), whether an entry is complete (closed by its writer:
no process of this user holds a file under it open for writing, nothing changed while that was
looked at, inotify through Watch, a file changed just now seen closed, a directory settled or
renamed into place: sample_dir), and the moves that put a checkpoint's entries into place and the
others aside (swap_in).
"""
import os
import shutil
import time

from .common import own_dir

CHUNK = 1 << 20
CHANGED = 6  # `send`'s and `freeze`'s exit code when a file is not as listed
STAGE = ".clusterctl-restore"  # restore's staging directory, beside PATH's entries: never an entry
# An empty file changed within this is a save that has just truncated (or created) it: open() does
# that before /proc shows the descriptor and, on a loaded machine, tens of ms before inotify hears of
# it, so its writer's previous close still reads as the newest event (sample_dir)
EMPTY_S = 2.0


def abs_path(path):
    return os.path.abspath(os.path.expanduser(path))


class Watch:
    """inotify over a directory tree through libc (Linux; ctypes is stdlib): the paths under it
    (relative) that were written, truncated, created, removed or renamed since the last
    `changed()`, each with its events, and `closed`: the paths whose last event seen, in order, left
    them whole (closed after writing, or renamed into place) or not (written, truncated, created).
    Without inotify (`ok` False), or when events were lost (`lost`), the caller relies on each
    file's identity alone."""

    # IN_MODIFY IN_ATTRIB IN_CLOSE_WRITE IN_MOVED_FROM IN_MOVED_TO IN_CREATE IN_DELETE
    MASK = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200
    WRITTEN = 0x2 | 0x8  # IN_MODIFY IN_CLOSE_WRITE: the bytes under a name (a rename over it is not)
    IN_ISDIR, IN_Q_OVERFLOW, IN_NEW = 0x40000000, 0x4000, 0x80 | 0x100
    OPENED = 0x2 | 0x100  # IN_MODIFY (a truncate too) IN_CREATE: bytes on their way
    WHOLE = 0x8 | 0x80  # IN_CLOSE_WRITE IN_MOVED_TO: bytes their writer let go of
    GONE = 0x40 | 0x200  # IN_MOVED_FROM IN_DELETE

    def __init__(self, root):
        self.root, self.fd, self.dirs, self.lost, self.closed = root, -1, {}, False, {}
        try:
            import ctypes

            self.libc = ctypes.CDLL(None, use_errno=True)
            self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return
        for d, _dirs, _names in os.walk(root) if self.fd >= 0 else ():
            self._add(d)

    @property
    def ok(self):
        return self.fd >= 0 and not self.lost

    def _add(self, d):
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(d), self.MASK)
        if wd < 0:
            self.lost = True  # out of watches: changes there would go unseen
        else:
            self.dirs[wd] = os.path.relpath(d, self.root)

    def changed(self):
        import struct

        out = {}
        while self.fd >= 0:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            i = 0
            while i < len(buf):
                wd, mask, _cookie, n = struct.unpack_from("iIII", buf, i)
                name = os.fsdecode(buf[i + 16:i + 16 + n].rstrip(b"\0"))
                i += 16 + n
                self.lost |= bool(mask & self.IN_Q_OVERFLOW)
                if wd in self.dirs:
                    rel = os.path.normpath(os.path.join(self.dirs[wd], name))
                    out[rel] = out.get(rel, 0) | mask
                    self._track(rel, mask)
                    if mask & self.IN_ISDIR and mask & self.IN_NEW:
                        for d, _dirs, _names in os.walk(os.path.join(self.root, rel)):
                            self._add(d)
        return out

    def _track(self, rel, mask):
        if mask & self.GONE:
            self.closed.pop(rel, None)
        elif mask & self.WHOLE:
            self.closed[rel] = True
        elif mask & self.OPENED:
            self.closed[rel] = False

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def merge(touched, more):
    for rel, mask in more.items():
        touched[rel] = touched.get(rel, 0) | mask


def ident_of(st):
    """A version of a file: a write changes its mtime and ctime, a rename over it its inode."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def is_under(rel, top):
    return rel == top or rel.startswith(top + os.sep)


def _tree(root, name):
    """One top-level entry: {"files": {rel: identity}, "dir": bool, "newest": the latest mtime under
    it, "renamed": its own ctime is newer still}; None when it is gone."""
    top = os.path.join(root, name)
    try:
        st = os.lstat(top)
    except OSError:
        return None
    files, newest = {}, st.st_mtime_ns
    isdir = os.path.isdir(top) and not os.path.islink(top)
    for d, dirs, names in os.walk(top) if isdir else [(root, [], [name])]:
        dirs.sort()
        if isdir:
            try:
                newest = max(newest, os.lstat(d).st_mtime_ns)  # a file removed changes its directory
            except OSError:
                pass
        for n in sorted(names):
            p = os.path.join(d, n)
            try:
                s = os.lstat(p)
            except OSError:
                continue
            if os.path.isfile(p) and not os.path.islink(p):
                files[os.path.relpath(p, root)] = ident_of(s)
                newest = max(newest, s.st_mtime_ns)
    return {"files": files, "dir": isdir, "newest": newest, "renamed": isdir and st.st_ctime_ns > newest}


def files_of(root, name):
    """[[rel, size, mtime_ns]] of an entry's regular files."""
    t = _tree(root, name) or {"files": {}}
    return [[rel, i[1], i[2]] for rel, i in sorted(t["files"].items())]


def listing(root):
    """[[rel, size, mtime_ns]] of every regular file under root."""
    return [f for name in (sorted(os.listdir(root)) if os.path.isdir(root) else ()) for f in files_of(root, name)]


def entries_of(root):
    names = sorted(n for n in os.listdir(root) if not n.startswith(STAGE)) if os.path.isdir(root) else []
    return {n: t for n in names if (t := _tree(root, n)) is not None}


def _writers(root):
    """Paths under root that a process of this user has open for writing (this one excepted)."""
    out, me, uid = set(), str(os.getpid()), os.getuid()
    prefix = os.path.realpath(root) + os.sep
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            if os.stat("/proc/" + pid).st_uid != uid:
                continue
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if not target.startswith(prefix):
                    continue
                with open("/proc/%s/fdinfo/%s" % (pid, fd)) as f:
                    flags = next((int(ln.split()[1], 8) for ln in f if ln.startswith("flags:")), 0)
            except (OSError, ValueError):
                continue
            if flags & 3:  # O_WRONLY or O_RDWR
                out.add(target[len(prefix):])
    return out


def fresh_wait(entries, done, young_s):
    """How long a sample's fresh entries (those not in `done`) take to age complete by sample_dir's
    rule: EMPTY_S where one holds an empty file (a marker written in the job's last seconds),
    else young_s."""
    empty = any(i[1] == 0 for n, t in entries.items() if n not in done and t["why"] == "fresh"
                for i in t["files"].values())
    return EMPTY_S if empty else young_s


def sample_dir(root, watch, settle_ns, touched, young_ns):
    """Every top-level entry of root now: its files' identities and whether it is complete: held
    open for writing by nobody, unchanged while the writers were looked for (`touched` gathers what
    inotify saw change), each file changed within young_ns seen closed by its writer (a save's
    truncate lands inside open(), before /proc shows the descriptor: an empty file no one holds),
    an empty file unchanged for EMPTY_S whatever inotify said (that truncate's event can come after
    the sample, the last one seen then being the previous save's close), and for a directory
    settled or renamed into place."""
    touched.clear()
    watch.changed()  # what changed before this sample is judged by the identities below
    before = entries_of(root)
    writers = _writers(root)
    merge(touched, watch.changed())
    now, out = time.time_ns(), {}
    for name, t in entries_of(root).items():
        writing = sorted(r for r in writers if is_under(r, name))
        b = before.get(name)
        # inotify sees a rewrite that leaves the identities as they were (within one clock tick)
        seen = watch.ok and any(is_under(r, name) for r in touched)
        stable = b is not None and b["files"] == t["files"] and not seen
        fresh = any((0 <= now - i[3] < young_ns and not (watch.ok and watch.closed.get(rel)))
                    or (i[1] == 0 and 0 <= now - i[3] < EMPTY_S * 1e9) for rel, i in t["files"].items())
        settled = not t["dir"] or t["renamed"] or now - t["newest"] >= settle_ns
        t.update(writing=writing, why="writing" if writing else "changing" if not stable else
                 "fresh" if fresh else "" if settled else "settling")
        out[name] = t
    return out


def as_listed(path, size, mtime_ns):
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_size == size and st.st_mtime_ns == mtime_ns


def rel_ok(rel):
    return bool(rel) and not rel.startswith("/") and ".." not in rel.split("/")


def move_aside(root, name, aside):
    """root/name moved into aside, under a name free there. -> that name."""
    own_dir(aside)
    dst, k = os.path.join(aside, name), 1
    while os.path.lexists(dst):
        dst, k = os.path.join(aside, "%s.%d" % (name, k)), k + 1
    shutil.move(os.path.join(root, name), dst)  # a rename, or a copy where aside is on another filesystem
    return os.path.basename(dst)


def swap_in(root, stage, aside):
    """stage's entries into root: an entry root has too is replaced, root's others set aside."""
    aside = abs_path(aside)
    new = set(os.listdir(stage))
    moved = []
    for name in sorted(os.listdir(root)):
        if name.startswith(STAGE):
            continue
        p = os.path.join(root, name)
        if name in new:
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
        else:
            moved.append(move_aside(root, name, aside))
    written = []
    for name in sorted(new):
        os.replace(os.path.join(stage, name), os.path.join(root, name))
        written += files_of(root, name)
    return {"files": written, "aside": moved}

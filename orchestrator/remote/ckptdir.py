"""A job's own checkpoint directory on a node (`train --checkpoint-dir DIR`), for the control machine
to copy and restore: shipped on stdin, stdlib only, with remote/common.py in front of it (probe.py
`program`).

Whatever the job writes under DIR counts, any names and shapes (nanoGPT's ckpt.pt, a Trainer's
checkpoint-500/, DeepSpeed's global_step500/ and `latest`, a torch DCP directory). The unit is a
top-level entry of DIR. An entry is complete on this node when its writer has closed it: no process
of this user holds a file under it open for writing (/proc/PID/fdinfo's access mode) and nothing
under it changed while that was looked at (inotify over DIR's tree, and each file's inode, size,
mtime and ctime before and after); a directory also once nothing under it changed for SETTLE_S, or
at once when it was renamed into place after its files were written (its own ctime is newer than
everything under it). No mark from the script is needed. Regular files are carried; links, empty
directories and special files are not.

A complete version is captured at once into PENDING (beside the run's artifacts, out of the job's
reach): each changed file copied under the same watch and voided when the job writes it meanwhile,
so a file rewritten every second is taken between two saves and never torn, and the control side
then reads the capture at its own pace.

  prepare PATH              create PATH (with the user's own umask: it is the job's directory) and
                            print its absolute path
  look PATH PENDING SETTLE_S WAIT_S KEY
                            sample DIR (for up to WAIT_S while an entry is being written) and capture
                            each complete entry's changed files into PENDING. KEY: the attempt's run
                            key on this node (- for none): nothing is taken once a rank of it failed
                            or one of its processes ended (a writer killed mid-save leaves a torn
                            file that looks closed). Prints {"path": ABS, "entries": {NAME: {"files":
                            [[rel, size, mtime_ns]], "complete": bool, "writing": [rel]}}, "torn":
                            [rel], "guard": why nothing was taken or ""}; a complete entry's files
                            are in PENDING as listed (same size and mtime)
  forget PENDING            remove a look's captures
  send PATH                 stdin after the program: one JSON line [[rel, size, mtime_ns], ...]; an
                            uncompressed tar of those files on stdout. A file whose size or mtime
                            differs from the line, before or after it is read, ends the program with
                            CHANGED
  restore PATH ASIDE        stdin after the program: a tar of a checkpoint's entries. Unpacked
                            beside PATH first; then each entry of PATH that the checkpoint has is
                            replaced by it, and every other entry (a half-written checkpoint, files
                            the checkpoint never had) is moved into ASIDE, kept, out of the job's
                            way. Prints {"files": [[rel, size, mtime_ns]] (as written),
                            "aside": [NAME, ...]}
  setaside PATH ASIDE       every entry of PATH moved into ASIDE (a name ASIDE has already gets a
                            .N suffix): a run's checkpoints start from an empty DIR. Prints
                            {"path": ABS ASIDE, "aside": [NAME, ...] (moved now), "files": [[rel,
                            size, mtime_ns]] (all of ASIDE's, rel to it)}
  digest PATH               stdin after the program: JSON [[rel, size, mtime_ns]]. Prints {"files":
                            {rel: sha256}, "why": ""}, or "why" a file is missing or has changed

With train.copy_checkpoints false and train.checkpoint_replica true the snapshots stay on the nodes
(runs/ckpt/jobdir_replicas.py): each node freezes its part of a snapshot beside its run's artifacts, a
neighbour holds a replica, and a restore puts the parts together on every node:

  freeze PENDING ROOT NAME  stdin after the program: one JSON line {"files": [[rel, size, mtime_ns]],
                            "prev": {rel: [size, mtime_ns, SNAP, sha256]}}. Links those captures of
                            a look into ROOT/NAME/ (a file as it was in ROOT/SNAP, same size and
                            mtime, is linked from there), renamed into place once whole; exits
                            CHANGED when one is not as listed. Prints {rel: sha256}
  link ROOT NAME SNAP       stdin: a JSON list of rel: hard-links ROOT/SNAP/rel into ROOT/NAME/rel
                            where it exists (a replica's unchanged files). Prints the rels linked
  check ROOT NAME           stdin: JSON {rel: sha256}. Prints {"ok": bool, "why": str}: every file
                            of ROOT/NAME is there with its sha256
  keep ROOT NAMES           NAMES: JSON list. Removes every ROOT/*/snap-* not named (old snapshots)
  place PATH ASIDE STAGED   stdin: JSON {"files": {rel: sha256}, "from": {rel: ABS}}: the files
                            named in "from" (parts this node holds) are copied into STAGED beside
                            those other nodes sent there; every file is checked against its
                            sha256; then STAGED's entries go into PATH as `restore` does. Prints
                            what `restore` prints
"""
import json
import os
import shutil
import sys
import tarfile
import time

from .common import (
    NODE_RUNS, RUN_KEY, extract_member, first_rank_failure, Hashed, marked_pids, own_dir,
    private_files, safe_name, user_umask, sha256_file, tar_member_ok, write_atomic,
)

CHUNK = 1 << 20
CHANGED = 6  # `send`'s and `freeze`'s exit code when a file is not as listed
STAGE = ".clusterctl-restore"  # restore's staging directory, beside PATH's entries
PENDING = ".pending"  # a look's captures: the last path component the control side gives
INDEX = ".index.json"  # in PENDING: {rel: the identity of the version captured}
SAMPLE_S = 0.1  # between two samples of DIR while an entry is being written
GUARD_S = 0.5  # a rank killed mid-save is noted (the waiter, node_agent.py RankLines) well within this of its death



def _abs(path):
    return os.path.abspath(os.path.expanduser(path))


def prepare(path):
    if user_umask() is not None:
        os.umask(user_umask())  # the job's directory: the user's umask, as if the job had made it
    path = _abs(path)
    os.makedirs(path, exist_ok=True)
    print(json.dumps({"path": path}))


# ------------------------------------------------------------------ closed by its writer


class Watch:
    """inotify over a directory tree through libc (Linux; ctypes is stdlib): the paths under it
    (relative) that were written, truncated, created, removed or renamed since the last
    `changed()`, each with its events. Without inotify (`ok` False), or when events were lost
    (`lost`), the caller relies on each file's identity alone."""

    # IN_MODIFY IN_ATTRIB IN_CLOSE_WRITE IN_MOVED_FROM IN_MOVED_TO IN_CREATE IN_DELETE
    MASK = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200
    WRITTEN = 0x2 | 0x8  # IN_MODIFY IN_CLOSE_WRITE: the bytes under a name (a rename over it is not)
    IN_ISDIR, IN_Q_OVERFLOW, IN_NEW = 0x40000000, 0x4000, 0x80 | 0x100

    def __init__(self, root):
        self.root, self.fd, self.dirs, self.lost = root, -1, {}, False
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
                    if mask & self.IN_ISDIR and mask & self.IN_NEW:
                        for d, _dirs, _names in os.walk(os.path.join(self.root, rel)):
                            self._add(d)
        return out

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _merge(touched, more):
    for rel, mask in more.items():
        touched[rel] = touched.get(rel, 0) | mask


def _ident(st):
    """A version of a file: a write changes its mtime and ctime, a rename over it its inode."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _under(rel, top):
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
                files[os.path.relpath(p, root)] = _ident(s)
                newest = max(newest, s.st_mtime_ns)
    return {"files": files, "dir": isdir, "newest": newest, "renamed": isdir and st.st_ctime_ns > newest}


def _files(root, name):
    """[[rel, size, mtime_ns]] of an entry's regular files."""
    t = _tree(root, name) or {"files": {}}
    return [[rel, i[1], i[2]] for rel, i in sorted(t["files"].items())]


def _listing(root):
    """[[rel, size, mtime_ns]] of every regular file under root."""
    return [f for name in (sorted(os.listdir(root)) if os.path.isdir(root) else ()) for f in _files(root, name)]


def _entries(root):
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


def _sample(root, watch, settle_ns, touched):
    """Every top-level entry of root now: its files' identities and whether it is complete: held
    open for writing by nobody, unchanged while the writers were looked for (`touched` gathers what
    inotify saw change), and for a directory settled or renamed into place."""
    touched.clear()
    watch.changed()  # what changed before this sample is judged by the identities below
    before = _entries(root)
    writers = _writers(root)
    _merge(touched, watch.changed())
    now, out = time.time_ns(), {}
    for name, t in _entries(root).items():
        writing = sorted(r for r in writers if _under(r, name))
        b = before.get(name)
        # inotify sees a rewrite that leaves the identities as they were (within one clock tick)
        seen = watch.ok and any(_under(r, name) for r in touched)
        stable = b is not None and b["files"] == t["files"] and not seen
        settled = not t["dir"] or t["renamed"] or now - t["newest"] >= settle_ns
        t.update(writing=writing, why="" if stable and not writing and settled else
                 "writing" if writing else "changing" if not stable else "settling")
        out[name] = t
    return out


def _copy_chunk(src, dst, off):
    """Up to CHUNK bytes of src at `off` appended to dst (fds) -> how many (0 at the end)."""
    try:
        return os.copy_file_range(src, dst, CHUNK, off, off)  # in the kernel; a reflink where it can
    except (AttributeError, OSError):
        data = os.pread(src, CHUNK, off)
        os.pwrite(dst, data, off)
        return len(data)


def _copy_fd(src, dst):
    off = 0
    while True:
        n = _copy_chunk(src, dst, off)
        if n <= 0:
            return off
        off += n


def _capture_file(root, rel, ident, pending, watch, touched):
    """The version `ident` of root/rel copied to pending/rel, or nothing when it is not that version
    any more or the job wrote it while it was read (inotify, or its identity before and after).
    -> whether it was captured."""
    tmp = os.path.join(pending, ".incoming")
    try:
        fd = os.open(os.path.join(root, rel), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if _ident(os.fstat(fd)) != ident:
            return False
        with open(tmp, "wb") as out:
            _copy_fd(fd, out.fileno())
        end = os.fstat(fd)
    finally:
        os.close(fd)
    _merge(touched, watch.changed())
    # the descriptor holds the version it opened: a rename over the name leaves those bytes be (and
    # changes only their ctime); without inotify the ctime is what shows a write that kept the mtime
    same = _ident(end)[:3] == ident[:3] and not touched.get(rel, 0) & Watch.WRITTEN if watch.ok else \
        _ident(end) == ident
    if not same or watch.lost:
        os.remove(tmp)
        return False
    os.utime(tmp, ns=(end.st_atime_ns, end.st_mtime_ns))
    dst = os.path.join(pending, rel)
    _clear_way(pending, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.replace(tmp, dst)
    return True


def _clear_way(pending, rel):
    """What an earlier capture left where rel goes (a file where a directory is now, or the reverse)."""
    parts = rel.split(os.sep)
    for k in range(1, len(parts)):
        p = os.path.join(pending, *parts[:k])
        if os.path.lexists(p) and not os.path.isdir(p):
            os.remove(p)
    p = os.path.join(pending, rel)
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p)


def _index(pending):
    try:
        with open(os.path.join(pending, INDEX)) as f:
            found = json.load(f)
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _capture(root, pending, t, index, watch, touched, torn):
    """Entry t's files not yet in pending as they are now, captured. -> whether all are."""
    for rel, ident in sorted(t["files"].items()):
        if index.get(rel) == ident and os.path.isfile(os.path.join(pending, rel)):
            continue
        if not _capture_file(root, rel, ident, pending, watch, touched):
            torn.append(rel)
            return False
        index[rel] = ident
    return True


def _guard(key, start):
    """Why nothing may be taken from the attempt `key` now ("" when it may): a rank of it failed (a
    failure note, common.py), or fewer of its processes run than at `start` (their count then)."""
    if key == "-":
        return ""
    if first_rank_failure(os.path.join(NODE_RUNS, key)) is not None:
        return "a rank of the job failed"
    alive = len(marked_pids(RUN_KEY, lambda k: k == key))
    return "the job's processes ended" if alive == 0 or alive < start else ""


def look(path, pending, settle_s, wait_s, key):
    root, pending = _abs(path), _abs(pending)
    if os.path.basename(pending) != PENDING:
        sys.exit("refusing captures directory " + pending)
    own_dir(pending)
    index, torn, done, touched = _index(pending), [], {}, {}
    start = len(marked_pids(RUN_KEY, lambda k: k == key)) if key != "-" else 0
    watch, taken_at = Watch(root), 0.0
    deadline = time.monotonic() + float(wait_s)
    try:
        while True:
            sampled = time.monotonic()
            entries = _sample(root, watch, int(float(settle_s) * 1e9), touched)
            for name, t in entries.items():
                if name not in done and not t["why"] and _capture(root, pending, t, index, watch, touched, torn):
                    done[name], taken_at = t, sampled
            busy = [t for n, t in entries.items() if n not in done and t["why"] in ("writing", "changing")]
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(SAMPLE_S)
    finally:
        watch.close()
    if key != "-" and done:  # a writer killed before that sample has its failure noted by now
        time.sleep(max(0.0, taken_at + GUARD_S - time.monotonic()))
    guard = _guard(key, start) if done else ""
    entries.update(done)
    _prune(pending, entries, index)
    write_atomic(os.path.join(pending, INDEX), json.dumps(index))
    out = {name: {"files": [[rel, i[1], i[2]] for rel, i in sorted(t["files"].items())],
                  "complete": name in done and not guard, "writing": t["writing"]} for name, t in entries.items()}
    print(json.dumps({"path": root, "entries": out, "torn": torn, "guard": guard}))


def _prune(pending, entries, index):
    """Captures of files DIR no longer has, removed with their index lines."""
    keep = {rel for t in entries.values() for rel in t["files"]}
    for rel in [r for r in index if r not in keep]:
        del index[rel]
    for d, dirs, names in os.walk(pending, topdown=False):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), pending)
            if rel not in keep and rel != INDEX:
                os.remove(os.path.join(d, n))
        if d != pending and not os.listdir(d):
            os.rmdir(d)


def forget(pending):
    pending = _abs(pending)
    if os.path.basename(pending) != PENDING:
        sys.exit("refusing captures directory " + pending)
    shutil.rmtree(pending, ignore_errors=True)


def _same(path, size, mtime_ns):
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_size == size and st.st_mtime_ns == mtime_ns


def send(path):
    root = _abs(path)
    want = json.loads(sys.stdin.buffer.readline())
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", bufsize=CHUNK) as tar:
        for rel, size, mtime_ns in want:
            p = os.path.join(root, rel)
            if ".." in rel.split("/") or rel.startswith("/") or not _same(p, size, mtime_ns):
                sys.stderr.write("changed: %s\n" % rel)
                sys.exit(CHANGED)
            tar.add(p, arcname=rel, recursive=False)
            if not _same(p, size, mtime_ns):
                sys.stderr.write("changed while read: %s\n" % rel)
                sys.exit(CHANGED)


def restore(path, aside):
    root = _abs(path)
    os.makedirs(root, exist_ok=True)
    stage = os.path.join(root, "%s.%d" % (STAGE, os.getpid()))
    os.makedirs(stage)
    try:
        with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
            for member in tar:
                if not tar_member_ok(member, stage) or member.isdir():
                    sys.exit("refusing tar member " + member.name)
                extract_member(tar, member, stage)
        print(json.dumps(_swap(root, stage, aside)))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _aside(root, name, aside):
    """root/name moved into aside, under a name free there. -> that name."""
    own_dir(aside)
    dst, k = os.path.join(aside, name), 1
    while os.path.lexists(dst):
        dst, k = os.path.join(aside, "%s.%d" % (name, k)), k + 1
    shutil.move(os.path.join(root, name), dst)  # a rename, or a copy where aside is on another filesystem
    return os.path.basename(dst)


def setaside(path, aside):
    root, aside = _abs(path), _abs(aside)
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    moved = [_aside(root, name, aside) for name in names if not name.startswith(STAGE)]
    print(json.dumps({"path": aside, "aside": moved, "files": _listing(aside)}))


def digest(path):
    root, out = _abs(path), {}
    for rel, size, mtime_ns in json.loads(sys.stdin.buffer.read()):
        p = os.path.join(root, rel)
        if not _rel_ok(rel) or not _same(p, size, mtime_ns) or not os.path.isfile(p):
            print(json.dumps({"files": {}, "why": "%s is missing or has changed since it was set aside" % rel}))
            return
        out[rel] = sha256_file(p)
    print(json.dumps({"files": out, "why": ""}))


def _swap(root, stage, aside):
    """stage's entries into root: an entry root has too is replaced, root's others set aside."""
    aside = _abs(aside)
    new = set(os.listdir(stage))
    moved = []
    for name in sorted(os.listdir(root)):
        if name.startswith(STAGE):
            continue
        p = os.path.join(root, name)
        if name in new:
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
        else:
            moved.append(_aside(root, name, aside))
    written = []
    for name in sorted(new):
        os.replace(os.path.join(stage, name), os.path.join(root, name))
        written += _files(root, name)
    return {"files": written, "aside": moved}


def _rel_ok(rel):
    return bool(rel) and not rel.startswith("/") and ".." not in rel.split("/")


def _copy_hashed(src, dst):
    """src to dst, hashed as it is written; dst gets src's mtime. -> sha256 hex."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(src, "rb") as f, open(dst, "wb") as out:
        h = Hashed(out.write)
        for block in iter(lambda: f.read(CHUNK), b""):
            h.write(block)
    st = os.stat(src)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    return h.hexdigest()


def freeze(pending, root, name):
    src_root, root = _abs(pending), _abs(root)
    want = json.loads(sys.stdin.buffer.readline())
    own_dir(root)
    stage = os.path.join(root, ".%s.partial" % name)
    shutil.rmtree(stage, ignore_errors=True)
    digests = {}
    try:
        for rel, size, mtime_ns in want["files"]:
            if not _rel_ok(rel):
                sys.exit("refusing path " + rel)
            src, dst = os.path.join(src_root, rel), os.path.join(stage, rel)
            prev = want.get("prev", {}).get(rel)
            old = os.path.join(root, prev[2], rel) if prev and safe_name(prev[2]) else None
            if old and len(prev) == 4 and prev[:2] == [size, mtime_ns] and _same(old, size, mtime_ns) \
                    and _same(src, size, mtime_ns):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.link(old, dst)  # frozen copies are never written again: linking shares their bytes
                digests[rel] = prev[3]
                continue
            if not _same(src, size, mtime_ns):
                sys.stderr.write("changed: %s\n" % rel)
                sys.exit(CHANGED)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.link(src, dst)  # a look's capture: never written in place (a new one is renamed over it)
            digests[rel] = sha256_file(dst)
        final = os.path.join(root, name)
        if not safe_name(name):
            sys.exit("refusing name " + name)
        shutil.rmtree(final, ignore_errors=True)
        os.makedirs(stage, exist_ok=True)
        os.replace(stage, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    print(json.dumps(digests))


def link(root, name, snap):
    root = _abs(root)
    done = []
    for rel in json.loads(sys.stdin.buffer.read() or b"[]"):
        if not (_rel_ok(rel) and safe_name(name) and safe_name(snap)):
            sys.exit("refusing path " + rel)
        old, dst = os.path.join(root, snap, rel), os.path.join(root, name, rel)
        if os.path.isfile(old) and not os.path.islink(old) and not os.path.exists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.link(old, dst)
            done.append(rel)
    print(json.dumps(done))


def _verify(root, files):
    """Why the files {rel: sha256} under root are not all there as recorded; None: they are."""
    for rel, digest in sorted(files.items()):
        p = os.path.join(root, rel)
        if not _rel_ok(rel) or not os.path.isfile(p) or os.path.islink(p):
            return "%s is missing" % rel
        if sha256_file(p) != digest:
            return "%s does not match its sha256" % rel
    return None


def check(root, name):
    why = _verify(os.path.join(_abs(root), name), json.loads(sys.stdin.buffer.read()))
    print(json.dumps({"ok": why is None, "why": why or ""}))


def keep(root, names):
    root, names = _abs(root), set(json.loads(names))
    if not os.path.isdir(root):
        return
    for origin in os.listdir(root):
        d = os.path.join(root, origin)
        for snap in os.listdir(d) if os.path.isdir(d) else ():
            if snap.lstrip(".").startswith("snap-") and snap not in names:
                shutil.rmtree(os.path.join(d, snap), ignore_errors=True)


def place(path, aside, staged):
    root, staged = _abs(path), _abs(staged)
    if os.path.dirname(staged) != root or not os.path.basename(staged).startswith(STAGE):
        sys.exit("refusing staging directory " + staged)
    want = json.loads(sys.stdin.buffer.read())
    try:
        os.makedirs(staged, exist_ok=True)
        for rel, src in sorted(want.get("from", {}).items()):
            if not _rel_ok(rel):
                sys.exit("refusing path " + rel)
            _copy_hashed(src, os.path.join(staged, rel))
        why = _verify(staged, want["files"])
        if why is not None:
            sys.exit("not placed: " + why)
        print(json.dumps(_swap(root, staged, aside)))
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def main(argv):
    private_files()
    verbs = {"prepare": (prepare, 1), "look": (look, 5), "forget": (forget, 1), "send": (send, 1),
             "restore": (restore, 2), "freeze": (freeze, 3), "link": (link, 3), "check": (check, 2), "keep": (keep, 2),
             "place": (place, 3), "setaside": (setaside, 2), "digest": (digest, 1)}
    if not argv or argv[0] not in verbs or len(argv) - 1 != verbs[argv[0]][1]:
        sys.exit("usage: ckptdir.py prepare PATH | look PATH PENDING SETTLE_S WAIT_S KEY | forget PENDING | "
                 "send PATH | restore PATH ASIDE | freeze PENDING ROOT NAME | link ROOT NAME SNAP | check ROOT NAME | "
                 "keep ROOT NAMES | place PATH ASIDE STAGED | setaside PATH ASIDE | digest PATH")
    verbs[argv[0]][0](*argv[1:])


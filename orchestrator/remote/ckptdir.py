"""A job's own checkpoint directory on a node (`train --checkpoint-dir DIR`), for the control machine
to copy and restore: shipped on stdin, stdlib only, with remote/common.py in front of it (probe.py
`program`).

Whatever the job writes under DIR counts, any names and shapes (nanoGPT's ckpt.pt, a Trainer's
checkpoint-500/, DeepSpeed's global_step500/ and `latest`, a torch DCP directory). The unit is a
top-level entry of DIR. An entry is complete on this node once it has stopped changing (nothing
under it, files or directories, modified for QUIET_S seconds by this node's clock) and no process
of this user holds a file under it open for writing (/proc/PID/fdinfo's access mode): no mark from
the script is needed. Regular files are carried; links, empty directories and special files are not.

  prepare PATH              create PATH (with the user's own umask: it is the job's directory) and
                            print its absolute path
  state PATH QUIET_S        print {"path": ABS, "entries": {NAME: {"files": [[rel, size, mtime_ns]],
                            "quiet": bool, "writing": [rel]}}}; rel is relative to PATH
  send PATH                 stdin after the program: one JSON line [[rel, size, mtime_ns], ...]; an
                            uncompressed tar of those files on stdout. A file whose size or mtime
                            differs from the line, before or after it is read, ends the program with
                            CHANGED (the job wrote it meanwhile: the copy is not a checkpoint)
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
(runs/dirreplicas.py): each node freezes its part of a snapshot beside its run's artifacts, a
neighbour holds a replica, and a restore puts the parts together on every node:

  freeze PATH ROOT NAME     stdin after the program: one JSON line {"files": [[rel, size, mtime_ns]],
                            "prev": {rel: [size, mtime_ns, SNAP, sha256]}}. Copies those files of PATH
                            into ROOT/NAME/ (a file as it was in ROOT/SNAP, same size and mtime, is
                            hard-linked instead), renamed into place once whole; exits CHANGED when one
                            changed while read. Prints {rel: sha256}
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

CHUNK = 1 << 20
CHANGED = 6  # `send`'s exit code when a file changed under it
STAGE = ".clusterctl-restore"  # restore's staging directory, beside PATH's entries


def _abs(path):
    return os.path.abspath(os.path.expanduser(path))


def prepare(path):
    if USER_UMASK is not None:
        os.umask(USER_UMASK)  # the job's directory: the user's umask, as if the job had made it
    path = _abs(path)
    os.makedirs(path, exist_ok=True)
    print(json.dumps({"path": path}))


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


def _entry(root, name, now_ns, quiet_ns):
    """One top-level entry: its regular files and whether nothing under it changed for quiet_ns."""
    top = os.path.join(root, name)
    files, newest = [], 0
    try:
        newest = os.lstat(top).st_mtime_ns
    except OSError:
        return None
    if os.path.isdir(top) and not os.path.islink(top):
        for d, dirs, names in os.walk(top):
            dirs.sort()
            try:
                newest = max(newest, os.lstat(d).st_mtime_ns)  # a file removed changes its directory
            except OSError:
                pass
            for n in sorted(names):
                _add(files, root, os.path.join(d, n))
    else:
        _add(files, root, top)
    newest = max([newest] + [f[2] for f in files])
    return {"files": files, "quiet": now_ns - newest >= quiet_ns, "writing": []}


def _add(files, root, path):
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not os.path.islink(path) and os.path.isfile(path):
        files.append([os.path.relpath(path, root), st.st_size, st.st_mtime_ns])


def state(path, quiet_s):
    import time

    root = _abs(path)
    now = time.time_ns()
    entries = {}
    names = sorted(n for n in os.listdir(root) if not n.startswith(STAGE)) if os.path.isdir(root) else []
    for name in names:
        e = _entry(root, name, now, int(float(quiet_s) * 1e9))
        if e is not None:
            entries[name] = e
    for rel in sorted(_writers(root)):
        top = rel.split(os.sep, 1)[0]
        if top in entries:
            entries[top]["writing"].append(rel)
            entries[top]["quiet"] = False
    print(json.dumps({"path": root, "entries": entries}))


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


def _listing(root):
    """[[rel, size, mtime_ns]] of every regular file under root."""
    files = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        files += (_entry(root, name, 0, 0) or {"files": []})["files"]
    return files


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
        written += _entry(root, name, 0, 0)["files"]
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


def freeze(path, root, name):
    src_root, root = _abs(path), _abs(root)
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
            digests[rel] = _copy_hashed(src, dst)
            if not _same(src, size, mtime_ns):
                sys.stderr.write("changed while read: %s\n" % rel)
                sys.exit(CHANGED)
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
    verbs = {"prepare": (prepare, 1), "state": (state, 2), "send": (send, 1), "restore": (restore, 2),
             "freeze": (freeze, 3), "link": (link, 3), "check": (check, 2), "keep": (keep, 2), "place": (place, 3),
             "setaside": (setaside, 2), "digest": (digest, 1)}
    if not argv or argv[0] not in verbs or len(argv) - 1 != verbs[argv[0]][1]:
        sys.exit("usage: ckptdir.py prepare PATH | state PATH QUIET_S | send PATH | restore PATH ASIDE | "
                 "freeze PATH ROOT NAME | link ROOT NAME SNAP | check ROOT NAME | keep ROOT NAMES | "
                 "place PATH ASIDE STAGED | setaside PATH ASIDE | digest PATH")
    verbs[argv[0]][0](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])

"""ckptdir.py's verbs for snapshots kept on the nodes (train.copy_checkpoints false,
train.checkpoint_replica true: runs/ckpt/jobdir_replicas.py): `freeze` a look's captures into a
snapshot, `link` a replica's unchanged files, `check` one against its sha256s, `keep` the named
snapshots, and `place` the parts together into PATH.
"""
import json
import os
import shutil
import sys

from .ckpt_entries import CHANGED, CHUNK, STAGE, abs_path, as_listed, rel_ok, swap_in
from .common import Hashed, own_dir, safe_name, sha256_file


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
    src_root, root = abs_path(pending), abs_path(root)
    want = json.loads(sys.stdin.buffer.readline())
    own_dir(root)
    stage = os.path.join(root, ".%s.partial" % name)
    shutil.rmtree(stage, ignore_errors=True)
    digests = {}
    try:
        for rel, size, mtime_ns in want["files"]:
            if not rel_ok(rel):
                sys.exit("refusing path " + rel)
            src, dst = os.path.join(src_root, rel), os.path.join(stage, rel)
            prev = want.get("prev", {}).get(rel)
            old = os.path.join(root, prev[2], rel) if prev and safe_name(prev[2]) else None
            if old and len(prev) == 4 and prev[:2] == [size, mtime_ns] and as_listed(old, size, mtime_ns) \
                    and as_listed(src, size, mtime_ns):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.link(old, dst)  # frozen copies are never written again: linking shares their bytes
                digests[rel] = prev[3]
                continue
            if not as_listed(src, size, mtime_ns):
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
    root = abs_path(root)
    done = []
    for rel in json.loads(sys.stdin.buffer.read() or b"[]"):
        if not (rel_ok(rel) and safe_name(name) and safe_name(snap)):
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
        if not rel_ok(rel) or not os.path.isfile(p) or os.path.islink(p):
            return "%s is missing" % rel
        if sha256_file(p) != digest:
            return "%s does not match its sha256" % rel
    return None


def check(root, name):
    why = _verify(os.path.join(abs_path(root), name), json.loads(sys.stdin.buffer.read()))
    print(json.dumps({"ok": why is None, "why": why or ""}))


def keep(root, names):
    root, names = abs_path(root), set(json.loads(names))
    if not os.path.isdir(root):
        return
    for origin in os.listdir(root):
        d = os.path.join(root, origin)
        for snap in os.listdir(d) if os.path.isdir(d) else ():
            if snap.lstrip(".").startswith("snap-") and snap not in names:
                shutil.rmtree(os.path.join(d, snap), ignore_errors=True)


def place(path, aside, staged):
    root, staged = abs_path(path), abs_path(staged)
    if os.path.dirname(staged) != root or not os.path.basename(staged).startswith(STAGE):
        sys.exit("refusing staging directory " + staged)
    want = json.loads(sys.stdin.buffer.read())
    try:
        os.makedirs(staged, exist_ok=True)
        for rel, src in sorted(want.get("from", {}).items()):
            if not rel_ok(rel):
                sys.exit("refusing path " + rel)
            _copy_hashed(src, os.path.join(staged, rel))
        why = _verify(staged, want["files"])
        if why is not None:
            sys.exit("not placed: " + why)
        print(json.dumps(swap_in(root, staged, aside)))
    finally:
        shutil.rmtree(staged, ignore_errors=True)

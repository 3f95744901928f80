"""ckptdir.py `look` and `forget`: a look samples DIR and captures each complete entry's changed
files into PENDING at once (a file copied under the same watch, voided when the job writes it
meanwhile), unless a rank of the attempt failed or one of its processes ended (_guard).
"""
import json
import os
import shutil
import sys
import time

from .ckpt_entries import CHUNK, Watch, abs_path, fresh_wait, ident_of, merge, sample_dir
from .common import NODE_RUNS, RUN_KEY, first_rank_failure, marked_pids, own_dir, write_atomic

PENDING = ".pending"  # a look's captures: the last path component the control side gives
INDEX = ".index.json"  # in PENDING: {rel: the identity of the version captured}
SAMPLE_S = 0.1  # between two samples of DIR while an entry is being written
YOUNG_S = 0.5  # a file changed within this is taken once seen closed, or once it aged past it unchanged
GUARD_S = 0.5  # a rank killed mid-save is noted (the waiter, agent_lines.py RankLines) well within this of its death


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
        if ident_of(os.fstat(fd)) != ident:
            return False
        with open(tmp, "wb") as out:
            _copy_fd(fd, out.fileno())
        end = os.fstat(fd)
    finally:
        os.close(fd)
    merge(touched, watch.changed())
    # the descriptor holds the version it opened: a rename over the name leaves those bytes be (and
    # changes only their ctime); without inotify the ctime is what shows a write that kept the mtime
    same = ident_of(end)[:3] == ident[:3] and not touched.get(rel, 0) & Watch.WRITTEN if watch.ok else \
        ident_of(end) == ident
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
    root, pending = abs_path(path), abs_path(pending)
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
            entries = sample_dir(root, watch, int(float(settle_s) * 1e9), touched, int(YOUNG_S * 1e9))
            for name, t in entries.items():
                if name not in done and not t["why"] and _capture(root, pending, t, index, watch, touched, torn):
                    done[name], taken_at = t, sampled
            busy = {t["why"] for n, t in entries.items() if n not in done} & {"writing", "changing", "fresh"}
            # a file changed just now ages past YOUNG_S (an empty one past EMPTY_S) even where the
            # job has ended (wait 0). Judged by when this sample began: on a loaded machine a sample
            # can outlast what was left of the grace, and a file that aged meanwhile would be left untaken
            if not busy or sampled >= deadline + (fresh_wait(entries, done, YOUNG_S) if busy == {"fresh"} else 0):
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
    pending = abs_path(pending)
    if os.path.basename(pending) != PENDING:
        sys.exit("refusing captures directory " + pending)
    shutil.rmtree(pending, ignore_errors=True)

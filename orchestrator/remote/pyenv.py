"""clusterctl's node side of `setup`: report a node's Python and what its wheel cache holds, and
build a venv from that cache. Stdlib only; run by the interpreter that creates the venv as
`python3 -c <this> MODE ...`, never installed, with remote/common.py in front of it (probe.py
`program`): sha256_file, write_atomic and progress come from there.

    probe VENV ROOT          one JSON line: this interpreter's version, arch and glibc, the state
                             of VENV (absent | managed | foreign | broken), the hash recorded in
                             the venv it points at, the files of ROOT's cache ({path: sha256},
                             from the index, each still of the size and mtime it was recorded
                             with), the locks whose files the cache holds, and where uv is
    install VENV ROOT HASH16 [--shipped] [--online] [--force]
                             build a new venv for the lock ROOT/wheelhouse/HASH16/lock.json and
                             switch VENV to it (--shipped: the files the index lacks came through
                             the relay in this run, whose sha256 check stands for theirs;
                             --online: the node's index serves the wheels, each checked against
                             the lock's sha256; --force: check every wheel's sha256, unpack every
                             wheel again and import every checked module)

ROOT (~/.cache/clusterctl), shared by every setup of this user: wheels/ holds every wheel of the
current lock by file name, one directory for all locks, so that uv's cache of unpacked wheels
(keyed by this directory and the file name, checked against the lock's sha256) serves a wheel an
earlier venv had: the new venv links those files instead of unpacking them. tools/uv is the
control machine's uv; wheels.json indexes the files whose sha256 was checked here or by the relay
({"files": {path: {sha256, size, mtime_ns}}}); wheelhouse/<hash16>/lock.json is a lock.

A managed VENV is a symlink to VENV.d/<hash12>-<tag>, a directory that holds a complete venv and
its record (.clusterctl-setup.json: hash, pins, the lock's wheels and checks, python, time).
`install` checks the cache against the lock, builds into a fresh directory (uv when the cache or
the node has it, else venv + pip) with no index and the lock's sha256 for every wheel, imports the
checked modules that the change can reach (all of them for a first venv), writes the record, and
only then replaces the symlink with one rename. Any failure removes the new directory and leaves
VENV as it was; the last stderr line is "error: ...", naming the package where the installer
did. The previous directory is kept, older ones are removed, and so are other locks and the
wheels no kept lock lists.
"""
import fcntl
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import time

from .common import progress, sha256_file, write_atomic

RECORD = ".clusterctl-setup.json"
DIR_RE = re.compile(r"^[0-9a-f]{12}-[0-9a-z]{6}$")
LOCK_RE = re.compile(r"^[0-9a-f]{16}$")
POOL = "wheels"
INDEX = "wheels.json"
STEP_TIMEOUT = 1800  # seconds any one installer step may take


class Failed(Exception):
    pass


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def current(venv):
    """(state, record or None) of VENV."""
    if not os.path.lexists(venv):
        return "absent", None
    if not os.path.islink(venv):
        return "foreign", None
    try:
        with open(os.path.join(venv, RECORD)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return "broken", None
    if not os.access(os.path.join(venv, "bin", "python"), os.X_OK):
        return "broken", None
    return "managed", rec


def read_lock(root, short):
    with open(os.path.join(root, "wheelhouse", short, "lock.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------ the cache and its index


def load_index(root):
    try:
        with open(os.path.join(root, INDEX)) as f:
            files = json.load(f)["files"]
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _stat(root, rel):
    try:
        st = os.stat(os.path.join(root, rel))
    except OSError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def held(root, index=None):
    """{path: sha256} of the index's files that are still there as they were recorded."""
    index = load_index(root) if index is None else index
    out = {}
    for rel, e in index.items():
        st = _stat(root, rel)
        if st is not None and isinstance(e, dict) and all(e.get(k) == v for k, v in st.items()):
            out[rel] = e.get("sha256")
    return out


def needs(lock, online):
    """[(path under ROOT, sha256, size)] of the files this lock installs from."""
    out = [(f"{POOL}/{w['file']}", w["sha256"], w["size"]) for w in lock["wheels"] if not online or w.get("local")]
    return out + [(rel, t["sha256"], t["size"]) for rel, t in (lock.get("tools") or {}).items()]


def check_cache(root, lock, online, shipped, force):
    """Every file the lock installs from is in the cache with its sha256: the index's word for
    it, the relay's (shipped), or a hash now (force: always). A damaged one is removed with its
    entry, so the next setup ships it again. What it learned goes into the index."""
    index = load_index(root)
    have = held(root, index)
    todo = [(rel, sha, size) for rel, sha, size in needs(lock, online) if force or have.get(rel) != sha]
    unsure = {rel for rel, _, _ in todo if force or not shipped}
    if unsure:
        progress("verifying the wheels", sum(size for rel, _, size in todo if rel in unsure))
    bad = []
    for rel, sha, _ in todo:
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            raise Failed(f"the wheel cache {root} lacks {rel}: run setup again to ship it")
        if rel in unsure and sha256_file(path) != sha:
            bad.append(rel)
            os.unlink(path)
            index.pop(rel, None)
        else:
            index[rel] = dict(sha256=sha, **_stat(root, rel))
    if todo:
        write_atomic(os.path.join(root, INDEX), json.dumps({"files": index}))
    if bad:
        raise Failed(f"{', '.join(bad)} in {root} did not match the lock's sha256 (a damaged copy, now "
                     "removed): run setup again to ship it")


def complete(root, short, have):
    """Does the cache hold the lock `short` and every file it installs from?"""
    try:
        lock = read_lock(root, short)
        return all(have.get(rel) == sha for rel, sha, _ in needs(lock, False))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def probe(venv, root):
    state, rec = current(venv)
    have = held(root)
    try:
        locks = sorted(n for n in os.listdir(os.path.join(root, "wheelhouse")) if LOCK_RE.match(n))
    except OSError:
        locks = []
    libc = (os.confstr("CS_GNU_LIBC_VERSION") or "") if hasattr(os, "confstr") else ""
    print(json.dumps({
        "python": platform.python_version(), "xy": "%d.%d" % sys.version_info[:2],
        "arch": platform.machine(), "glibc": libc.split()[-1] if libc.startswith("glibc") else None,
        "venv": state, "hash": (rec or {}).get("hash"), "cache": have,
        "wheelhouses": [n for n in locks if complete(root, n, have)],
        "uv": shutil.which("uv"), "executable": sys.executable}))


# ------------------------------------------------------------------ what changed


def _reach(wheels, start):
    """The projects `start` needs, itself included, through the wheels' requirements."""
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n in seen or n not in wheels:
            continue
        seen.add(n)
        todo += wheels[n].get("requires") or []
    return seen


def changes(lock, old, force=False):
    """(added, changed, removed projects, the checked modules to import) for a venv of `lock`
    built where a venv with record `old` stood. A module is imported when a project it needs
    (its own and every one its requirements reach) is new or another file, or one it needed is
    gone: the files of every other project are the very ones the old venv imported. Every module
    without an old record of the same Python and lock format, and with force."""
    new = {canonical(w["name"]): w for w in lock["wheels"]}
    before = {canonical(w["name"]): w for w in (old or {}).get("wheels") or []}
    added = sorted(n for n in new if n not in before)
    changed = sorted(n for n in new if n in before and before[n].get("sha256") != new[n]["sha256"])
    removed = sorted(n for n in before if n not in new)
    checks = lock.get("checks") or {m: None for m in lock.get("imports", [])}
    if force or not before or (old or {}).get("python") != platform.python_version():
        return added, changed, removed, sorted(checks)
    moved, gone = set(added) | set(changed), set(removed)
    todo = [m for m, dist in checks.items() if dist is None or _reach(new, dist) & moved
            or _reach(before, dist) & gone]
    return added, changed, removed, sorted(todo)


# ------------------------------------------------------------------ building


def tail(text, lines=3):
    """The installer's message as one line, without uv's box drawing: its error and cause lines
    (uv's "Failed to download `torch==2.13.0`", "Caused by: ...", pip's "ERROR: ..."), then its
    last lines."""
    keep = [re.sub(r"^[\s│├╰─▶×|]+", "", ln).strip() for ln in text.splitlines()]
    keep = [ln for ln in keep if ln and not ln.startswith(("hint:", "[notice]", "WARNING:"))]
    heads = [ln for ln in keep if ln.startswith(("error:", "ERROR:", "Caused by:", "cause:", "Because"))
             or ln.startswith(("Failed", "No solution"))][:3]
    last = [ln for ln in keep[-lines:] if ln not in heads]
    return " ".join(heads + last)


def step(what, argv, env=None, timings=None, nbytes=None):
    progress(what, nbytes)  # shown per node while this runs (clusterctl setup)
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=STEP_TIMEOUT,
                           env=dict(os.environ, **(env or {})), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Failed(f"{what} took longer than {STEP_TIMEOUT}s") from None
    except OSError as e:
        raise Failed(f"{what}: {e}") from None
    if p.returncode != 0:
        raise Failed(f"{what} failed (exit {p.returncode}): {tail(p.stderr + p.stdout)}")
    if timings is not None:
        timings[what.split()[0]] = round(time.monotonic() - t0, 2)
    return p


def hashed(path, lock):
    """The lock as a requirements file that accepts only the very files resolved on the control
    machine (name==version --hash=sha256:...): an index's, or the cache's, where uv's unpacked
    copy of a file of the same name serves only when its sha256 is the lock's."""
    with open(path, "w") as f:
        f.writelines(f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}\n" for w in lock["wheels"])
    return path


def build(new, root, lock, short, timings, online=False, force=False):
    """Create the venv at `new` and install the locked set into it from the cache's wheels (or,
    online, the node's index), each file checked against the lock's sha256."""
    py = os.path.join(new, "bin", "python")
    uv = os.path.join(root, "tools", "uv")
    uv = uv if os.access(uv, os.X_OK) else shutil.which("uv")
    # online: the index serves the lock's files; a wheel made on the control machine (clusterctl's
    # node side) came with the lock, into the cache
    source = ["--find-links", os.path.join(root, POOL), "-r",
              hashed(os.path.join(root, "wheelhouse", short, "hashed.txt"), lock)]
    size = sum(w.get("size", 0) for w in lock["wheels"])
    if uv:
        env = {"UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1", "NO_COLOR": "1"}
        step("creating the venv", [uv, "venv", "--offline", "--python", sys.executable, new], env, timings)
        step("installing the wheels", [uv, "pip", "install", "--python", py,
                                       *([] if online else ["--offline", "--no-index"]),
                                       *(["--no-cache"] if force else []), *source], env, timings, size)
    else:
        step("creating the venv", [sys.executable, "-m", "venv", new], None, timings)
        step("installing the wheels", [py, "-m", "pip", "install", *([] if online else ["--isolated", "--no-index"]),
                                       "--disable-pip-version-check", "--no-input", *source], None, timings, size)
    return "uv" if uv else "pip"


def write_record(new, lock, installer):
    rec = {"hash": lock["hash"], "requirements": lock["pins"], "python": platform.python_version(),
           "installer": installer, "created": time.time(), "checks": lock.get("checks"),
           "wheels": [{k: w.get(k) for k in ("name", "version", "sha256", "requires")} for w in lock["wheels"]]}
    write_atomic(os.path.join(new, RECORD), json.dumps(rec, indent=1))


def switch(venv, new):
    """Point venv at new with one rename of a fresh symlink over it."""
    tmp = venv + ".clusterctl-" + secrets.token_hex(4)
    os.symlink(os.path.relpath(new, os.path.dirname(venv)), tmp)
    try:
        os.replace(tmp, venv)
    except OSError:
        os.unlink(tmp)
        raise


def prune(parent, keep, root, short):
    """Older venv directories, other locks, and the cache's wheels the kept lock does not list.
    A venv directory (some 20,000 files with torch) is renamed aside at once and removed by a
    detached `rm`, so that setup does not wait for it; one left by an interrupted `rm` goes too."""
    trash = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if DIR_RE.match(name) and path not in keep:
            os.rename(path, os.path.join(parent, ".trash-" + name))
            name = ".trash-" + name
        if name.startswith(".trash-"):
            trash.append(os.path.join(parent, name))
    if trash:  # at the lowest priority: the node's jobs (and the venv just built) come first
        subprocess.Popen(["nice", "-n", "19", "rm", "-rf", "--", *trash], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    locks = os.path.join(root, "wheelhouse")
    for name in os.listdir(locks):
        if LOCK_RE.match(name) and name != short:
            shutil.rmtree(os.path.join(locks, name), ignore_errors=True)
    wanted = {rel for rel, _, _ in needs(read_lock(root, short), False)}
    index = load_index(root)
    for name in os.listdir(os.path.join(root, POOL)):
        if f"{POOL}/{name}" not in wanted and name.endswith(".whl"):
            os.unlink(os.path.join(root, POOL, name))
            index.pop(f"{POOL}/{name}", None)
    write_atomic(os.path.join(root, INDEX), json.dumps({"files": index}))


def _locked(path, what):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Failed(f"another clusterctl setup is {what} right now; run it again when that one is done") from None
    return fd


def install(venv, root, short, flags):
    t0 = time.monotonic()
    timings = {}
    state, _ = current(venv)
    if state == "foreign":
        raise Failed(f"{venv} is a directory that clusterctl setup did not build; move it away "
                     "(or name another setup.venv): it is never replaced")
    lock = read_lock(root, short)
    parent = venv + ".d"
    os.makedirs(parent, exist_ok=True)
    os.makedirs(os.path.join(root, POOL), exist_ok=True)  # (online, it may hold no wheel)
    _locked(os.path.join(parent, ".lock"), f"building {venv}")
    _locked(os.path.join(root, ".lock"), f"using the wheel cache {root}")
    v0 = time.monotonic()
    check_cache(root, lock, "--online" in flags, "--shipped" in flags, "--force" in flags)
    if time.monotonic() - v0 > 0.05:
        timings["verifying"] = round(time.monotonic() - v0, 2)
    state, rec = current(venv)  # again, under the lock
    old = os.path.realpath(venv) if state != "absent" else None
    added, changed, removed, imports = changes(lock, rec if state == "managed" else None, "--force" in flags)
    new = os.path.join(parent, lock["hash"][:12] + "-" + secrets.token_hex(3))
    try:
        try:
            installer = build(new, root, lock, short, timings, "--online" in flags, "--force" in flags)
        except Failed:  # a wheel damaged in place (its size and time kept) says so, and is shipped again
            if "--force" not in flags:  # (--force checked every wheel already)
                check_cache(root, lock, "--online" in flags, False, True)
            raise
        if imports:
            step("importing " + ", ".join(imports), [os.path.join(new, "bin", "python"), "-c",
                                                     "import " + ", ".join(imports)], None, timings)
        write_record(new, lock, installer)
        switch(venv, new)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    try:
        prune(parent, {new, old}, root, short)
    except OSError as e:  # the venv is switched: what is left over is removed by the next setup
        sys.stderr.write(f"warning: cleaning up after the switch: {e}\n")
    progress("done")
    print(json.dumps({"installed": lock["hash"], "dir": new, "installer": installer, "previous": old,
                      "seconds": round(time.monotonic() - t0, 2), "steps": timings, "added": added,
                      "changed": changed, "removed": removed, "imported": imports}))


FLAGS = ("--shipped", "--online", "--force")


def run(argv):
    if len(argv) == 3 and argv[0] == "probe":
        probe(os.path.abspath(argv[1]), os.path.abspath(argv[2]))
        return 0
    if len(argv) >= 4 and argv[0] == "install" and LOCK_RE.match(argv[3]) and set(argv[4:]) <= set(FLAGS):
        install(os.path.abspath(argv[1]), os.path.abspath(argv[2]), argv[3], argv[4:])
        return 0
    sys.stderr.write("usage: pyenv.py probe VENV ROOT | install VENV ROOT HASH16 [--shipped] [--online] [--force]\n")
    return 2


def main(argv):
    try:
        return run(argv)
    except (Failed, OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 1

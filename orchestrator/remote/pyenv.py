"""clusterctl's node side of `setup`: report a node's Python, and build a venv from a shipped
wheelhouse. Stdlib only; run by the interpreter that creates the venv as
`python3 -c <this> MODE ...`, never installed, with remote/common.py in front of it (probe.py
`program`): sha256_file and write_atomic come from there.

    probe VENV ROOT            one JSON line: this interpreter's version, arch and glibc, the
                               state of VENV (absent | managed | foreign | broken), the hash
                               recorded in the venv it points at, the wheelhouses under ROOT that
                               hold every wheel their lock.json lists, and where uv is
    install VENV WHEELHOUSE [--shipped | --online]
                               build a new venv from the wheelhouse ROOT/<hash16> and switch VENV
                               to it (--shipped: it came through the relay in this run, whose
                               sha256 check stands for the per-wheel one; --online: the directory
                               holds only the lock, and the node's index serves exactly its files)

A managed VENV is a symlink to VENV.d/<hash12>-<tag>, a directory that holds a complete venv
and its record (.clusterctl-setup.json: hash, pinned requirements, python, time). `install`
verifies every wheel's sha256, builds into a fresh directory (uv when the wheelhouse or the
node has it, else venv + pip), installs with no index, imports the top-level packages, writes
the record, and only then replaces the symlink with one rename. Any failure removes the new
directory and leaves VENV as it was; the last stderr line is "error: ...", naming the package
where the installer did. The previous directory is kept, older ones are removed, and so are
wheelhouses other than this one.
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

RECORD = ".clusterctl-setup.json"
DIR_RE = re.compile(r"^[0-9a-f]{12}-[0-9a-z]{6}$")
STEP_TIMEOUT = 1800  # seconds any one installer step may take


class Failed(Exception):
    pass


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


def read_lock(wheelhouse):
    with open(os.path.join(wheelhouse, "lock.json")) as f:
        return json.load(f)


def wheelhouse_complete(wheelhouse):
    """Every wheel of the lock is there with its size (the sha256 is checked at install)."""
    try:
        lock = read_lock(wheelhouse)
        return all(os.path.getsize(os.path.join(wheelhouse, w["file"])) == w["size"] for w in lock["wheels"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def find_uv(wheelhouse):
    shipped = os.path.join(wheelhouse, "tools", "uv")
    if os.access(shipped, os.X_OK):
        return shipped
    return shutil.which("uv")


def probe(venv, root):
    state, rec = current(venv)
    try:
        names = sorted(n for n in os.listdir(root) if re.match(r"^[0-9a-f]{16}$", n))
    except OSError:
        names = []
    libc = (os.confstr("CS_GNU_LIBC_VERSION") or "") if hasattr(os, "confstr") else ""
    print(json.dumps({
        "python": platform.python_version(), "xy": "%d.%d" % sys.version_info[:2],
        "arch": platform.machine(), "glibc": libc.split()[-1] if libc.startswith("glibc") else None,
        "venv": state, "hash": (rec or {}).get("hash"),
        "wheelhouses": [n for n in names if wheelhouse_complete(os.path.join(root, n))],
        "uv": shutil.which("uv"), "executable": sys.executable}))


def verify(wheelhouse, lock):
    for w in lock["wheels"]:
        path = os.path.join(wheelhouse, w["file"])
        if not os.path.exists(path):
            raise Failed(f"the wheelhouse {wheelhouse} lacks {w['file']}")
        if sha256_file(path) != w["sha256"]:
            raise Failed(f"{w['file']} in {wheelhouse} does not match its sha256 (damaged copy)")


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


def hashed(wheelhouse, lock):
    """The lock as a requirements file that accepts only the very files resolved on the control
    machine (name==version --hash=sha256:...), for an install from an index."""
    path = os.path.join(wheelhouse, "hashed.txt")
    with open(path, "w") as f:
        f.writelines(f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}\n" for w in lock["wheels"])
    return path


def build(new, wheelhouse, lock, timings, online=False):
    """Create the venv at `new` and install the locked set into it: from the wheelhouse with no
    index, or (online) from the node's index, each file checked against the lock's sha256."""
    py = os.path.join(new, "bin", "python")
    uv = find_uv(wheelhouse)
    if online:
        # the index serves the lock's files; a wheel made on the control machine (clusterctl's
        # node side) came with the lock, from the wheelhouse
        source = ["--require-hashes", "--find-links", wheelhouse, "-r", hashed(wheelhouse, lock)]
    else:
        source = ["--no-index", "--find-links", wheelhouse, "-r", os.path.join(wheelhouse, "pins.txt")]
    size = sum(w.get("size", 0) for w in lock["wheels"])
    if uv:
        env = {"UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1", "NO_COLOR": "1"}
        step("creating the venv", [uv, "venv", "--offline", "--python", sys.executable, new], env, timings)
        step("installing the wheels", [uv, "pip", "install", "--python", py, *([] if online else ["--offline"]),
                                       *source], env, timings, size)
    else:
        step("creating the venv", [sys.executable, "-m", "venv", new], None, timings)
        step("installing the wheels", [py, "-m", "pip", "install", *([] if online else ["--isolated"]),
                                       "--disable-pip-version-check", "--no-input", *source], None, timings, size)
    if lock.get("imports"):
        step("importing " + ", ".join(lock["imports"]), [py, "-c", "import " + ", ".join(lock["imports"])],
             None, timings)
    return "uv" if uv else "pip"


def write_record(new, lock, installer):
    rec = {"hash": lock["hash"], "requirements": lock["pins"], "python": platform.python_version(),
           "installer": installer, "created": time.time()}
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


def prune(parent, keep, wheelhouse):
    for name in os.listdir(parent):
        if DIR_RE.match(name) and os.path.join(parent, name) not in keep:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    root = os.path.dirname(wheelhouse)
    for name in os.listdir(root):
        if re.match(r"^[0-9a-f]{16}$", name) and os.path.join(root, name) != wheelhouse:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def install(venv, wheelhouse, mode=None):
    """mode --shipped: the wheelhouse arrived in this run through the relay, which checked the
    stream's sha256, so the wheels are not hashed again; --online: there are no wheels here, the
    node's index serves them (checked against the lock's sha256 as they come)."""
    t0 = time.monotonic()
    timings = {}
    state, _ = current(venv)
    if state == "foreign":
        raise Failed(f"{venv} is a directory that clusterctl setup did not build; move it away "
                     "(or name another setup.venv): it is never replaced")
    lock = read_lock(wheelhouse)
    if mode is None:
        progress("verifying the wheels", sum(w.get("size", 0) for w in lock["wheels"]))
        verify(wheelhouse, lock)
        timings["verifying"] = round(time.monotonic() - t0, 2)
    parent = venv + ".d"
    os.makedirs(parent, exist_ok=True)
    lock_fd = os.open(os.path.join(parent, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise Failed(f"another clusterctl setup is building {venv} right now; run it again when that one "
                     "is done") from None
    state, _ = current(venv)  # again, under the lock
    old = os.path.realpath(venv) if state != "absent" else None
    new = os.path.join(parent, lock["hash"][:12] + "-" + secrets.token_hex(3))
    try:
        installer = build(new, wheelhouse, lock, timings, online=mode == "--online")
        write_record(new, lock, installer)
        switch(venv, new)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    prune(parent, {new, old}, wheelhouse)
    progress("done")
    print(json.dumps({"installed": lock["hash"], "dir": new, "installer": installer,
                      "previous": old, "seconds": round(time.monotonic() - t0, 2), "steps": timings}))


def main(argv):
    if len(argv) == 3 and argv[0] == "probe":
        probe(os.path.abspath(argv[1]), os.path.abspath(argv[2]))
        return 0
    if len(argv) in (3, 4) and argv[0] == "install" and argv[3:] in ([], ["--shipped"], ["--online"]):
        install(os.path.abspath(argv[1]), os.path.abspath(argv[2]), argv[3] if len(argv) == 4 else None)
        return 0
    sys.stderr.write("usage: pyenv.py probe VENV ROOT | install VENV ROOT/HASH16 [--shipped | --online]\n")
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (Failed, OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)

"""Node facts for preflight and sync: a program of the node code, stdlib only, run on the node
and loaded as a module on the control machine (probe.load_nodeinfo), so both sides hash a workdir
the same way. This module holds the verbs (info, prune, select, send) and the JSON they print;
which files are code and their digest are codefiles.py's, the Python and torch facts pyfacts.py's,
sha256_file and send_tar common.py's.

    python - info WORKDIR        one JSON line: python/torch/CUDA/ROCm/NCCL versions (torch is
                                 *not* imported: its version.py and dist-info are read, which
                                 takes milliseconds instead of seconds) and the workdir digest.
    python -c <this> prune WD    after a push of the files listed on stdin (NUL-separated): delete
                                 what the previous push shipped and this one does not (ignored
                                 files, data, left alone), and record the list in WD/.clusterctl-code.
    python -c <this> select WD   the code of WD as this node holds it (a donor of a spare's code):
                                 one JSON line {"files": [...], "code": digest}.
    python -c <this> send WD     stream those files (NUL-separated after a "to HOST PORT TOKEN"
                                 line on stdin) as a tar to a relay.py `recv` on another node;
                                 prints "sent BYTES SHA256".
Every mode takes `--output DIR` (repeated): a run's output directory, relative to WD or absolute;
info and select also `--include GLOB`, `--exclude GLOB` (the inventory's sync section) and
`--never PATH` (an exact path: the inventory file and the files it names).

Code is what a sync ships; everything else in a workdir is output. On the control machine that
is `select`: what git tracks and the untracked files no .gitignore ignores (git ls-files -co
--exclude-standard; without git, a walk honouring .gitignore files), plus --include, minus
--exclude, the output directories, the --never paths, and what git does not track in the
folders tools write by default (TOOL_OUTPUTS: lightning_logs/, wandb/, runs/, outputs/,
multirun/ at the top, __pycache__/ anywhere). On a node a push went to, it is the list that push
recorded (.clusterctl-code): whatever a job wrote there since, on one rank or all, is not code.
A node no push recorded (a git clone there, an older clusterctl's push) is read like the control
machine. Nothing here writes into the workdir except `prune` (deleting, and the list).

The digest is content-based: for every file of the code its path, executable bit and sha256. A
git checkout, a plain copy of it and a pushed workdir hash the same, so a workdir pushed by
`clusterctl sync` compares equal to the control machine's checkout. `info` also lists each
file's short hash, so preflight's code_sync can name the files that differ.
"""
import os
import sys

from .codefiles import digest, ignored, output_dirs, parse_gitignore, pushed_files, record_pushed, under, walk_files
from .codefiles import git_files, select  # noqa: F401 - the control side's (probe.load_nodeinfo), read here
from .common import send_tar
from .common import sha256_file  # noqa: F401 - the control side hashes with nodeinfo's sha256_file
from .pyfacts import versions

# Lazy imports (re, subprocess, hashlib, tarfile), and no json (it pulls in re and enum: 8 ms):
# preflight starts this on every node with -S (no site: 14 ms saved), and every stdlib import it
# skips is 1-8 ms more, per node and per command.


def _json_char(c):
    if " " <= c <= "~":
        return "\\" + c if c in '"\\' else c
    n = ord(c)
    if n < 0x10000:
        return f"\\u{n:04x}"
    n -= 0x10000
    return f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}"


def dumps(value):
    """JSON for what this script prints (dict, list, str, int, bool, None); non-ASCII and
    surrogate-escaped bytes of odd file names come out as \\u escapes, which json.loads reads."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + "".join(map(_json_char, value)) + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(dumps(str(k)) + ": " + dumps(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    raise TypeError(f"cannot encode {type(value).__name__}")

# ------------------------------------------------------------------ prune (after a push)


def _file_or_link(p):
    return os.path.islink(p) or os.path.isfile(p)


def gitignored(root, rel):
    """rel (a file) is ignored by the .gitignore files on its way down from root."""
    rules, parts = [], rel.split("/")
    for i in range(len(parts)):
        base = "/".join(parts[:i])
        try:
            with open(os.path.join(root, base, ".gitignore"), encoding="utf-8", errors="replace") as f:
                rules = rules + parse_gitignore(f.read(), base)
        except OSError:
            pass
        if ignored(rules, "/".join(parts[:i + 1]), i < len(parts) - 1):
            return True
    return False


def prune(root, manifest, outputs=()):
    """After a push of the files `manifest` lists (NUL-separated paths): delete what an earlier
    push shipped that this one does not, unless a .gitignore ignores it now (data shipped with
    --include once stays), then record this push's list (PUSHED_LIST). A workdir no push recorded
    loses every file no .gitignore ignores that the list lacks, outside the output directories
    and the tools' output folders. Nothing else a job wrote is touched."""
    keep = {p for p in manifest.decode("utf-8", "surrogateescape").split("\0") if p}
    before = pushed_files(root)
    if before is None:
        stale = [rel for rel in walk_files(root, outputs) if rel not in keep]
    else:
        # a pushed file still there (not a directory a job made in its place), not ignored now
        stale = [rel for rel in before if rel not in keep and not under(rel, outputs)
                 and _file_or_link(os.path.join(root, rel)) and not gitignored(root, rel)]
    for rel in stale:
        os.unlink(os.path.join(root, rel))
    record_pushed(root, keep)
    print(dumps({"kept": len(keep), "removed": len(stale)}))



def _stdin_all(idle):
    """All of stdin, waiting at most `idle` seconds for each piece."""
    import select as sel

    data = b""
    while True:
        if not sel.select([0], [], [], idle)[0]:
            raise SystemExit(f"nothing from the control machine for {idle:g}s")
        part = os.read(0, 1 << 20)
        if not part:
            return data
        data += part


def send(root, idle, connect_timeout):
    """Stdin: "to HOST PORT TOKEN" and the NUL-separated files; stream them as a tar to the relay
    listening there (token first), then print "sent BYTES SHA256" for the control machine."""
    head, _, names = _stdin_all(idle).partition(b"\n")
    words = head.decode().split()
    if len(words) != 4 or words[0] != "to":
        raise SystemExit("protocol error: expected 'to HOST PORT TOKEN'")

    def add(tar):
        for rel in names.decode("utf-8", "surrogateescape").split("\0"):
            p = os.path.join(root, rel)
            if rel and (os.path.islink(p) or os.path.isfile(p)):
                tar.add(p, arcname=rel, recursive=False)

    try:
        sent = send_tar(words[1], words[2], words[3], connect_timeout, idle, add)
    except ConnectionError as e:
        raise SystemExit(str(e)) from None
    print(f"sent {sent.total} {sent.hexdigest()}")


def _options(argv):
    """WORKDIR and the --output/--include/--exclude/--never/--idle/--connect-timeout values after it."""
    opts = {"--output": [], "--include": [], "--exclude": [], "--never": [], "--idle": ["60"],
            "--connect-timeout": ["5"]}
    rest = argv[1:]
    while len(rest) >= 2 and rest[0] in opts:
        opts[rest[0]] = ([] if rest[0] in ("--idle", "--connect-timeout") else opts[rest[0]]) + [rest[1]]
        rest = rest[2:]
    if rest:
        raise SystemExit("unexpected arguments: " + " ".join(rest))
    return argv[0], opts


def main(argv):
    mode = argv[0] if argv else ""
    if mode not in ("info", "prune", "select", "send") or len(argv) < 2:
        sys.stderr.write("usage: nodeinfo.py info|prune|select|send WORKDIR [--output DIR]...\n")
        return 2
    wd, opts = _options(argv[1:])
    code = {"include": opts["--include"], "exclude": opts["--exclude"], "never": opts["--never"], "pushed": True}
    if mode == "info":
        doc = versions()
        doc["code"] = None if wd == "-" else digest(wd, output_dirs(wd, opts["--output"]), listing=True, **code)
        print(dumps(doc))
    elif mode == "send":
        send(os.path.realpath(wd), float(opts["--idle"][0]), float(opts["--connect-timeout"][0]))
    else:
        root = os.path.realpath(wd)
        outputs = output_dirs(root, opts["--output"])
        if mode == "prune":
            prune(root, sys.stdin.buffer.read(), outputs)
        else:  # what this node would hand a spare: exactly the files its code digest covers
            doc = digest(root, outputs, listing=True, **code)
            print(dumps({"files": sorted(doc.pop("hashes", {})), "code": doc}))
    return 0


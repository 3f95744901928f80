"""Which files of a workdir are code, for nodeinfo.py and the control side alike (sync, a spare's
code): the .gitignore subset, the folders tools write by default, git's list or a push's recorded
list (PUSHED_LIST), a sync's selection (--include, --exclude, the output directories, --never) and
the content digest over it. Lazy imports only (re, subprocess, hashlib): nodeinfo runs under
`python -S` on every node, and each stdlib import it skips is 1-8 ms per node and command.
"""
import os

from .common import Hashed, sha256_file, write_atomic

OWN_PREFIX = ".clusterctl-"  # relay staging, an older clusterctl's output marks: never part of the code
PUSHED_LIST = OWN_PREFIX + "code"  # in a pushed workdir: the paths its last push shipped, NUL-separated

# Folders that common tools write into the working directory by default: Lightning's logger,
# Weights & Biases, TensorBoard's SummaryWriter, Hydra's runs and multiruns; and Python's bytecode
# caches at any depth. What git does not track in them is output, whatever .gitignore says.
TOOL_OUTPUTS = ("lightning_logs", "wandb", "runs", "outputs", "multirun")
BYTECODE = "__pycache__"


def tool_output_dir(rel):
    """rel (a directory) is one of the folders tools write by default."""
    return rel in TOOL_OUTPUTS or rel.rsplit("/", 1)[-1] == BYTECODE


def tool_output(rel):
    """rel (a file) lies in one of the folders tools write by default."""
    parts = rel.split("/")
    return any(tool_output_dir("/".join(parts[:i])) for i in range(1, len(parts)))


# ------------------------------------------------------------------ .gitignore subset


def _glob_re(pat):
    """A gitignore glob -> regex over a '/'-separated relative path."""
    import re

    out, i = "", 0
    while i < len(pat):
        c = pat[i]
        if pat.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pat.startswith("/**", i) and i + 3 == len(pat):
            out += "/.*"
            i += 3
            continue
        if pat.startswith("**", i):
            out += ".*"
            i += 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            j = pat.find("]", i + 1)
            if j < 0:
                out += re.escape(c)
            else:
                body = pat[i + 1:j].replace("\\", "\\\\")
                out += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
                i = j
        elif c == "\\" and i + 1 < len(pat):
            i += 1
            out += re.escape(pat[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def parse_gitignore(text, base=""):
    """[(regex, negate, dir_only, anchored, base)] from one .gitignore's text."""
    rules = []
    for line in text.splitlines():
        line = line.rstrip("\r")
        if not line.strip() or line.startswith("#"):
            continue
        if not line.endswith("\\ "):
            line = line.rstrip(" ")
        neg = line.startswith("!")
        if neg:
            line = line[1:]
        elif line.startswith("\\!") or line.startswith("\\#"):
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        rules.append((_glob_re(line.lstrip("/")), neg, dir_only, anchored, base))
    return rules


def ignored(rules, rel, is_dir):
    """Last matching rule wins (gitignore semantics, minus re-including inside ignored dirs)."""
    verdict = False
    name = rel.rsplit("/", 1)[-1]
    for rx, neg, dir_only, anchored, base in rules:
        if dir_only and not is_dir:
            continue
        if base:
            if not rel.startswith(base + "/"):
                continue
            sub = rel[len(base) + 1:]
        else:
            sub = rel
        if rx.match(sub if anchored else name):
            verdict = not neg
    return verdict


def output_dirs(root, paths):
    """The workdir-relative paths of the output directories `paths` (relative to root, absolute
    or ~) that lie inside root; root itself and paths outside it are not outputs of it."""
    base = os.path.realpath(root)
    out = set()
    for p in paths:
        full = os.path.realpath(os.path.join(base, os.path.expanduser(p)))
        if full.startswith(base + os.sep):
            out.add(os.path.relpath(full, base).replace(os.sep, "/"))
    return out


def walk_files(root, outputs=()):
    """Relative paths of the files a git tree would ship, honouring every .gitignore; output
    directories and the tools' output folders (a plain tree tracks nothing in them) left out."""
    out = []

    def visit(d, rel, rules):
        gi = os.path.join(d, ".gitignore")
        if os.path.isfile(gi):
            try:
                with open(gi, encoding="utf-8", errors="replace") as f:
                    rules = rules + parse_gitignore(f.read(), rel)
            except OSError:
                pass
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if e.name == ".git" or e.name.startswith(OWN_PREFIX):  # clusterctl's own markers are not code
                continue
            r = e.name if not rel else rel + "/" + e.name
            is_dir = e.is_dir(follow_symlinks=False)
            if ignored(rules, r, is_dir):
                continue
            if is_dir:
                if r not in outputs and not tool_output_dir(r):
                    visit(e.path, r, rules)
            else:
                out.append(r)

    visit(root, "", [])
    return out


def git_files(root, outputs=()):
    """(files, head, dirty) from git, or None when root is not a usable git checkout: what git
    tracks and the untracked files no .gitignore ignores, less untracked files in the tools' output
    folders; output directories left out."""
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    import subprocess

    try:
        ls = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard", "-t", "-z"],
                            capture_output=True, timeout=60)
        st = subprocess.run(["git", "-C", root, "status", "--porcelain", "-z"], capture_output=True,
                            timeout=60)
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if ls.returncode != 0:
        return None
    tagged = [t for t in ls.stdout.decode("utf-8", "surrogateescape").split("\0") if len(t) > 2]
    # -t: "? " marks a file git does not track (the others: "H ", "S ", ...)
    files = sorted({t[2:] for t in tagged if not (t[0] == "?" and tool_output(t[2:]))
                    and not any(part.startswith(OWN_PREFIX) for part in t[2:].split("/"))})
    files = [f for f in files if not under(f, outputs)]
    return files, head.stdout.decode().strip() or None, bool(st.stdout.strip())


def pushed_files(root):
    """The paths the last push into root shipped (its PUSHED_LIST), or None when none was recorded."""
    try:
        with open(os.path.join(root, PUSHED_LIST), "rb") as f:
            data = f.read()
    except OSError:
        return None
    return [p for p in data.decode("utf-8", "surrogateescape").split("\0") if p]


def record_pushed(root, files):
    """Write root's PUSHED_LIST (a reader never sees half a list)."""
    write_atomic(os.path.join(root, PUSHED_LIST), "\0".join(sorted(files)).encode("utf-8", "surrogateescape"))


def code_files(root, outputs=(), pushed=False):
    """(files, head, dirty, kind) of the code in a workdir. `pushed` (a node's side): the files
    of the last push into it, when one recorded them ("pushed"); otherwise, and always on the
    control machine, git's list ("git") or the walk's ("tree")."""
    files = pushed_files(root) if pushed else None
    if files is not None:
        return files, None, None, "pushed"
    g = git_files(root, outputs)
    return (g[0], g[1], g[2], "git") if g else (walk_files(root, outputs), None, None, "tree")


def _entry(p):
    """(mode, 32-byte content hash) of one file or symlink, or None when it is neither."""
    import hashlib  # a link's target, hashed whole

    if os.path.islink(p):
        return "l", hashlib.sha256(os.readlink(p).encode("utf-8", "surrogateescape")).digest()
    if os.path.isfile(p):
        return ("x" if os.access(p, os.X_OK) else "f"), bytes.fromhex(sha256_file(p))
    return None


def digest(root, outputs=(), include=(), exclude=(), listing=False, never=(), pushed=False):
    """{"kind": "git"|"tree"|"pushed"|"missing", "digest", "files", "head", "dirty"} of what a sync
    of the workdir ships (`select`; `outputs`: workdir-relative output directories, left out;
    `never`: workdir-relative paths that are never code). `pushed`: a node's workdir, whose code
    is what its last push shipped (include and exclude were applied then). With `listing`, also
    "hashes": {path: mode + 16 hex digits of its hash}, to name what differs."""
    if not os.path.isdir(root):
        return {"kind": "missing", "digest": None, "files": 0, "head": None, "dirty": None}
    code, head, dirty, kind = code_files(root, outputs, pushed)
    if kind == "pushed":
        include, exclude = (), ()
    h = Hashed()
    hashes = {}
    for rel in select(root, include, exclude, outputs, code, never):
        try:
            entry = _entry(os.path.join(root, rel))
        except OSError:
            continue
        if entry is None:
            continue
        mode, content = entry
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0" + mode.encode() + b"\0")
        h.update(content)
        hashes[rel] = mode + content.hex()[:16]
    doc = {"kind": kind, "digest": h.hexdigest()[:16], "files": len(hashes), "head": head, "dirty": dirty}
    return doc | {"hashes": hashes} if listing else doc



# ------------------------------------------------------------------ a sync's selection, on a node


def _walk_all(src, rel_dir):
    """Every file and symlink under src/rel_dir, .gitignore or not (.git itself skipped; a link
    to a directory ships as the link)."""
    out = []
    for d, dirs, files in os.walk(os.path.join(src, rel_dir)):
        links = [x for x in dirs if os.path.islink(os.path.join(d, x))]
        dirs[:] = [x for x in dirs if x != ".git" and x not in links]
        rel = os.path.relpath(d, src).replace(os.sep, "/")
        out += [name if rel == "." else f"{rel}/{name}" for name in files + links]
    return out


def included(src, patterns):
    """Files named by `patterns`: a directory ships everything under it, a glob (** recursive)
    ships the files it matches."""
    import glob

    out = []
    for pat in patterns:
        for rel in sorted(glob.glob(pat.rstrip("/"), root_dir=src, recursive=True, include_hidden=True)):
            p = os.path.join(src, rel)
            if os.path.isdir(p) and not os.path.islink(p):
                out += _walk_all(src, rel)
            elif os.path.lexists(p):
                out.append(os.path.normpath(rel).replace(os.sep, "/"))
    return out


def excluded(rel, patterns):
    """A pattern matches the path, any of its parent directories, or (without '/') a name in it."""
    import fnmatch

    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        pat = pat.rstrip("/")
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            return True
        if "/" not in pat and any(fnmatch.fnmatchcase(name, pat) for name in parts):
            return True
    return False


def under(rel, dirs):
    """rel is one of dirs or inside one of them."""
    return any(rel == d or rel.startswith(d + "/") for d in dirs)


def select(src, include=(), exclude=(), outputs=(), code=None, never=()):
    """Sorted relative paths a sync of src ships: the code (`code`: code_files' list, when the
    caller has it), plus `include`, minus `exclude`, the output directories and `never` (exact
    paths: the inventory and the files it names)."""
    code = code_files(src, outputs)[0] if code is None else code
    files = [f for f in code if os.path.lexists(os.path.join(src, f))]
    files = set(files) | set(included(src, include))
    never = set(never)
    return sorted(f for f in files if not excluded(f, exclude) and not under(f, outputs) and f not in never
                  and not any(p.startswith(OWN_PREFIX) for p in f.split("/")))


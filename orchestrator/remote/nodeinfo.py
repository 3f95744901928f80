"""Node facts for preflight and sync; stdlib only, runs on the node (shipped, never installed)
and on the control machine (loaded as a module by probe.py), so both sides hash a workdir the
same way. remote/common.py comes in front of it either way (probe.py `program`): sha256_file,
Hashed, send_tar and write_atomic come from there.

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

from .common import Hashed, send_tar, sha256_file, write_atomic

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


# ------------------------------------------------------------------ versions


def _literal_assignments(path):
    """`name = 'x'` / `name: T = 'x'` / `name = None` lines of torch/version.py, read as text
    (importing torch takes seconds on a GPU box; even `ast` costs a few ms per node)."""
    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return out
    for line in lines:
        if line[:1].isspace() or "=" not in line:
            continue
        left, _, value = line.partition("=")
        name = left.split(":", 1)[0].strip()
        value = value.split("#", 1)[0].strip()
        if not name.isidentifier():
            continue
        if value == "None":
            out[name] = None
        elif len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" and value[0] not in value[1:-1]:
            out[name] = value[1:-1]
    return out


def venv_prefix():
    """(prefix, include-system-site-packages) when this interpreter is a venv's, else None.
    Under -S, site.venv() has not run, so sys.prefix is still the base Python's."""
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    for d in (exe_dir, os.path.dirname(exe_dir)):
        cfg = os.path.join(d, "pyvenv.cfg")
        if os.path.isfile(cfg):
            system_site = False
            try:
                with open(cfg, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        key, eq, value = line.partition("=")
                        if eq and key.strip().lower() == "include-system-site-packages":
                            system_site = value.strip().lower() == "true"
            except OSError:
                pass
            return os.path.dirname(exe_dir), system_site
    return None


def site_dirs():
    """Where `import torch` would look, without running site (the probe runs python -S): sys.path
    as it is (PYTHONPATH, stdlib), the prefix's site-packages (venvs included), the user site, and
    the directory lines of their .pth files. `import` lines of .pth files are not run."""
    import site

    dirs = [d for d in sys.path if d]
    extra, system_site = [], True
    venv = venv_prefix()
    if venv is not None:  # what site.venv() does, minus running the .pth files
        prefix, system_site = venv
        v = f"python{sys.version_info.major}.{sys.version_info.minor}"
        # the venv layout itself: distro patches to getsitepackages (Debian's dist-packages)
        # only apply once site.venv() has changed sys.prefix, which -S skips
        extra += [os.path.join(prefix, lib, v, "site-packages") for lib in dict.fromkeys(
            [getattr(sys, "platlibdir", "lib"), "lib"])] + [os.path.join(prefix, "Lib", "site-packages")]
    if system_site:
        extra += site.getsitepackages()
    if system_site and site.check_enableusersite():
        extra.append(site.getusersitepackages())
    for d in extra:
        if not os.path.isdir(d) or d in dirs:
            continue
        dirs.append(d)
        try:
            pths = sorted(n for n in os.listdir(d) if n.endswith(".pth"))
        except OSError:
            continue
        for name in pths:
            try:
                with open(os.path.join(d, name), encoding="utf-8", errors="replace") as f:
                    for line in f:
                        line = line.strip()
                        if not line or line.startswith(("#", "import ", "import\t")):
                            continue
                        p = os.path.join(d, line)
                        if os.path.isdir(p) and p not in dirs:
                            dirs.append(p)
            except OSError:
                continue
    return dirs


def _nccl_version(dirs):
    """The pip-shipped NCCL (nvidia-nccl-cuXX wheel), from its dist-info directory name."""
    for d in dirs:
        try:
            names = os.listdir(d or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("nvidia_nccl_cu") and name.endswith(".dist-info"):
                dist, _, version = name[:-len(".dist-info")].partition("-")
                if dist[len("nvidia_nccl_cu"):].isdigit() and version and "-" not in version:
                    return version
    return None


def _bundled(dirs, prefix):
    """"bundled" when a directory holds lib<prefix>*.so* (torch/lib of a wheel that ships it)."""
    for d in dirs:
        try:
            if any(n.startswith(prefix) and ".so" in n for n in os.listdir(d)):
                return "bundled"
        except OSError:
            continue
    return None


def versions():
    """Python and torch facts without importing torch: torch/version.py read as text, NCCL from
    the nvidia-nccl-cu* wheel (or a libnccl in torch/lib), RCCL from librccl in torch/lib or
    /opt/rocm/lib. Set only for a CUDA (nccl) or ROCm (rccl) build of torch."""
    v = sys.version_info
    info = {"python": f"{v.major}.{v.minor}.{v.micro}", "executable": sys.executable, "torch": None,
            "cuda": None, "hip": None, "nccl": None, "rccl": None}
    dirs = site_dirs() if sys.flags.no_site else [d for d in sys.path if d]
    for d in dirs:
        version_py = os.path.join(d, "torch", "version.py")
        if os.path.isfile(version_py):
            lit = _literal_assignments(version_py)
            info.update(torch=lit.get("__version__", "?"), cuda=lit.get("cuda"), hip=lit.get("hip"))
            lib = os.path.join(d, "torch", "lib")
            if info["cuda"]:
                info["nccl"] = _nccl_version(dirs) or _bundled([lib], "libnccl")
            if info["hip"]:
                info["rccl"] = _bundled([lib, "/opt/rocm/lib"], "librccl")
            break
    return info


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


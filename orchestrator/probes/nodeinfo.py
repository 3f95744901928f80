"""Node facts for preflight and sync; stdlib only, runs on the node (shipped, never installed)
and on the control machine (imported), so both sides hash a workdir the same way.

    python - info WORKDIR        one JSON line: python/torch/CUDA/ROCm/NCCL versions (torch is
                                 *not* imported: its version.py and dist-info are read, which
                                 takes milliseconds instead of seconds) and the workdir digest.
    python -c <this> receive WD  extract a tar stream from stdin into WD, then delete files the
                                 manifest (.clusterctl-manifest in the tar) does not list,
                                 leaving ignored files (data, checkpoints) alone.
    python -c <this> prune WD    the same deletion, the manifest on stdin (after an rsync).

The digest is content-based: for every file a git tree would ship (git ls-files -co
--exclude-standard in a git checkout, else a walk honouring .gitignore files) its path,
executable bit and sha256. A git checkout and a plain copy of it hash the same, so a
workdir pushed by `clusterctl sync` compares equal to the control machine's checkout.
"""
import hashlib
import json
import os
import re
import subprocess
import sys

MANIFEST = ".clusterctl-manifest"


# ------------------------------------------------------------------ .gitignore subset


def _glob_re(pat):
    """A gitignore glob -> regex over a '/'-separated relative path."""
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


def walk_files(root):
    """Relative paths of the files a git tree would ship, honouring every .gitignore."""
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
            if e.name == ".git" or e.name == MANIFEST and not rel:
                continue
            r = e.name if not rel else rel + "/" + e.name
            is_dir = e.is_dir(follow_symlinks=False)
            if ignored(rules, r, is_dir):
                continue
            if is_dir:
                visit(e.path, r, rules)
            else:
                out.append(r)

    visit(root, "", [])
    return out


def git_files(root):
    """(files, head, dirty) from git, or None when root is not a usable git checkout."""
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        ls = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, timeout=60)
        st = subprocess.run(["git", "-C", root, "status", "--porcelain", "-z"], capture_output=True,
                            timeout=60)
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if ls.returncode != 0:
        return None
    files = sorted({f for f in ls.stdout.decode("utf-8", "surrogateescape").split("\0") if f})
    return files, head.stdout.decode().strip() or None, bool(st.stdout.strip())


def digest(root):
    """{"kind": "git"|"tree"|"missing", "digest", "files", "head", "dirty"} of a workdir."""
    if not os.path.isdir(root):
        return {"kind": "missing", "digest": None, "files": 0, "head": None, "dirty": None}
    g = git_files(root)
    files, head, dirty, kind = (g[0], g[1], g[2], "git") if g else (walk_files(root), None, None, "tree")
    h = hashlib.sha256()
    n = 0
    for rel in files:
        p = os.path.join(root, rel)
        try:
            if os.path.islink(p):
                content, mode = os.readlink(p).encode("utf-8", "surrogateescape"), "l"
            elif os.path.isfile(p):
                fh = hashlib.sha256()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        fh.update(chunk)
                content, mode = fh.digest(), "x" if os.access(p, os.X_OK) else "f"
            else:
                continue
        except OSError:
            continue
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0" + mode.encode() + b"\0")
        h.update(content if mode != "l" else hashlib.sha256(content).digest())
        n += 1
    return {"kind": kind, "digest": h.hexdigest()[:16], "files": n, "head": head, "dirty": dirty}


# ------------------------------------------------------------------ versions


def _literal_assignments(path):
    """`name = 'x'` lines of torch/version.py, without importing torch (seconds on a GPU box)."""
    import ast

    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return out
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            out[target.id] = value.value
    return out


def _nccl_version():
    """The pip-shipped NCCL (nvidia-nccl-cuXX wheel), from its dist-info directory name."""
    for d in sys.path:
        try:
            names = os.listdir(d or ".")
        except OSError:
            continue
        for name in names:
            m = re.match(r"^nvidia_nccl_cu\d+-([^-]+)\.dist-info$", name)
            if m:
                return m.group(1)
    return None


def versions():
    import importlib.util
    import platform

    info = {"python": platform.python_version(), "executable": sys.executable, "torch": None,
            "cuda": None, "hip": None, "nccl": None}
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        v = _literal_assignments(os.path.join(list(spec.submodule_search_locations)[0], "version.py"))
        info.update(torch=v.get("__version__", "?"), cuda=v.get("cuda"), hip=v.get("hip"))
        if info["cuda"]:
            info["nccl"] = _nccl_version()
    return info


# ------------------------------------------------------------------ receive (sync's tar path)


def _within(root, rel):
    p = os.path.realpath(os.path.join(root, rel))
    return p == root or p.startswith(root + os.sep)


def receive(root):
    import tarfile

    os.makedirs(root, exist_ok=True)
    root = os.path.realpath(root)
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|*") as tar:
        for m in tar:
            if m.name.startswith("/") or ".." in m.name.split("/") or not _within(root, m.name):
                raise SystemExit("refusing unsafe path in the stream: " + m.name)
            if m.isfile() or m.issym() or m.isdir():
                dest = os.path.join(root, m.name)
                if os.path.lexists(dest) and not os.path.isdir(dest):
                    os.unlink(dest)
                tar.extract(m, root, set_attrs=m.isfile(), **({"filter": "tar"} if hasattr(
                    tarfile, "tar_filter") else {}))
    mpath = os.path.join(root, MANIFEST)
    if os.path.exists(mpath):
        with open(mpath, "rb") as f:
            data = f.read()
        os.unlink(mpath)
        prune(root, data)


def prune(root, manifest):
    """Delete the files under root that manifest (NUL-separated paths) does not list and no
    .gitignore ignores: what a push left behind from an older tree."""
    keep = {p for p in manifest.decode("utf-8", "surrogateescape").split("\0") if p}
    removed = 0
    for rel in walk_files(root):
        if rel not in keep:
            os.unlink(os.path.join(root, rel))
            removed += 1
    print(json.dumps({"kept": len(keep), "removed": removed}))


def main(argv):
    if len(argv) >= 2 and argv[0] == "info":
        doc = versions()
        doc["code"] = digest(argv[1]) if argv[1:] and argv[1] != "-" else None
        print(json.dumps(doc))
    elif len(argv) >= 2 and argv[0] == "receive":
        receive(argv[1])
    elif len(argv) >= 2 and argv[0] == "prune":
        prune(os.path.realpath(argv[1]), sys.stdin.buffer.read())
    else:
        sys.stderr.write("usage: nodeinfo.py info WORKDIR | receive WORKDIR\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What a sync ships: the files git would ship, plus `include`, minus `exclude`."""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os

from orchestrator.probe import load_nodeinfo


def sha256_file(path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def git_list(src: str) -> list[str]:
    """The files a git tree would ship: git ls-files in a checkout, else a .gitignore-aware walk."""
    ni = load_nodeinfo()
    g = ni.git_files(src)
    files = g[0] if g else ni.walk_files(src)
    return [f for f in files if os.path.lexists(os.path.join(src, f))]


def _walk_all(src: str, rel_dir: str) -> list[str]:
    """Every file and symlink under src/rel_dir, .gitignore or not (.git itself skipped; a link
    to a directory ships as the link)."""
    out = []
    for d, dirs, files in os.walk(os.path.join(src, rel_dir)):
        links = [x for x in dirs if os.path.islink(os.path.join(d, x))]
        dirs[:] = [x for x in dirs if x != ".git" and x not in links]
        rel = os.path.relpath(d, src).replace(os.sep, "/")
        out += [name if rel == "." else f"{rel}/{name}" for name in files + links]
    return out


def included(src: str, patterns: tuple[str, ...] | list[str]) -> list[str]:
    """Files named by `patterns`: a directory ships everything under it, a glob (** recursive)
    ships the files it matches."""
    out: list[str] = []
    for pat in patterns:
        for rel in sorted(glob.glob(pat.rstrip("/"), root_dir=src, recursive=True, include_hidden=True)):
            p = os.path.join(src, rel)
            if os.path.isdir(p) and not os.path.islink(p):
                out += _walk_all(src, rel)
            elif os.path.lexists(p):
                out.append(os.path.normpath(rel).replace(os.sep, "/"))
    return out


def excluded(rel: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """A pattern matches the path, any of its parent directories, or (without '/') a name in it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        pat = pat.rstrip("/")
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            return True
        if "/" not in pat and any(fnmatch.fnmatchcase(name, pat) for name in parts):
            return True
    return False


def select_files(src: str, include=(), exclude=()) -> list[str]:
    """Sorted relative paths to ship."""
    files = set(git_list(src)) | set(included(src, include))
    return sorted(f for f in files if not excluded(f, exclude))

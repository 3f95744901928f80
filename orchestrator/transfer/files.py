"""What a sync ships: the files git would ship, plus `include`, minus `exclude`, and never the
run's outputs (`run_outputs`), the tools' default output folders' untracked files, nor the
inventory and the files it names (`private_files`). The selection itself is
orchestrator/remote/nodeinfo.py's, so a node that hands its code to a spare (runs/spares.py)
picks the same files as this machine."""

from __future__ import annotations

import os
import shutil
import subprocess

from orchestrator.errors import UsageError
from orchestrator.inventory import Inventory, Node
from orchestrator.probe import common, load_nodeinfo

TRAINER_MODULE = "trainer"
OUTPUT_FLAG = "--output-dir"


def sha256_file(path) -> str:
    """The hex sha256 of a file's bytes, as the nodes take it (remote/common.py)."""
    return common().sha256_file(path)


def git_list(src: str) -> list[str]:
    """The files a git tree would ship: git ls-files in a checkout, else a .gitignore-aware walk."""
    ni = load_nodeinfo()
    g = ni.git_files(src)
    files = g[0] if g else ni.walk_files(src)
    return [f for f in files if os.path.lexists(os.path.join(src, f))]


def select_files(src: str, include=(), exclude=(), outputs=(), never=()) -> list[str]:
    """Sorted relative paths to ship; `outputs` (relative directories) and `never` (relative
    paths) never are."""
    return load_nodeinfo().select(src, tuple(include), tuple(exclude), set(outputs), never=set(never))


def _in_tree(base: str, path: str) -> str | None:
    """path (as written here: ~, relative to the current directory) relative to the directory
    `base` (real path), when it lies inside it. The file itself is not resolved: a link in the
    checkout to a key elsewhere is the link's path."""
    full = os.path.abspath(os.path.expanduser(path))
    full = os.path.join(os.path.realpath(os.path.dirname(full)), os.path.basename(full))
    return os.path.relpath(full, base).replace(os.sep, "/") if full.startswith(base + os.sep) else None


def private_files(inv: Inventory, src: str) -> set[str]:
    """The inventory file and the files its SSH settings name (identity files with their .pub and
    -cert.pub, known_hosts, ssh config), as paths relative to `src` where they lie inside it: they
    never ship to a node and are never code, tracked by git or not. An edit of the inventory in
    the checkout leaves code_sync as it was."""
    paths = [inv.source] if os.path.isfile(inv.source) else []
    for n in inv.nodes:
        s = n.ssh
        if s.identity_file:
            paths += [s.identity_file, s.identity_file + ".pub", s.identity_file + "-cert.pub"]
        paths += [p for p in (s.known_hosts, s.config_file) if p]
    base = os.path.realpath(src)
    return {rel for p in dict.fromkeys(paths) if (rel := _in_tree(base, p)) is not None
            and os.path.lexists(os.path.join(base, rel))}


def _trainer_output_dir() -> str | None:
    """The bundled trainer's default output directory; None where there is no trainer to import
    (a setup venv holds clusterctl's node side only, and a workdir without trainer/ runs another
    script: `launch --from-env` of a render)."""
    try:
        from trainer.config import TrainConfig
    except ModuleNotFoundError as e:
        if e.name not in ("trainer", "trainer.config"):
            raise
        return None
    return TrainConfig.__dataclass_fields__["output_dir"].default


def _flag_values(args: list[str] | tuple[str, ...], flag: str) -> list[str]:
    """The values given to `flag` in an argument list (`--flag V` and `--flag=V`)."""
    out = []
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith(flag + "="):
            out.append(a[len(flag) + 1:])
    return out


def _inside(workdir: str, path: str) -> str | None:
    """path as a directory relative to workdir, when it lies inside it (compared as written:
    `~/` and absolute paths are the node's, not this machine's)."""
    if not path.startswith(("/", "~")):
        rel = os.path.normpath(path)
    else:
        base = os.path.normpath(workdir.rstrip("/") or "/")
        p = os.path.normpath(path)
        rel = p[len(base) + 1:] if p.startswith(base + "/") else ""
    rel = rel.replace(os.sep, "/")
    return rel if rel and rel != "." and not rel.startswith("../") and rel != ".." else None


def run_outputs(inv: Inventory, node: Node) -> list[str]:
    """The run's output directories inside `node`'s workdir, relative to it: the inventory's
    `output_dir`, `train.output_dir` and `train.checkpoint_dir`, every `--output-dir` in `train.args`, and the bundled
    trainer's default output directory when the inventory runs it without one. They are never
    code: not shipped, pruned, hashed by code_sync, nor copied to a spare."""
    t = inv.train
    named = _flag_values(t.args, OUTPUT_FLAG)
    dirs = [inv.output_dir, t.output_dir, t.checkpoint_dir, *named]
    if t.script is None and (t.module or TRAINER_MODULE) == TRAINER_MODULE and not named:
        dirs.append(_trainer_output_dir())
    out = [_inside(node.workdir, d) for d in dirs if d]
    return sorted({d for d in out if d})


def checkout_of(cwd: str) -> str | None:
    """The top of the git checkout holding `cwd` (`git rev-parse --show-toplevel`), or None."""
    try:
        p = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    top = p.stdout.strip() if p.returncode == 0 else ""
    return top or None


def code_source(inv: Inventory, src: str | None = None, cwd: str | None = None) -> str | None:
    """The directory on this machine whose files `sync` pushes and code_sync compares with:
    `src` (--src), else the inventory's `sync.src` (relative to the inventory's directory), else
    the git checkout the current directory is in; None when there is none."""
    if src is None and inv.sync.src is not None:
        src = os.path.expanduser(inv.sync.src)
        if not os.path.isabs(src) and os.path.isfile(inv.source):
            src = os.path.join(os.path.dirname(os.path.abspath(inv.source)), src)
    if src is not None:
        return os.path.abspath(os.path.expanduser(src))
    return checkout_of(cwd or os.getcwd())


def require_code_source(inv: Inventory, src: str | None = None, cwd: str | None = None) -> str:
    """code_source, or a UsageError that says why there is none and how to name one."""
    found = code_source(inv, src, cwd)
    if found is not None and os.path.isdir(found):
        return found
    if found is not None:
        raise UsageError(f"nothing to push: {found} is not a directory here (give --src DIR, or `sync: {{src: DIR}}` "
                         "in the inventory)")
    here = os.path.abspath(cwd or os.getcwd())
    why = (f"{here} is not inside a git checkout" if shutil.which("git") else
           f"git is not installed on this machine, so the checkout {here} may be in cannot be found")
    raise UsageError(f"nothing to push: {why}. Run sync from the checkout whose code the nodes should get, "
                     "or name the directory with --src DIR or `sync: {src: DIR}` in the inventory")


def control_code(inv: Inventory, src: str) -> dict:
    """What code_sync compares every node with: the digest and per-file hashes of the files a
    sync of `src` ships (the inventory's include and exclude, no run outputs, no private files)."""
    outputs = {d for n in inv.nodes for d in run_outputs(inv, n)}
    return load_nodeinfo().digest(src, outputs, tuple(inv.sync.include), tuple(inv.sync.exclude), listing=True,
                                  never=private_files(inv, src)) | {"source": src}

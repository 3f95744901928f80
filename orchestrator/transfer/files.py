"""What a sync ships: the files git would ship, plus `include`, minus `exclude`, and never the
run's outputs (`run_outputs`). The selection itself is orchestrator/remote/nodeinfo.py's, so a
node that hands its code to a spare (runs/spares.py) picks the same files as this machine."""

from __future__ import annotations

import os

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


def select_files(src: str, include=(), exclude=(), outputs=()) -> list[str]:
    """Sorted relative paths to ship; `outputs` (relative directories) never are."""
    return load_nodeinfo().select(src, tuple(include), tuple(exclude), set(outputs))


def _trainer_output_dir() -> str:
    from trainer.config import TrainConfig

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
    `output_dir` and `train.output_dir`, every `--output-dir` in `train.args`, and the bundled
    trainer's default output directory when the inventory runs it without one. They are never
    code: not shipped, pruned, hashed by code_sync, nor copied to a spare."""
    t = inv.train
    named = _flag_values(t.args, OUTPUT_FLAG)
    dirs = [inv.output_dir, t.output_dir, *named]
    if t.script is None and (t.module or TRAINER_MODULE) == TRAINER_MODULE and not named:
        dirs.append(_trainer_output_dir())
    out = [_inside(node.workdir, d) for d in dirs if d]
    return sorted({d for d in out if d})

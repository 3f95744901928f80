"""The node side read on the control machine: the `@@name` sections its probes print, the node
code (orchestrator/remote/ as one package, a tar keyed by its hash: `node_code`, and the `BOOT`
line that starts one of its programs on a node), and those programs loaded here as modules (`load`,
`common`, `load_nodeinfo`): the same files, imported.

A probe (the preflight script, the GPU probe, nodeinfo) prints each tool's output under an
`@@name [arg]` line and may close it with `@@rc N`, the tool's exit code. The checks' parsers, the
GPU parsers and sync's file lists all read that one format here.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import tempfile
import shutil
import tarfile
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

_SECTION = re.compile(r"^@@([A-Za-z0-9_-]+)(?: (.*))?$")


@dataclass(frozen=True)
class Section:
    name: str
    arg: str  # text after the name on the @@ line
    body: str  # the tool's output (without trailing "@@rc N")
    rc: int | None  # the tool's exit code, when the probe recorded one


def sections(text: str) -> list[Section]:
    """Split probe output into sections. `@@rc N` closes the section before it. A node's output is
    split once for all the checks that read it (each check's parser asks again: 18 splits of a node
    with 8 GPUs' `nvidia-smi -q`, ~75 KB, took ~8 ms of control CPU)."""
    return list(_split(text))


@lru_cache(maxsize=8)  # the outputs of the last few nodes; a node's checks are read one after another
def _split(text: str) -> tuple[Section, ...]:
    out: list[Section] = []
    cur: list | None = None

    def close():
        if cur is not None:
            out.append(Section(cur[0], cur[1], "\n".join(cur[2]), cur[3]))

    for line in text.splitlines():
        m = _SECTION.match(line)
        if m and m.group(1) == "rc" and cur is not None:
            try:
                cur[3] = int((m.group(2) or "").strip())
            except ValueError:
                pass
            continue
        if m and m.group(1) != "rc":
            close()
            cur = [m.group(1), m.group(2) or "", [], None]
            continue
        if cur is not None:
            cur[2].append(line)
    close()
    return tuple(out)


def section(text: str, name: str) -> Section | None:
    return next((s for s in sections(text) if s.name == name), None)


REMOTE = Path(__file__).resolve().parent / "remote"
COMMON = "common"  # remote/common.py: the rules every shipped program imports, and the control side too
PACKAGE = "clusterctl_node"  # the node code's package name on a node (remote/'s imports are relative)
CACHE = "~/.clusterctl/node-code"  # on a node: one directory per version, named HASH, holding PACKAGE
COMPLETE = ".complete"  # PACKAGE's last file in the tar: a version is on a node once this file is
MISSING = "clusterctl-node-code-missing"  # the boot's word on stderr (exit MISSING_EXIT) when the code is not there
MISSING_EXIT = 97

# How every shipped program starts on a node: `PYTHON [FLAGS] -c BOOT CODE PROGRAM ARGS`. CODE (a
# `~/` path: the node user's home) goes first on sys.path; PROGRAM's `main(ARGS)` is called and
# its return is the exit code. Nothing but the interpreter's own start-up is imported (-S keeps it
# so). The node's Python caches the program's bytecode beside it (__pycache__, written even where
# PYTHONDONTWRITEBYTECODE is set, for the whole program: a module a verb imports late, the
# stream's, is cached too; the directory is clusterctl's), so a program's source is compiled once
# per node and version, not on every start.
BOOT = ('import os,sys\n'
        'p=os.path.expanduser(sys.argv[1])\n'
        'if not os.path.isfile(p+"/%s/%s"):sys.stderr.write("%s "+p+"\\n");sys.stderr.flush();os._exit(%d)\n'
        'sys.path.insert(0,p);n=sys.argv[2];sys.argv[:3]=[n];sys.dont_write_bytecode=0\n'
        'sys.exit(__import__("%s."+n,fromlist=["main"]).main(sys.argv[1:]))') % (PACKAGE, COMPLETE, MISSING, MISSING_EXIT, PACKAGE)


def programs() -> list[str]:
    """The modules of orchestrator/remote/ (the package the nodes run), by name."""
    return sorted(p.stem for p in REMOTE.glob("*.py"))


@cache
def node_code() -> tuple[str, bytes]:
    """(HASH, the tar's bytes): orchestrator/remote/*.py as the package PACKAGE, COMPLETE last,
    every header fixed (owner, mode, date), so the same sources give the same bytes and the same
    HASH (sha256, 20 hex digits) on every control machine. Read once per process."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in [*((f"{n}.py", (REMOTE / f"{n}.py").read_bytes()) for n in programs()), (COMPLETE, b"")]:
            info = tarfile.TarInfo(f"{PACKAGE}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 1_577_836_800  # 2020-01-01
            tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    return hashlib.sha256(data).hexdigest()[:20], data


def node_code_path() -> str:
    """Where a node keeps this version (a `~/` path: the node user's home): CACHE/HASH."""
    return f"{CACHE}/{node_code()[0]}"


def local_code() -> Path:
    """This version unpacked on this machine (once, under the temporary directory), for a program
    run here exactly as a node runs it (tests, benches): `local_argv`."""
    h, data = node_code()
    path = Path(tempfile.gettempdir()) / f"clusterctl-node-code-{os.getuid()}" / h
    if not (path / PACKAGE / COMPLETE).is_file():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".in."))
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tmp)  # our own members, built above: no name or link to refuse
        try:
            tmp.rename(path)
        except OSError:  # another process placed it first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def local_argv(name: str, *args: str, python: str = sys.executable, flags: tuple[str, ...] = ()) -> list[str]:
    """The argv that runs remote/NAME.py here as a node runs it (the boot, the code, the program)."""
    return [python, *flags, "-c", BOOT, str(local_code()), name, *args]


def load(name: str):
    """orchestrator/remote/NAME.py as a module here: the same code the nodes run."""
    import importlib

    return importlib.import_module(f"orchestrator.remote.{name}")


def common():
    """orchestrator/remote/common.py as a module: the node side's shared rules (stop grace,
    checkpoint names, the tar member rule, sha256) that the control side follows too."""
    return load(COMMON)


def load_nodeinfo():
    """orchestrator/remote/nodeinfo.py as a module (the same code the nodes run)."""
    return load("nodeinfo")

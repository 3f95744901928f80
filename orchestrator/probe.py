"""The node side read on the control machine: the `@@name` sections its probes print, the bytes
of each program shipped to the nodes (`program`: remote/common.py in front of it), and those
programs loaded here as modules from the same bytes (`load`, `common`, `load_nodeinfo`).

A probe (the preflight script, the GPU probe, nodeinfo) prints each tool's output under an
`@@name [arg]` line and may close it with `@@rc N`, the tool's exit code. The checks' parsers, the
GPU parsers and sync's file lists all read that one format here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_SECTION = re.compile(r"^@@([A-Za-z0-9_-]+)(?: (.*))?$")


@dataclass(frozen=True)
class Section:
    name: str
    arg: str  # text after the name on the @@ line
    body: str  # the tool's output (without trailing "@@rc N")
    rc: int | None  # the tool's exit code, when the probe recorded one


def sections(text: str) -> list[Section]:
    """Split probe output into sections. `@@rc N` closes the section before it."""
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
    return out


def section(text: str, name: str) -> Section | None:
    return next((s for s in sections(text) if s.name == name), None)


REMOTE = Path(__file__).resolve().parent / "remote"
COMMON = "common"  # remote/common.py: the helpers every shipped program is sent with


def program(name: str) -> bytes:
    """The bytes a node runs for orchestrator/remote/NAME.py (`python3 - ARGS` with them on stdin,
    `python -c` with them as text, or exec'd by the node agent): remote/common.py's text, then the
    program's, so the shared helpers are the program's globals there. The one place a shipped
    program is read: every caller, and every module loaded from one here, takes these bytes."""
    head = (REMOTE / f"{COMMON}.py").read_bytes()
    return head + f"\n# ---- orchestrator/remote/{name}.py\n".encode() + (REMOTE / f"{name}.py").read_bytes()


class _Program:
    """The loader of a shipped program run here as a module: the same bytes the nodes run."""

    def __init__(self, name: str):
        self.name = name

    def get_source(self, fullname: str) -> str:  # tracebacks show the program's lines through it
        return (REMOTE / f"{COMMON}.py").read_text() if self.name == COMMON else program(self.name).decode()

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        code = compile(self.get_source(module.__name__), module.__spec__.origin, "exec")
        exec(code, module.__dict__)


def load(name: str):
    """orchestrator/remote/NAME.py as a module here, built from `program(NAME)` (the same code the
    nodes run, common.py's helpers included); common.py alone for NAME "common"."""
    import importlib.util
    import sys

    modname = f"orchestrator.probes.{name}"
    if modname not in sys.modules:
        origin = str(REMOTE / (f"{name}.py" if name == COMMON else f"{COMMON}.py+{name}.py"))
        spec = importlib.util.spec_from_loader(modname, _Program(name), origin=origin)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[modname]
            raise
    return sys.modules[modname]


def common():
    """orchestrator/remote/common.py as a module: the node side's shared rules (stop grace,
    checkpoint names, the tar member rule, sha256) that the control side follows too."""
    return load(COMMON)


def load_nodeinfo():
    """orchestrator/remote/nodeinfo.py as a module (the same code the nodes run)."""
    return load("nodeinfo")

"""The node side read on the control machine: the `@@name` sections its probes print, and
orchestrator/remote/nodeinfo.py loaded as a module (the same code the nodes run).

A probe (the preflight script, the GPU probe, nodeinfo) prints each tool's output under an
`@@name [arg]` line and may close it with `@@rc N`, the tool's exit code. The checks' parsers, the
GPU parsers and sync's file lists all read that one format here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


def load_nodeinfo():
    """orchestrator/remote/nodeinfo.py as a module (the same code the nodes run)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "orchestrator.probes.nodeinfo"
    if name not in sys.modules:
        path = Path(__file__).resolve().parent / "remote" / "nodeinfo.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def program(name: str) -> bytes:
    """The bytes a node runs for orchestrator/remote/NAME.py (`python3 - ARGS` with them on stdin,
    or exec'd by the node agent): the one place a shipped program is read, so how it is built
    (one file, or a shared helper module in front of it) is decided here and nowhere else."""
    from pathlib import Path

    return (Path(__file__).resolve().parent / "remote" / f"{name}.py").read_bytes()

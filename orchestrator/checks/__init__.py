"""Preflight checks: a probe (orchestrator/remote/preflight.sh, one run per node) plus pure
parsers from its output to a verdict (pyinfra's facts: command + process(output)).

Every `parse_<check>(text, ctx) -> CheckResult` takes the node's whole probe output (sections
that start with `@@name` lines) and a `Ctx` with what the inventory expects; nothing here runs
a command, so each parser is unit-tested from recorded tool outputs (tests/fixtures/preflight).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from orchestrator.inventory import Inventory, Node

# Names are the JSON keys of `clusterctl preflight --json`; this is also the column order.
CHECKS = ("ssh", "ping", "gpu_count", "gpu_idle", "port_free", "port_reachable", "firewall",
          "clock_skew", "code_sync", "python_env", "iface", "disk")
STATUSES = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True)
class CheckResult:
    check: str
    status: str  # ok | warn | fail | skip
    detail: str
    remedy: str | None = None

    def __post_init__(self):
        if self.check not in CHECKS or self.status not in STATUSES:
            raise ValueError(f"bad check result {self.check}/{self.status}")

    def to_json(self) -> dict:
        d = {"check": self.check, "status": self.status, "detail": self.detail}
        if self.remedy:
            d["remedy"] = self.remedy
        return d


def ok(check, detail, remedy=None):
    return CheckResult(check, "ok", detail, remedy)


def warn(check, detail, remedy=None):
    return CheckResult(check, "warn", detail, remedy)


def fail(check, detail, remedy=None):
    return CheckResult(check, "fail", detail, remedy)


def skip(check, detail):
    return CheckResult(check, "skip", detail)


@dataclass(frozen=True)
class Ctx:
    """What a parser needs to know besides the probe's text."""

    node: Node
    inventory: Inventory
    is_master: bool = False
    own_pids: frozenset[int] = frozenset()  # our temporary listener: not a conflict on the port
    t_send: float | None = None  # control clock (time.time) just before the probe started
    t_recv: float | None = None  # ... when the node's @@time line arrived
    extra: dict = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.inventory.master_port


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


def first_line(text: str, limit: int = 160) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def load_nodeinfo():
    """orchestrator/remote/nodeinfo.py as a module (the same code the nodes run)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "orchestrator.probes.nodeinfo"
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "remote" / "nodeinfo.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]

"""Preflight checks. A check is one unit, declared once as a `Check`:

  - `probes`: the shell snippets that gather its facts on a node. The registry
    (orchestrator/checks/registry.py) assembles the snippets of the chosen checks into ONE script
    per node (`sh -s`), each snippet once, however many checks read it;
  - `parse(text, ctx) -> CheckResult`: a pure function from the node's whole probe output
    (sections that start with `@@name` lines) and a `Ctx` to a verdict; or `compare(texts,
    ctx_of)` when the verdict needs every node's output (python_env, code_sync);
  - metadata: the nodes it applies to, whether train's fast preflight runs it, the usual remedy.

Nothing here runs a command, so every parser is unit-tested from recorded tool outputs
(tests/fixtures/preflight) and the same parsers read a probe run locally (launch --from-env).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.inventory import Inventory, Node

STATUSES = ("ok", "warn", "fail", "skip")
NODES = ("all", "master", "workers")
_NAMES: set[str] = set()  # every Check's name, filled as the check modules load


@dataclass(frozen=True)
class CheckResult:
    check: str
    status: str  # ok | warn | fail | skip
    detail: str
    remedy: str | None = None

    def __post_init__(self):
        if self.check not in _NAMES or self.status not in STATUSES:
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
    visible_gpus: tuple[str, ...] | None = None  # CUDA/HIP_VISIBLE_DEVICES entries (launch --from-env)
    extra: dict = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.inventory.master_port


@dataclass(frozen=True)
class Probe:
    """A shell snippet that prints `@@section` lines and the tools' output. It runs inside the
    one probe script, where $wd $out $port $iface $master $role $py $ct are set (see
    orchestrator/remote/preflight.sh) and `want CHECK...` says whether a check was asked for."""

    name: str
    text: str
    first: bool = False  # runs before the others (clock_skew's timestamp: the less before it, the better)


@dataclass(frozen=True)
class Check:
    name: str  # the column, the --only/--skip name and the JSON key
    summary: str  # what it verifies, one line
    remedy: str  # the usual fix (a failure's own remedy is more precise where it has one)
    probes: tuple[Probe, ...] = ()  # () = gathered on the control machine (ssh, ping)
    parse: Callable[[str, Ctx], CheckResult] | None = None
    compare: Callable[[dict[str, str], dict[str, Ctx]], dict[str, CheckResult]] | None = None
    nodes: str = "all"  # all | master | workers: where it means something (the others skip it)
    fast: bool = False  # part of the quick preflight `clusterctl train` runs before launching

    def __post_init__(self):
        if self.nodes not in NODES:
            raise ValueError(f"check {self.name}: nodes must be one of {NODES}")
        _NAMES.add(self.name)

    def applies_to(self, node: Node, is_master: bool) -> bool:
        return self.nodes == "all" or (self.nodes == "master") == is_master


# ------------------------------------------------------------------ the probe's output

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

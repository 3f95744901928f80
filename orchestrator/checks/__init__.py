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

from dataclasses import dataclass, field
from typing import Callable

from orchestrator.inventory import Inventory, Node
from orchestrator.probe import Section, load_nodeinfo, section, sections  # noqa: F401 - the parsers' kit

STATUSES = ("ok", "warn", "fail", "skip")
NODES = ("all", "master", "workers")
_NAMES: set[str] = set()  # every Check's name, filled as the check modules load


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict on one node. `unanswered`: the node could not answer this time (the
    probe timed out or broke off, a tool could not read what it reads, a connect that found no
    listener), so the verdict says nothing yet about the node: preflight asks it again
    (checks/retry.py). A finding that holds (a DROP rule, a wrong GPU count) is never unanswered."""

    check: str
    status: str  # ok | warn | fail | skip
    detail: str
    remedy: str | None = None
    unanswered: bool = False

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


def warn(check, detail, remedy=None, *, unanswered=False):
    return CheckResult(check, "warn", detail, remedy, unanswered)


def fail(check, detail, remedy=None, *, unanswered=False):
    return CheckResult(check, "fail", detail, remedy, unanswered)


def skip(check, detail, *, unanswered=False):
    return CheckResult(check, "skip", detail, None, unanswered)


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


def first_line(text: str, limit: int = 160) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"

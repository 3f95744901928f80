"""What every transport shares: per-node results, the running-command and connection interfaces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from orchestrator.inventory import Node

DEFAULT_FANOUT = 64
DEFAULT_CONNECT_TIMEOUT = 10.0
KEEPALIVE_S = 5
DEFAULT_LOST_TIMEOUT = 30.0
SWEEP_S = 0.2  # how often every running command is checked for deadlines and lost links  # a node silent this long (no answer to keepalives) is lost

# on_line(node_name, stream ("stdout"|"stderr"), line_without_newline)
LineCallback = Callable[[str, str, str], None]


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class NodeResult:
    node: str
    exit_code: int | None  # None: never ran to completion (unreachable, timed out, lost)
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    error: str | None = None  # connection/timeout problem, not a non-zero exit

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    @property
    def reachable(self) -> bool:
        return self.exit_code is not None or (self.error or "").startswith("timed out")

    def describe(self) -> str:
        if self.error:
            return self.error
        return f"exit code {self.exit_code}"


class ClusterResult(dict):
    """node name -> NodeResult, in rank order, with fabric-style views."""

    @property
    def ok(self) -> dict[str, NodeResult]:
        return {k: v for k, v in self.items() if v.ok}

    @property
    def failed(self) -> dict[str, NodeResult]:
        return {k: v for k, v in self.items() if not v.ok}

    @property
    def all_ok(self) -> bool:
        return all(v.ok for v in self.values())

    @property
    def worst_exit_code(self) -> int:
        """Like `pdsh -S`: the largest exit code; a node that never answered counts as 255 (ssh's)."""
        codes = [255 if v.exit_code is None else v.exit_code for v in self.values()]
        return max(codes, default=0)


# ------------------------------------------------------------------ processes


class Proc:
    """A running command. Output is read non-blockingly after `fileno()` polls readable."""

    node: str
    started: float

    def fileno(self) -> int | list[int]: ...
    def read(self) -> tuple[bytes, bytes]: ...
    def done(self) -> bool: ...
    def exit_code(self) -> int | None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


# ------------------------------------------------------------------ connections


class Connection:
    """One node, opened once, reused for everything a command does."""

    def __init__(self, node: Node):
        self.node = node

    def open(self) -> None: ...
    def exec(self, command: str, *, stdin: bytes | None = None) -> Proc: ...
    def close(self) -> None: ...

    @property
    def alive(self) -> bool:
        return True



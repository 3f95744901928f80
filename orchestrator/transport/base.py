"""What every transport shares: per-node results, the running-command and connection interfaces."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from orchestrator.errors import (
    ClusterFailure,
    CommandFailed,
    CommandTimeout,
    ConnectError,
    ConnectionLost,
)
from orchestrator.inventory import Node

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_LOST_TIMEOUT = 30.0  # a node silent this long (no answer to keepalives) is lost
RETRY_FIRST_S = 1.0  # the first wait between tries to reach a node; it doubles after each failure
RETRY_CAP_S = 60.0  # up to this for a node that refuses us: a person must act there
RETRY_DOWN_CAP_S = 8.0  # up to this for a node that does not answer: back any moment, a try costs it nothing


def retry_wait(tries: int, refused: bool = True) -> float:
    """The wait after the `tries`-th failed try (from 0) to reach a node: 1 s, 2 s, 4 s ... up to
    60 s when the node refused us (its host key, our key: every try holds one of its sshd's
    unauthenticated slots for the handshake), up to 8 s when it did not answer. The one backoff
    of every loop that retries a connection: never one try a second."""
    return min(RETRY_CAP_S if refused else RETRY_DOWN_CAP_S, RETRY_FIRST_S * 2 ** min(tries, 16))

# on_line(node_name, stream ("stdout"|"stderr"), line_without_newline)
LineCallback = Callable[[str, str, str], None]
# on_bytes(node_name, stream ("stdout"|"stderr"), raw bytes as they arrived)
BytesCallback = Callable[[str, str, bytes], None]


# ------------------------------------------------------------------ results


class ErrorKind(str, enum.Enum):
    """Why a command has no exit code to report."""

    CONNECT = "connect"  # the node could not be reached or authenticated
    LOST = "lost"  # the connection went away while the command ran
    TIMEOUT = "timeout"  # the command ran past its timeout and was killed
    STOPPED = "stopped"  # the caller asked every command to stop


@dataclass(frozen=True)
class NodeResult:
    node: str
    exit_code: int | None  # None: never ran to completion (unreachable, timed out, lost, stopped)
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    error: str | None = None  # connection/timeout problem in words, not a non-zero exit
    kind: ErrorKind | None = None  # set whenever `error` is
    timeout: float | None = None  # the limit the command ran under (for CommandTimeout)

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    @property
    def reachable(self) -> bool:
        """The node answered: it ran the command (whatever its exit code) or ran it too long."""
        return self.exit_code is not None or self.kind is ErrorKind.TIMEOUT

    def describe(self) -> str:
        if self.error:
            return self.error
        return f"exit code {self.exit_code}"

    def exception(self) -> Exception | None:
        """The typed error for a result that is not ok (None when it is): ConnectError,
        ConnectionLost, CommandTimeout, else CommandFailed. Each carries the node; the
        command errors carry this result."""
        if self.ok:
            return None
        if self.kind is ErrorKind.CONNECT:
            return ConnectError(self.node, self.error or "cannot connect")
        if self.kind is ErrorKind.LOST:
            return ConnectionLost(self.node, self.error or "the connection was lost")
        if self.kind is ErrorKind.TIMEOUT:
            return CommandTimeout(self, self.timeout or 0.0)
        return CommandFailed(self)

    def check(self) -> "NodeResult":
        """This result when it is ok; else raise its typed error (see `exception`)."""
        e = self.exception()
        if e is not None:
            raise e
        return self


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

    def check(self, message: str | None = None) -> "ClusterResult":
        """This result when every node is ok; else raise ClusterFailure wrapping it."""
        if not self.all_ok:
            raise ClusterFailure(self, message)
        return self


# ------------------------------------------------------------------ processes


class Proc(ABC):
    """A running command. The engine polls `fds()` for readability, then reads without blocking."""

    node: str
    started: float

    @abstractmethod
    def fds(self) -> list[int]:
        """The descriptors still worth polling (a stream at EOF drops out); always a list."""

    @abstractmethod
    def read(self) -> tuple[bytes, bytes]:
        """Whatever stdout and stderr bytes are ready now; never blocks."""

    @abstractmethod
    def done(self) -> bool:
        """The command ended and all its output was read."""

    @abstractmethod
    def exit_code(self) -> int | None:
        """The exit code once known (128+N for signal N), else None."""

    @abstractmethod
    def lost_reason(self) -> str | None:
        """Why the command's connection is gone, in words; None while it is fine."""

    @abstractmethod
    def kill(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def send(self, data: bytes) -> bool:
        """Write `data` to the stdin of a command started with keep_stdin; whether it went out
        (False: its stdin or its connection is closed, or this kind of command takes none)."""
        return False


# ------------------------------------------------------------------ connections


class Connection(ABC):
    """One node, opened once, reused for everything a command does."""

    def __init__(self, node: Node):
        self.node = node

    @abstractmethod
    def open(self) -> None:
        """Connect; raises ConnectError (or HostKeyError) naming the node."""

    @abstractmethod
    def exec(self, command: str, *, stdin: bytes | None = None, keep_stdin: bool = False) -> Proc:
        """Start `command` in the node's shell; raises ConnectionLost when the connection is gone.
        `stdin`: bytes (then EOF), or an iterable of byte chunks fed from a thread (then EOF); with
        keep_stdin (bytes or None only) the stdin stays open for Proc.send until the command ends."""

    @abstractmethod
    def close(self) -> None: ...

    def reopen(self, timeout: float | None = None) -> None:
        """Replace a lost connection with a fresh one to the same node; raises like `open`.
        `timeout` caps this attempt's connect timeout (what is left of a deadline)."""
        self.close()
        self.open()

    @property
    def alive(self) -> bool:
        return True

    @property
    def lost_reason(self) -> str | None:
        """Why the connection is gone, in words; None while it is alive."""
        return None


def quiet_paramiko(debug: bool = False) -> None:
    """paramiko's transport thread logs a traceback for every failed handshake (a port that
    answers but is not sshd, a node that drops the connection); with no handler configured,
    Python's last-resort handler prints it. The failure already reaches the user as one line
    naming the node, so the traceback is shown with --debug only."""
    import logging

    log = logging.getLogger("paramiko")
    if debug:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    elif not log.handlers:
        log.addHandler(logging.NullHandler())
        log.propagate = False

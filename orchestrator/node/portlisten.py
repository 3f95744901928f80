"""remote/portlisten.py's client: preflight's temporary listener on the master's port.

`PYTHON -c BOOT CODE portlisten PORT SECONDS EXPECTED TOKEN` (form.py); the token sits
on its command line so that the listener is found again by it (/proc/PID/cmdline) before it is
killed. Its first line says whether it listens (`Listening`).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.form import Exec

PROGRAM = "portlisten"


def listen(node: Node, port: int, seconds: float, expected: int, token: str) -> Exec:
    return form.command(node, PROGRAM, port, seconds, expected, token, group_env=False)


@dataclass(frozen=True)
class Listening:
    """The listener's first line: its pid (listening), or the port was taken (busy), or neither
    (error: what it said instead)."""

    pid: int | None = None
    busy: bool = False
    error: str | None = None


def read_first(line: str) -> Listening:
    words = line.split()
    if words[:1] == ["listening"] and len(words) > 1 and words[1].isdigit():
        return Listening(pid=int(words[1]))
    if words[:1] == ["busy"]:
        return Listening(busy=True)
    return Listening(error=line or "no answer")

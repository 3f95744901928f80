"""remote/relay.py's client: the relay that carries sync's, setup's and cp's tar streams node to
node (transfer/chain.py, transfer/pair.py), and sync's first look at a workdir (`changed`).

`PYTHON -c BOOT CODE relay VERB ARGS` (form.py): stdin is the stream it relays.
A transfer's processes carry its id in CLUSTERCTL_XFER, so `stop` finds them again by it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.form import Exec, NodePath

PROGRAM = "relay"


def command(node: Node, verb: str, *args: object, python: str | None = None, xfer: str | None = None,
            group_env: bool = False) -> Exec:
    """`[CLUSTERCTL_XFER=ID ]PYTHON -c BOOT CODE relay VERB ARGS` (python: the node's unless named)."""
    return form.command(node, PROGRAM, verb, *args, python=python,
                        env={"CLUSTERCTL_XFER": xfer} if xfer else None, group_env=group_env)


def end(node: Node, xfer: str, mode: str, where: str, *names: str, idle: float, connect: float,
        listen: str | None = None, python: str | None = None) -> Exec:
    """One end of transfer `xfer`: `recv ID DIR` (listening on `listen`) or `send ID DIR NAMES`."""
    tail = ["--listen", listen] if listen is not None else []
    return command(node, mode, xfer, NodePath(where), *names, "--idle", f"{idle:g}", "--connect-timeout",
                   f"{connect:g}", *tail, python=python, xfer=xfer, group_env=True)


def stop(node: Node, xfer: str, where: str, python: str | None = None) -> Exec:
    """`stop ID DIR`: transfer `xfer`'s processes on the node ended, its staging in DIR removed."""
    return command(node, "stop", xfer, NodePath(where), python=python)


def changed(node: Node, workdir: str) -> Exec:
    """`changed WORKDIR`: the bytes of the listed files (NUL-separated `SIZE MTIME PATH` on stdin)
    that differ there, and whether rsync is installed."""
    return command(node, "changed", NodePath(workdir))


@dataclass(frozen=True)
class Said:
    """One protocol line of a relay end on its stdout: `port N` (where it listens), `linked` or
    `link-failed WHY` (its downstream), `progress N` (bytes so far), `done N [FILES]`, or a sender's
    `sent N SHA256`. `n` is the number the line carries; `text` its words after that."""

    word: str
    n: int | None = None
    files: int = 0
    text: str = ""


def read_line(line: str) -> Said | None:
    """A relay's stdout line -> Said; None for any other line (a blank one, a traceback's)."""
    word, _, rest = line.partition(" ")
    if word in ("port", "progress") and rest.isdigit():
        return Said(word, int(rest))
    if word == "linked":
        return Said(word)
    if word == "link-failed":
        return Said(word, text=rest)
    if word == "done":
        n, _, files = rest.partition(" ")
        return Said(word, int(n), int(files or 0)) if n.isdigit() and (files or "0").isdigit() else None
    words = line.split()
    if len(words) == 3 and words[0] == "sent" and words[1].isdigit():
        return Said("sent", int(words[1]), text=words[2])
    return None


def read_changed(stdout: str) -> tuple[int, bool] | None:
    """`changed`'s answer -> (bytes that differ, rsync installed); None when it did not say."""
    m = re.search(r"^changed (\d+) \d+\nrsync (yes|no)$", stdout, re.M)
    return (int(m.group(1)), m.group(2) == "yes") if m else None


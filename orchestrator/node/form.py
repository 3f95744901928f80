"""The one command form: how a program of orchestrator/remote/ is run on a node.

Every node command line for a shipped program is built by `command` (or, inside a shell probe,
`heredoc`), every argument quoted by orchestrator/shell.py: `NodePath` arguments keep a leading
`~/` as the node user's home, everything else is one literal word. How the program's bytes reach
the node is the `Travel`; a change of that (a cached copy on the node, keyed by its hash) is made
here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Iterable, Iterator, Mapping

from orchestrator import probe, shell
from orchestrator.inventory import Node

# `python -c LOADER ARGS`: the program arrives first on stdin, length-prefixed, and the caller's
# data (a tar stream, a manifest) follows on the same stdin (`python -` would read it as script)
LOADER = "import sys;exec(sys.stdin.buffer.read(int(sys.stdin.buffer.readline())))"


class Travel(Enum):
    """How the program reaches the node."""

    STDIN = "stdin"  # `PYTHON - ARGS`: the program is the whole stdin
    LOADER = "loader"  # `PYTHON -c LOADER ARGS`: the program length-prefixed on stdin, the caller's data after it
    ARGUMENT = "argument"  # `PYTHON -c PROGRAM ARGS`: stdin is the caller's (a feed, a manifest, nothing)


class NodePath(str):
    """An argument that is a path on the node: a leading `~` is the node user's home there."""


@cache
def source(name: str) -> bytes:
    """orchestrator/remote/NAME.py as the nodes run it (probe.program), read once per process."""
    return probe.program(name)


def word(arg: object) -> str:
    """One argument as one shell word (a NodePath keeps a leading `~` as the node's home)."""
    return shell.path(arg) if isinstance(arg, NodePath) else shell.quote(arg)


@dataclass(frozen=True)
class Exec:
    """A node command: the shell line and what goes on its stdin in front of the caller's data
    (the program itself, or its length-prefixed loader form; None when it travels as an argument:
    no stdin unless the caller gives one)."""

    command: str
    stdin: bytes | None

    def then(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The stdin with the caller's data after the program (Travel.LOADER, Travel.ARGUMENT)."""
        if self.stdin:
            yield self.stdin
        yield from chunks

    def start(self, conn):
        """Started on one open connection (transport Connection); raises what `conn.exec` raises."""
        return conn.exec(self.command, stdin=self.stdin)


def command(node: Node, program: str, *args: object, travels: Travel = Travel.STDIN, python: str | None = None,
            env: Mapping[str, object] | None = None, flags: tuple[str, ...] = (), group_env: bool = True,
            preface: str = "") -> Exec:
    """`[GROUP_ENV=1 ][K=V ...]PYTHON [FLAGS] (-|-c ...) ARGS` running remote/PROGRAM.py on `node`.
    python: the interpreter (default the node's); env: assignments in front of it (names are the
    house's, values quoted); group_env: the node's program_env (share_with_group) in front;
    preface: Python text run before the program (values the program reads as globals), which
    never appears on a command line (`ps` shows argv)."""
    body = (preface.encode() if preface else b"") + source(program)
    head = [f"{k}={shell.quote(v)}" for k, v in (env or {}).items()]
    if travels is Travel.STDIN:
        how, stdin = ["-"], body
    elif travels is Travel.LOADER:
        how, stdin = ["-c", shell.quote(LOADER)], str(len(body)).encode() + b"\n" + body
    else:
        how, stdin = ["-c", shell.quote(body.decode())], None
    words = [*head, shell.path(python or node.python), *flags, *how, *(word(a) for a in args)]
    return Exec((node.program_env if group_env else "") + " ".join(words), stdin)


def heredoc(program: str, python: str, *args: str, flags: tuple[str, ...] = (), end: str = "PYEOF") -> str:
    """Shell text that runs remote/PROGRAM.py inside a node-side `sh` script: `PYTHON [FLAGS] - ARGS
    2>&1 <<'END'`, the program, END. python and args are shell words as the script has them
    ("$py", "$@"): the script's own variables, not values from here."""
    text = source(program).decode()
    if f"\n{end}\n" in text:
        raise ValueError(f"remote/{program}.py holds its own heredoc end {end!r}")
    return f"{' '.join([python, *flags, '-', *args])} 2>&1 <<'{end}'\n{text}{end}\n"

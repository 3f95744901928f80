"""remote/netprobe.py's client: netbench's TCP server and client on the nodes and its all-reduce.

`PYTHON -c BOOT CODE netprobe VERB ARGS` (form.py); it answers with one JSON line, read here into
a wire.Answer.
"""

from __future__ import annotations

from typing import Mapping

from orchestrator import shell
from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.form import Exec
from orchestrator.node.wire import Answer, Call, reply
from orchestrator.transport import NodeResult

PROGRAM = "netprobe"


def command(node: Node, verb: str, *args: object, env: Mapping[str, str] | None = None) -> Exec:
    """`[export K=V; ... ]PYTHON -c BOOT CODE netprobe VERB ARGS` (env: exported first, for the
    all-reduce's backend)."""
    e = form.command(node, PROGRAM, verb, *args, group_env=False)
    return Exec(shell.exports(env) + " " + e.command, e.stdin) if env is not None else e


def read(r: NodeResult) -> Answer:
    """The probe's JSON line; its error says `EXIT: STDERR` when it failed."""
    return reply(r, dict, lambda d: Answer(d, None, r.exit_code),
                 lambda why: Answer(None, why, r.exit_code), PROGRAM) if r.ok else \
        Answer(None, f"{r.describe()}: {r.stderr.strip()[-500:]}", r.exit_code)


def client(node: Node, *args: object, timeout: float) -> Call[Answer]:
    """`client ADDR PORT up|down|rtt N`: one measurement against the master's server."""
    e = command(node, "client", *args)
    return Call(e.command, e.stdin, timeout, read)


def serve(node: Node, port: int, timeout: float) -> Exec:
    """`serve PORT TIMEOUT`: the server; its first stdout line says where it listens."""
    return command(node, "serve", port, timeout)


def listening_port(line: str) -> int | None:
    """The server's first line, `listening PORT` -> PORT; None for anything else."""
    words = line.split()
    return int(words[1]) if len(words) == 2 and words[0] == "listening" and words[1].isdigit() else None


def quit_server(node: Node, port: int | str) -> Exec:
    return command(node, "quit", "127.0.0.1", port)

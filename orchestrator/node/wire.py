"""A node's answer, read once: calls that carry their reader, and the reading of a JSON reply.

A client function of orchestrator/node/ builds a `Call` for one node: its command (form.py), its
time limit and the reader that turns what came back into the verb's small frozen reply. `run`
sends a call to many nodes at once through the cluster; `Call.over` sends it on one open
connection. A node that could not be asked, or whose answer could not be read, still gets a
reply: its `error` says why, so callers decide what that means and nothing is parsed twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, TypeVar

from orchestrator.inventory import Node
from orchestrator.probe import common
from orchestrator.node import form
from orchestrator.node.form import Exec
from orchestrator.transport import Cluster, NodeResult, wait

T = TypeVar("T")


class BadReply(ValueError):
    """A node program printed something that is not the answer its verb gives."""


@dataclass(frozen=True)
class Call(Exec, Generic[T]):
    """A node command whose answer is read into a reply (also when the node could not be asked)."""

    timeout: float
    read: Callable[[NodeResult], T]

    def over(self, conn) -> T:
        """On one open connection; raises what `conn.exec` raises (ConnectionLost)."""
        r = wait(self.start(conn), self.timeout)
        if form.missing(r):  # the code went missing under the open connection: placed again, asked once more
            form.forget(conn)
            r = wait(self.start(conn), self.timeout)
        return self.read(r)


def call(exe: Exec, timeout: float, read: Callable[[NodeResult], T]) -> Call[T]:
    return Call(exe.command, exe.stdin, timeout, read)


def run(cluster: Cluster, call: Callable[[Node], Call[T]], nodes: Iterable[str] | None = None, **kw) -> dict[str, T]:
    """`call` on each chosen node of the cluster (all when `nodes` is None), at once: node -> reply.
    `kw` goes to Cluster.run (on_line, on_done, capture ...)."""
    chosen = None if nodes is None else set(nodes)
    calls = {n.name: call(n) for n in cluster.nodes if chosen is None or n.name in chosen}
    if not calls:
        return {}
    timeout = max(c.timeout for c in calls.values())
    form.place(cluster, calls)
    res = cluster.run(lambda n: calls[n.name].command, stdin=lambda n: calls[n.name].stdin, nodes=list(calls),
                      timeout=timeout, **kw)
    again = [name for name, r in res.items() if form.missing(r)]
    if again:  # the code went missing under an open connection: placed again, asked once more
        for name in again:
            form.forget(cluster.connections.get(name))
        form.place(cluster, again)
        res.update(cluster.run(lambda n: calls[n.name].command, stdin=lambda n: calls[n.name].stdin, nodes=again,
                               timeout=timeout, **kw))
    return {name: calls[name].read(r) for name, r in res.items()}


def send(cluster: Cluster, exe: Callable[[Node], Exec], nodes: Iterable[str] | None = None, *,
         data: Callable[[Node], Iterable[bytes]] | None = None, **kw) -> dict[str, NodeResult]:
    """exe(node)'s command on each chosen node at once (all when `nodes` is None), its stdin the
    program's part and then data(node) when given; `kw` goes to Cluster.run (timeout, on_bytes,
    capture ...). For commands whose output the caller reads as it comes (tar streams, frames)."""
    built: dict[str, Exec] = {}

    def of(node: Node) -> Exec:
        if node.name not in built:
            built[node.name] = exe(node)
        return built[node.name]

    stdin = (lambda n: of(n).then(data(n))) if data is not None else (lambda n: of(n).stdin)
    form.place(cluster, nodes)
    res = cluster.run(lambda n: of(n).command, stdin=stdin, nodes=None if nodes is None else list(nodes), **kw)
    for name, r in res.items():  # a stream is not sent twice: the next command places the code again
        if form.missing(r):
            form.forget(cluster.connections.get(name))
    return res


def failure(r: NodeResult, keep: int = 500) -> str:
    """Why a node's command did not answer: the transport's word, or the exit code and the end of stderr."""
    if form.missing(r):
        return f"clusterctl's node code was not on the node ({r.stderr.strip()[-keep:]}); the next command sends it again"
    return f"{r.describe()} {r.stderr.strip()[-keep:]}".strip()


def last_line_json(stdout: str) -> Any:
    """The JSON on the last non-blank line of a node program's stdout; ValueError when there is none."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise BadReply("no answer")
    return json.loads(lines[-1])


def last_object(text: str) -> dict | None:
    """The last JSON object a node-side script printed on a line of its own (None: none, or unreadable)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def progress_of(line: str) -> tuple[str, int | None] | None:
    """A node-side program's progress line (remote/common.py `progress`) -> (step, bytes)."""
    mark = common().PROGRESS
    if not line.startswith(mark):
        return None
    try:
        doc = json.loads(line[len(mark):])
        return str(doc["step"]), doc.get("bytes") if isinstance(doc.get("bytes"), int) else None
    except (ValueError, KeyError, TypeError):
        return None


def reply(r: NodeResult, want: type, build: Callable[[Any], T], failed: Callable[[str], T],
          program: str = "node program", keep: int = 500) -> T:
    """build(the JSON the program printed last) when it ran and printed a `want` that reads; else
    failed(why): the transport's word, or the exit code and the end of stderr, or what it printed."""
    if not r.ok:
        return failed(failure(r, keep))
    try:
        doc = last_line_json(r.stdout)
        if not isinstance(doc, want):
            raise BadReply(f"not a JSON {want.__name__}")
        return build(doc)
    except (LookupError, TypeError, ValueError, AttributeError) as e:
        return failed(f"unreadable {program} answer ({type(e).__name__}: {e}): {r.stdout[-200:]!r}")


@dataclass(frozen=True)
class Answer:
    """A node program's JSON answer as it printed it (`doc`), or why there is none (`error`), and
    the program's exit code (None: it did not end by itself)."""

    doc: Any = None
    error: str | None = None
    exit_code: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def read_answer(r: NodeResult, want: type = dict, program: str = "node program", keep: int = 500) -> Answer:
    return reply(r, want, lambda d: Answer(d, None, r.exit_code), lambda why: Answer(None, why, r.exit_code),
                 program, keep)

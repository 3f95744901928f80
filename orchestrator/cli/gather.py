"""Gathered output (`clush -b`, `dshbak -c`): nodes whose output is identical are shown once,
under one header naming them as a node range.

Lines arrive as (node, stream, text) events, like any other sink (output.py); each node's lines
go into ClusterShell's MsgTree in the order they came, stderr lines marked `stderr: `, so two
nodes share a block only when they printed the same lines on the same streams in the same order.
"""

from __future__ import annotations

import threading

from ClusterShell.MsgTree import MsgTree
from ClusterShell.NodeSet import NodeSet

STDERR_MARK = "stderr: "


def header(nodes: NodeSet) -> str:
    """`---------------- n[1-8] (8) ----------------`, as clush prints it."""
    return f"{'-' * 16} {nodes} ({len(nodes)}) {'-' * 16}"


class Gatherer:
    """A line sink that keeps every node's lines; `blocks()` groups identical outputs."""

    def __init__(self, order: list[str]):
        self.order = {name: i for i, name in enumerate(order)}
        self.tree = MsgTree()
        self.silent = set(order)
        self._lock = threading.Lock()

    def __call__(self, node: str, stream: str, text: str, key: str | None = None) -> None:
        line = (STDERR_MARK + text if stream == "stderr" else text).encode("utf-8", "surrogateescape")
        with self._lock:
            self.tree.add(node, line)
            self.silent.discard(node)

    def blocks(self) -> list[tuple[NodeSet, list[str]]]:
        """(nodes, lines) per distinct output, in the order of each group's first node."""
        out = []
        for msg, keys in self.tree.walk():
            lines = [bytes(ln).decode("utf-8", "surrogateescape") for ln in msg.lines()]
            out.append((NodeSet.fromlist(keys), lines, min(self.order.get(k, len(self.order)) for k in keys)))
        out.sort(key=lambda b: b[2])
        return [(nodes, lines) for nodes, lines, _ in out]

    def render(self) -> str:
        text = []
        for nodes, lines in self.blocks():
            text.append(header(nodes))
            text += lines
        return "\n".join(text) + ("\n" if text else "")


def group_by(items: dict[str, str]) -> list[tuple[NodeSet, str]]:
    """{node: message} -> [(nodes, message)]: one entry per distinct message."""
    groups: dict[str, list[str]] = {}
    for node, msg in items.items():
        groups.setdefault(msg, []).append(node)
    return [(NodeSet.fromlist(nodes), msg) for msg, nodes in groups.items()]

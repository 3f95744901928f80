"""Copying every node's log into the run directory while the run goes on.

One agent `tail KEY OFFSET` per running node, all driven by the transport's engine: stdout
bytes go to runs/RUN/nodes/NODE.log as they arrive (the same offsets as on the node), the
agent's own stderr lines to the supervisor's log. `on_end` hears each node's end.
"""

from __future__ import annotations

from typing import Callable, IO

from orchestrator.inventory import Node
from orchestrator.runs.launch import AGENT, agent_cmd, node_key
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster, NodeResult


class LogCopier:
    """Byte and line sinks for the engine: a node's stdout appended to its log copy."""

    def __init__(self, run: Run, names: list[str], echo: Callable[[str], None] = print,
                 after_write: Callable[[], object] | None = None, start_at: dict[str, int] | None = None):
        self.files: dict[str, IO[bytes]] = {name: open(run.node_log(name), "ab") for name in names}
        self.echo, self.after_write = echo, after_write
        self.start_at = start_at or {}  # where the node's log begins in the copy (a restart appends)

    def offset(self, name: str) -> int:
        return self.files[name].tell() - self.start_at.get(name, 0)

    def on_bytes(self, name: str, stream: str, data: bytes) -> None:
        if stream == "stdout":
            f = self.files[name]
            f.write(data)
            f.flush()
            if self.after_write is not None:
                self.after_write()

    def on_line(self, name: str, stream: str, line: str) -> None:
        if stream == "stderr" and line.strip():
            self.echo(f"supervisor: {name}: {line.strip()}")

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def copy_logs(cluster: Cluster, run: Run, nodes: list[Node], on_end: Callable[[NodeResult], None],
              *, echo: Callable[[str], None] = print, after_write: Callable[[], object] | None = None,
              key: str | None = None, start_at: dict[str, int] | None = None) -> None:
    """Copy each node's log until its run ended there and every byte arrived (or the node is
    lost: the engine ends its tail with ErrorKind.LOST). No timeout: a run lasts as long as it
    trains; a silent node is caught by the transport's liveness watch. `after_write` runs after
    each chunk lands in a log copy (`tail` prints the new lines). `key`: the run's id on the
    nodes when it is not run.id (a restart's RUN_ID.aK); `start_at`: where each node's log
    begins in its copy."""
    if not nodes:
        return
    copier = LogCopier(run, [n.name for n in nodes], echo, after_write, start_at)
    try:
        cluster.run(lambda n: agent_cmd(n, "tail", node_key(key or run.id, n), copier.offset(n.name)), stdin=AGENT,
                    nodes=[n.name for n in nodes], timeout=None, capture=False, on_bytes=copier.on_bytes,
                    on_line=copier.on_line, on_done=on_end, follow=True)
    finally:
        copier.close()

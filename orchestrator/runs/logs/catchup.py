"""A node's log copy completed after its stream could not carry it to the end.

The copy (runs/RUN/nodes/NODE.log) holds each attempt's log from byte 0 at the offset the attempt
began at (AttemptRecord.log_start). A stream cut by a lost link, or bytes the control machine had
no room for, leave the copy short of the node's log; what the node wrote meanwhile (a lost rank's
own traceback) is still on the node. Once the node answers again and the attempt has ended there,
the agent's plain `tail KEY OFFSET status` hands over the rest (it ends with the run's status), and
it is appended: the copy is then byte-identical to the node's log.

A copy that a later attempt on the same node appended to is not completed: the missing bytes would
belong before that attempt's, which cannot be put in between. So copies left short for want of
room (`ShortCopies`) are completed as soon as there is room, and before the next attempt begins.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from orchestrator.errors import ClusterctlError
from orchestrator.inventory import Inventory, Node
from orchestrator.node import agent
from orchestrator.runs.record import Book
from orchestrator.runs.space import Space
from orchestrator.transport import Cluster, Connection, stream

TAIL_TIMEOUT = 120.0  # the rest of one ended attempt's log
ENDED_TRIES, ENDED_WAIT_S = 4, 5.0  # asking whether the attempt ended on the node


def where(book: Book, node: str, key: str) -> int | None:
    """Where attempt `key`'s log of `node` begins in the copy; None when the copy cannot be
    completed (no such attempt on the node, or a later attempt appended to the copy since)."""
    attempts = book.rec.attempts
    i = next((i for i, a in enumerate(attempts) if a.key == key and node in a.nodes), None)
    if i is None or any(node in b.nodes for b in attempts[i + 1:]):
        return None
    return attempts[i].log_start.get(node, 0)


def complete(conn: Connection, node: Node, key: str, copy: Path, start: int) -> int:
    """Append what the node's log of attempt `key` holds past the copy; the attempt must have
    ended on the node. -> the bytes added (0: the copy was complete). OSError (this machine's
    disk) and ClusterctlError (the node) are the caller's; what landed before either stays."""
    for _ in range(ENDED_TRIES):  # a stop carried out a moment ago: the node records the end within seconds
        now = agent.status(node, key).over(conn)
        if now.error is not None:
            raise ClusterctlError(f"{node.name}: {now.error}")
        if not now.exists or now.exit_code is not None or not now.alive:
            break
        time.sleep(ENDED_WAIT_S)
    have = copy.stat().st_size - start if copy.exists() else 0
    if not now.exists or now.alive or now.log_size <= have:
        return 0
    added = 0
    with open(copy, "ab", buffering=0) as f:
        def write(_name: str, which: str, data: bytes) -> None:
            nonlocal added
            if which == "stdout":
                f.write(data)
                added += len(data)

        stream([agent.tail(node, key, have).start(conn)], on_bytes=write, timeout=TAIL_TIMEOUT, capture=False)
    return added


def complete_after_stop(conn: Connection, node: Node, key: str, book: Book, say: Callable[[str], None]) -> None:
    """A node that did not answer answered again and attempt `key` was stopped there: its copy is
    completed, and said so when bytes were missing. Never raises: a copy left short is said."""
    start = where(book, node.name, key)
    if start is None:
        return
    try:
        added = complete(conn, node, key, book.run.node_log(node.name), start)
    except (OSError, ClusterctlError) as e:
        say(f"{node.name}: the rest of its log of {key} not copied: {e}")
        return
    if added:
        book.tell(f"{node.name}: answered again; its log of {key} completed ({added} bytes the lost stream "
                  "had not carried)", event="log_completed", node=node.name)


class ShortCopies:
    """Log copies that ended short for want of room here (runs/space.py): completed from their
    nodes once there is room again (`settle`, each node on a connection of its own)."""

    def __init__(self, cluster: Cluster, inv: Inventory, book: Book, space: Space, say: Callable[[str], None]):
        self.cluster, self.inv, self.book, self.space, self.say = cluster, inv, book, space, say
        self.owed: list[tuple[str, str]] = []  # (node, attempt key)
        self.lock = threading.Lock()

    def owe(self, key: str, nodes: set[str]) -> None:
        with self.lock:
            self.owed += [(n, key) for n in sorted(nodes) if (n, key) not in self.owed]

    def settle(self, gap: dict | None = None) -> None:
        """Every copy owed, completed (kept owed while the disk still has no room)."""
        if self.space.is_full or (gap or {}).get("reserve"):  # the reserve holds the final record, not logs
            return
        with self.lock:
            owed, self.owed = self.owed, []
        for name, key in owed:
            start = where(self.book, name, key)
            if start is None:
                self.say(f"{name}: its log of {key} stays short here (a later attempt's log follows it); "
                         f"the node keeps the whole of it")
                continue
            node = self.inv.node(name)
            conn = self.cluster.connection_for(node, connect_timeout=10)
            try:
                conn.open()
                added = complete(conn, node, key, self.book.run.node_log(name), start)
                self.say(f"{name}: its log copy of {key} caught up ({added} bytes)")
            except OSError as e:
                if not self.space.full(e, "the log copies"):
                    self.say(f"{name}: the rest of its log of {key} not copied: {e}")
                self.owe(key, {name})
            except ClusterctlError as e:
                self.say(f"{name}: the rest of its log of {key} not copied: {e}")
            finally:
                conn.close()

"""Push one tar stream to many nodes, each byte crossing the control machine's link once.

The control machine streams to the first node over its SSH channel; every node runs
orchestrator/remote/relay.py, which writes the stream into its workdir while forwarding each
chunk over TCP to the next node's `address`, so the wall time approaches size / the slowest link.

Each node's relay binds an ephemeral port (the kernel picks it; nothing fixed must be open) and
reports it on its SSH channel. The control machine then hands each node, over that node's own
channel, the token its upstream must present and the address, port and token of its downstream.
A node that cannot reach its downstream (refused, timed out) says so; the stream is then pushed
directly from the control machine to the node after the break, which heads its own segment. A
node whose relayed stream fails later (its upstream died or stalled past the idle timeout, the
bytes did not match) and which is still connected gets the stream once more, straight from here.
Every node checks the sha256 of what it received against the one the control machine announces
over its channel at the end. With `chain=False` every node is its own segment: direct pushes.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node import relay as door
from orchestrator.transfer import SyncResult
from orchestrator.transfer.archive import TarStream, framed
from orchestrator.transport import Cluster, NodeResult

START_TIMEOUT = 60.0  # every relay reports its port within this
CONNECT_TIMEOUT = 5.0  # a node's connect to its downstream
IDLE_TIMEOUT = 120.0  # a relay with no data (or protocol line) for this long gives up


@dataclass
class _Hop:
    node: Node
    token: str
    port: int | None = None
    linked: bool | None = None  # did this node connect to its downstream
    link_error: str = ""
    exited: bool = False
    bytes: int = 0
    done: bool = False
    files: int = 0
    head: "_Hop | None" = None  # the segment head that feeds this node's stream
    sha: str | None = None  # set on a head when its stream is complete


class Chain:
    """One relay over `nodes` (all connected, at most the cluster's fan-out)."""

    def __init__(self, cluster: Cluster, nodes: list[Node], src: str, files: list[str], *,
                 chain: bool = True, on_bytes: Callable[[str, int], None] | None = None,
                 timeout: float = 3600.0, dest: Callable[[Node], str] | None = None,
                 python: Callable[[Node], str] | None = None, stream: Callable[[], TarStream] | None = None):
        self.cluster, self.src, self.files, self.chain = cluster, src, files, chain
        # the stream each segment head sends: the files as they are, unless a caller names and
        # shapes it (cp: directories too, the top entry renamed)
        self.stream = stream or (lambda: TarStream(self.src, self.files))
        # where the tree lands and which interpreter runs the relay: the workdir and the node's
        # python unless a caller ships elsewhere (setup: a wheelhouse, before the venv exists)
        self.dest = dest or (lambda n: n.workdir)
        self.python = python or (lambda n: n.python)
        self.on_bytes, self.timeout = on_bytes, timeout
        self.xfer = secrets.token_hex(8)
        self.hops = [_Hop(n, secrets.token_hex(16)) for n in nodes]
        self.by_name = {h.node.name: h for h in self.hops}
        self.cond = threading.Condition()
        self.order: list[_Hop] | None = None  # the hops that started, in rank order
        self.segmented = False
        self.bytes_sent = 0
        self.notes: list[str] = []

    # ------------------------------------------------------------------ the feeders (one per node)

    def _wait(self, pred: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    def _next(self, hop: _Hop) -> _Hop | None:
        i = self.order.index(hop)
        return self.order[i + 1] if self.chain and i + 1 < len(self.order) else None

    def _plan_order(self) -> None:
        with self.cond:
            if self.order is None:
                self.order = [h for h in self.hops if h.port is not None]

    def _plan_segments(self) -> None:
        """After the link phase: each hop's head is its upstream's head, or itself when the
        upstream could not connect to it (or exited)."""
        with self.cond:
            if self.segmented:
                return
            prev = None
            for h in self.order:
                if prev is not None and prev.linked and not prev.exited:
                    h.head = prev.head
                else:
                    h.head = h
                    if prev is not None and self.chain:
                        why = prev.link_error or "its relay exited"
                        self.notes.append(f"{prev.node.name} cannot reach {h.node.name} ({why}): "
                                          f"pushing to {h.node.name} directly from this machine")
                prev = h
            self.segmented = True

    def feed(self, node: Node):
        """The stdin of one node's relay: the protocol of orchestrator/remote/relay.py."""
        hop = self.by_name[node.name]
        yield f"token {hop.token}\n".encode()
        if not self._wait(lambda: all(h.port is not None or h.exited for h in self.hops), START_TIMEOUT):
            return
        self._plan_order()
        if hop not in self.order:  # its relay exited before it listened
            return
        nxt = self._next(hop)
        yield (f"next {nxt.node.address} {nxt.port} {nxt.token}\n" if nxt else "last\n").encode()
        linking = [h for h in self.order if self._next(h) is not None]
        if not self._wait(lambda: all(h.linked is not None or h.exited for h in linking),
                          CONNECT_TIMEOUT + 30):
            return
        self._plan_segments()
        if hop.head is hop:
            yield b"source stdin\n"
            stream = self.stream()
            yield from framed(stream)
            with self.cond:
                self.bytes_sent += stream.bytes
                hop.sha = stream.sha256
                self.cond.notify_all()
            if stream.skipped:
                self.notes.append(f"{len(stream.skipped)} files vanished or were unreadable while "
                                  f"streaming to {node.name}: {', '.join(stream.skipped[:3])}")
        else:
            up = self.order[self.order.index(hop) - 1]  # it connects from its address: no other source
            yield f"source tcp {up.node.address}\n".encode()
            if not self._wait(lambda: hop.head.sha is not None or hop.head.exited, self.timeout):
                return
        if hop.head.sha is not None:
            yield f"sha256 {hop.head.sha}\n".encode()

    # ------------------------------------------------------------------ events from the relays

    def on_line(self, name: str, stream: str, line: str) -> None:
        hop = self.by_name.get(name)
        if hop is None or stream != "stdout":
            return
        said = door.read_line(line)
        word = said.word if said is not None else ""
        with self.cond:
            if word == "port":
                hop.port = said.n
            elif word == "linked":
                hop.linked = True
            elif word == "link-failed":
                hop.linked, hop.link_error = False, said.text
            elif word == "progress":
                hop.bytes = said.n
            elif word == "done":
                hop.done, hop.bytes, hop.files = True, said.n, said.files
            self.cond.notify_all()
        if word in ("progress", "done") and self.on_bytes:
            self.on_bytes(name, hop.bytes)

    def on_done(self, r: NodeResult) -> None:
        with self.cond:
            self.by_name[r.node].exited = True
            self.cond.notify_all()

    # ------------------------------------------------------------------ running it

    def command(self, node: Node) -> str:
        return door.end(node, self.xfer, "recv", self.dest(node), idle=IDLE_TIMEOUT, connect=CONNECT_TIMEOUT,
                        listen=node.address, python=self.python(node)).command

    def run(self) -> list[SyncResult]:
        form.place(self.cluster, [h.node.name for h in self.hops])
        res = self.cluster.run(self.command, stdin=self.feed, nodes=[h.node.name for h in self.hops],
                               timeout=self.timeout, on_line=self.on_line, on_done=self.on_done)
        failed = [name for name, r in res.items() if not (r.ok and self.by_name[name].done)]
        if failed:  # stragglers of this transfer, found by its id, and their staging dirs
            self.cluster.run(lambda n: door.stop(n, self.xfer, self.dest(n), python=self.python(n)).command,
                             nodes=failed, timeout=30)
        return [self._result(h, res[h.node.name]) for h in self.hops]

    def _result(self, hop: _Hop, r: NodeResult) -> SyncResult:
        seg = [h for h in self.order or [] if h.head is hop.head]
        method = "relay" if len(seg) > 1 else "tar"
        if r.ok and hop.done:
            via = "" if hop.head is hop else f" (relayed from {self.order[self.order.index(hop) - 1].node.name})"
            return SyncResult(hop.node.name, method, True, f"{hop.files} files, {hop.bytes / 1e6:.1f} MB{via}",
                              hop.bytes, r.duration, hop.files)
        err = [ln.removeprefix("relay: ") for ln in r.stderr.splitlines() if ln.strip()]
        why = err[-1] if err else (r.error or f"the relay exited with code {r.exit_code}")
        if hop.port is None and not err:
            why = f"the relay did not start: {why}"
        return SyncResult(hop.node.name, method, False, why, hop.bytes, r.duration)


def push(cluster: Cluster, nodes: list[Node], src: str, files: list[str], *, chain: bool,
         on_bytes=None, timeout: float = 3600.0, dest=None, python=None, stream=None
         ) -> tuple[list[SyncResult], int, list[str]]:
    """Relay (chain=True) or direct tar pushes to `nodes`, in groups of at most the fan-out (a
    relay needs all its nodes running at once). Returns (results, bytes sent from here, notes)."""
    results: dict[str, SyncResult] = {}
    sent, notes = 0, []
    t0 = time.monotonic()
    for i in range(0, len(nodes), cluster.fanout):
        group = nodes[i:i + cluster.fanout]
        for relayed in ((chain, False) if chain else (False,)):
            c = Chain(cluster, group, src, files, chain=relayed, on_bytes=on_bytes,
                      timeout=max(1.0, timeout - (time.monotonic() - t0)), dest=dest, python=python,
                      stream=stream)
            got = {r.node: r for r in c.run()}
            sent += c.bytes_sent
            notes += c.notes
            live = set(cluster.live(n.name for n in group))
            done = [got[n.name] for n in group if got[n.name].ok or n.name not in live or not relayed]
            results.update({r.node: r for r in done})
            # a relayed stream that stalled or broke (its upstream died or was cut, the bytes did not
            # match) is retried once for those nodes straight from here, the next source there is
            group = [n for n in group if n.name not in {r.node for r in done}]
            if not group:
                break
            notes.append(f"{', '.join(n.name for n in group)}: the relayed stream failed "
                         f"({got[group[0].name].detail}); pushed again from this machine")
    return [results[n.name] for n in nodes], sent, notes


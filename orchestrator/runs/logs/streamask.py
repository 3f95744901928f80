"""Asking an attempt's nodes through their open log streams: a stop, a snapshot of every rank, the
node's clock; no SSH session, no process started on the node.

A node's framed log stream (remote/agent_stream.py Stream) takes requests on its stdin, which the
control machine keeps open (transport Proc.send): a stop, carried out as the `stop` verb would
(remote/agent_stop.py `ask`: the request written and the run's waiter woken) and answered with a
FRAME_STOPPING record; a snapshot, taken as the `snapshot` verb takes it (every rank's /proc state,
stacks and Flight Recorder) and answered with a FRAME_SNAPSHOT record; a clock reading, answered
with a FRAME_CLOCK record (the straggler watch's clock offsets, runs/judge/stragglersnap.py). `StreamAsks` holds one
attempt's streams (runs/logs/streams.py attaches each as it starts and detaches it as it ends);
runs/stopping.py Stopper asks a stop through it first and sends the `stop` verb, as before, to
every node whose stream did not answer within ACK_S; the hang watch's snapshots (`snapshot_nodes`)
ask the `snapshot` verb of every node whose stream did not answer in time: none open (a plain
tail, a lost node), ended meanwhile, stuck, or a node code that does not listen. So the stream is
the fast way to a node, never the only one.

Measured at 64 stand-in nodes x 8 on 2 shared cores (docs/performance.md, "a stop through the open
log streams"): the `stop` verb's round to every node costs 1.7-2.0 s and 3.4-4.1 s of CPU (an SSH
session and an interpreter per node) before a node acts; through the streams the median node
wrote its stop marker 0.26-0.32 s after a rank was killed, ~0.1 s after the supervisor's decision.
A hang snapshot through a training node's stream: docs/performance.md, "a hang's snapshots
through the open log streams".
"""

from __future__ import annotations

import json
import threading
import time
from typing import Iterable

from orchestrator.node import agent
from orchestrator.node.artifacts import FRAME_CLOCK, FRAME_SNAPSHOT, FRAME_STOPPING
from orchestrator.transport import Cluster, Proc

ACK_S = 2.0  # how long a stream's answer to a stop is waited for before the node gets the `stop` verb
SNAP_MARGIN_S = 5.0  # a snapshot's answer is waited for its ranks' wait and this (py-spy of a silent rank)


class StreamAsks:
    """One attempt's open log streams, by node, and the requests they answered."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.procs: dict[str, Proc] = {}
        self.answers: dict[str, int] = {}  # node -> stop requests its streams answered as taken
        self.snaps: dict[tuple[str, int], dict | None] = {}  # (node, ask) -> its answer (None: awaited)
        # (node, ask) -> (its clock, this machine's at the answer's arrival)
        self.clocks: dict[tuple[str, int], tuple[float, float] | None] = {}

    def attach(self, name: str, proc: Proc) -> None:
        with self.cond:
            self.procs[name] = proc

    def detach(self, name: str, proc: Proc | None) -> None:
        """The node's stream `proc` ended: no answer is coming from it."""
        with self.cond:
            if proc is not None and self.procs.get(name) is proc:
                del self.procs[name]
            self.cond.notify_all()

    def answered(self, name: str, kind: str, doc: dict) -> None:
        """A FRAME_STOPPING record from the node's stream (the request taken, or why not: "error"), or
        a FRAME_SNAPSHOT one (kept only while its asker waits)."""
        with self.cond:
            if kind == FRAME_STOPPING and "error" not in doc:
                self.answers[name] = self.answers.get(name, 0) + 1
            elif kind == FRAME_SNAPSHOT and (key := (name, doc.get("ask"))) in self.snaps:
                self.snaps[key] = doc
            elif kind == FRAME_CLOCK and (key := (name, doc.get("clock"))) in self.clocks \
                    and isinstance(doc.get("time"), (int, float)):
                self.clocks[key] = (float(doc["time"]), time.time())
            self.cond.notify_all()

    def ask(self, names: list[str], grace: float, peer_failed: bool, wait: float = ACK_S) -> set[str]:
        """Send the stop to each of `names` with an open stream; the nodes whose stream answered that
        it took the request, within `wait` s (sooner once every stream asked answered or ended)."""
        line = json.dumps({"stop": grace, "peer_failed": peer_failed}).encode() + b"\n"
        deadline = time.monotonic() + wait
        with self.cond:
            before = {n: self.answers.get(n, 0) for n in names}
            # sent under the lock: two stops at once (a second request kills) never interleave a line
            sent = {n for n in names if (p := self.procs.get(n)) is not None and p.send(line)}
            while True:
                taken = {n for n in sent if self.answers.get(n, 0) > before[n]}
                waiting = [n for n in sent - taken if n in self.procs]
                if not waiting or time.monotonic() >= deadline:
                    return taken
                self.cond.wait(deadline - time.monotonic())

    def snapshot(self, names: Iterable[str], request: int, wait: float, limit: float) -> dict[str, dict]:
        """Ask each of `names` with an open stream for snapshot `request` (its ranks' hooks waited
        for `wait` s); {node: the document} of those that answered within `limit` s (sooner once
        every stream asked answered or ended)."""
        return self._gather(self.snaps, names, request, {"snapshot": request, "wait": wait}, limit)

    def clock(self, names: Iterable[str], request: int, limit: float) -> dict[str, tuple[float, float]]:
        """Ask each of `names` with an open stream for its clock; {node: (its clock when it read the
        request, this machine's when the answer arrived)} of those that answered within `limit` s."""
        return self._gather(self.clocks, names, request, {"clock": request}, limit)

    def _gather(self, into: dict, names: Iterable[str], request: int, req: dict, limit: float) -> dict:
        names, line = list(names), json.dumps(req).encode() + b"\n"
        deadline = time.monotonic() + limit
        with self.cond:
            sent = set()
            for n in names:
                into[(n, request)] = None  # before the send: the answer may come at once
                if (p := self.procs.get(n)) is not None and p.send(line):
                    sent.add(n)
            try:
                while True:
                    got = {n: a for n in sent if (a := into[(n, request)]) is not None}
                    if all(n in got or n not in self.procs for n in sent) or time.monotonic() >= deadline:
                        return got
                    self.cond.wait(deadline - time.monotonic())
            finally:
                for n in names:
                    into.pop((n, request), None)


def snapshot_nodes(cluster: Cluster, asks: StreamAsks | None, names: list[str], key: str,
                   wait: float) -> dict[str, agent.Snapshot]:
    """Every rank of run `key` on the nodes `names` through their open log streams, and by the
    agent's `snapshot` verb where a stream did not answer in time (or answered an error)."""
    ask = time.time_ns() // 1_000_000  # unique on the node: `clusterctl stack` asks the same hooks
    got = {n: agent.snapshot_of(doc) for n, doc in
           (asks.snapshot(names, ask, wait, wait + SNAP_MARGIN_S) if asks is not None else {}).items()}
    rest = [n for n in names if n not in got or got[n].error is not None]
    if rest:
        again = max(ask + 1, time.time_ns() // 1_000_000)  # never the stream's request again on its hooks
        got.update(agent.run(cluster, lambda nd: agent.snapshot(nd, key, again, wait), rest))
    return got

"""Stopping a run's processes on its nodes: the grace (stretched to cover a checkpoint save), the
nodes reached now, and a retry per node that cannot be reached until it answers again.

Every stop names the attempt it is for: its key (RUN_ID, or RUN_ID.aK for attempt k) and its
nodes. A node that cannot be reached is recorded as a PendingStop(node, key) in the run record and
retried on a fresh connection, with backoff (1 s doubling to 8 s, to 60 s for a node that refuses
us), until it answers; then that attempt's processes are
stopped there, whatever attempt the run is on by then, and that attempt's log copy completed from
the node (runs/logs/catchup.py). So a node lost in attempt 1 that comes back while attempt 2 runs
elsewhere keeps nothing of the run, and its log here ends as its log there does.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from orchestrator.errors import ClusterctlError, ConnectError
from orchestrator.inventory import Inventory
from orchestrator.inventory.ranges import fold
from orchestrator.node import agent
from orchestrator.runs.logs.catchup import complete_after_stop
from orchestrator.runs.logs.streamask import StreamAsks
from orchestrator.runs.policy import stop_grace
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import PendingStop
from orchestrator.transport import Cluster, retry_wait

LOST_PATIENCE = 300.0  # how long a lost node is retried, to stop the run there once it answers
LOG_DRAIN_S = 60.0  # after a stop's grace, how long the nodes' logs may take to close


def say(text: str) -> None:
    print(f"supervisor: {text}", flush=True)  # stdout is runs/RUN/supervisor.log


def asked_grace(run) -> float:
    """The grace a stop asked for (runs/RUN/stop.json), else the run's own (train --grace)."""
    req = run.stop_request or {}
    return req.get("grace") if req.get("grace") is not None else run.spec.grace


def grace_for(cluster: Cluster | None, key: str, asked: float, kill: bool) -> float:
    """A second stop request kills (0); else the grace asked for, stretched to cover the job's last
    checkpoint save on any live node of the attempt `key`."""
    if kill:
        return 0.0
    live = cluster.live(list(cluster.connections)) if cluster else []
    saves = [s.save_seconds for s in agent.run(cluster, lambda n: agent.status(n, key, timeout=10), live).values()] \
        if live else []
    return stop_grace(asked, max(saves, default=0))


class Stopper:
    """Stops attempts on their nodes, and keeps the stops that could not be confirmed (one retry
    thread per (node, key), recorded in the Book) until each node answers again."""

    def __init__(self, cluster: Cluster, inv: Inventory, run_id: str, book: Book,
                 say: Callable[[str], None] = say):
        self.cluster, self.inv, self.run_id, self.book, self.say = cluster, inv, run_id, book, say
        self.lock = threading.Lock()
        self.pending: dict[tuple[str, str], PendingStop] = {}
        self.threads: dict[tuple[str, str], threading.Thread] = {}
        self.quit_at = float("inf")  # monotonic time after which no try starts (end_by)
        self.wake = threading.Condition()  # notified by end_by: the retries' waits are cut

    def stop(self, key: str, nodes: list[str], grace: float, unreached_ok: set[str] = frozenset(),
             peer_failed: bool = False, streams: StreamAsks | None = None) -> list[str]:
        """Stop attempt `key` on `nodes` now; a node not reached gets a pending stop (unless it is
        in `unreached_ok`: never started). `peer_failed`: the attempt is going down because a node
        failed (agent.stop). `streams`: the attempt's open log streams, asked first (no session
        or process started on a node that takes it there: runs/logs/streamask.py); the other
        nodes get the `stop` verb. Returns the nodes left pending."""
        live = self.cluster.live(nodes)
        taken = streams.ask(live, grace, peer_failed) if streams is not None else set()
        rest = [n for n in live if n not in taken]
        # every node at once, past the fan-out cap: the stop is a short command on a connection
        # already open, and under a cap the nodes past it would wait for the first ones' ends
        res = agent.run(self.cluster, lambda n: agent.stop(n, key, grace, peer_failed), rest,
                        fanout=max(1, len(rest))) if rest else {}
        if streams is not None and live:
            self.say(f"stop of {key}: taken on the log stream of {len(taken)} of {len(live)} nodes"
                     + (f"; the stop command sent to {fold(rest)}" if rest else ""))
        left = []
        for name in (n for n in nodes if n not in taken):
            r = res.get(name)
            if (r is None or not r.reached) and name not in unreached_ok:
                self.say(f"{name}: could not confirm the stop of {key} "
                         f"({r.error if r else 'not connected'}); retrying until the node answers")
                self.pend(PendingStop(name, key, grace, time.time()))
                left.append(name)
        return left

    def pend(self, p: PendingStop) -> None:
        with self.lock:
            k = (p.node, p.key)
            if k in self.threads:
                return
            self.pending[k] = p
            t = threading.Thread(target=self._retry, args=(p,), daemon=True, name=f"stop-{p.node}")
            self.threads[k] = t
            self.book.stops(list(self.pending.values()))
        t.start()

    def resume(self, pending: list[PendingStop]) -> None:
        """A replacement supervisor takes over the stops its predecessor could not confirm."""
        for p in pending:
            self.pend(p)

    def is_pending(self, node: str) -> bool:
        with self.lock:
            return any(n == node for n, _ in self.pending)

    def _retry(self, p: PendingStop) -> None:
        """On a fresh connection each try, waiting longer after each failure (retry_wait: 1 s to
        60 s), until the node answers; then stop attempt `p.key` there and drop the run's claim on
        the node. Each failure is written on the pending stop (why, tries, next try), so the record
        and `status` say why the node is pending. `end_by` cuts the retries short."""
        node = self.inv.node(p.node)
        deadline = time.monotonic() + LOST_PATIENCE
        while time.monotonic() < min(deadline, self.quit_at):
            why, refused = self._try(node, p)
            if why is None:
                return
            wait = retry_wait(p.tries, refused)
            p = dataclasses.replace(p, why=why, tries=p.tries + 1, next_try=time.time() + wait)
            self._note(p)
            if p.tries == 1 or p.tries % 5 == 0:
                self.say(f"{p.node} still unreachable ({why}); try {p.tries}, next in {wait:g}s")
            with self.wake:
                self.wake.wait(max(0.0, min(time.monotonic() + wait, deadline, self.quit_at) - time.monotonic()))
        if time.monotonic() >= self.quit_at:
            self.say(f"stop of {p.key} on {p.node} left pending in the record (the supervisor was asked to end)")
        else:
            self.say(f"gave up stopping {p.key} on {p.node} after {LOST_PATIENCE:g}s; it stays pending in the record")

    def _try(self, node, p: PendingStop) -> tuple[str | None, bool]:
        """One try: (None, _) when the stop was carried out, else (why not in a few words, whether
        the node refused us)."""
        c = self.cluster.connection_for(node, connect_timeout=3)
        try:
            c.open()
            res = agent.stop(node, p.key, p.grace).over(c)
            if res.reached:
                self.say(f"stopped {p.key} on {p.node} after it answered again")
                complete_after_stop(c, node, p.key, self.book, self.say)  # what its lost stream did not carry
                if not self.in_use(p.node):
                    agent.release(node, self.run_id, timeout=30).over(c)
                self._done(p)
                return None, False
            return res.error or "no answer", False
        except ConnectError as e:  # HostKeyError, AuthRefused, ConnectionLost: not answering, or refusing us
            return e.brief, e.refused
        except ClusterctlError as e:
            return str(e)[:200], False
        finally:
            c.close()  # no connection outlives its try

    def _note(self, p: PendingStop) -> None:
        with self.lock:
            k = (p.node, p.key)
            if k in self.pending:
                self.pending[k] = p
                self.book.stops(list(self.pending.values()))

    def end_by(self, seconds: float) -> None:
        """Stop retrying within `seconds` (a stop request's grace, once the run has ended: the
        supervisor is to end); the stops not carried out by then stay pending in the record for the
        next supervisor."""
        with self.wake:
            self.quit_at = min(self.quit_at, time.monotonic() + seconds)
            self.wake.notify_all()

    def in_use(self, node: str) -> bool:
        """The run still trains on `node` (a later attempt took it): its claim stays."""
        rec = self.book.rec
        return not rec.state.terminal and rec.current is not None and node in rec.current.nodes

    def _done(self, p: PendingStop) -> None:
        with self.lock:
            self.pending.pop((p.node, p.key), None)
            self.threads.pop((p.node, p.key), None)
            self.book.stops(list(self.pending.values()))
            if not self.in_use(p.node):
                self.book.released([p.node])

    def join(self, timeout: float) -> None:
        """Wait (up to `timeout` in all) for the pending stops to be carried out."""
        deadline = time.monotonic() + timeout
        for t in list(self.threads.values()):
            t.join(max(0.0, deadline - time.monotonic()))

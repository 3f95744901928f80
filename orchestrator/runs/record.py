"""The run record, runs/RUN/run.json: one typed document (runs/runrecord.py RunRecord, read by
everyone through `Run.record`), written only through named transitions.

A run's truth lives there and nowhere else. `Book` is its only writer: every change of state is one
of the named transitions below, checked against TRANSITIONS and persisted at once (temp file and
rename, so a crash of the controller leaves the last good record). A replacement supervisor loads
the record and re-enters the run loop at the recorded attempt (orchestrator/runs/controller.py).

    starting ─► connecting ─► queued ─► connecting ─► preflight ─► launching ─► running ─► finished
                                                          ▲                        │        failed
                                                          └──── recovering ◄───────┘        stopped

Any live state may end (failed, stopped); preflight, launching and running may go to recovering
(the attempt failed and another follows); recovering leads to the next attempt's preflight.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

from orchestrator.runs.runrecord import AttemptRecord, PendingStop, RunRecord
from orchestrator.runs.space import Space
from orchestrator.runs.spec import NodeStatus, RunResult, RunState
from orchestrator.runs.store import Run, write_json
from orchestrator.runs.storyfile import STORY, UNTOLD_MAX, add_line, story  # noqa: F401 - `story`: its readers import it here

S = RunState
LIVE_END = frozenset({S.FAILED, S.STOPPED})
TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    S.STARTING: frozenset({S.CONNECTING, S.QUEUED}) | LIVE_END,
    S.CONNECTING: frozenset({S.CONNECTING, S.QUEUED, S.PREFLIGHT}) | LIVE_END,
    S.QUEUED: frozenset({S.QUEUED, S.CONNECTING}) | LIVE_END,
    S.PREFLIGHT: frozenset({S.LAUNCHING, S.RECOVERING}) | LIVE_END,
    S.LAUNCHING: frozenset({S.RUNNING, S.RECOVERING}) | LIVE_END,
    S.RUNNING: frozenset({S.RECOVERING, S.FINISHED}) | LIVE_END,
    S.RECOVERING: frozenset({S.RECOVERING, S.PREFLIGHT}) | LIVE_END,  # itself: adopted between attempts
    S.FINISHED: frozenset(), S.FAILED: frozenset(), S.STOPPED: frozenset(),
    S.UNKNOWN: frozenset({S.CONNECTING}) | LIVE_END,
}


class TransitionError(RuntimeError):
    """A transition the table does not allow: a bug in the controller, never a user error."""


FLUSH_S = 0.2  # per-node changes within this long of the first one cost one write of the record


class Book:
    """The one writer of a run's record. Each method is a named transition or a named update; each
    is persisted before it returns (per-node bookkeeping asked `later`: within FLUSH_S). With
    `space` (the supervisor's: runs/space.py) a disk with no room does not stop the run: the record
    and the story are kept in memory, said once, and written when there is room again, with the
    spell kept in the record (disk_full)."""

    def __init__(self, run: Run, space: Space | None = None):
        self.run = run
        self.rec = run.record
        self._lock = threading.RLock()
        # told each write of the record (line None) and each story line, under the lock; it must
        # not block (observe/events.py queues what it makes of them for its own threads)
        self.sink: Callable[[RunRecord, dict | None], None] | None = None
        self.space = space
        self.unsaved = False  # the record here is newer than run.json (no room to write it)
        self.untold: deque[dict] = deque(maxlen=UNTOLD_MAX)  # story lines waiting for room
        self._seq = self._on_disk = 0  # snapshots of the record taken, and the newest one written
        self._file = threading.Lock()  # run.json's writer (write_json's temporary file is one per process)
        self._dirty = False  # per-node changes not yet written (nodes_changed(later=True))
        self._later: threading.Timer | None = None  # their write, when one is due
        if space is not None:
            space.on_full.append(self._no_room)
            space.on_room.append(self._room_again)

    def _write(self) -> None:
        """The whole record, now (under the lock): with it whatever per-node change waited."""
        with self._lock:
            self._put(*self._snapshot())
            if self.sink is not None:
                self.sink(self.rec, None)

    def _snapshot(self) -> tuple[int, dict]:  # under the lock
        self._seq, self._dirty = self._seq + 1, False
        return self._seq, self.rec.to_json()

    def _put(self, seq: int, doc: dict) -> None:
        """Snapshot `seq` onto disk unless a newer one is there already. A full disk is told to
        `space` with the file's lock released: its telling takes the record's lock."""
        with self._file:
            if seq <= self._on_disk:
                return
            try:
                write_json(self.run.dir / "run.json", doc)
                self._on_disk, err = seq, None
            except OSError as e:
                err = e
        if err is not None and (self.space is None or not self.space.full(err, "the run record")):
            raise err
        self.unsaved = err is not None

    def flush(self) -> None:
        """Write the per-node changes that wait (nodes_changed(later=True)), if any still do."""
        with self._lock:
            if self._later is not None:
                self._later.cancel()
            self._later = None
            if not self._dirty:
                return
            seq, doc = self._snapshot()
            if self.sink is not None:
                self.sink(self.rec, None)
        self._put(seq, doc)  # outside the record's lock: the log copies' loop marks the next node's end meanwhile

    def _to(self, state: RunState, **changes) -> None:
        with self._lock:
            if state not in TRANSITIONS[self.rec.state]:
                raise TransitionError(f"run {self.rec.id}: {self.rec.state} -> {state} is not a transition")
            self.rec.state = state
            self._set(**changes)

    def _set(self, **changes) -> None:
        with self._lock:
            for k, v in changes.items():
                if not hasattr(self.rec, k):
                    raise AttributeError(f"run record has no field {k!r}")
                setattr(self.rec, k, v)
            self._write()

    # ---------------------------------------------------------------- transitions
    def connecting(self) -> None:
        self._to(RunState.CONNECTING)

    def queued(self, nodes: list[str]) -> None:
        self._to(RunState.QUEUED, queue_nodes=list(nodes), queued_at=self.rec.queued_at or time.time())

    def claimed(self, nodes: list[str]) -> None:
        """The nodes are this run's (a queued run leaves the queue)."""
        claimed = sorted(set(self.rec.claimed) | set(nodes))
        if self.rec.state is RunState.QUEUED:
            self._to(RunState.CONNECTING, claimed=claimed, waiting_for=None)
        else:
            self._set(claimed=claimed)

    def attempt_started(self, a: AttemptRecord, statuses: list[NodeStatus]) -> None:
        """Attempt k begins with its preflight (recorded even when the preflight is skipped)."""
        self._to(RunState.PREFLIGHT, attempt=a.attempt, attempts=[*self.rec.attempts, a], nodes=list(statuses),
                 recovering=None, rank_map=None, world_size=None, teardown=None, teardown_at=None)

    def launching(self, rank_map: str, world_size: int) -> None:
        self._to(RunState.LAUNCHING, rank_map=rank_map, world_size=world_size)

    def running(self) -> None:
        self._to(RunState.RUNNING, started=self.rec.started or time.time())

    def recovering(self, why: str) -> None:
        self._to(RunState.RECOVERING, recovering=why)

    def ended(self, result: RunResult, error: str | None = None) -> None:
        """The run is over: finished, failed or stopped, with its exit code and summary."""
        self._to(result.state, exit_code=result.exit_code, summary=result.summary,
                 first_failure=result.first_failure, error=error, ended=time.time())

    # ---------------------------------------------------------------- updates (no change of state)
    def supervisor(self, pid: int, created: float, adopted: bool) -> None:
        self._set(supervisor_pid=pid, supervisor_created=created, **({"adopted_at": time.time()} if adopted else {}))

    def waiting(self, what: str) -> None:
        if self.rec.waiting_for != what:
            self._set(waiting_for=what)

    def nodes_changed(self, statuses: list[NodeStatus] | None = None, later: bool = False) -> None:
        """The current attempt's nodes. `later`: per-node bookkeeping only (a node's end, exit code,
        loss), written by `flush` within FLUSH_S, once for all that changed meanwhile: a teardown's
        node ends arrive together on the log copies' loop, and a write each (the whole record,
        fsync'd: 43 ms at 256 nodes) held it for N writes of N nodes. Safe: a replacement supervisor
        asks every started node how its run ended (attempt.py `adopt`), and what must not wait (a
        first failure, teardown, verdict, restart, claim, pending stop, the run's end) is written at
        once by its own transition, which carries the waiting nodes too."""
        if not later:
            self._set(**({"nodes": list(statuses)} if statuses is not None else {}))
            return
        with self._lock:
            if statuses is not None:
                self.rec.nodes = list(statuses)
            self._dirty = True
            if self._later is None:
                self._later = threading.Timer(FLUSH_S, self.flush)
                self._later.daemon = True
                self._later.start()

    def attempt_changed(self, **changes) -> None:
        """Fields of the current attempt (timings, restore, verdict)."""
        with self._lock:
            a = self.rec.current
            for k, v in changes.items():
                if not hasattr(a, k):
                    raise AttributeError(f"attempt record has no field {k!r}")
                setattr(a, k, v)
            self._write()

    def tearing_down(self, why: str, grace: float) -> None:
        self._set(teardown=why, teardown_at=time.time(), stop_grace=grace)

    def stops(self, pending: list[PendingStop]) -> None:
        self._set(pending_stops=sorted(pending, key=lambda p: (p.node, p.key)))

    def leave_out(self, why: dict[str, str]) -> None:
        """Nodes no later attempt may use: lost, failed their preflight, or could not be prepared."""
        self._set(left_out=sorted(set(self.rec.left_out) | set(why)), left_out_why={**self.rec.left_out_why, **why})

    def released(self, nodes: list[str]) -> None:
        self._set(claimed=sorted(set(self.rec.claimed) - set(nodes)))

    def scaled(self, doc: dict) -> None:
        """The settings that grow with the cluster (runs/scaling.py `record_doc`), as this run uses them."""
        self._set(scaling=doc)

    def cpu(self, seconds: float) -> None:
        self._set(supervisor_cpu_s=round(seconds, 3))

    # ---------------------------------------------------------------- the story
    def tell(self, text: str, **about: Any) -> None:
        """One line of the run's story: what clusterctl saw and did (a node silent, lost, the
        teardown, a restart), appended to runs/RUN/story.jsonl, which the foreground and `tail`
        print as it grows (cli/runs.py), and to the supervisor's log. `about`: what the line is
        about, as data (event="node_silent", node="n2"), kept on the line for its readers."""
        print(f"supervisor: {text}", flush=True)
        doc = {"at": time.time(), "text": text, **about}
        with self._lock:
            add_line(self.run.dir / STORY, doc, self.untold, self.space)
            if self.sink is not None:
                self.sink(self.rec, doc)

    # ---------------------------------------------------------------- no room on this machine's disk
    def _no_room(self, what: str, e: OSError) -> None:
        self.tell(f"no room on the control machine's disk ({e.strerror}, writing {what} under {self.run.dir}): the "
                  "log copies, per-rank files and checkpoint copies stop until there is room; the run goes on, "
                  "watched from memory, and the record is written once there is room", event="disk_full")

    def _room_again(self, gap: dict) -> None:
        with self._lock:
            self.rec.disk_full = [*self.rec.disk_full, gap]
            if gap.get("reserve"):  # the run ended on a full disk: the record first, then what fits of the story
                self._write()
                self.tell(f"the run ended with no room on the control machine's disk for {gap['until'] - gap['since']:.0f}s: "
                          f"its reserve freed to write the final record; not written meanwhile: {', '.join(gap['what'])}; "
                          "the log copies stay short here (the nodes keep the whole logs)",
                          event="disk_room", seconds=round(gap["until"] - gap["since"], 1), reserve=True)
                return
            self.tell(f"room again on the control machine's disk after {gap['until'] - gap['since']:.0f}s; not "
                      f"written meanwhile: {', '.join(gap['what'])}; the log copies catch up from the nodes",
                      event="disk_room", seconds=round(gap["until"] - gap["since"], 1))
            self._write()


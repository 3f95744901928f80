"""The run record, runs/RUN/run.json: one typed document, written only through named transitions.

A run's truth lives here and nowhere else. `Book` is its only writer: every change of state is one
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

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from orchestrator.runs.space import Space
from orchestrator.runs.spec import NodeStatus, RunResult, RunState, fields_of
from orchestrator.runs.store import Run, read_json, write_json
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


@dataclass
class AttemptRecord:
    """One launch of the run on a set of nodes, under its own key (RUN, then RUN.aK)."""

    attempt: int
    key: str
    nodes: list[str]
    started: float = 0.0
    log_start: dict[str, int] = field(default_factory=dict)  # where this attempt's bytes begin in each log copy
    prepared: list[str] = field(default_factory=list)  # fresh nodes brought to the run's code first
    ready: list[str] | None = None  # those of them whose preparation finished (None: an older record)
    prepare_s: float | None = None  # claiming them and bringing them to the code (runs/spares.py)
    checkpoint: str | None = None  # what it started from
    checkpoint_about: str | None = None  # --checkpoint-dir: the snapshot's entries, step and size, in words
    set_aside: dict[str, list[str]] = field(default_factory=dict)  # --checkpoint-dir: node -> entries moved aside
    restored: list[str] = field(default_factory=list)  # the nodes the checkpoint was put on
    restored_from: str | None = None  # "nodes" (node to node) or None (the control machine's copy)
    resumed_from: str | None = None  # train --resume-from RUN
    resume_args: list[str] = field(default_factory=list)  # added to the job's arguments: it started from `checkpoint`
    restore_s: float | None = None
    skipped: list[str] = field(default_factory=list)  # newer copies passed over: damaged on this machine
    preflight_s: float | None = None
    preflight_ok: bool | None = None
    preflight_asked: int | None = None  # a relaunch's preflight rounds, when a survivor's failure was asked again
    preflight_file: str | None = None  # the table, under the run directory
    launch_s: float | None = None
    launched: float | None = None
    failed_at: float | None = None  # when the supervisor saw the first failure
    ended: float | None = None
    exit_code: int | None = None
    verdict: str | None = None  # restart.classify's cause: finished, node lost, script error, ...
    detail: str | None = None
    retry: bool | None = None  # the verdict: another attempt is worth it
    bad_nodes: list[str] = field(default_factory=list)  # the verdict: not to be used again
    copy_s: float | None = None
    hang: str | None = None  # the hang verdict's line (runs/judge/hang.py), when the watch found one
    hang_dir: str | None = None  # its snapshots, under the run directory (hangs/N)
    straggler: str | None = None  # the stragglers named now (runs/judge/straggler.py), one line

    @classmethod
    def from_json(cls, doc: dict) -> "AttemptRecord":
        kw = fields_of(cls, doc)
        kw.setdefault("attempt", 1)
        kw.setdefault("key", "")
        kw.setdefault("nodes", [])
        return cls(**kw)

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class PendingStop:
    """A node that could not be reached to stop an attempt's processes there: stopped (under that
    attempt's own key) as soon as it answers again."""

    node: str
    key: str
    grace: float = 5.0
    since: float = 0.0
    why: str = ""  # the last try's failure in a few words ("host key changed (it presented SHA256:..)")
    tries: int = 0
    next_try: float | None = None  # when the next try is due (time.time())

    @classmethod
    def from_json(cls, doc: dict) -> "PendingStop":
        return cls(**fields_of(cls, doc))


@dataclass
class RunRecord:
    id: str
    state: RunState = RunState.STARTING
    created: float = 0.0
    supervisor_pid: int | None = None
    supervisor_created: float | None = None
    adopted_at: float | None = None
    claimed: list[str] = field(default_factory=list)  # nodes this run holds a claim on
    left_out: list[str] = field(default_factory=list)  # nodes not to be used again by this run, and why
    left_out_why: dict[str, str] = field(default_factory=dict)
    queue_nodes: list[str] = field(default_factory=list)
    queued_at: float | None = None
    waiting_for: str | None = None
    attempt: int = 0
    attempts: list[AttemptRecord] = field(default_factory=list)
    nodes: list[NodeStatus] = field(default_factory=list)  # the current attempt's nodes
    rank_map: str | None = None
    world_size: int | None = None
    started: float | None = None
    recovering: str | None = None  # why the run is between attempts
    teardown: str | None = None
    teardown_at: float | None = None
    stop_grace: float | None = None
    pending_stops: list[PendingStop] = field(default_factory=list)
    ended: float | None = None
    exit_code: int | None = None
    summary: str | None = None
    error: str | None = None
    first_failure: dict | None = None
    supervisor_cpu_s: float | None = None
    disk_full: list[dict] = field(default_factory=list)  # spells with no room on this machine (runs/space.py)
    scaling: dict | None = None  # the settings that grow with the cluster, as the run uses them (runs/scaling.py)

    @classmethod
    def from_json(cls, doc: dict | None, run_id: str = "") -> "RunRecord":
        doc = dict(doc or {"id": run_id, "state": RunState.UNKNOWN.value})
        kw = fields_of(cls, doc)
        kw.setdefault("id", run_id)
        st = kw.get("state")
        kw["state"] = RunState(st) if st in RunState._value2member_map_ else RunState.UNKNOWN
        kw["attempts"] = [AttemptRecord.from_json(a) for a in kw.get("attempts") or []]
        kw["nodes"] = [NodeStatus.from_json(n) for n in kw.get("nodes") or []]
        kw["pending_stops"] = [PendingStop.from_json(p) for p in kw.get("pending_stops") or []]
        return cls(**{k: v for k, v in kw.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc["state"] = self.state.value
        doc["attempts"] = [a.to_json() for a in self.attempts]
        doc["nodes"] = [n.to_json() for n in self.nodes]
        doc["pending_stops"] = [dataclasses.asdict(p) for p in self.pending_stops]
        doc["stop_pending"] = self.stop_pending  # the node names, for readers of the names alone
        return {k: v for k, v in doc.items() if v is not None}

    @property
    def stop_pending(self) -> list[str]:
        return sorted({p.node for p in self.pending_stops})

    @property
    def current(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None

    def node(self, name: str) -> NodeStatus | None:
        return next((n for n in self.nodes if n.name == name), None)


def load(run: Run) -> RunRecord:
    return RunRecord.from_json(read_json(run.dir / "run.json"), run.id)


FLUSH_S = 0.2  # per-node changes within this long of the first one cost one write of the record


class Book:
    """The one writer of a run's record. Each method is a named transition or a named update; each
    is persisted before it returns (per-node bookkeeping asked `later`: within FLUSH_S). With
    `space` (the supervisor's: runs/space.py) a disk with no room does not stop the run: the record
    and the story are kept in memory, said once, and written when there is room again, with the
    spell kept in the record (disk_full)."""

    def __init__(self, run: Run, space: Space | None = None):
        self.run = run
        self.rec = load(run)
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
        doc = result.to_json()
        self._to(result.state, exit_code=result.exit_code, summary=doc["summary"],
                 first_failure=doc.get("first_failure"), error=error, ended=time.time())

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


"""The run record's typed document, runs/RUN/run.json: RunRecord and its parts (AttemptRecord,
PendingStop, and spec.py's NodeStatus), and how JSON becomes them and back.

Every reader gets the record through `Run.record` (runs/store.py), typed; `Run.create` writes the
first one (state starting) and `Book` (runs/record.py) every later one. A record written by an older clusterctl lacks keys, and they take the defaults
here; keys this one does not know are left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from orchestrator.runs.spec import FirstFailure, NodeStatus, RunState, fields_of


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
    first_failure: FirstFailure | None = None
    supervisor_cpu_s: float | None = None
    disk_full: list[dict] = field(default_factory=list)  # spells with no room on this machine (runs/space.py)
    scaling: dict | None = None  # the settings that grow with the cluster, as the run uses them (runs/scaling.py)

    @classmethod
    def from_json(cls, doc: dict | None, run_id: str = "") -> "RunRecord":
        doc = dict(doc) if isinstance(doc, dict) and doc else {"id": run_id, "state": RunState.UNKNOWN.value}
        kw = fields_of(cls, doc)
        kw.setdefault("id", run_id)
        st = kw.get("state")
        kw["state"] = RunState(st) if st in RunState._value2member_map_ else RunState.UNKNOWN
        kw["attempts"] = [AttemptRecord.from_json(a) for a in kw.get("attempts") or []]
        kw["nodes"] = [NodeStatus.from_json(n) for n in kw.get("nodes") or []]
        kw["pending_stops"] = [PendingStop.from_json(p) for p in kw.get("pending_stops") or []]
        kw["first_failure"] = FirstFailure.from_json(kw.get("first_failure"))
        return cls(**{k: v for k, v in kw.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc["state"] = self.state.value
        doc["attempts"] = [a.to_json() for a in self.attempts]
        doc["nodes"] = [n.to_json() for n in self.nodes]
        doc["pending_stops"] = [dataclasses.asdict(p) for p in self.pending_stops]
        doc["first_failure"] = self.first_failure.to_json() if self.first_failure is not None else None
        doc["stop_pending"] = self.stop_pending  # the node names, for readers of the names alone
        return {k: v for k, v in doc.items() if v is not None}

    @property
    def stop_pending(self) -> list[str]:
        return sorted({p.node for p in self.pending_stops})

    @property
    def current(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def key(self) -> str:
        """What the nodes know the current attempt's processes by (node agent RunKey: RUN for
        attempt 1, RUN.aK after a restart); the run id before any attempt, or in an older record."""
        a = self.current
        return a.key if a is not None and a.key else self.id

    def node(self, name: str) -> NodeStatus | None:
        return next((n for n in self.nodes if n.name == name), None)

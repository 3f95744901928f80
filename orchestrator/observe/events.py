"""A run's story as structured events, as it happens: what they are and where they come from.

The supervisor's Book (runs/record.py) hands every write of the run record and every story line
to `Watcher` (its `sink`). The record is typed, so most events are read from what changed in it:

    running            an attempt's ranks were all launched        (state -> running)
    node_lost          a node of the attempt was lost              (its state -> lost)
    attempt_failed     the attempt ended and was not the last word (its verdict, not finished/stopped)
    restarting         attempt k>1 begins, on these nodes          (a new attempt)
    spare_prepared     fresh nodes were brought to the run's code  (the attempt's prepare_s)
    hang               the hang watch's verdict                    (the attempt's hang)
    straggler          the straggler watch named ranks             (the attempt's straggler line)
    finished, failed, stopped   the run ended                       (a final state)

Two come from story lines that carry their data (runs/logs/streams.py): node_silent, node_reconnected.
Two are seen by the dispatcher's own thread (delivery.py), in files other parts of clusterctl own:
quarantined (the control home's quarantine.json gains an entry of this run) and checkpoint_copied
(a new complete copy in runs/RUN/checkpoints). heartbeat: every --heartbeat seconds while the run
is live, with its newest step.

Every event is one JSON document (orchestrator/schemas/event.json): event, run_id, seq, at, time,
attempt, state, a one-line text (the words the foreground would print) and the event's own data.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.spec import NodeState, RunState

END = ("finished", "failed", "stopped")
KINDS = ("running", "node_silent", "node_reconnected", "node_lost", "attempt_failed", "restarting",
         "spare_prepared", "hang", "straggler", "quarantined", "checkpoint_copied", *END, "heartbeat")
ALIASES = {"all": KINDS, "end": END}
NOT_FAILED = ("finished", "stopped")  # an attempt's verdicts that are no failure


def parse_kinds(text: str) -> frozenset[str]:
    """`node_lost,restarting,end` -> the kinds; ValueError naming an unknown one."""
    out: set[str] = set()
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        if word in ALIASES:
            out.update(ALIASES[word])
        elif word in KINDS:
            out.add(word)
        else:
            raise ValueError(f"{word!r} is not an event (events: {', '.join(KINDS)}; or all, end)")
    return frozenset(out)


def event(kind: str, rec: RunRecord, text: str, **data) -> dict:
    """One event's document, before its sequence number (the dispatcher's) is added."""
    at = time.time()
    return {"event": kind, "run_id": rec.id, "at": round(at, 3),
            "time": datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds"),
            "attempt": rec.attempt, "state": rec.state.value, "text": text,
            "data": {k: v for k, v in data.items() if v is not None}}


@dataclass
class _Seen:
    """What the last look at the record held, of what events are made from."""

    state: RunState = RunState.UNKNOWN
    attempts: int = 0
    verdict: str | None = None
    prepared: bool = False
    hang: str | None = None
    straggler: str | None = None
    lost: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, rec: RunRecord) -> "_Seen":
        a = rec.current
        return cls(rec.state, len(rec.attempts), a.verdict if a else None,
                   bool(a and a.prepare_s is not None), a.hang if a else None, a.straggler if a else None,
                   {n.name for n in rec.nodes if n.state is NodeState.LOST})


class Watcher:
    """The record's changes and the story's lines -> events. Called under the Book's lock: it only
    compares a few fields, never reads a file."""

    def __init__(self, rec: RunRecord):
        self.seen = _Seen.of(rec)

    def changed(self, rec: RunRecord) -> list[dict]:
        old, new = self.seen, _Seen.of(rec)
        self.seen = new
        a, out = rec.current, []
        if new.attempts > old.attempts and a is not None and a.attempt > 1:
            prev = rec.attempts[-2].nodes if len(rec.attempts) > 1 else []
            out.append(event("restarting", rec, f"restarting as attempt {a.attempt} on {', '.join(a.nodes)}",
                             nodes=list(a.nodes), spares=list(a.prepared),
                             replaced=[n for n in prev if n not in a.nodes], checkpoint=a.checkpoint))
        for name in sorted(new.lost - old.lost):
            nd = rec.node(name)
            out.append(event("node_lost", rec, f"{name} lost" + (f": {nd.error}" if nd and nd.error else ""),
                             node=name, reason=nd.error if nd else None))
        if a is not None and new.prepared and not old.prepared and a.prepared:
            out.append(event("spare_prepared", rec, f"{', '.join(a.prepared)} brought to the run's code "
                             f"in {a.prepare_s:.1f}s", nodes=list(a.prepared), seconds=a.prepare_s))
        if new.hang and new.hang != old.hang:
            out.append(event("hang", rec, new.hang, verdict=new.hang, snapshots=a.hang_dir if a else None))
        if new.straggler and new.straggler != old.straggler:
            out.append(event("straggler", rec, new.straggler, verdict=new.straggler))
        if a is not None and new.verdict and new.verdict != old.verdict and new.verdict not in NOT_FAILED:
            out.append(event("attempt_failed", rec, f"attempt {a.attempt} failed ({a.verdict}: {a.detail})",
                             cause=a.verdict, detail=a.detail, retry=a.retry, bad_nodes=list(a.bad_nodes)))
        if new.state is RunState.RUNNING and old.state is not RunState.RUNNING and a is not None:
            out.append(event("running", rec, f"attempt {a.attempt} running on {', '.join(a.nodes)}",
                             nodes=list(a.nodes), world_size=rec.world_size))
        if new.state.terminal and not old.state.terminal:
            out.append(event(new.state.value, rec, f"run {new.state.value}" + (f": {rec.summary}" if rec.summary
                                                                              else ""),
                             exit_code=rec.exit_code, summary=rec.summary, attempts=len(rec.attempts),
                             error=rec.error))
        return out

    def told(self, rec: RunRecord, line: dict) -> list[dict]:
        """A story line that says what it is about (Book.tell's data) is an event of that kind."""
        kind = line.get("event")
        if kind not in KINDS:
            return []
        data = {k: v for k, v in line.items() if k not in ("event", "at", "text")}
        return [event(kind, rec, str(line.get("text", "")), **data)]

    def sink(self, rec: RunRecord, line: dict | None) -> list[dict]:
        return self.changed(rec) if line is None else self.told(rec, line)


def dumps(doc: dict) -> bytes:
    """An event's bytes as sent (the signature is over exactly these)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

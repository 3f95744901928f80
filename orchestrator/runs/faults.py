"""When each attempt's fault happened and when clusterctl declared it, read from the run's record and
its story (runs/RUN/story.jsonl): the times the goodput ledger (runs/goodput.py) splits a fault's
cost by. Pure: the story's lines and the record in, typed times out.

A fault is an attempt that ended in anything but `finished` or `stopped`. Its time `at`, by the
best evidence the run kept:
- node lost: when the node was last heard: the story's `X lost: no answer for 4.8s` line (data
  `lost`, `silent_s`) or its `X: silent for 3.8s` line, minus the silence it measured; or the
  attempt's last progress, where that came later (a job that still stepped still had the node);
- hang: when the attempt last made progress (its step journal, runs/stepjournal.py), else the hang
  watch's `no rank wrote a line for 30s` line minus those seconds;
- an exit (script error, a signal, a peer's failure), a straggler left out, a supervisor that died:
  when the supervisor saw it (`failed_at`): the nodes' streams carry an exit as it happens.
It is `declared` at the hang verdict's line for a hang, at the `X lost` line for a lost node (or
the first failure, `failed_at`, if earlier), else at `failed_at` (else the attempt's end).

Stragglers (`straggler_spans`): from each `straggler: node3 ranks 2,3 compute 2.6x the median
(480 ms vs 185 ms over the last 50 steps)` line until its `no longer computes slower` line (or the
attempt's end), the excess compute per step of the slowest rank named: in a synchronous job every
rank waits for it, so each step takes that much longer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from orchestrator.runs.record import STORY
from orchestrator.runs.runrecord import AttemptRecord

NO_FAULT = (None, "finished", "stopped")
LOST = "node lost"
HANG = "hang"
LOST_LINE = re.compile(r"^(\S+) lost: no answer for ([\d.]+)s")
SILENT_LINE = re.compile(r"^(\S+): silent for ([\d.]+)s")
QUIET_LINE = re.compile(r"^no rank wrote a line for ([\d.]+)s")
# runs/judge/straggler.py describe(): one part per node
SLOW_PART = re.compile(r"(\S+) ranks? ([\d,]+) computes? [\d.]+x the median \(([\d.]+) ms vs ([\d.]+) ms over "
                       r"the last \d+ (steps|collectives)\)")
RECOVERED = re.compile(r"^straggler: (\S+) rank (\d+) no longer computes slower")


@dataclass(frozen=True)
class Fault:
    kind: str  # the attempt's verdict: node lost, hang, script error, killed by signal, ...
    at: float  # when it happened, by the best evidence kept (== declared when none says earlier)
    declared: float  # when clusterctl declared it
    evidence: str  # where `at` comes from, in words


@dataclass(frozen=True)
class SlowSpan:
    """A stretch of an attempt during which a straggler slowed every step by `excess_s`."""

    start: float
    end: float
    excess_s: float  # seconds per unit (a step, or a collective) the slowest straggler adds
    unit: str  # "steps" | "collectives"


def story_lines(run_dir: Path) -> list[dict]:
    """The story's lines as written (whole lines; unreadable ones left out), oldest first."""
    try:
        raw = (run_dir / STORY).read_bytes()
    except OSError:
        return []
    out = []
    for line in raw[:raw.rfind(b"\n") + 1].splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and isinstance(d.get("at"), (int, float)):
            out.append(d)
    return out


def _within(lines: list[dict], t0: float, t1: float) -> list[dict]:
    return [d for d in lines if t0 <= d["at"] <= t1]


def _lost_evidence(d: dict, nodes: set[str]) -> tuple[float, float | None] | None:
    """(last heard, declared) from a story line about one of `nodes`: a loss declares, a silence only
    says when the node was last heard."""
    text = str(d.get("text", ""))
    if isinstance(d.get("lost"), str) and isinstance(d.get("silent_s"), (int, float)):
        return (d["at"] - d["silent_s"], d["at"]) if d["lost"] in nodes else None
    if d.get("event") == "node_silent" and isinstance(d.get("silent_s"), (int, float)):
        return (d["at"] - d["silent_s"], None) if d.get("node") in nodes else None
    m = LOST_LINE.match(text)  # a story written before the lines carried their data
    if m and m.group(1) in nodes:
        return d["at"] - float(m.group(2)), d["at"]
    return None


def fault_of(a: AttemptRecord, lines: list[dict], progress: list[tuple[float, int]]) -> Fault | None:
    """The fault that ended attempt `a` (None: it finished, was stopped, or still runs).
    `progress`: the attempt's step journal, (time, value) oldest first."""
    if a.verdict in NO_FAULT:
        return None
    end = a.ended or a.failed_at or a.launched or a.started
    declared = a.failed_at or end
    mine = _within(lines, a.launched or a.started, end + 1.0)
    if a.verdict == LOST:
        return _lost(a, mine, progress, declared)
    if a.verdict == HANG:
        verdict = [d["at"] for d in mine if a.hang and d.get("text") == a.hang]
        declared = min(verdict) if verdict else declared
        moved = [t for t, _ in progress if t <= declared]
        if moved:
            return Fault(a.verdict, moved[-1], declared, "the attempt's last progress (its step journal)")
        quiet = [d["at"] - float(m.group(1)) for d in mine if d["at"] <= declared
                 and (m := QUIET_LINE.match(str(d.get("text", ""))))]
        if quiet:
            return Fault(a.verdict, min(quiet), declared, "the hang watch's silence")
        return Fault(a.verdict, declared, declared, "declared (no progress recorded)")
    return Fault(a.verdict or "?", declared, declared, "when the supervisor saw it")


def _lost(a: AttemptRecord, mine: list[dict], progress: list[tuple[float, int]], declared: float) -> Fault:
    """A lost node's fault: when it was last heard (its loss's line, else its last silence), or
    the attempt's last progress if that came later: a synchronous job that still stepped still had
    the node (the SSH channel's silence is measured from its last keepalive)."""
    found = [e for d in mine if (e := _lost_evidence(d, set(a.bad_nodes) or set(a.nodes))) is not None]
    losses = [(heard, said) for heard, said in found if said is not None]
    if losses:
        heard, said = min(losses, key=lambda e: e[1])
        declared, why = min(declared, said), "when the node was last heard (its loss)"
    elif silences := [h for h, said in found if h <= declared]:
        heard, why = max(silences), "when the node was last heard (its silence)"
    else:
        heard, why = declared, "declared (no silence measured)"
    moved = [t for t, _ in progress if heard < t <= declared]
    if moved:
        return Fault(a.verdict or LOST, moved[-1], declared, "the attempt's last progress, after the node was last heard")
    return Fault(a.verdict or LOST, min(heard, declared), declared, why)


def straggler_spans(lines: list[dict], t0: float, t1: float) -> list[SlowSpan]:
    """The stretches of [t0, t1] that a named straggler slowed, from the story's straggler lines."""
    active: dict[tuple[str, int], tuple[float, str]] = {}  # (node, rank) -> (excess per unit, unit)
    out: list[SlowSpan] = []
    since = t0

    def close(until: float) -> None:
        if active and until > since:
            excess, unit = max(active.values())
            out.append(SlowSpan(since, until, excess, unit))

    for d in lines:
        if not t0 <= d["at"] <= t1:
            continue
        text = str(d.get("text", ""))
        if not text.startswith("straggler: "):
            continue
        close(d["at"])
        since = d["at"]
        if (m := RECOVERED.match(text)) is not None:
            active.pop((m.group(1), int(m.group(2))), None)
            continue
        for m in SLOW_PART.finditer(text):
            excess = max(0.0, (float(m.group(3)) - float(m.group(4))) / 1e3)
            for r in m.group(2).split(","):
                active[(m.group(1), int(r))] = (excess, m.group(5))
    close(t1)
    return out

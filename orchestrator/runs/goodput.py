"""The goodput ledger of a run: its wall time split into productive time and badput by cause, per
attempt and in total, and, while it runs, when it will reach its target step. Pure: `ledger(Facts)`
from what the run recorded (run.json's attempts, the story's times, each attempt's step journal),
`of_run(run)` reads those.

The wall time runs from `train` (a run that queued for its nodes: from its first attempt) to the
run's end (a live run: now). Every second of it is in exactly one category; per attempt, on this
machine's clock:

    [previous fault declared | train] ─ launch ─ first step ─────────── fault ── declared
     restore (startup, attempt 1)       startup   computing               detection (or hang)

- startup: from `train` to attempt 1's launch, and from each launch to the attempt's first
  progress (a step its rank 0 logged, else one its hooks told; else a collective entered);
- restore: from a fault's declaration to the next attempt's launch (stopping the failed attempt,
  bringing a spare to the code, restoring the checkpoint, preflight, launch, and any relaunch that
  failed its preflight on the way);
- detection: from the fault (runs/faults.py says when, and by what evidence) to its declaration;
- hang: the same for a hang: from the attempt's last progress to the hang verdict;
- computing, from the first progress to the fault (to the last progress for an attempt that
  ended well, to now for a live one), is productive but for
  - checkpoint: the stalls the job's log says its checkpoint saves took (runs/stepjournal.py);
  - straggler: while a straggler is named, each step's excess compute (runs/faults.py) times the
    steps done meanwhile;
  - recompute: the steps the next attempt redid: the step reached at the fault (the attempt's
    highest) less the step the next attempt starts at (the checkpoint it restored; else one
    before the first step its log names), times the attempt's seconds per step (the median over
    its journal's intervals), taken from the attempt that computed them (from earlier ones when
    the next attempt went back further than this one's start);
- other: what none of these explains: after the last progress of an attempt that ended well (a
  final evaluation, the last save, the processes' exit), after the run's last fault, and whatever
  the clamping of disordered times left over (never negative).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.probe import common
from orchestrator.runs import stepjournal
from orchestrator.runs.faults import Fault, fault_of, story_lines, straggler_spans
from orchestrator.runs.runrecord import AttemptRecord, RunRecord
from orchestrator.runs.spec import RunSpec
from orchestrator.runs.stepjournal import Steps, seconds_per_step, value_at
from orchestrator.runs.store import Run, read_json

CATEGORIES = ("startup", "checkpoint", "detection", "restore", "recompute", "hang", "straggler", "other")
TARGET_FLAGS = re.compile(r"^--?(?:max[-_]steps|max[-_]iters|total[-_]steps|num[-_]steps|max[-_]step)(?:=(\d+))?$")
ABOUT_STEP = re.compile(r"\bstep (\d+)\b")
PACE_INTERVALS = 20  # the newest journal intervals a live ETA's pace is taken over
STALL_GRACE_S = 60.0  # a live attempt this long without progress stops counting as computing


@dataclass
class Facts:
    """What the ledger is computed from."""

    rec: RunRecord
    story: list[dict] = field(default_factory=list)
    steps: dict[int, Steps] = field(default_factory=dict)  # attempt -> its step journal
    target: int | None = None  # the job's last step, from its arguments
    now: float = 0.0


@dataclass
class Share:
    """One attempt's part of the wall time."""

    attempt: int
    nodes: list[str]
    verdict: str | None
    launched: float | None
    wall_s: float = 0.0
    productive_s: float = 0.0
    computing_s: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    first_step_at: float | None = None
    fault: Fault | None = None
    start_step: int | None = None
    reached_step: int | None = None
    step_s: float | None = None

    def add(self, category: str, seconds: float) -> None:
        self.wall_s += seconds
        if category == "computing":
            self.computing_s += seconds
            self.productive_s += seconds
        else:
            self.badput[category] += seconds

    def carve(self, category: str, seconds: float) -> float:
        """Move up to `seconds` of productive time to `category`; how much was moved."""
        moved = max(0.0, min(seconds, self.productive_s))
        self.productive_s -= moved
        self.badput[category] += moved
        return moved

    def to_json(self) -> dict:
        f = self.fault
        return {"attempt": self.attempt, "nodes": self.nodes, "verdict": self.verdict,
                "launched_at": _t(self.launched), "first_step_at": _t(self.first_step_at),
                "fault_at": _t(f.at) if f else None, "declared_at": _t(f.declared) if f else None,
                "fault_evidence": f.evidence if f else None,
                "start_step": self.start_step, "reached_step": self.reached_step,
                "step_s": None if self.step_s is None else round(self.step_s, 4),
                "wall_s": _s(self.wall_s), "productive_s": _s(self.productive_s),
                "badput": {f"{c}_s": _s(v) for c, v in self.badput.items()}}


def _t(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _s(x: float) -> float:
    return round(max(0.0, x), 2)


@dataclass
class Ledger:
    run_id: str
    state: str
    start: float
    end: float
    live: bool
    shares: list[Share]
    step: int | None = None  # the newest step
    target: int | None = None
    step_s: float | None = None  # the current pace (seconds per step)
    eta_s: float | None = None  # live: seconds to the target at the current pace
    notes: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def productive_s(self) -> float:
        return sum(s.productive_s for s in self.shares)

    @property
    def badput(self) -> dict[str, float]:
        return {c: sum(s.badput[c] for s in self.shares) for c in CATEGORIES}

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def largest(self, n: int = 3) -> list[tuple[str, float]]:
        """The largest badput causes, largest first (those under 0.05 s left out)."""
        return sorted(((c, v) for c, v in self.badput.items() if v >= 0.05), key=lambda p: -p[1])[:n]

    def to_json(self) -> dict:
        g = self.goodput
        return {"run_id": self.run_id, "state": self.state, "live": self.live, "started_at": _t(self.start),
                "until": _t(self.end), "wall_s": _s(self.wall_s), "productive_s": _s(self.productive_s),
                "badput": {f"{c}_s": _s(v) for c, v in self.badput.items()},
                "goodput": None if g is None else round(g, 4),
                "step": self.step, "target_step": self.target,
                "step_s": None if self.step_s is None else round(self.step_s, 4),
                "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
                "attempts": [s.to_json() for s in self.shares], "notes": self.notes}


# ---------------------------------------------------------------- where an attempt started
def checkpoint_step(a: AttemptRecord) -> int | None:
    """The step of the checkpoint attempt `a` started from: its name (ckpt_00000060.pt), else its
    description (a --checkpoint-dir snapshot's `..., step 30; 14 files`)."""
    if not a.checkpoint:
        return None
    step = common().checkpoint_step(a.checkpoint)
    if step is None and a.checkpoint_about and (m := ABOUT_STEP.search(a.checkpoint_about)):
        step = int(m.group(1))
    return step


def start_step(a: AttemptRecord, steps: Steps) -> int | None:
    """The step attempt `a` started at: the checkpoint it restored, unless its log starts lower (the
    job did not resume from it); else one before the first step its log names; else 0 when it
    restored nothing; None: not known yet."""
    ck = checkpoint_step(a)
    first = steps.points[0][1] if steps.points else None
    if ck is not None and (first is None or first >= ck):
        return ck
    if first is not None:
        return max(0, first - 1)
    return 0 if a.checkpoint is None else None


# ---------------------------------------------------------------- the timeline
class _Cursor:
    """Walks the wall time forward, giving each stretch to one category of one attempt."""

    def __init__(self, at: float, end: float):
        self.at, self.end = at, end

    def to(self, sh: Share, category: str, t: float | None) -> None:
        t = min(max(self.at if t is None else t, self.at), self.end)
        sh.add(category, t - self.at)
        self.at = t


def _attempt(sh: Share, a: AttemptRecord, steps: Steps, f: Facts, cur: _Cursor, faulted: bool, last: bool,
             notes: list[str]) -> None:
    """Attempt `a`'s stretch of the wall time, from the cursor (its start) to its fault's
    declaration (or, the last attempt, the run's end)."""
    before = "restore" if faulted else "startup"
    if not a.launched:  # its preflight failed (or it has not launched yet): on the way to a launch
        cur.to(sh, before, cur.end if last else a.ended)
        return
    cur.to(sh, before, a.launched)
    prog = steps.progress
    journaled = a.attempt in f.steps  # its file exists: no progress in it means none was made
    sh.fault = fault_of(a, f.story, prog)
    if sh.fault is not None:
        q = sh.fault.at
    elif a.ended is None:  # live: computing until now, unless it has not moved for a while
        q = cur.end
        quiet = cur.end - prog[-1][0] if prog else 0.0
        if prog and quiet > max(STALL_GRACE_S, 2 * stepjournal.MIN_SPACING_S, 2 * (cur.end - prog[0][0]) / stepjournal.POINTS):
            q = prog[-1][0]
            notes.append(f"attempt {a.attempt}: no progress for {quiet:.0f}s: counted as other until a verdict says "
                         "why (or the job moves again)")
    else:
        q = prog[-1][0] if prog else a.ended
    if prog:
        sh.first_step_at = prog[0][0]
        cur.to(sh, "startup", sh.first_step_at)
    elif journaled and a.verdict != "finished":
        cur.to(sh, "startup", q)  # it never made progress (yet)
    elif journaled:
        notes.append(f"attempt {a.attempt}: no progress recorded (a script that says no step and whose hooks "
                     "did not answer): its time from launch counts as computing")
    else:
        notes.append(f"attempt {a.attempt}: no step journal (recorded by a clusterctl before it): its time from "
                     "launch counts as computing, and its steps, startup and recompute are not known")
    first = cur.at
    cur.to(sh, "computing", q)
    _split_computing(sh, steps, f, first, cur.at)
    if sh.fault is not None:
        cur.to(sh, "hang" if sh.fault.kind == "hang" else "detection", sh.fault.declared)
    sh.start_step = start_step(a, steps)
    if steps.points:  # at the fault: the steps done while it went undetected are in its detection
        sh.reached_step = int(value_at(steps.points, q)) if sh.fault is not None else max(v for _, v in steps.points)
    if last:
        live_recovery = f.rec.state.value == "recovering"
        cur.to(sh, "restore" if live_recovery and sh.fault is not None else "other", cur.end)
    elif sh.fault is None:
        cur.to(sh, "other", a.ended)


def _split_computing(sh: Share, steps: Steps, f: Facts, t0: float, t1: float) -> None:
    """Checkpoint stalls and straggler slowdown, out of the computing stretch [t0, t1]."""
    if t1 <= t0:
        return
    sh.step_s = seconds_per_step(steps.points, t0, t1)
    sh.carve("checkpoint", sum(s for t, s in steps.saves if t0 <= t <= t1))
    for span in straggler_spans(f.story, t0, t1):
        pts = steps.points if span.unit == "steps" else steps.collectives
        a, b = value_at(pts, span.start), value_at(pts, span.end)
        if a is not None and b is not None:
            sh.carve("straggler", min((b - a) * span.excess_s, span.end - span.start))


def _recompute(shares: list[Share], notes: list[str]) -> None:
    """Each fault's steps redone by the next attempt that launched, carved from the attempts that
    had computed them (the faulted one first, then earlier ones if the next went back further)."""
    kept = {i: sh.reached_step for i, sh in enumerate(shares)}  # the highest step still productive
    for i, sh in enumerate(shares):
        if sh.fault is None:
            continue
        nxt = next((n for n in shares[i + 1:] if n.launched), None)
        if nxt is None or nxt.start_step is None:
            continue
        if sh.reached_step is None:
            notes.append(f"attempt {sh.attempt}: the steps redone after its fault are not known (no step recorded)")
            continue
        back_to = nxt.start_step
        for k in range(i, -1, -1):
            done = shares[k]
            if kept[k] is None or done.start_step is None:
                continue
            lost = kept[k] - max(back_to, done.start_step)
            if lost > 0:
                done.carve("recompute", lost * _pace(done))
                kept[k] = max(back_to, done.start_step)
            if back_to >= done.start_step:
                break


def _pace(sh: Share) -> float:
    """Seconds per step of an attempt: its journal's median, else its computing over its steps."""
    if sh.step_s is not None:
        return sh.step_s
    done = (sh.reached_step or 0) - (sh.start_step or 0)
    return sh.computing_s / done if done > 0 else 0.0


def ledger(f: Facts) -> Ledger:
    """The run's ledger from its facts (see the module's docstring for each category)."""
    rec = f.rec
    live = not rec.state.terminal
    first = rec.attempts[0] if rec.attempts else None
    start = (first.started if rec.queued_at and first is not None and first.started else rec.created) or f.now
    end = max(start, f.now if live else rec.ended or _latest(rec))
    lg = Ledger(rec.id, rec.state.value, start, end, live, [])
    cur = _Cursor(start, end)
    faulted = False
    for i, a in enumerate(rec.attempts):
        sh = Share(a.attempt, list(a.nodes), a.verdict, a.launched)
        _attempt(sh, a, f.steps.get(a.attempt, Steps()), f, cur, faulted, i == len(rec.attempts) - 1, lg.notes)
        faulted = faulted or sh.fault is not None
        lg.shares.append(sh)
    if not lg.shares:  # connecting, queued, or ended before its first attempt
        lg.shares.append(Share(0, [], None, None))
        cur.to(lg.shares[0], "startup" if live else "other", end)
    _recompute(lg.shares, lg.notes)
    _progress(lg, f)
    return lg


def _latest(rec: RunRecord) -> float:
    """The last time an ended run's record names, where it lacks its end (written by an older
    clusterctl, or by hand)."""
    times = [t for a in rec.attempts for t in (a.started, a.launched, a.failed_at, a.ended) if t]
    return max([rec.created or 0.0, *times])


def _progress(lg: Ledger, f: Facts) -> None:
    """The newest step, the target, the pace now and (live) the ETA."""
    journals = [(sh, f.steps.get(sh.attempt, Steps())) for sh in lg.shares]
    totals = [s.total for _, s in journals if s.total]
    lg.target = f.target or (totals[-1] if totals else None)
    for sh, s in reversed(journals):
        if s.points:
            lg.step = s.points[-1][1]
            break
        if sh.start_step is not None and sh.launched:
            lg.step = sh.start_step
            break
    sh, s = journals[-1]
    lg.step_s = seconds_per_step(s.points, 0.0, lg.end, PACE_INTERVALS) or next(
        (x.step_s for x in reversed(lg.shares) if x.step_s is not None), None)
    if lg.live and lg.target is not None and lg.step is not None and lg.step_s is not None:
        lg.eta_s = max(0, lg.target - lg.step) * lg.step_s


# ---------------------------------------------------------------- a run's ledger
def target_in(args: list[str]) -> int | None:
    """The job's last step from its arguments: --max-steps N, --max_steps=N, --max_iters=N, ..."""
    for i, word in enumerate(args):
        m = TARGET_FLAGS.match(word)
        if m is None:
            continue
        value = m.group(1) or (args[i + 1] if i + 1 < len(args) else "")
        if value.isdigit():
            return int(value)
    return None


def target_of(run_dir: Path) -> int | None:
    """The job's last step from the run's arguments (spec.json; the inventory's train.args when
    the command line gave none)."""
    from orchestrator.errors import ClusterctlError

    spec = RunSpec.from_json(read_json(run_dir / "spec.json"))
    args = list(spec.args)
    if not args and spec.inventory_text is not None:
        try:
            args = list(spec.load_inventory().train.args)
        except (ClusterctlError, OSError, ValueError):
            args = []
    return target_in(args)


def of_dir(run_dir: Path, now: float | None = None, target: int | None = None) -> Ledger:
    """The ledger of the run recorded in `run_dir`, now. `target`: the job's last step, when the
    caller knows it (else read from the run's arguments)."""
    rec = RunRecord.from_json(read_json(run_dir / "run.json"), run_dir.name)
    return ledger(Facts(rec, story_lines(run_dir), stepjournal.read(run_dir),
                        target if target is not None else target_of(run_dir), time.time() if now is None else now))


def of_run(run: Run, now: float | None = None) -> Ledger:
    return of_dir(run.dir, now)

"""Each attempt's progress with the time it reached this machine: runs/RUN/progress/steps-aK.jsonl,
the clock of the goodput ledger (runs/goodput.py).

Nothing else in a run's record says *when* a step happened: the log copies keep every byte but no
time, and the progress files (runs/progresslog.py) keep only the newest step. So the supervisor
notes, as they arrive, rank 0's lines (runs/logs/copier.py hands each line the rank files' splitter
takes, runs/logs/rankfiles.py) and the steps the ranks' hooks report (runs/progresslog.py), one JSON
object a line, on this machine's clock (the clock of the story and the record):

    {"at": T, "step": N}                  rank 0's log says step N (runs/progress.py `parse`)
    {"at": T, "step": N, "from": "hook"}  the slowest rank's step told to clusterctl_step
    {"at": T, "c": N}                     the fewest collectives any rank entered (its Flight
                                          Recorder), for a script that says no step at all
    {"at": T, "save_s": X}                a line that says how long saving a checkpoint stalled
                                          the job (`saved checkpoint ckpt_40.pt in 0.21 s`)
    {"at": T, "total": M}                 the log's target (`step 45/1000`, a tqdm bar's 45/1000)

A step line every few milliseconds must not grow the file without bound: a point is written when
`spacing` has passed since the last one written (MIN_SPACING_S, growing with the attempt's age so
an attempt keeps about POINTS points per e-fold of its length), and the newest step that was not
written is kept back and written before a point that follows a pause longer than the spacing, and
when the attempt's log copy closes, so both edges of every stall, and the step reached at the end,
are in the file at their own times.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.runs.progress import parse

DIR = "progress"
MIN_SPACING_S = 2.0
POINTS = 5000
# `saved checkpoint ckpt_40.pt in 0.21 s`, `checkpoint 40 saved: stall 12 ms`, `Saving ckpt took 3.2s`
SAVE_WORD = re.compile(r"\b(?:sav(?:e|ed|ing)|wr(?:ote|itten|iting))\b", re.IGNORECASE)
CKPT_WORD = re.compile(r"\b(?:checkpoint|ckpt)", re.IGNORECASE)
STALL = re.compile(r"\bstall(?:ed)?\b\D{0,12}?(\d+(?:\.\d+)?)\s*(ms|s|sec|seconds)\b", re.IGNORECASE)
DURATION = re.compile(r"\b(?:in|took|after)\s*:?\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|seconds)\b", re.IGNORECASE)
TOTAL = re.compile(r"\b(?:step|iter(?:ation)?)\s*[:=#]?\s*\d+\s*/\s*(\d+)\b|(?:^|\s|\|)\d+/(\d+)\s*\[\d+:\d\d",
                   re.IGNORECASE)
# Every rank-0 line is looked at: these cheap tests, which each form above needs to match, spare the
# slow searches on the lines that cannot (bench/bench_stepjournal.py: 5.6x the splitting's CPU without).
SLASH_DIGIT = re.compile(r"/\s*\d")
ATTEMPT_KEY = re.compile(r"\.a(\d+)$")  # runs/controller.py names attempt k's key RUN.ak (attempt 1: RUN)


def path(run_dir: Path, attempt: int) -> Path:
    return run_dir / DIR / f"steps-a{attempt}.jsonl"


def attempt_of(key: str) -> int:
    """The attempt an attempt's key names."""
    m = ATTEMPT_KEY.search(key)
    return int(m.group(1)) if m else 1


def save_seconds(line: str) -> float | None:
    """How long a line says saving a checkpoint stalled the job: its `stall` figure, else the
    duration it took; None for any other line (`startup 9 s: ..., checkpoint 0.06 s` loads one)."""
    low = line.lower()
    if "ckpt" not in low and "checkpoint" not in low:
        return None
    if not (SAVE_WORD.search(line) and CKPT_WORD.search(line)):
        return None
    m = STALL.search(line) or DURATION.search(line)
    if m is None:
        return None
    x = float(m.group(1))
    return x / 1e3 if m.group(2).lower() == "ms" else x


def total_of(line: str) -> int | None:
    """The target a progress line carries (`step 45/1000`, a tqdm bar `45/1000 [00:10<...]`)."""
    m = TOTAL.search(line) if SLASH_DIGIT.search(line) else None
    if m is None:
        return None
    return int(m.group(1) or m.group(2))


class _Thinned:
    """One kind of point (the log's steps, the hooks' steps, collectives), written thinned."""

    def __init__(self, write, key: str, extra: dict | None = None):
        self.write, self.key, self.extra = write, key, extra or {}
        self.first: float | None = None
        self.last_at: float | None = None  # the newest point written
        self.last_value: int | None = None
        self.held: tuple[float, int] | None = None  # the newest value not written

    def spacing(self, now: float) -> float:
        return max(MIN_SPACING_S, (now - self.first) / POINTS) if self.first is not None else 0.0

    def note(self, value: int, now: float) -> None:
        if value == self.last_value and self.held is None:
            return
        if self.held is not None and value == self.held[1]:
            return
        if self.first is None or now - self.last_at >= self.spacing(now):
            if self.held is not None and now - self.held[0] >= self.spacing(now):
                self._put(*self.held)  # the edge before a pause, at its own time
            self._put(now, value)
            self.first = self.first if self.first is not None else now
        else:
            self.held = (now, value)

    def _put(self, at: float, value: int) -> None:
        self.write({"at": round(at, 3), self.key: value, **self.extra})
        self.last_at, self.last_value, self.held = at, value, None

    def flush(self) -> None:
        if self.held is not None:
            self._put(*self.held)


class StepJournal:
    """The writer of one attempt's file (the log copy's and the progress log's, each its own)."""

    def __init__(self, run_dir: Path, attempt: int):
        self.file = path(run_dir, attempt)
        self.log = _Thinned(self._write, "step")
        self.hooked = _Thinned(self._write, "step", {"from": "hook"})
        self.collectives = _Thinned(self._write, "c")
        self.total: int | None = None
        self.broken = False
        self._write(None)  # the file says the attempt was journaled, steps or none

    def _write(self, doc: dict | None) -> None:
        if self.broken:
            return
        try:
            self.file.parent.mkdir(exist_ok=True)
            fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                if doc is not None:
                    os.write(fd, (json.dumps(doc) + "\n").encode())  # one write: lines never tear
            finally:
                os.close(fd)
        except OSError:  # the ledger goes without; the run goes on
            self.broken = True

    def line(self, text: str, now: float | None = None) -> None:
        """One of rank 0's lines, as it arrived."""
        now = time.time() if now is None else now
        p = parse(text)
        if p is not None and p.step is not None:
            self.log.note(p.step, now)
            total = total_of(text)
            if total is not None and total != self.total and total >= p.step:
                self.total = total
                self._write({"at": round(now, 3), "total": total})
        saved = save_seconds(text)
        if saved is not None:
            self._write({"at": round(now, 3), "save_s": saved})

    def rank_line(self, rank: int, raw: bytes) -> None:
        """A rank's line from the rank files' splitter: rank 0's are noted."""
        if rank == 0:
            self.line(raw.decode(errors="replace").rstrip("\n"))

    def hook(self, step: int | None, collectives: int | None, now: float | None = None) -> None:
        """The slowest rank's step (or collectives) by the ranks' hooks now."""
        now = time.time() if now is None else now
        if step is not None:
            self.hooked.note(step, now)
        elif collectives is not None:
            self.collectives.note(collectives, now)

    def close(self) -> None:
        for kind in (self.log, self.hooked, self.collectives):
            kind.flush()


@dataclass
class Steps:
    """One attempt's journal, read back: (time, value) points oldest first."""

    log: list[tuple[float, int]] = field(default_factory=list)
    hook: list[tuple[float, int]] = field(default_factory=list)
    collectives: list[tuple[float, int]] = field(default_factory=list)
    saves: list[tuple[float, float]] = field(default_factory=list)
    total: int | None = None

    @property
    def points(self) -> list[tuple[float, int]]:
        """The job's steps: its log's where it says any, else its hooks'."""
        return self.log or self.hook

    @property
    def progress(self) -> list[tuple[float, int]]:
        """Any progress at all (steps, else collectives): when the attempt first and last moved."""
        return self.points or self.collectives


def read(run_dir: Path) -> dict[int, Steps]:
    """Every attempt's journal in the run directory (a torn last line is left out)."""
    out: dict[int, Steps] = {}
    for p in sorted((run_dir / DIR).glob("steps-a*.jsonl")):
        digits = p.name[len("steps-a"):-len(".jsonl")]
        if not digits.isdigit():
            continue
        out[int(digits)] = _read_one(p)
    return out


def progressed(run_dir: Path) -> bool:
    """Whether any attempt of the run made progress (a step, else a collective): its start is over."""
    return any(s.progress for s in read(run_dir).values())


def _read_one(p: Path) -> Steps:
    s = Steps()
    try:
        text = p.read_text(errors="replace")
    except OSError:
        return s
    for raw in text.splitlines():
        try:
            d = json.loads(raw)
            at = float(d["at"])
        except (ValueError, KeyError, TypeError):
            continue
        if "step" in d and isinstance(d["step"], int):
            (s.hook if d.get("from") == "hook" else s.log).append((at, d["step"]))
        elif isinstance(d.get("c"), int):
            s.collectives.append((at, d["c"]))
        elif isinstance(d.get("save_s"), (int, float)):
            s.saves.append((at, float(d["save_s"])))
        elif isinstance(d.get("total"), int):
            s.total = d["total"]
    for pts in (s.log, s.hook, s.collectives):
        pts.sort()
    return s


# ---------------------------------------------------------------- the job's pace
def seconds_per_step(points: list[tuple[float, int]], t0: float, t1: float, newest: int = 0) -> float | None:
    """The median over the journal's intervals within [t0, t1] of seconds per step (the newest
    `newest` intervals only, when given): a save or an evaluation inside one interval does not move it."""
    pts = [(t, s) for t, s in points if t0 <= t <= t1]
    rates = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(pts, pts[1:]) if b[1] > a[1]]
    if newest:
        rates = rates[-newest:]
    return statistics.median(rates) if rates else None


def value_at(points: list[tuple[float, int]], t: float) -> float | None:
    """The progress at time `t`, linear between the journal's points (held before and after them)."""
    if not points:
        return None
    if t <= points[0][0]:
        return float(points[0][1])
    for (ta, va), (tb, vb) in zip(points, points[1:]):
        if ta <= t <= tb:
            return va + (vb - va) * ((t - ta) / (tb - ta) if tb > ta else 1.0)
    return float(points[-1][1])

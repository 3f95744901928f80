"""What `clusterctl watch` shows, read from this machine alone: the run record and the per-rank
log files (runs/RUN/ranks/rankN.log), never a node, so a frozen node cannot freeze the view.

Each rank's file is read from where the last look ended (a file cut back by an adopting
supervisor is read again from its start). Its lines give the step in any common form
(runs/progress.py: `step 40 | loss ...`, `step=45`, `iter 45`, a tqdm or Lightning bar, the HF
Trainer's log dicts), the step time where the log says (`step 977 ms`, else measured from how
fast the step number moved here) and tokens/s (`tok/s 1,234`, `tokens/s`); the file's
modification time is when the rank was last heard. A rank whose log says no step has the
progress its hook reported (runs/progresslog.py: the steps the script told clusterctl_step,
else the collectives it entered, shown `c812`), which every rank of a distributed job has. A row
is one node (its ranks together) or one rank.

Flags:
- `stall Ns`: a running rank's progress (its step, or its collectives) has not moved for longer
  than the run's hang timeout (60 s when the hang watch is off): what the hang watch is about to
  look at, or has;
- `HANG why`: the hang watch's verdict (runs/RUN/hangs/N/verdict.json) names the rank;
- `slow 2.6x`: the straggler watch names it (the attempt's `straggler` line, runs/judge/straggler.py).
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from orchestrator.runs import progresslog
from orchestrator.runs.progress import Progress, parse
from orchestrator.runs.progresslog import RankProgress
from orchestrator.runs.logs.fold import rank_label
from orchestrator.runs.logs.rankfiles import rank_file
from orchestrator.runs.logs.screen import job_text
from orchestrator.runs.runrecord import AttemptRecord
from orchestrator.runs.spec import NodeState, NodeStatus

STEP_MS = re.compile(r"\bstep ([\d.]+) ?ms\b")
TOKENS = re.compile(r"\b(?:tok/s|tokens/s)[ :=]+([\d,.]+)")
# runs/judge/straggler.py describe(): "straggler: node3 ranks 2,3 compute 2.6x the median (...)"
SLOW = re.compile(r"(\S+) ranks? ([\d,]+) computes? ([\d.]+)x the median")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a terminal's cursor and colour codes (tqdm's nested bars)
COLLECTIVES_NOTE = "cN: collectives the rank entered (its Flight Recorder), where its log says no step"
STALL_OFF_S = 60.0  # a silent rank's flag when the hang watch is off
KEEP_LINES = 8  # a rank's last lines, for its detail
READ_MAX = 1 << 20  # at most this much of a file per look (the rest on the next)


@dataclass
class RankTail:
    """One rank's file, read as it grows: newest step (or epoch), its timing and the last lines."""

    path: Path
    at: int = 0
    step: int | None = None
    epoch: float | None = None  # where the log says only an epoch (the HF Trainer's log dicts)
    step_s: float | None = None  # from the log's own figure
    tokens_s: float | None = None
    heard: float | None = None  # the file's mtime
    moved: float | None = None  # the file's mtime when the step (or epoch) last changed
    lines: deque = field(default_factory=lambda: deque(maxlen=KEEP_LINES))
    seen: deque = field(default_factory=lambda: deque(maxlen=20))  # (time here, step) as it moved
    partial: bytes = b""

    def read(self, now: float) -> None:
        try:
            st = self.path.stat()
        except OSError:
            return
        self.heard = st.st_mtime
        if st.st_size < self.at:  # cut back (a supervisor took the run over): read it again
            self.at, self.partial = 0, b""
        if st.st_size == self.at:
            return
        with open(self.path, "rb") as f:
            f.seek(self.at)
            data = self.partial + f.read(READ_MAX)
            self.at = f.tell()
        cut = data.rfind(b"\n") + 1
        self.partial = data[cut:]
        for raw in data[:cut].splitlines():
            self.line(raw.decode(errors="replace").rstrip(), now)
        if b"\r" in self.partial:  # a progress bar updating in place: its newest whole update
            self.progress(parse(self.partial.decode(errors="replace")), now)

    def line(self, text: str, now: float) -> None:
        shown = job_text(ANSI.sub("", text.rsplit("\r", 1)[-1]))
        if not text.strip() or shown is None:
            return
        if shown.strip():
            self.lines.append(shown)
        self.progress(parse(text), now)
        if (ms := STEP_MS.search(text)) is not None:
            self.step_s = float(ms.group(1)) / 1e3
        if (tk := TOKENS.search(text)) is not None:
            try:
                self.tokens_s = float(tk.group(1).replace(",", ""))
            except ValueError:
                pass

    def progress(self, p: Progress | None, now: float) -> None:
        if p is None:
            return
        if p.step is not None and p.step != self.step:
            self.seen.append((now, p.step))
            self.step, self.moved = p.step, self.heard
        elif p.epoch is not None and p.epoch != self.epoch:
            self.epoch, self.moved = p.epoch, self.heard

    @property
    def seconds_per_step(self) -> float | None:
        """The log's own step time, else how fast the step number moved while watched."""
        if self.step_s is not None:
            return self.step_s
        if len(self.seen) >= 2 and self.seen[-1][1] > self.seen[0][1] and self.seen[-1][0] > self.seen[0][0]:
            return (self.seen[-1][0] - self.seen[0][0]) / (self.seen[-1][1] - self.seen[0][1])
        return None


@dataclass(frozen=True)
class Row:
    """One line of the view: a node or a rank."""

    name: str
    state: str
    step: int | None  # the job's step: its log's, else what it told its hook
    step_s: float | None
    tokens_s: float | None
    heard_s: float | None  # seconds since the last line
    flags: tuple[str, ...] = ()
    epoch: float | None = None  # where the log says only an epoch
    collectives: int | None = None  # where neither says a step: the collectives entered

    @property
    def progress(self) -> str:
        """The step column: `345`, `ep 0.3` (an epoch only), `c812` (collectives only), `-`."""
        if self.step is not None:
            return str(self.step)
        if self.epoch is not None:
            return f"ep {self.epoch:g}"
        return f"c{self.collectives}" if self.collectives is not None else "-"


def hang_culprits(run_dir: Path, hang_dir: str | None) -> dict[int, str]:
    """rank -> why, from the attempt's hang verdict (runs/judge/hang.py HangVerdict.to_json)."""
    if not hang_dir:
        return {}
    try:
        doc = json.loads((run_dir / hang_dir / "verdict.json").read_text())
    except (OSError, ValueError):
        return {}
    return {int(c["rank"]): str(c.get("why") or "") for c in doc.get("culprits") or [] if str(c.get("rank")).isdigit()}


def slow_ranks(line: str | None) -> dict[int, float]:
    """rank -> how many times the median it computes, from the attempt's straggler line."""
    out: dict[int, float] = {}
    for m in SLOW.finditer(line or ""):
        for r in m.group(2).split(","):
            out[int(r)] = float(m.group(3))
    return out


def _hang_word(why: str) -> str:
    for word in ("stopped", "uninterruptible", "no process", "never entered", "mismatch", "called"):
        if word in why:
            return {"never entered": "behind", "called": "mismatch", "no process": "gone"}.get(word, word)
    return "culprit"


class LiveView:
    """The rows of one run now: `look()` reads what changed, `rows(by_rank)` says it."""

    def __init__(self, run_dir: Path, hang_timeout: float):
        self.dir = run_dir
        self.stall_after = hang_timeout if hang_timeout > 0 else STALL_OFF_S
        self.tails: dict[int, RankTail] = {}
        self.hooked: dict[int, RankProgress] = {}  # what the ranks' hooks reported (runs/progresslog.py)
        self.nodes: list[NodeStatus] = []
        self.hang: dict[int, str] = {}
        self.slow: dict[int, float] = {}

    def ranks_of(self, nd: NodeStatus) -> range:
        if nd.first_rank is None:
            return range(0)
        return range(nd.first_rank, (nd.last_rank if nd.last_rank is not None else nd.first_rank) + 1)

    def look(self, nodes: list[NodeStatus], attempt: AttemptRecord | None, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.nodes = nodes
        for nd in nodes:
            for r in self.ranks_of(nd):
                self.tails.setdefault(r, RankTail(rank_file(self.dir, r))).read(now)
        self.hooked = progresslog.read(self.dir, attempt.key if attempt is not None else None)
        self.hang = hang_culprits(self.dir, attempt.hang_dir if attempt is not None else None)
        self.slow = slow_ranks(attempt.straggler if attempt is not None else None)

    def moved(self, rank: int) -> float | None:
        """When the rank's progress last moved (its log's step, its hook's step or collectives);
        None: it has shown none."""
        t, h = self.tails.get(rank), self.hooked.get(rank)
        found = [x for x in ((t.moved if t is not None else None), (h.moved if h is not None else None))
                 if x is not None]
        return max(found) if found else None

    def _flags(self, ranks: Iterable[int], now: float, running: bool) -> tuple[str, ...]:
        flags = []
        quiet = [now - m for r in ranks if running and (m := self.moved(r)) is not None and now - m > self.stall_after]
        if quiet:
            flags.append(f"stall {max(quiet):.0f}s")
        for r in ranks:
            if r in self.hang:
                flags.append(f"HANG r{r} {_hang_word(self.hang[r])}")
        slow = [(r, x) for r, x in self.slow.items() if r in ranks]
        if slow:
            r, x = max(slow, key=lambda p: p[1])
            flags.append(f"slow r{r} {x:.1f}x")
        return tuple(flags)

    def step_of(self, rank: int) -> int | None:
        """The rank's step: its log's, else the one it told its hook."""
        t, h = self.tails.get(rank), self.hooked.get(rank)
        if t is not None and t.step is not None:
            return t.step
        return h.step if h is not None else None

    def _row(self, name: str, state: str, ranks: list[int], now: float, running: bool) -> Row:
        tails = [t for r in ranks if (t := self.tails.get(r)) is not None]
        steps = [(s, r) for r in ranks if (s := self.step_of(r)) is not None]
        lead = self.tails.get(max(steps)[1]) if steps else None
        heard = max((t.heard for t in tails if t.heard is not None), default=None)
        epochs = [t.epoch for t in tails if t.epoch is not None]
        colls = [h.collectives for r in ranks if (h := self.hooked.get(r)) is not None and h.collectives is not None]
        return Row(name, state, max(steps)[0] if steps else None,
                   lead.seconds_per_step if lead is not None and lead.step is not None else None,
                   next((t.tokens_s for t in tails if t.tokens_s is not None), None),
                   None if heard is None else max(0.0, now - heard), self._flags(ranks, now, running),
                   epoch=max(epochs) if epochs and not steps else None,
                   collectives=max(colls) if colls and not steps and not epochs else None)

    def rows(self, by_rank: bool = False, state_of=str, now: float | None = None) -> list[Row]:
        """One row per node (its ranks together), or per rank (`node/rN`). `state_of(NodeState)`
        words a node's state."""
        now = time.time() if now is None else now
        out = []
        for nd in self.nodes:
            ranks = list(self.ranks_of(nd))
            running = nd.state is NodeState.RUNNING
            if not by_rank:
                out.append(self._row(nd.name, state_of(nd.state), ranks, now, running))
                continue
            out.extend(self._row(rank_label(nd.name, r), state_of(nd.state), [r], now, running) for r in ranks)
        return out

    def ranks_json(self, now: float | None = None) -> list[dict]:
        """Every rank's progress now, for `status --json`."""
        now = time.time() if now is None else now
        out = []
        for nd in self.nodes:
            for r in self.ranks_of(nd):
                row, t, h = self._row(nd.name, str(nd.state), [r], now, nd.state is NodeState.RUNNING), \
                    self.tails.get(r), self.hooked.get(r)
                moved = self.moved(r)
                out.append({"rank": r, "node": nd.name, "step": row.step, "epoch": row.epoch,
                            "collectives": h.collectives if h is not None else None,
                            "step_from": "log" if t is not None and t.step is not None else
                            "hook" if row.step is not None else None,
                            "progress": row.progress, "since_progress_s": None if moved is None else round(now - moved, 1),
                            "stall": any(f.startswith("stall") for f in row.flags),
                            "last_line": t.lines[-1] if t is not None and t.lines else ""})
        return out

    def last_lines(self, rank: int) -> list[str]:
        t = self.tails.get(rank)
        return list(t.lines) if t is not None else []

    def node_of(self, rank: int) -> str | None:
        return next((nd.name for nd in self.nodes if rank in self.ranks_of(nd)), None)

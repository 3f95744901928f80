"""What one run looks like now, read from its directory alone, incrementally: the facts the
exporter (metrics.py) and the report (report.py) turn into figures.

Cost stays flat however many runs are recorded: `RunView.refresh` stats run.json first, and a run
that has ended and was read to the end is not read again until its record changes (a `status`
that adopts it, say). A live run's rank files (runs/RUN/ranks/rankN.log) are read from where the
last look ended; the first look starts near a file's end (TAIL_BYTES), since only the newest
step, step time and tokens/s are wanted, so a week-old 10 GB log costs one short read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.probe import common
from orchestrator.runs import goodput, stepjournal
from orchestrator.runs.faults import story_lines
from orchestrator.runs.goodput import Ledger
from orchestrator.runs.liveview import RankTail, hang_culprits, slow_ranks
from orchestrator.runs.logs.rankfiles import rank_file
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.spec import NodeState, NodeStatus

TAIL_BYTES = 64 << 10  # a rank file seen for the first time is read from this far before its end
LOST = "node lost"  # runs/restart.py classify's cause for an attempt that lost nodes


class _Tail(RankTail):
    """A rank file's tail: the first read may start mid-line, and that line is dropped."""

    skip: bool = False

    def start_near_end(self) -> None:
        try:
            size = self.path.stat().st_size
        except OSError:
            return
        if size > TAIL_BYTES:
            self.at, self.skip = size - TAIL_BYTES, True

    def line(self, text: str, now: float) -> None:
        if self.skip:
            self.skip = False
            return
        super().line(text, now)

    def at_end(self) -> bool:
        try:
            return self.path.stat().st_size <= self.at
        except OSError:
            return True


@dataclass(frozen=True)
class RankFacts:
    rank: int
    node: str
    step: int | None
    step_s: float | None  # seconds per step: the log's own figure, else how fast the step moved
    tokens_s: float | None  # where the log says
    heard: float | None  # the rank file's mtime: its last line


@dataclass(frozen=True)
class Checkpoint:
    name: str
    step: int | None
    at: float  # when its copy on this machine was complete (mtime)


@dataclass(frozen=True)
class RunFacts:
    """One run as the exporter and the report see it."""

    id: str
    rec: RunRecord
    ranks: tuple[RankFacts, ...] = ()
    checkpoint: Checkpoint | None = None
    hang: dict[int, str] = field(default_factory=dict)  # rank -> why, the current attempt's hang verdict
    slow: dict[int, float] = field(default_factory=dict)  # rank -> times the median compute
    goodput: Ledger | None = None  # the run's goodput ledger (runs/goodput.py)

    @property
    def restarts(self) -> int:
        """Attempts begun after the first: each one a relaunch."""
        return max(0, len(self.rec.attempts) - 1)

    @property
    def lost_nodes(self) -> list[str]:
        """Every node this run lost: those an attempt's verdict left out as lost, and the current
        attempt's nodes lost now (before the verdict)."""
        lost = {n for a in self.rec.attempts if a.verdict == LOST for n in a.bad_nodes}
        lost |= {n.name for n in self.rec.nodes if n.state is NodeState.LOST}
        return sorted(lost)

    @property
    def hangs(self) -> int:
        return sum(1 for a in self.rec.attempts if a.hang)

    @property
    def lead(self) -> RankFacts | None:
        """The rank with the newest step (rank 0 on a tie): the run's step and pace."""
        stepped = [r for r in self.ranks if r.step is not None]
        return max(stepped, key=lambda r: (r.step, -r.rank)) if stepped else None


def ranks_of(nd: NodeStatus) -> range:
    if nd.first_rank is None:
        return range(0)
    return range(nd.first_rank, (nd.last_rank if nd.last_rank is not None else nd.first_rank) + 1)


def newest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest complete copy in runs/RUN/checkpoints: a checkpoint by its step (the trainer's
    names), a --checkpoint-dir snapshot by its record (snap-N.json, written once it is complete)."""
    d = run_dir / "checkpoints"
    best: Checkpoint | None = None
    try:
        entries = list(os.scandir(d))
    except OSError:
        return None
    names = {e.name for e in entries}
    for e in entries:
        step = common().checkpoint_step(e.name)
        snap = e.name.startswith("snap-") and e.name.endswith(".json") and e.name[:-5] in names
        if step is None and not snap:
            continue
        try:
            at = e.stat().st_mtime
        except OSError:
            continue
        c = Checkpoint(e.name[:-5] if snap else e.name, step, at)
        if best is None or (c.step or -1, c.at) > (best.step or -1, best.at):
            best = c
    return best


class RunView:
    """One run directory, read as it changes. `bytes_read` counts what its reads cost."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir
        self.sig: tuple[int, int] | None = None
        self.facts: RunFacts | None = None
        self.tails: dict[int, _Tail] = {}
        self.settled = False  # ended and read to the end: not read again while run.json is unchanged
        self.bytes_read = 0
        self.target: int | None = None  # the job's last step, from its arguments (read once)
        self.target_read = False

    def refresh(self, now: float) -> RunFacts | None:
        try:
            st = os.stat(self.dir / "run.json")
        except OSError:
            return None
        sig = (st.st_mtime_ns, st.st_size)
        if self.settled and sig == self.sig:
            return self.facts
        try:
            doc = json.loads((self.dir / "run.json").read_bytes())
        except (OSError, ValueError):
            return self.facts  # being replaced this instant (never torn: written by rename)
        self.bytes_read += st.st_size
        rec = RunRecord.from_json(doc, self.dir.name)
        ranks = self._ranks(rec, now)
        a = rec.current
        if not self.target_read:
            self.target, self.target_read = goodput.target_of(self.dir), True
        ledger = goodput.ledger(goodput.Facts(rec, story_lines(self.dir), stepjournal.read(self.dir), self.target, now))
        self.facts = RunFacts(self.dir.name, rec, ranks, newest_checkpoint(self.dir),
                              hang_culprits(self.dir, a.hang_dir if a else None), slow_ranks(a.straggler if a else None),
                              ledger)
        self.sig = sig
        self.settled = rec.state.terminal and all(t.at_end() for t in self.tails.values())
        return self.facts

    def _ranks(self, rec: RunRecord, now: float) -> tuple[RankFacts, ...]:
        out = []
        for nd in rec.nodes:
            for r in ranks_of(nd):
                t = self.tails.get(r)
                if t is None:
                    t = self.tails[r] = _Tail(rank_file(self.dir, r))
                    t.start_near_end()
                before = t.at
                t.read(now)
                self.bytes_read += max(0, t.at - before)
                out.append(RankFacts(r, nd.name, t.step, t.seconds_per_step, t.tokens_s, t.heard))
        return tuple(out)


class Home:
    """Every run under runs/ of a control home, each a RunView kept between looks."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = runs_dir
        self.views: dict[str, RunView] = {}
        self._gone_bytes = 0  # what views no longer here read: the total only grows

    def look(self, now: float) -> list[RunFacts]:
        try:
            names = sorted(e.name for e in os.scandir(self.runs_dir) if e.is_dir() and not e.name.startswith("."))
        except OSError:
            names = []
        for gone in set(self.views) - set(names):
            self._gone_bytes += self.views.pop(gone).bytes_read
        out = []
        for name in names:
            v = self.views.setdefault(name, RunView(self.runs_dir / name))
            f = v.refresh(now)
            if f is not None:
                out.append(f)
        return sorted(out, key=lambda f: (f.rec.created, f.id))

    @property
    def bytes_read(self) -> int:
        return self._gone_bytes + sum(v.bytes_read for v in self.views.values())

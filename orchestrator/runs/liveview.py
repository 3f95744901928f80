"""What `clusterctl watch` shows, read from this machine alone: the run record and the per-rank
log files (runs/RUN/ranks/rankN.log), never a node, so a frozen node cannot freeze the view.

Each rank's file is read from where the last look ended (a file cut back by an adopting
supervisor is read again from its start). Its lines give the step (`step 40 | loss ...`, `rank 3
step 40`), the step time where the log says (`step 977 ms`, else measured from how fast the step
number moved here) and tokens/s (`tok/s 1,234`, `tokens/s`); the file's modification time is
when the rank was last heard. A row is one node (its ranks together) or one rank.

Flags:
- `stall Ns`: a rank that logged a step went silent longer than the run's hang timeout (60 s when
  the hang watch is off): what the hang watch is about to look at, or has;
- `HANG why`: the hang watch's verdict (runs/RUN/hangs/N/verdict.json) names the rank;
- `slow 2.6x`: the straggler watch names it (the attempt's `straggler` line, runs/straggler.py).
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from orchestrator.runs.rankfiles import rank_file
from orchestrator.runs.spec import NodeStatus

STEP = re.compile(r"\bstep (\d+)\b(?! ?ms)")
STEP_MS = re.compile(r"\bstep ([\d.]+) ?ms\b")
TOKENS = re.compile(r"\b(?:tok/s|tokens/s)[ :=]+([\d,.]+)")
# runs/straggler.py describe(): "straggler: node3 ranks 2,3 compute 2.6x the median (...)"
SLOW = re.compile(r"(\S+) ranks? ([\d,]+) computes? ([\d.]+)x the median")
STALL_OFF_S = 60.0  # a silent rank's flag when the hang watch is off
KEEP_LINES = 8  # a rank's last lines, for its detail
READ_MAX = 1 << 20  # at most this much of a file per look (the rest on the next)


@dataclass
class RankTail:
    """One rank's file, read as it grows: newest step, its timing and the last lines."""

    path: Path
    at: int = 0
    step: int | None = None
    step_s: float | None = None  # from the log's own figure
    tokens_s: float | None = None
    heard: float | None = None  # the file's mtime
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
            self.line(raw.decode(errors="replace").rsplit("\r", 1)[-1].rstrip(), now)

    def line(self, text: str, now: float) -> None:
        if not text.strip():
            return
        self.lines.append(text)
        m = STEP.search(text)
        if m is None:
            return
        step = int(m.group(1))
        if self.step is None or step != self.step:
            self.seen.append((now, step))
        self.step = step
        if (ms := STEP_MS.search(text)) is not None:
            self.step_s = float(ms.group(1)) / 1e3
        if (tk := TOKENS.search(text)) is not None:
            try:
                self.tokens_s = float(tk.group(1).replace(",", ""))
            except ValueError:
                pass

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
    step: int | None
    step_s: float | None
    tokens_s: float | None
    heard_s: float | None  # seconds since the last line
    flags: tuple[str, ...] = ()


def hang_culprits(run_dir: Path, hang_dir: str | None) -> dict[int, str]:
    """rank -> why, from the attempt's hang verdict (runs/hang.py HangVerdict.to_json)."""
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
        self.nodes: list[NodeStatus] = []
        self.hang: dict[int, str] = {}
        self.slow: dict[int, float] = {}

    def ranks_of(self, nd: NodeStatus) -> range:
        if nd.first_rank is None:
            return range(0)
        return range(nd.first_rank, (nd.last_rank if nd.last_rank is not None else nd.first_rank) + 1)

    def look(self, nodes: list[NodeStatus], attempt: dict | None, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.nodes = nodes
        for nd in nodes:
            for r in self.ranks_of(nd):
                self.tails.setdefault(r, RankTail(rank_file(self.dir, r))).read(now)
        attempt = attempt or {}
        self.hang = hang_culprits(self.dir, attempt.get("hang_dir"))
        self.slow = slow_ranks(attempt.get("straggler"))

    def _flags(self, ranks: Iterable[int], now: float) -> tuple[str, ...]:
        flags = []
        quiet = [now - t.heard for r in ranks if (t := self.tails.get(r)) is not None
                 and t.step is not None and t.heard is not None and now - t.heard > self.stall_after]
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

    def _row(self, name: str, state: str, ranks: list[int], now: float) -> Row:
        tails = [t for r in ranks if (t := self.tails.get(r)) is not None]
        stepped = [t for t in tails if t.step is not None]
        lead = max(stepped, key=lambda t: t.step) if stepped else None
        heard = max((t.heard for t in tails if t.heard is not None), default=None)
        return Row(name, state, lead.step if lead else None, lead.seconds_per_step if lead else None,
                   next((t.tokens_s for t in stepped if t.tokens_s is not None), None),
                   None if heard is None else max(0.0, now - heard), self._flags(ranks, now))

    def rows(self, by_rank: bool = False, state_of=str, now: float | None = None) -> list[Row]:
        """One row per node (its ranks together), or per rank (`node/rN`). `state_of(NodeState)`
        words a node's state."""
        now = time.time() if now is None else now
        out = []
        for nd in self.nodes:
            ranks = list(self.ranks_of(nd))
            if not by_rank:
                out.append(self._row(nd.name, state_of(nd.state), ranks, now))
                continue
            out.extend(self._row(f"{nd.name}/r{r}", state_of(nd.state), [r], now) for r in ranks)
        return out

    def last_lines(self, rank: int) -> list[str]:
        t = self.tails.get(rank)
        return list(t.lines) if t is not None else []

    def node_of(self, rank: int) -> str | None:
        return next((nd.name for nd in self.nodes if rank in self.ranks_of(nd)), None)


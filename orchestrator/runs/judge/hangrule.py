"""The hang rule: from what each rank was seen doing, whether ranks wait for others that make no
progress. Pure: observations in (runs/judge/hangsnap.py RankSnap, from the nodes' progress records every
few seconds and from the watch's own snapshots), a Standing out; runs/judge/hangwatch.py acts on it.

Progress is a rank's steps (what the script told `clusterctl_step`) and its collectives (the
Flight Recorder's newest entered and completed, per process group), never its log: a thread that
prints does not make a stuck rank look alive. Each rank is, at its newest observation:

- moving: its progress moved within WAIT_S (node clock);
- waiting: inside a collective (entered, not completed) for WAIT_S or more: since it entered, where
  its Flight Recorder says when (a snapshot's entries, a progress answer's `entered`), else since the
  observation that first saw it move there;
- stopped (state T), gone (its process ended or vanished), in D state, or idle (no progress, under
  IDLE_CPU of a core and under IDLE_IO bytes a second of disk I/O over the last IDLE_S, its data-loader
  workers and other processes of its RANK counted): it makes no progress and nothing says it will;
- busy: no progress, but it computes or reads and writes (a rank evaluating alone, saving a
  checkpoint, a loop spinning in its own code);
- quiet: no progress and no sign yet either way (idle for less than IDLE_S);
- left: its script ended (the hook's atexit ran), or its process ended less than GONE_S ago;
  ended: its node's torchrun ended (`Tracker.end`). Both are the run's end, never a culprit; a
  process gone for GONE_S while others still wait inside a collective is `gone` (a script that
  ended early: the others wait for it forever).

The Standing (`early` when a rank is stopped: worth a look at once, before the others are seen waiting):
`moving` while any rank moves; `nobody waits` when no rank is inside a collective
(every rank importing, loading, writing, sleeping: not a hang); otherwise, of the ranks not
waiting, `stuck` when one is stopped, gone, in D state or idle (a hang), `ending` when one has
left or ended (the others are leaving the last collective: not a hang), `busy` when they compute
(a hang only once a rank has been busy that long: the watch's --hang-busy-limit), `quiet` while one
has not shown which, and `all wait` when every rank is inside a collective (a broken link, or a
collective that never completes: the watch asks whether the nodes reach each other).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from orchestrator.runs.judge.hangsnap import RankSnap, word

WAIT_S = 3.0  # inside one collective this long, with no progress: the rank waits (node clock)
IDLE_S = 20.0  # idle this long while others wait for it: stuck (a rank that waits on the network for
# its data uses no CPU either; a shorter bound would call a slow remote read a hang)
IDLE_CPU = 0.05  # below this share of a core a rank is idle (one waiting in gloo used 0.25 %)
# disk bytes per second read or written over the window below which a rank did no I/O to speak of: a
# rate, not a count, since the hook's own answers (every thread's stack and Flight Recorder entries:
# hundreds of KB for a Lightning rank) are written to disk by the rank each time the watch looks
IDLE_IO = 256 << 10
ACT_S = 2.0  # the shortest window a rank's CPU is judged over
KEEP = 24  # observations kept per rank: the stream's every 2-10 s (progress_s) and the checks' looks: 48 s and more
GONE_S = 20.0  # a process ended this long while others wait inside a collective: not the run's end
# (ranks leave the last collective within moments of each other; exit code != 0 is fail-fast's)
DEFAULT_BUSY_LIMIT = 600.0  # a rank busy in its own code while others wait is a hang after this long


def progressed(a: RankSnap, b: RankSnap) -> bool:
    """b moved past a: a newer step, a collective entered or completed, or a new process group."""
    if a.step is not None and b.step is not None and b.step > a.step:
        return True
    return any(seq > a.pgs.get(pg, -1) for pg, seq in b.pgs.items()) or \
        any(seq > a.done.get(pg, -1) for pg, seq in b.done.items())


def _share(a: RankSnap, b: RankSnap) -> tuple[float, float]:
    """(CPU share of a core, disk bytes per second) of the rank between two observations."""
    dt = (b.t or 0.0) - (a.t or 0.0)
    cpu = (b.cpu - a.cpu) / dt if dt > 0 and a.cpu is not None and b.cpu is not None else 0.0
    io = (b.io - a.io) / dt if dt > 0 and a.io is not None and b.io is not None else 0.0
    return max(cpu, 0.0), max(io, 0.0)


@dataclass
class Seen:
    """One rank's observations: the newest few, the newest with an answer, and since when its
    progress has not moved (its node's clock, and this machine's)."""

    recent: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    known: RankSnap | None = None
    since_t: float = 0.0
    since: float = 0.0
    floor: float = 0.0  # the observation before the one that saw it move last (node clock): it moved after


@dataclass(frozen=True)
class RankState:
    rank: int
    node: str
    kind: str  # moving | waiting | stopped | gone | dstate | idle | busy | quiet | left | ended
    stalled_s: float  # how long its progress has not moved, as observed (node clock)
    cpu: float = 0.0  # share of a core over the window judged
    since: float = 0.0  # this machine's clock: when its progress last moved

    def doing(self, now: float) -> str:
        """What it did, for a verdict: "has been busy in its own code for 612s (98% of a core)"."""
        if self.kind == "busy":
            return f"has been busy in its own code for {now - self.since:.0f}s ({self.cpu:.0%} of a core)"
        return f"used {self.cpu:.0%} of a core and did no disk I/O for {self.stalled_s:.0f}s"


STUCK = ("stopped", "gone", "dstate", "idle")
LEAVING = ("left", "ended")  # the run's end: never waited for, never a culprit


@dataclass(frozen=True)
class Standing:
    kind: str  # moving | nobody waits | stuck | ending | busy | quiet | all wait
    ranks: Mapping[int, RankState]
    early: bool = False  # a rank is stopped: worth a look now

    def of(self, *kinds: str) -> list[RankState]:
        return [s for s in self.ranks.values() if s.kind in kinds]

    @property
    def signature(self) -> tuple:
        return tuple(sorted((r, s.kind) for r, s in self.ranks.items()))

    def line(self) -> str:
        """One line for the supervisor's log: who waits, for whom, doing what."""
        waiting = [s.rank for s in self.of("waiting")]
        others = [f"rank {s.rank} ({s.node}) {s.kind}" for s in sorted(self.ranks.values(), key=lambda s: s.rank)
                  if s.kind != "waiting"]
        return f"{word(waiting) if waiting else 'no rank'} inside a collective; " + (", ".join(others) or "none else")


class Tracker:
    """Every rank's observations over one attempt (`add`), and the Standing they make (`standing`)."""

    def __init__(self, world: Iterable[int]):
        self.world = sorted(set(world))
        self.seen: dict[int, Seen] = {}
        self.answered = False  # a rank's hook has answered: progress can be told from steps and collectives
        self.ended: set[int] = set()  # ranks whose node's torchrun ended
        self.started = False  # a rank was seen inside or past a collective, or told a step

    def add(self, s: RankSnap, now: float) -> bool:
        """One observation of rank s.rank, taken at s.t on its node's clock and arriving at `now`;
        True when it shows progress."""
        seen = self.seen.get(s.rank)
        t = s.t if s.t is not None else now
        s = s if s.t is not None else replace(s, t=t)
        if seen is None:
            seen = self.seen[s.rank] = Seen(since_t=t, since=now)
        moved = False
        if s.replied or s.answered:
            self.answered = True
            self.started |= bool(s.pgs) or s.step is not None
            if seen.known is not None and progressed(seen.known, s):
                seen.floor = seen.recent[-1].t or 0.0 if seen.recent else 0.0
                seen.since_t, seen.since, moved = t, now, True
            seen.known = s
            # its last move was entering the collective it is still inside: counted from then where its
            # Flight Recorder says when (never before the observation that had not yet seen it move)
            entered = s.inside_since
            if entered is not None and seen.floor <= entered < seen.since_t:
                seen.since_t = entered
        seen.recent.append(s)
        return moved

    def end(self, ranks: Iterable[int]) -> None:
        """Their node's torchrun ended: the run's end there (or a failure, fail-fast's to act on)."""
        self.ended.update(ranks)

    def last_progress(self) -> float | None:
        """When a rank's progress last moved (this machine's clock); None before any was seen."""
        return max((s.since for s in self.seen.values()), default=None)

    def state(self, rank: int) -> RankState | None:
        seen = self.seen.get(rank)
        if seen is None or not seen.recent:
            return RankState(rank, "", "ended", 0.0) if rank in self.ended else None
        last = seen.recent[-1]
        stalled = (last.t or 0.0) - seen.since_t
        base = dict(rank=rank, node=last.node, stalled_s=max(stalled, 0.0), since=seen.since)
        if rank in self.ended or last.exiting:
            return RankState(kind="ended" if rank in self.ended else "left", **base)
        if last.state in ("Z", "X"):
            first = last
            for o in reversed(seen.recent):
                if o.state not in ("Z", "X"):
                    break
                first = o
            return RankState(kind="gone" if (last.t or 0.0) - (first.t or 0.0) >= GONE_S else "left", **base)
        if last.state in ("T", "t"):
            return RankState(kind="stopped", **base)
        if stalled < WAIT_S:
            return RankState(kind="moving", **base)
        if last.answered and last.inside:
            return RankState(kind="waiting", **base)
        within = [o for o in seen.recent if (o.t or 0.0) >= seen.since_t]
        long_ago = [o for o in within if (last.t or 0.0) - (o.t or 0.0) >= IDLE_S]
        if long_ago:
            cpu, io = _share(long_ago[-1], last)
            if cpu < IDLE_CPU and io < IDLE_IO:
                return RankState(kind="dstate" if last.state == "D" else "idle", cpu=cpu, **base)
        short = [o for o in within if (last.t or 0.0) - (o.t or 0.0) >= ACT_S]
        cpu, io = _share(short[-1], last) if short else (0.0, 0)
        return RankState(kind="busy" if cpu >= IDLE_CPU or io >= IDLE_IO else "quiet", cpu=cpu, **base)

    def standing(self) -> Standing:
        ranks = {r: st for r in self.world if (st := self.state(r)) is not None}
        early = any(st.kind == "stopped" for st in ranks.values())
        kinds = {st.kind for st in ranks.values()}

        def out(kind: str) -> Standing:
            return Standing(kind, ranks, early)

        if "moving" in kinds:
            return out("moving")
        if "waiting" not in kinds:
            return out("nobody waits")
        if any(k in STUCK for k in kinds):
            return out("stuck")
        if any(k in LEAVING for k in kinds):
            return out("ending")
        if "busy" in kinds:
            return out("busy")
        if "quiet" in kinds or len(ranks) < len(self.world):
            return out("quiet")
        return out("all wait")


def gone(node: str, ranks: Iterable[int], t: float | None) -> list[RankSnap]:
    """Observations of ranks whose node reported them no more (their process ended)."""
    return [RankSnap(node, r, state="X", error="no process left on its node", t=t) for r in ranks]

"""The hang watch over one attempt: when to look (its rule: runs/judge/hangrule.py) and what it found
(the verdict: runs/judge/hang.py analyze).

Every rank's progress arrives every few seconds on its node's log stream (`feed`: the stream asks
the ranks' hooks, runs/logs/streams.py) into a Tracker. The watch looks closer, at once, when its
Standing says ranks wait inside a collective for a rank that is stuck (stopped, gone, in D state,
idle), when a rank is stopped (`early`: before the others are even seen waiting), or when
every rank is inside a collective; when a rank has been busy in its own code for the busy limit
(--hang-busy-limit) while others wait; and, as the backstop, when no rank's progress (steps,
collectives: not log bytes) moved for the hang timeout (--hang-timeout; on a run whose hooks never
answer, its log's bytes stand in for progress). To look closer is to snapshot every rank (stacks,
Flight Recorder, /proc state and CPU), wait CONFIRM_S (or, where ranks are stuck, only what they
lack of having held it: `lacking`), snapshot again, add both to the Tracker and judge again: a
hang is what still holds then. Where the first snapshot already shows it held that
long (`settled`: the ranks stuck, the others inside the collective for CONFIRM_S since they entered
it by their Flight Recorders, and no stopped rank's progress moved for as long), it is judged at
once. Every rank inside a collective with none behind is a hang when the nodes cannot reach each
other (`probe`), a mismatch or a deadlock, or at the backstop; else it is left to the backstop (a
collective can be slow). A check that finds no hang
is not repeated until the Standing changes. The verdict is kept in runs/RUN/hangs/N/ and handed
to `on_hang` (runs/attempt.py: told, recorded, and the --on-hang policy applied).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from orchestrator.runs.judge.hang import HangVerdict, analyze, with_links
from orchestrator.runs.judge.hangrule import DEFAULT_BUSY_LIMIT, LEAVING, Standing, Tracker, gone
from orchestrator.runs.judge.hangsnap import RankSnap, stacks_text, word

CONFIRM_S = 3.0  # between a check's first snapshot and its last (sooner once what it lacked has held: `lacking`)
LOOK_S = 0.5  # the shortest wait for a check's next snapshot
EDGE_S = 60.0  # the backstop's least wait at a run's edges: before any rank entered a collective or
# told a step (imports, rendezvous, a first load), and once a rank left (the others are leaving too)
TICK_S = 1.0  # how often the Standing is judged (in memory: the nodes are asked only by a check)


@dataclass
class HangWatch:
    """Watches one attempt for a hang (see the module doc). `feed` takes each node's progress
    record, `heard` each log byte, `ended` each node whose torchrun ended; `snap(request)` returns
    every rank's snapshot and the nodes that answered, `probe()` the node pairs that cannot reach
    each other; `on_hang(verdict, directory)` applies the policy."""

    timeout: float
    snap: Callable[[int], tuple[list[RankSnap], list[str]]]
    world: list[int]
    ranks_of: Mapping[int, str]
    out_dir: Path
    on_hang: Callable[[HangVerdict, Path], None]
    say: Callable[[str], None]
    probe: Callable[[], list[tuple[str, str]]] | None = None
    observe: bool = False
    tell: Callable[[str], None] | None = None  # the run's story (the foreground prints it); else say
    busy_limit: float = DEFAULT_BUSY_LIMIT
    order: Sequence[str] = ()  # the attempt's nodes in rank order: which end of a broken link a restart leaves out
    # armed by the attempt's first log byte or progress answer (an adopted attempt: from the start)
    armed: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    requests: int = 0
    verdict: HangVerdict | None = None
    thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.tracker = Tracker(self.world)
        self.lock = threading.Lock()
        now = time.monotonic()
        self.armed_at = self.log_at = self.backstop_at = now
        self.checked: tuple | None = None  # the Standing a check last found no hang in
        self.quiet = False  # observe: a verdict was told; quiet until a rank moves again
        self.told_busy: set[int] = set()
        self.by_node: dict[str, list[int]] = {}  # node -> its ranks: a node's record costs its own ranks
        for r, n in self.ranks_of.items():
            self.by_node.setdefault(n, []).append(r)

    # ---------------------------------------------------------------- what comes in
    def heard(self) -> None:
        """A log byte: arms the watch; progress only for a run whose hooks never answered."""
        self.log_at = time.monotonic()
        self.arm()

    def arm(self) -> None:
        if not self.armed:
            self.armed, self.armed_at = True, time.monotonic()

    def ended(self, node: str) -> None:
        """`node`'s torchrun ended (or the node was lost): its ranks are the run's end there, never
        waited for (a failure is fail-fast's)."""
        with self.lock:
            self.tracker.end(self.by_node.get(node, ()))

    def feed(self, node: str, doc: Mapping) -> None:
        """A node's progress record (node agent `snapshot_doc`, what=progress)."""
        if doc.get("error"):
            return
        self.add([RankSnap.from_agent(node, d, doc.get("time")) for d in doc.get("ranks") or ()], [node],
                 doc.get("time"))

    def add(self, snaps: list[RankSnap], nodes: Sequence[str], at: float | None = None) -> None:
        """Observations of `nodes`' ranks; a rank seen before that a node reports no more has gone
        (at its node's time of the report: `at` where it reported no rank at all)."""
        now = time.monotonic()
        with self.lock:
            moved = False
            for s in snaps:
                if s.rank >= 0:
                    moved |= self.tracker.add(s, now)
            said, newest = {s.rank for s in snaps}, {}
            for s in snaps:
                if s.t:
                    newest[s.node] = max(newest.get(s.node, s.t), s.t)
            for node in nodes:
                t = newest.get(node, at)
                missing = [r for r in self.by_node.get(node, ()) if r in self.tracker.seen and r not in said]
                for s in gone(node, missing, t):
                    self.tracker.add(s, now)
            if self.tracker.answered:
                self.arm()
            if moved:
                self.quiet, self.checked = False, None
                self.told_busy.clear()

    # ---------------------------------------------------------------- the watch thread
    def start(self) -> None:
        if self.timeout > 0:
            self.thread = threading.Thread(target=self.loop, name="hang-watch", daemon=True)
            self.thread.start()

    def close(self) -> None:
        self.stop.set()

    def loop(self) -> None:
        while not self.stop.wait(TICK_S):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the watch must never take the run down itself
                self.say(f"hang watch: {type(e).__name__}: {e}")
                self.backstop_at = time.monotonic()

    def standing(self) -> Standing:
        with self.lock:
            return self.tracker.standing()

    def tick(self) -> None:
        if not self.armed or self.quiet:
            return
        now, st = time.monotonic(), self.standing()
        if (st.kind in ("stuck", "all wait") or st.early) and st.signature != self.checked:
            self.check(st, backstop=False)
        elif st.kind == "busy":
            self.busy(st, now)
        elif now - self.backstop_at >= self.timeout and self.silent_for(now) >= self.backstop(st):
            self.check(st, backstop=True)

    def backstop(self, st: Standing) -> float:
        """No progress this long is looked at: the hang timeout; at the run's edges (no progress
        record yet, no collective or step yet, or a rank left or its node ended) no less than EDGE_S:
        a slow start or exit is not a hang. (Before the first record, the log's bytes would stand
        in for progress as for a run whose hooks never answer: a quiet script was looked at.)"""
        with self.lock:
            t = self.tracker
            edge = bool(t.ended or st.of(*LEAVING) or not t.seen or (t.answered and not t.started))
        return max(self.timeout, EDGE_S) if edge else self.timeout

    def silent_for(self, now: float) -> float:
        """How long no rank's progress has moved: as the observations show it (each rank's, on its
        node's clock, the least of them; ranks that left are not counted), or, where no hook ever
        answered, since the last log byte."""
        with self.lock:
            if not self.tracker.answered:
                return now - max(self.log_at, self.armed_at)
            stalled = [st.stalled_s for r in self.world
                       if (st := self.tracker.state(r)) is not None and st.kind not in LEAVING]
        return min(stalled) if stalled else 0.0

    def busy(self, st: Standing, now: float) -> None:
        """Ranks busy in their own code while others wait: a hang once one has been so for the limit."""
        waiting = word(s.rank for s in st.of("waiting"))
        for s in st.of("busy"):
            if s.rank not in self.told_busy:
                self.told_busy.add(s.rank)
                self.say(f"hang watch: rank {s.rank} ({s.node}) is busy in its own code ({s.cpu:.0%} of a core) "
                         f"while {waiting} wait inside a collective: a hang only after {self.busy_limit:g}s of it "
                         "(--hang-busy-limit)")
            if now - s.since >= self.busy_limit and st.signature != self.checked:
                self.check(st, backstop=False)
                return

    def take(self) -> list[RankSnap]:
        self.requests += 1
        snaps, nodes = self.snap(self.requests)
        # a node that answered without a rank it had: that rank's process ended
        self.add(snaps, nodes, max((s.t for s in snaps if s.t), default=None))
        return snaps

    # ---------------------------------------------------------------- a closer look
    def check(self, st: Standing, backstop: bool) -> None:
        tell = self.tell or self.say
        if backstop:
            tell(f"no rank made progress (no step, no collective) for {self.silent_for(time.monotonic()):.0f}s: "
                 "taking a snapshot of every rank's stacks and collectives")
        else:
            self.say(f"hang watch: {st.line()}: taking a snapshot of every rank")
        snaps = self.take()
        st = self.standing()
        waited = 0.0
        # again once what the look lacked has held (CONFIRM_S in all at most); past the first wait, only
        # while it is still stuck without having held long enough
        while waited < CONFIRM_S and (backstop or not settled(st) and (not waited or st.kind == "stuck" or st.early)):
            wait = CONFIRM_S - waited if backstop else min(CONFIRM_S - waited, lacking(st))
            if self.stop.wait(wait):
                return
            waited += wait
            snaps = self.take()
            if self.stop.is_set():
                return
            st = self.standing()
        v = self.judge(st, snaps, backstop)
        if v is None:
            self.checked, self.backstop_at = st.signature, time.monotonic()
        else:
            self.found(v, snaps)

    def judge(self, st: Standing, snaps: list[RankSnap], backstop: bool) -> HangVerdict | None:
        """The verdict of a closer look (None: no hang, said why)."""
        now, tell = time.monotonic(), (self.tell or self.say) if backstop else self.say
        if not snaps:
            tell("no rank's process was found on the nodes (still starting, or ending): nothing to judge")
            return None
        if st.kind == "moving":
            tell("the ranks still make progress (steps, collectives): not a hang")
            return None
        with self.lock:
            blind = not self.tracker.answered
        if blind:  # no hook ever answered: nothing says who waits; a rank that works is not hung
            working = [s for s in st.ranks.values() if s.kind == "busy"]
            if working:
                tell(f"rank {working[0].rank} ({working[0].node}) is busy ({working[0].cpu:.0%} of a core): not a hang")
                return None
            return analyze(snaps, self.world, self.ranks_of)
        if st.kind == "ending":
            tell("ranks are leaving (" + ", ".join(f"rank {s.rank} {s.kind}" for s in st.of("left", "ended")) +
                 "): the run's end, not a hang")
            return None
        if st.kind == "nobody waits":
            tell("no rank waits in a collective for another (each is in its own code: importing, loading, "
                 "writing, sleeping): not a hang")
            return None
        over = {s.rank: s.doing(now) for s in st.of("busy") if now - s.since >= self.busy_limit}
        if st.kind == "busy" and not over:
            tell("; ".join(f"rank {s.rank} ({s.node}) is busy in its own code ({s.cpu:.0%} of a core)"
                           for s in st.of("busy")) + f": not a hang unless it goes on for {self.busy_limit:g}s "
                 "(--hang-busy-limit)")
            return None
        if st.kind == "quiet" and not backstop:
            self.say(f"hang watch: {st.line()}: not yet told apart from a pause")
            return None
        v = analyze(snaps, self.world, self.ranks_of, busy=over)
        idle = [f"rank {s.rank} ({s.node}) {s.doing(now)}" for s in st.of("idle", "dstate")]
        if idle:
            v = replace(v, details=(*v.details, "seen: " + "; ".join(idle) + " while others waited for it"))
        if v.culprits or v.mismatch or v.deadlock:
            return v
        down = self.probe() if self.probe is not None and v.collective else []
        if down:
            return with_links(v, down, self.order)
        if backstop:
            return v
        self.say("hang watch: every rank waits inside a collective and every node reaches the others: left to the "
                 f"backstop (no progress for {self.timeout:g}s, --hang-timeout)")
        return None

    def found(self, v: HangVerdict, snaps: list[RankSnap]) -> None:
        n = len([p for p in self.out_dir.glob("[0-9]*")]) + 1 if self.out_dir.is_dir() else 1
        d = self.out_dir / str(n)
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / "verdict.json").write_text(json.dumps(v.to_json(), indent=2))
            (d / "stacks.txt").write_text(stacks_text(snaps))
        except OSError as e:  # no room on this machine's disk: the verdict is applied without its files
            self.say(f"hang watch: the verdict's files not written: {e}")
        self.verdict = v
        self.on_hang(v, d)  # tells the verdict (the run's story) and applies the policy
        # observe: told once; the next hang is one that follows new progress
        self.quiet = self.observe
        self.backstop_at = time.monotonic()


def lacking(st: Standing) -> float:
    """How long until a stuck Standing, or one with a rank stopped, could be `settled` (every rank
    that waits, or is stopped, or is not yet seen waiting, without progress for CONFIRM_S), at least
    LOOK_S: the next look is taken then, not CONFIRM_S after the first (a progress request every 2 s
    often finds the others inside their collective for 1-2 s only). CONFIRM_S for anything else."""
    if st.kind != "stuck" and not st.early:
        return CONFIRM_S
    short = [CONFIRM_S - s.stalled_s for s in st.ranks.values() if s.kind in ("waiting", "stopped", "moving")]
    return min(CONFIRM_S, max(LOOK_S, max(short, default=CONFIRM_S)))


def settled(st: Standing) -> bool:
    """The Standing is a hang that has already held CONFIRM_S, as the ranks' own clocks show it:
    ranks wait for a stuck one, every rank that waits has been inside its collective that long (since
    it entered it, where its Flight Recorder says when), and a stopped one made no progress for as long
    (idle, D state and gone take IDLE_S and GONE_S of evidence to be told at all). A second look
    CONFIRM_S later would only see the same."""
    return st.kind == "stuck" and all(s.stalled_s >= CONFIRM_S for s in st.ranks.values()
                                      if s.kind in ("waiting", "stopped"))


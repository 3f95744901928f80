"""Stragglers: a rank that computes persistently slower than the others is named, and acted on.

In a synchronous job every rank's step takes the time of the slowest: the others wait in the
gradients' all-reduce. So the straggler is found by each rank's *compute* per step, measured on its
own clock (no clock is compared across nodes): the shipped trainer times it (trainer/progress.py)
and tells the hook clusterctl puts in every rank (remote/hook/sitecustomize.py `clusterctl_step`).
Each rank's newest steps (a request the hook answers from memory, no stacks, no Flight Recorder)
come every period (runs/scaling.py progress_s: 2 s on a small cluster, PERIOD_S from 256 ranks) on
each node's long-lived log stream (runs/logs/streams.py: the stream process asks the hooks itself,
`tail ... stream ... PROGRESS_S`, and sends the answers as records, which `feed` takes): no process
is started on a node for them. A run without that stream (no artifact directories) has them asked
of every node's agent instead (`snapshot ... progress`, a fresh process per node per round, over
the open connections). The supervisor's log says which.

`judge` is the rule, pure: each rank's median compute over its last `window` steps; a rank whose
median is at least `factor` times the median of all ranks' medians (and at least MIN_GAP_S more)
is slow. A rank found slow on CONFIRM checks in a row is named a straggler, or sooner when one look
at its history proves it (`sustained`: slow in each of its newest disjoint windows, back to back,
CONFIRM or more of them spanning SUSTAIN_S on the rank's clock; at SEVERE times the median, windows
a fifth that long spanning SEVERE_S), with its node:
`straggler: node3 rank 2 computes 2.6x the median (480 ms vs 185 ms over the last 50 steps)`;
one that stays below the factor for CONFIRM checks is told to have recovered.

A script that reports no compute (any script but the trainer) is judged from the Flight Recorder:
the hook answers with when the rank entered each of its newest collectives (time_created_ns; on
gloo torch 2.13 records nothing else per collective: time_discovered_*_ns and duration_ms stay
empty). Those are read on each node's own clock, so the clocks are compared: `clock_offsets`
(stragglersnap.py) measures every node's offset from this machine's clock as preflight's
clock_skew does (the best of 3 `date` round trips, within half the round trip), again every
OFFSETS_S, and takes off those larger than their uncertainty. Then `fr_compute`: in a
synchronous job nobody leaves collective k before the last rank entered it, so rank r's compute
between k and k+1 is when it entered k+1 minus when the last rank entered k (clipped at 0, in the
process group every rank shares). A straggler enters every collective last and computes the whole
interval; the others' waits are left out. The rule and the words are the same, per collective
(`... over the last 50 collectives`). With a DDP whose gradients go out in several buckets during
the backward pass the intervals inside one step overlap the communication, so the figure is a
lower bound for the fast ranks; the factor still separates a rank that is persistently last.

--on-straggler warn (default) names it in the foreground, the run's story and `status`;
replace ends the attempt and restarts it from the newest checkpoint without the straggler's node
(a spare takes its place), as --on-hang restart does, when a restart and a spare are left;
otherwise it only warns, and says why.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from orchestrator.runs.judge.warmhold import HELD, RELEASED, WarmHold

DEFAULT_FACTOR = 1.3
DEFAULT_WINDOW = 50
ON_STRAGGLER = ("warn", "replace")
PERIOD_S = 10.0  # how often every rank's newest steps are asked for (and judged)
CONFIRM = 3  # checks in a row before a rank is named (or named recovered): 20-30 s of persistence at PERIOD_S
# (with 2, a healthy run on a loaded machine once had a rank named for 1.4x over two 50-step windows)
CONFIRM_SPAN_S = 20.0  # a shorter period (runs/scaling.py progress_s) asks for more checks: the same persistence
SUSTAIN_S = 10.0  # or sooner: slow in each of the newest CONFIRM or more disjoint windows, back to back,
# spanning at least this long on the rank's clock (`sustained`; where a script's steps carry no time, their
# compute: less than their wall time, so never sooner): 10 s of evidence without a gap instead of 3
# glimpses over 20-30 s; the goodput bench's straggler (45 ms of compute in 105 ms steps) was named
# after 40 s by the checks alone
SEVERE, SEVERE_S = 2.0, 4.0  # or sooner: SEVERE x the median in each of the newest windows of `window` / 5
SEVERE_STEPS = 5  # (at least this) steps, CONFIRM or more back to back spanning SEVERE_S: no loaded machine's
# jitter (1.4x over two 50-step windows); the goodput bench's straggler (3.5x) was named 21 s in without it
KEEP = 6  # windows of steps kept per rank: `sustained` reaches back this far (at most)
MIN_GAP_S = 0.005  # a rank must also be this much slower than the median: jitter on tiny steps is not a straggler
MIN_RANKS = 2
OFFSETS_S = 300.0  # how often the nodes' clock offsets are measured again (Flight Recorder judging)


@dataclass(frozen=True)
class Slow:
    """One rank found slower than the median over its last `steps` steps."""

    rank: int
    node: str
    compute_s: float  # this rank's median compute per step
    median_s: float  # the median of every rank's median
    steps: int
    unit: str = "steps"  # or "collectives": judged from the Flight Recorder (`fr_compute`)

    @property
    def ratio(self) -> float:
        return self.compute_s / self.median_s if self.median_s > 0 else float("inf")


def judge(samples: Mapping[int, list[float]], node_of: Mapping[int, str], window: int = DEFAULT_WINDOW,
          factor: float = DEFAULT_FACTOR, unit: str = "steps") -> list[Slow]:
    """The ranks slower than `factor` times the median, by their median compute over their last
    `window` steps (`samples`: rank -> compute seconds per step, oldest first). Nothing is judged
    until at least MIN_RANKS ranks have `window` steps each."""
    full = {r: statistics.median(v[-window:]) for r, v in samples.items() if len(v) >= window}
    if len(full) < MIN_RANKS or factor <= 0:
        return []
    med = statistics.median(full.values())
    return [Slow(r, node_of.get(r, "?"), c, med, window, unit) for r, c in sorted(full.items())
            if c >= factor * med and c - med >= MIN_GAP_S]


def sustained(samples: Mapping[int, list[float]], node_of: Mapping[int, str], window: int = DEFAULT_WINDOW,
              factor: float = DEFAULT_FACTOR, unit: str = "steps", confirm: int = CONFIRM,
              span_s: float = SUSTAIN_S, at: Mapping[int, list[float | None]] | None = None) -> list[Slow]:
    """The ranks slow (`judge`) in each of their newest disjoint windows of `window` steps, back to back,
    as far back as it takes for at least `confirm` windows spanning `span_s`: a straggler proven in one
    look at the history, without waiting for CONFIRM checks. Each window is judged against every rank's
    same window (the steps every rank reported last). The span is on the rank's clock, `at` (when each
    of its steps was told, aligned with `samples`), else the compute of its steps (never more than
    their wall time)."""
    slow_in: dict[int, set[int]] = {}  # k windows back -> the ranks slow there, judged once for every rank

    def slow_at(k: int) -> set[int]:
        if k not in slow_in:
            slow_in[k] = {x.rank for x in judge({r: u[:len(u) - k * window] for r, u in samples.items()},
                                                node_of, window, factor, unit)}
        return slow_in[k]

    out = []
    for s in judge(samples, node_of, window, factor, unit):
        v, times, spent, k = samples[s.rank], (at or {}).get(s.rank) or (), 0.0, 0
        while len(v) >= (k + 1) * window:
            if k and s.rank not in slow_at(k):
                break
            spent += sum(v[len(v) - (k + 1) * window:len(v) - k * window])
            k += 1
            first, last = (times[-k * window], times[-1]) if len(times) == len(v) else (None, None)
            span = last - first if first is not None and last is not None else spent
            if k >= confirm and span >= span_s:
                out.append(s)
                break
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.1f} ms"


def describe(slow: Iterable[Slow]) -> str:
    """One line naming every straggling node, its ranks and by how much."""
    by_node: dict[str, list[Slow]] = {}
    for s in slow:
        by_node.setdefault(s.node, []).append(s)
    parts = []
    for node, ss in by_node.items():
        worst = max(ss, key=lambda s: s.ratio)
        ranks = ",".join(str(s.rank) for s in ss)
        verb = "computes" if len(ss) == 1 else "compute"
        parts.append(f"{node} rank{'s' if len(ss) > 1 else ''} {ranks} {verb} {worst.ratio:.1f}x the median "
                     f"({_ms(worst.compute_s)} vs {_ms(worst.median_s)} over the last {worst.steps} {worst.unit})")
    return "straggler: " + "; ".join(parts)


def merge(into: dict[int, dict[int, tuple[float, float | None]]], ranks: Iterable[Mapping], keep: int) -> None:
    """Add one progress snapshot's ranks (the agent's documents: rank, answer.steps [[step, s, at]];
    `at`, when the rank told it on its own clock, may be absent) into rank -> {step: (compute_s,
    at or None)}, keeping each rank's newest `keep` steps."""
    for doc in ranks:
        rank = doc.get("rank")
        steps = (doc.get("answer") or {}).get("steps") or []
        if not str(rank).isdigit() or not steps:
            continue
        mine = into.setdefault(int(rank), {})
        for step, seconds, *when in steps:
            mine[int(step)] = (float(seconds), float(when[0]) if when else None)
        for old in sorted(mine)[:-keep]:
            del mine[old]


def merge_entered(into: dict[int, dict[tuple[str, int], float]], ranks: Iterable[Mapping],
                  offsets: Mapping[str, float], node_of: Mapping[int, str], keep: int) -> None:
    """Add one progress snapshot's Flight Recorder entries (answer.entered [[pg, seq, ns]]) into
    rank -> {(pg, seq): seconds on this machine's clock}, the node's offset taken off."""
    for doc in ranks:
        rank = doc.get("rank")
        entered = (doc.get("answer") or {}).get("entered") or []
        if not str(rank).isdigit() or not entered:
            continue
        off = offsets.get(node_of.get(int(rank), ""), 0.0)
        mine = into.setdefault(int(rank), {})
        for pg, seq, ns in entered:
            mine[(str(pg), int(seq))] = int(ns) / 1e9 - off
        for old in sorted(mine, key=lambda k: k[1])[:-keep]:
            del mine[old]


def fr_compute(entered: Mapping[int, Mapping[tuple[str, int], float]]) -> dict[int, list[float]]:
    """Each rank's compute between consecutive collectives, oldest first, from when every rank
    entered them (this machine's clock): for collective k and k+1 of the process group the ranks
    share most, rank r's compute is its entry into k+1 minus the last rank's entry into k."""
    ranks = sorted(entered)
    if len(ranks) < MIN_RANKS:
        return {}
    common = set.intersection(*(set(entered[r]) for r in ranks))
    by_pg: dict[str, list[int]] = {}
    for pg, seq in common:
        by_pg.setdefault(pg, []).append(seq)
    if not by_pg:
        return {}
    pg, seqs = max(by_pg.items(), key=lambda kv: len(kv[1]))
    seqs.sort()
    out: dict[int, list[float]] = {r: [] for r in ranks}
    for a, b in zip(seqs, seqs[1:]):
        if b != a + 1:
            continue
        last_in = max(entered[r][(pg, a)] for r in ranks)
        for r in ranks:
            out[r].append(max(0.0, entered[r][(pg, b)] - last_in))
    return out


@dataclass
class StragglerWatch:
    """Each round judges every rank's newest steps and tells (`tell`) a straggler once it is
    confirmed and once it recovered; `on_straggler(new, current)` is called on every change: the
    newly confirmed, and the line naming every straggler now (None: none is left). `streamed`:
    the steps come from the nodes' log streams (`feed(node, doc)`, each node's newest document
    judged once), a round once every node's stream fed (they ask at one period from about one
    start), else after 1.5 periods (a lost node's feeds no more); else each round, every `period`
    s, asks for them (`snap()` -> every rank's document)."""

    snap: Callable[[], list[Mapping]]
    node_of: Mapping[int, str]
    tell: Callable[[str], None]
    on_straggler: Callable[[list[Slow], str | None], None]
    window: int = DEFAULT_WINDOW
    factor: float = DEFAULT_FACTOR
    period: float = PERIOD_S
    say: Callable[[str], None] = print
    offsets: Callable[[], Mapping[str, tuple[float, float]]] | None = None  # `clock_offsets`: the nodes
    steps: dict[int, dict[int, tuple[float, float | None]]] = field(default_factory=dict)  # `merge`
    entered: dict[int, dict[tuple[str, int], float]] = field(default_factory=dict)  # `merge_entered`
    clock: tuple[float, Mapping[str, float]] | None = None  # (when measured, the offsets)
    streak: dict[int, int] = field(default_factory=dict)  # rank -> checks in a row slow (>0) or not (<0)
    named: dict[int, Slow] = field(default_factory=dict)  # the ranks named a straggler now
    judged: bool = False  # every rank had a window of steps once
    rounds: int = 0  # checks that judged the ranks
    ever: dict[int, Slow] = field(default_factory=dict)  # every rank named during the attempt
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    streamed: bool = False
    fed: dict[str, Mapping] = field(default_factory=dict)  # node -> its stream's newest document, not yet judged
    lock: threading.Lock = field(default_factory=threading.Lock)
    fresh: threading.Event = field(default_factory=threading.Event)  # every node's stream fed since the last round
    warming: Callable[[], list[str]] = lambda: []  # nodes whose warm interpreter imports torch (runs/warmpool.py)

    def __post_init__(self) -> None:
        self.nodes = set(self.node_of.values())  # a node's feed compares nodes, not every rank's node
        self.hold = WarmHold(self.say)  # nobody judged while the warm interpreters import (warmhold.py)

    def start(self) -> None:
        if self.factor > 0:
            self.thread = threading.Thread(target=self.loop, name="straggler-watch", daemon=True)
            self.thread.start()

    def close(self) -> None:
        """Stop the watch; its tally goes to the supervisor's log."""
        if not self.stop.is_set() and self.judged:
            self.say(f"straggler watch: judged every rank {self.rounds} times; named "
                     f"{', '.join(f'{s.node} rank {r}' for r, s in sorted(self.ever.items())) or 'nobody'}")
        self.stop.set()
        self.fresh.set()

    def feed(self, node: str, doc: Mapping) -> None:
        """A node's stream brought its ranks' progress (node agent `snapshot_doc`): kept, the newest
        per node, for the next round, which starts once every node's is in (called on the log copy's
        thread)."""
        with self.lock:
            self.fed[node] = doc
            if len(self.fed) >= len(self.nodes) and self.nodes <= self.fed.keys():
                self.fresh.set()

    def take(self) -> list[Mapping]:
        """Every rank's document the streams brought since the last round."""
        with self.lock:
            docs, self.fed = self.fed, {}
        for node, doc in sorted(docs.items()):
            if doc.get("error"):
                self.say(f"{node}: no progress: {doc['error']}")
        return [rank for _, doc in sorted(docs.items()) for rank in doc.get("ranks") or ()]

    def loop(self) -> None:
        how = "from the nodes' log streams" if self.streamed else "asked of every node"
        self.say(f"straggler watch: progress {how} every {self.period:g} s")
        while not self.stop.is_set():
            self.fresh.wait(self.period * 1.5 if self.streamed else self.period)
            self.fresh.clear()
            if self.stop.is_set():
                break
            try:
                self.round()
            except Exception as e:  # noqa: BLE001 - the watch must never take the run down itself
                self.say(f"straggler watch: {type(e).__name__}: {e}")

    def round(self) -> None:
        """One round: what the streams fed since the last one (nothing new: the last judgement
        stands, not counted again), or, not streamed, every node asked now; judged."""
        ranks = self.take() if self.streamed else self.snap()
        if ranks or not self.streamed:
            self.check(ranks)

    @property
    def confirm(self) -> int:
        """Checks in a row before a rank is named (or named recovered): CONFIRM at PERIOD_S, and at
        a shorter period as many as span CONFIRM_SPAN_S (5 at 5 s: 20-25 s of persistence)."""
        return max(CONFIRM, math.ceil(CONFIRM_SPAN_S / self.period) + 1)

    def check(self, ranks: list[Mapping]) -> None:
        """One round: the snapshot merged, every rank judged, the changes told."""
        try:
            held = self.hold.look(self.warming())
        except Exception:  # noqa: BLE001 - the pool's connections torn down: nothing holds the watch
            held = None
        if held == HELD:
            return
        if held == RELEASED:  # what was seen while they imported: dropped
            self.steps.clear()
            self.entered.clear()
            self.streak.clear()
        ranks = [self.hold.after(d) for d in ranks]
        merge(self.steps, ranks, KEEP * self.window)
        samples = {r: [v[s][0] for s in sorted(v)] for r, v in self.steps.items()}
        unit = "steps"
        if not samples and self.offsets is not None and any((d.get("answer") or {}).get("entered") for d in ranks):
            if self.clock is None or time.monotonic() - self.clock[0] > OFFSETS_S:
                self.clock = (time.monotonic(), self.measure())
            merge_entered(self.entered, ranks, self.clock[1], self.node_of, KEEP * self.window + 1)
            self.hold.drop_entered(self.entered)
            samples, unit = fr_compute(self.entered), "collectives"
        slow = {s.rank: s for s in judge(samples, self.node_of, self.window, self.factor, unit)}
        judged = {r for r, v in samples.items() if len(v) >= self.window}
        self.rounds += len(judged) >= MIN_RANKS
        # once, in the supervisor's log, when the watch sees every rank (a round starts once every node's
        # stream fed: some ranks may not have a window of steps yet)
        if len(judged) >= max(MIN_RANKS, len(self.node_of)) and not self.judged:
            self.judged = True
            med = {r: statistics.median(samples[r][-self.window:]) for r in judged}
            mid = statistics.median(med.values())
            worst = max(med, key=med.get)
            per = unit[:-1]
            self.say(f"straggler watch: {len(judged)} ranks judged over their last {self.window} {unit}: median "
                     f"compute {_ms(mid)} per {per}, the slowest rank {worst} at {med[worst] / mid if mid else 1:.2f}x")
        proven = self.proven(samples, unit) if slow else set()
        confirm = self.confirm
        for r in judged:
            was = self.streak.get(r, 0)
            self.streak[r] = (max(was, 0, confirm - 1 if r in proven else 0) + 1) if r in slow else (min(was, 0) - 1)
        new = [slow[r] for r in sorted(slow) if self.streak[r] >= confirm and r not in self.named]
        gone = [r for r in sorted(self.named) if self.streak.get(r, 0) <= -confirm]
        for r in gone:
            s = self.named.pop(r)
            self.tell(f"straggler: {s.node} rank {r} no longer computes slower than the median")
        if new:
            self.named.update({s.rank: s for s in new})
            self.ever.update({s.rank: s for s in new})
            self.tell(describe(new))
        if new or gone:
            self.on_straggler(new, self.current)

    def proven(self, samples: Mapping[int, list[float]], unit: str) -> set[int]:
        """The ranks one look at their history proves slow (`sustained`): over windows of `window`
        steps spanning SUSTAIN_S, or, at SEVERE times the median, over windows a fifth that long
        spanning SEVERE_S."""
        at = {r: [v[s][1] for s in sorted(v)] for r, v in self.steps.items()}
        short = max(SEVERE_STEPS, self.window // 5)
        wide = sustained(samples, self.node_of, self.window, self.factor, unit, at=at)
        severe = sustained(samples, self.node_of, short, max(SEVERE, self.factor), unit, span_s=SEVERE_S, at=at)
        return {s.rank for s in wide} | {s.rank for s in severe}

    def measure(self) -> dict[str, float]:
        """The nodes' clock offsets to take off (an offset within its own uncertainty is taken as
        0: a clock kept by NTP is closer than a round trip over SSH can tell), said once."""
        found = self.offsets()
        self.say("straggler watch: judging from the Flight Recorder (the script reports no compute); clock offsets "
                 + ", ".join(f"{n} {o * 1e3:+.1f} ms ± {u * 1e3:.1f}" for n, (o, u) in sorted(found.items())))
        return {n: o if abs(o) > u else 0.0 for n, (o, u) in found.items()}

    @property
    def current(self) -> str | None:
        """The stragglers named now, in one line (None: none)."""
        return describe(self.named[r] for r in sorted(self.named)) if self.named else None

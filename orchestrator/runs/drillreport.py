"""A fault drill's plan and report, pure: which faults run (and which are skipped, why), what one
fault cost, read from the run's record and goodput ledger (runs/goodput.py), and the goodput a
cluster would have at one such fault per hour and per day.

Per fault, on this machine's clock (the record's):

    injected ── declared ─────────── next attempt's first step
     detected_s = declared - injected
                  relaunch_s = first step - declared
     lost_s = first step - injected + steps redone x the faulted attempt's seconds per step

The estimate is that simple on purpose: goodput at one fault per period P = 1 - lost_s / P.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# a straggler: while it computes, stopped STOP_S then let run RUN_S, for THROTTLE_S (runs/drill.py).
# The watch named it after its window of collectives and 3 rounds of 10 s in a row (52 s on the
# 2-core test cluster; runs/judge/straggler.py `sustained` can name it sooner). Stopped half the
# time, the rank computed 1.4x the median alone there and 1.2x beside another job (the cores
# shared: below the 1.3x factor); a quarter of the time running leaves room for that
THROTTLE_S, STOP_S, RUN_S = 90.0, 0.15, 0.05
FAULTS = ("kill", "hang", "lost", "straggler")
NEEDS_SPARE = ("hang", "lost")  # the culprit's node is left out of the next attempt: a spare takes its place
RESTARTS = ("kill", "hang", "lost")  # each costs one restart (--max-restarts)
WHAT = {"kill": "SIGKILL one worker rank's process",
        "hang": "SIGSTOP one rank (a hang)",
        "lost": "SIGSTOP everything of the run on one node, its log stream included (a node that looks lost)",
        "straggler": f"throttle one rank: stopped {STOP_S / (STOP_S + RUN_S):.0%} of the time it computes, "
                     f"for {THROTTLE_S:g} s (a straggler)"}
HOUR_S, DAY_S = 3600.0, 86400.0


def parse_faults(text: str) -> tuple[str, ...]:
    """'kill,hang' -> ('kill', 'hang'), in the order given, each once; ValueError naming what is
    not a fault."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    bad = [w for w in words if w not in FAULTS]
    if bad or not words:
        raise ValueError(f"{', '.join(repr(b) for b in bad) or 'nothing'}: the faults are {', '.join(FAULTS)} "
                         "(comma-separated, e.g. --faults kill,hang)")
    return tuple(dict.fromkeys(words))


@dataclass(frozen=True)
class Planned:
    fault: str
    skip: str | None = None  # why it will not be injected


def plan(faults: tuple[str, ...], workers: int, spares: int) -> list[Planned]:
    """Each fault in order, skipped where the cluster cannot recover from it: a fault whose
    culprit's node is left out needs a spare of its own (the spares are taken in order); every
    fault needs a node other than the master's (rank 0's, which holds the rendezvous)."""
    out, left = [], spares
    for f in faults:
        if workers < 2:
            out.append(Planned(f, "the run has one node: a drill needs a node besides the master's to inject on"))
        elif f in NEEDS_SPARE and left < 1:
            out.append(Planned(f, f"no spare left for it (the inventory has {spares}; each {'/'.join(NEEDS_SPARE)} "
                                  "fault leaves its node out and needs one): mark another node `spare: true`"))
        else:
            left -= f in NEEDS_SPARE
            out.append(Planned(f))
    return out


def goodput_at(lost_s: float | None) -> tuple[float | None, float | None]:
    """(goodput at one such fault per hour, per day): 1 - lost/3600, 1 - lost/86400."""
    if lost_s is None:
        return None, None
    return max(0.0, 1 - lost_s / HOUR_S), max(0.0, 1 - lost_s / DAY_S)


@dataclass
class Outcome:
    """One fault: what was done, and what the run made of it."""

    fault: str
    skip: str | None = None
    node: str | None = None  # injected on
    rank: int | None = None
    attempt: int | None = None  # the attempt it was injected into
    injected_at: float | None = None
    declared_at: float | None = None
    detected_by: str | None = None  # the verdict (node lost, hang, killed by signal, straggler)
    culprit_node: str | None = None
    culprit_rank: int | None = None
    recovered_at: float | None = None  # the next attempt's first step (a straggler: the throttle's end)
    steps_redone: int | None = None
    step_s: float | None = None
    straggler_s: float | None = None  # a straggler: the ledger's straggler badput of its attempt
    notes: list[str] = field(default_factory=list)

    @property
    def detected_s(self) -> float | None:
        return _diff(self.declared_at, self.injected_at)

    @property
    def relaunch_s(self) -> float | None:
        return None if self.fault == "straggler" else _diff(self.recovered_at, self.declared_at)

    @property
    def named_right(self) -> bool:
        if self.culprit_node is None or self.culprit_node != self.node:
            return False
        return self.fault == "lost" or self.culprit_rank == self.rank  # a lost node is named by its node

    @property
    def lost_s(self) -> float | None:
        if self.fault == "straggler":
            return self.straggler_s
        span = _diff(self.recovered_at, self.injected_at)
        if span is None:
            return None
        return span + (self.steps_redone or 0) * (self.step_s or 0.0)

    @property
    def ok(self) -> bool:
        return (self.skip is None and self.declared_at is not None and self.named_right
                and self.recovered_at is not None)

    def to_json(self) -> dict:
        hour, day = goodput_at(self.lost_s)
        return {"fault": self.fault, "ok": self.ok, "skipped": self.skip, "node": self.node, "rank": self.rank,
                "attempt": self.attempt, "injected_at": _r(self.injected_at, 3), "detected_by": self.detected_by,
                "detected_s": _r(self.detected_s), "culprit": {"node": self.culprit_node, "rank": self.culprit_rank},
                "named_right": self.named_right if self.skip is None else None, "relaunch_s": _r(self.relaunch_s),
                "steps_redone": self.steps_redone, "lost_s": _r(self.lost_s),
                "goodput_at_one_per_hour": _r(hour, 4), "goodput_at_one_per_day": _r(day, 5), "notes": self.notes}


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(0.0, a - b)


def _r(x: float | None, n: int = 1) -> float | None:
    return None if x is None else round(x, n)


def _s(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.1f}{unit}"


def line(o: Outcome) -> str:
    """One line per fault, as the drill prints it."""
    if o.skip is not None:
        return f"{o.fault}: skipped: {o.skip}"
    where = f"rank {o.rank} on {o.node}" if o.rank is not None else str(o.node)
    if o.declared_at is None:
        return f"{o.fault} ({where}): NOT detected" + (f" ({'; '.join(o.notes)})" if o.notes else "")
    who = f"{o.culprit_node}/rank {o.culprit_rank}" if o.culprit_rank is not None else str(o.culprit_node)
    hour, day = goodput_at(o.lost_s)
    parts = [f"{o.fault} ({where}): detected after {_s(o.detected_s)} as {o.detected_by}",
             f"named {who} ({'right' if o.named_right else 'WRONG: injected ' + where})"]
    if o.fault != "straggler":
        parts.append(f"relaunch {_s(o.relaunch_s)}" if o.recovered_at is not None else "NOT recovered")
        parts.append(f"steps redone {'-' if o.steps_redone is None else o.steps_redone}")
    elif o.recovered_at is None:
        parts.append("the run did not go on after it")
    parts.append(f"time lost {_s(o.lost_s)}")
    if hour is not None:
        parts.append(f"goodput at one per hour {hour:.3f}, per day {day:.4f}")
    return "; ".join(parts)


@dataclass
class Report:
    run_id: str
    outcomes: list[Outcome]
    left: dict[str, list[int]] = field(default_factory=dict)  # node -> pids of the run or drill still there
    unchecked: dict[str, str] = field(default_factory=dict)  # node -> why it could not be checked
    settings: list[str] = field(default_factory=list)  # what the drill set on the run, in words

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes) and not self.left and not self.unchecked

    def to_json(self) -> dict:
        return {"ok": self.ok, "run_id": self.run_id, "settings": self.settings,
                "faults": [o.to_json() for o in self.outcomes],
                "left": {n: p for n, p in self.left.items()}, "unchecked": self.unchecked,
                "estimate": "goodput at one such fault per period P = 1 - time lost / P"}


__all__ = ["FAULTS", "Outcome", "Planned", "Report", "goodput_at", "line", "parse_faults", "plan"]

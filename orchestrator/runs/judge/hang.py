"""Hangs: the verdict from every rank's snapshot (runs/judge/hangsnap.py RankSnap), and what a restart
leaves out. When to take the snapshots is the watch's (runs/judge/hangwatch.py, its rule in
runs/judge/hangrule.py).

`analyze` turns the ranks' snapshots into one verdict. Per process group (the Flight Recorder's
pg_status, by pg id) the collective the most advanced ranks entered last (last_enqueued_collective,
the group's collective_seq_id) is the one they wait in; a member that has not entered it, and is
not itself inside an earlier one, is a culprit, named with its innermost frame outside the Python
and site-packages libraries. Every rank is a member of the default group, so a rank that has
entered none of its collectives (stuck before the first barrier) is behind too. A member that is
inside an earlier collective (entered, not completed: it waits there, it did not stay away) is no
culprit: when every rank waits inside a collective and none is behind, the ranks cannot reach each
other, and `with_links` names the node pairs that cannot open a TCP connection (the node agent's
`reach`). A member that cannot answer is named by its /proc state: stopped (T), uninterruptible
(D), gone. Ranks that entered the same sequence number with different collectives (or different
sizes) are a mismatch. Ranks that wait for each other across process groups (rank 0 in group 1's
collective that rank 1 never entered, rank 1 in group 2's that rank 0 never entered) are a
deadlock, found as a cycle of those waits. A mismatch and a deadlock are the script's own bug: a
restart on other nodes hangs again, so no node is blamed.

A broken link blames no node either; a restart cannot use both its ends, so `link_ends` picks the
fewest nodes whose absence leaves every pair able to reach each other (the node in most broken
pairs first; of two alike, not the master, else the later in rank order): --on-hang restart
leaves those out, for this run only, a spare in their place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from orchestrator.runs.judge.hangsnap import Frame, RankSnap, stacks_text, unanswered_why, word

__all__ = ["Frame", "RankSnap", "stacks_text", "Culprit", "HangVerdict", "analyze", "with_links", "link_ends"]

DEFAULT_HANG_TIMEOUT = 300.0
ON_HANG = ("fail", "restart", "observe")
SNAPSHOT_WAIT_S = 10.0  # how long a node's agent waits for its ranks' hooks to answer (a loaded
# node's rank was seen taking 5 s to answer its first request)
DEFAULT_PG = "0"  # the default process group's id in the Flight Recorder: every rank is a member


@dataclass(frozen=True)
class Culprit:
    rank: int
    node: str
    pid: int | None
    why: str

    def text(self) -> str:
        return f"rank {self.rank} ({self.node}, pid {self.pid or '?'}) {self.why}"


@dataclass(frozen=True)
class HangVerdict:
    text: str  # one line: "hang: rank 1 (n2, pid 4242) never entered gloo:all_reduce #41 ..."
    details: tuple[str, ...] = ()  # the lines under it: stacks grouped, what else was seen
    culprits: tuple[Culprit, ...] = ()
    collective: str | None = None  # "gloo:all_reduce #41" the others wait in
    mismatch: bool = False  # the script's own bug: restarting elsewhere would not help
    links: tuple[tuple[str, str], ...] = ()  # node pairs that cannot reach each other
    deadlock: bool = False  # ranks wait for each other in different process groups: the script's own bug too
    avoid: tuple[str, ...] = ()  # for broken links: the nodes a restart leaves out (link_ends), none blamed

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes a restart should leave out: the culprits' (none for a mismatch or a deadlock);
        for broken links, `avoid`."""
        if self.mismatch or self.deadlock:
            return ()
        return tuple(dict.fromkeys(c.node for c in self.culprits)) or self.avoid

    def to_json(self) -> dict:
        return {"text": self.text, "details": list(self.details), "collective": self.collective,
                "mismatch": self.mismatch, "deadlock": self.deadlock, "links": [list(p) for p in self.links],
                "avoid": list(self.avoid),
                "culprits": [{"rank": c.rank, "node": c.node, "pid": c.pid, "why": c.why} for c in self.culprits]}


def stack_groups(snaps: Iterable[RankSnap]) -> list[tuple[str, list[int]]]:
    """(innermost own frame, ranks) per distinct main-thread stack, the most common first."""
    groups: dict[str, list[int]] = {}
    for s in snaps:
        key = s.where or ("no answer: " + unanswered_why(s) if not s.answered else "no Python frame")
        groups.setdefault(key, []).append(s.rank)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))


def _standing(pg: str, snaps: list[RankSnap]) -> tuple[int, list[RankSnap], list[RankSnap], str]:
    """A process group's newest collective (its sequence number), the members that entered it,
    those behind, and the group's words in a verdict ("" for the default group). Every rank that
    answered is a member of the default group: one that entered none of its collectives is behind."""
    members = [s for s in snaps if pg in s.pgs or (pg == DEFAULT_PG and s.answered)]
    top = max((s.pgs[pg] for s in members if pg in s.pgs), default=-1)
    return (top, [s for s in members if s.pgs.get(pg, -1) == top], [s for s in members if s.pgs.get(pg, -1) < top],
            "" if pg == DEFAULT_PG else f" of process group {pg}")


def _pg_ids(snaps: list[RankSnap]) -> list[str]:
    """Every process group the ranks entered a collective of, the default group first."""
    return sorted({pg for s in snaps for pg in s.pgs}, key=lambda p: (p != DEFAULT_PG, p))


def _called(s: RankSnap, pg: str, seq: int) -> str:
    return s.names.get((pg, seq), ("a collective",))[0] + f" #{seq}"


def _mismatch(pg: str, top: int, group: str, waiting: list[RankSnap], by_rank: Mapping[int, RankSnap],
              culprits: dict[int, Culprit]) -> tuple[str, str]:
    """Ranks that entered different collectives as #top: (the one most entered, the mismatch's text);
    each rank of a smaller party is added to `culprits`."""
    kinds: dict[tuple[str, str], list[int]] = {}
    for s in waiting:
        kinds.setdefault(s.names.get((pg, top), ("?", "?")), []).append(s.rank)
    seen = {s.names.get((pg, top)) for s in waiting} - {None}
    same_names = len(seen) != len({k[0] for k in seen})  # then the sizes tell them apart
    parts = [f"{word(rs)} ({', '.join(dict.fromkeys(by_rank[r].node for r in rs))}) in {n}"
             f"{' of sizes ' + sz if same_names else ''}"
             for (n, sz), rs in sorted(kinds.items(), key=lambda kv: min(kv[1]))]
    biggest = max(kinds.values(), key=len)
    called = by_rank[biggest[0]].names[(pg, top)][0]
    for rs in (rs for rs in kinds.values() if rs is not biggest):
        for r in rs:
            s = by_rank[r]
            culprits.setdefault(r, Culprit(r, s.node, s.pid, f"called {s.names[(pg, top)][0]} as #{top} where "
                                                             f"{word(biggest)} called {called}"))
    # the collective is the one most ranks entered (a set's order would pick either at random)
    return f"{called} #{top}{group}", f"collective mismatch at #{top}{group}: " + "; ".join(parts)


def _group(pg: str, snaps: list[RankSnap], by_rank: Mapping[int, RankSnap], culprits: dict[int, Culprit],
           busy: Mapping[int, str]) -> tuple[str | None, str, bool]:
    """One process group: the collective its most advanced members entered last ("name #seq"),
    a mismatch's text when they entered different ones there, and whether a member is behind
    (each one behind, or diverging, is added to `culprits`). A member inside an earlier collective
    of the group waits there: it is not behind."""
    top, waiting, behind, group = _standing(pg, snaps)
    if not waiting:
        return None, "", False
    behind = [s for s in behind if pg not in s.inside]
    behind_ranks = {s.rank for s in behind}
    if pg == DEFAULT_PG:  # every rank is a member: one that did not answer has not entered it either
        behind_ranks |= set(culprits)
    if len({s.names.get((pg, top)) for s in waiting} - {None}) > 1:  # same sequence number, different collectives
        what, text = _mismatch(pg, top, group, waiting, by_rank, culprits)
        return what, text, False
    what = f"{_called(waiting[0], pg, top)}{group}"
    wait_ranks = [s.rank for s in waiting]
    they_wait = f"that {word(wait_ranks)} wait{'s' if len(wait_ranks) == 1 else ''} in"
    for s in behind:
        where = f"; its stack: {s.where}" if s.where else ""
        doing = f"{busy[s.rank]} and " if s.rank in busy else ""
        culprits[s.rank] = Culprit(s.rank, s.node, s.pid, f"{doing}never entered {what} {they_wait}{where}")
    for r in behind_ranks - {s.rank for s in behind}:
        c = culprits[r]
        culprits[r] = Culprit(c.rank, c.node, c.pid, f"{c.why}: it never entered {what} {they_wait}")
    return what, "", bool(behind_ranks)


def waits(snaps: list[RankSnap]) -> dict[int, list[tuple[int, str]]]:
    """rank -> [(a rank it waits for, the collective it waits in)], over every process group: a
    member at the group's newest collective waits for each member that has not entered it."""
    out: dict[int, list[tuple[int, str]]] = {}
    for pg in _pg_ids(snaps):
        top, waiting, behind, group = _standing(pg, snaps)
        for s in sorted(waiting, key=lambda s: s.rank):
            what = f"{s.names.get((pg, top), ('a collective',))[0]} #{top}{group}"
            out.setdefault(s.rank, []).extend((b.rank, what) for b in sorted(behind, key=lambda b: b.rank))
    return out


def cycle(edges: Mapping[int, list[tuple[int, str]]]) -> list[tuple[int, int, str]]:
    """A cycle of waits [(rank, the rank it waits for, in what)], from the lowest rank on it, or []."""
    for start in sorted(edges):
        path: list[tuple[int, int, str]] = []
        seen = {start}

        def walk(r: int) -> bool:
            for nxt, what in edges.get(r, ()):
                path.append((r, nxt, what))
                if nxt == start or (nxt not in seen and (seen.add(nxt) or walk(nxt))):
                    return True
                path.pop()
            return False

        if walk(start):
            return path
    return []


def inside_text(snaps: list[RankSnap]) -> str:
    """Where each rank waits: "every rank entered X" when all wait in one collective, else
    "ranks 0,2-3 in X; rank 1 in Y" (the ranks inside an earlier one named with it)."""
    at: dict[str, list[int]] = {}
    for s in snaps:
        pg, seq = max(s.inside.items(), key=lambda kv: (kv[0] == DEFAULT_PG, kv[1]))
        at.setdefault(_called(s, pg, seq) + ("" if pg == DEFAULT_PG else f" of process group {pg}"), []).append(s.rank)
    if len(at) == 1:
        return f"every rank entered {next(iter(at))}"
    return "every rank waits inside a collective (" + "; ".join(
        f"{word(rs)} in {w}" for w, rs in sorted(at.items(), key=lambda kv: min(kv[1]))) + ")"


def _ending(snaps: list[RankSnap], collective: str | None) -> str:
    """The verdict's text when no rank is named."""
    answered = [s for s in snaps if s.answered]
    if collective and answered and all(s.inside for s in answered):
        return (f"hang: {inside_text(answered)} and none came out: the ranks cannot reach each other (a link "
                "between nodes, or a firewall)")
    if collective:
        return f"hang: no rank made progress for the hang timeout; the last collective entered is {collective}"
    return "hang: no rank made progress for the hang timeout and none is in a collective"


def analyze(snaps: list[RankSnap], world: Iterable[int], ranks_of: Mapping[int, str] | None = None,
            busy: Mapping[int, str] | None = None) -> HangVerdict:
    """One verdict from every rank's snapshot; `world` is every global rank of the attempt and
    `ranks_of` their nodes (for a rank that has no process left); `busy`: rank -> what the watch
    saw it do (a rank busy in its own code past the bound), said before what it never entered."""
    world = sorted(set(world))
    by_rank = {s.rank: s for s in snaps}
    culprits: dict[int, Culprit] = {}
    details: list[str] = []

    for r in world:
        if r not in by_rank:
            culprits[r] = Culprit(r, (ranks_of or {}).get(r, "?"), None, "has no process left on its node")
    for s in snaps:
        if not s.answered:  # a rank spinning in its own code can starve its hook past the wait: still busy
            doing = f"{busy[s.rank]} and " if busy and s.rank in busy else ""
            culprits[s.rank] = Culprit(s.rank, s.node, s.pid, doing + unanswered_why(s))

    collective, mismatch, mismatch_text = None, False, ""
    for pg in _pg_ids(snaps):
        what, mismatched, behind = _group(pg, snaps, by_rank, culprits, busy or {})
        collective = collective or what
        if mismatched:
            mismatch, mismatch_text = True, mismatch_text or mismatched
        elif behind:
            collective = what
            break  # the first group with a rank behind explains the others' wait

    loop = [] if mismatch else cycle(waits([s for s in snaps if s.answered]))
    if loop:
        found = [culprits[r] for r in sorted(culprits)]  # behind in a group: what the others wait for
        culprits.update({r: Culprit(r, by_rank[r].node, by_rank[r].pid, f"waits in {what}, which rank {w} "
                                    f"({by_rank[w].node}) never entered") for r, w, what in loop})
        if found:
            details.append("so: " + "; ".join(c.text() for c in found))
    groups = stack_groups(snaps)
    if len(groups) > 1:
        details.append("stacks: " + "; ".join(f"{word(rs)} at {where}" for where, rs in groups))
    elif groups:
        details.append(f"stacks: every rank at {groups[0][0]}")
    ordered = [culprits[r] for r in sorted(culprits)]
    if mismatch:
        text = "hang: " + mismatch_text
    elif loop:
        ring = [r for r, _, _ in loop]
        text = "hang: deadlock: " + "; ".join(f"rank {c.rank} ({c.node}) {c.why}" for c in
                                              [culprits[r] for r in ring] + [c for c in ordered if c.rank not in ring])
    elif ordered:
        text = "hang: " + "; ".join(c.text() for c in ordered[:4]) + (f"; and {len(ordered) - 4} more"
                                                                       if len(ordered) > 4 else "")
    else:
        text = _ending(snaps, collective)
    return HangVerdict(text, tuple(details), tuple(ordered), collective, mismatch, deadlock=bool(loop))


def link_ends(down: Iterable[tuple[str, str]], order: Sequence[str]) -> tuple[str, ...]:
    """The fewest nodes whose absence leaves every pair in `down` apart: the node in the most broken
    pairs first; of two alike, not the master (order[0]), else the later in rank order."""
    pairs = {tuple(sorted(p)) for p in down}
    rank = {n: i for i, n in enumerate(order)}
    out: list[str] = []
    while pairs:
        count: dict[str, int] = {}
        for a, b in pairs:
            count[a], count[b] = count.get(a, 0) + 1, count.get(b, 0) + 1
        pick = max(count, key=lambda n: (count[n], rank.get(n, -1) != 0, rank.get(n, -1)))
        out.append(pick)
        pairs = {p for p in pairs if pick not in p}
    return tuple(sorted(out, key=lambda n: rank.get(n, -1)))


def with_links(v: HangVerdict, down: list[tuple[str, str]], order: Sequence[str] = ()) -> HangVerdict:
    """The verdict with the node pairs found unable to reach each other, and the nodes a restart
    leaves out for them (`link_ends` over the attempt's nodes in rank order)."""
    if not down:
        return v
    pairs = ", ".join(f"{a} ↔ {b}" for a, b in down)
    avoid = link_ends(down, order)
    where = v.text.split(" and none came out")[0] if " and none came out" in v.text else \
        f"hang: every rank waits in {v.collective or 'a collective'}"
    text = (f"{where} and the nodes {pairs} cannot reach each other (TCP to the node's SSH port times out); "
            "each still answers this machine")
    restart = (f"no node is to blame; --on-hang restart goes on without {', '.join(avoid)} (one end of each broken "
               "link, for this run only)")
    return replace(v, text=text, details=(*v.details, restart), links=tuple(down), avoid=avoid)

"""Hangs: a run whose ranks all stopped making progress is found, explained and acted on.

Progress is what the control machine already sees: any byte of any node's log (every rank's
lines arrive on the node streams, runs/watch.py). When none arrives for the hang timeout
(`--hang-timeout`, inventory `train.hang_timeout`, 300 s by default, 0 off), the watch
(runs/hangwatch.py) asks
every node's agent for a snapshot of each rank (`snapshot`: the rank's /proc state, and what the
hook clusterctl puts on the job's PYTHONPATH answers — every thread's Python stack and the Flight
Recorder, remote/hook/sitecustomize.py), waits CONFIRM_S, and asks again. A log byte or a
collective entered between the two is progress and the watch goes on; otherwise it is a hang:
both snapshots and the verdict go to runs/RUN/hangs/N/, the verdict to the run record, the
supervisor's log and the foreground, and the run's --on-hang policy applies (fail, restart
without the culprit's node, observe).

`analyze` turns the ranks' snapshots into one verdict. Per process group (the Flight Recorder's
pg_status, by pg id) the collective the most advanced ranks entered last (last_enqueued_collective,
the group's collective_seq_id) is the one they wait in; a member that has not entered it is a
culprit, named with its innermost frame outside the Python and site-packages libraries. A member
that cannot answer is named by its /proc state: stopped (T), uninterruptible (D), gone. Ranks
that entered the same sequence number with different collectives (or different sizes) are a
mismatch. Ranks that wait for each other across process groups (rank 0 in group 1's collective
that rank 1 never entered, rank 1 in group 2's that rank 0 never entered: each group's members
at its newest collective wait for those behind it) are a deadlock, found as a cycle of those
waits. A mismatch and a deadlock are the script's own bug: a restart on other nodes hangs again,
so no node is blamed. When every rank waits in the same collective and none is behind, the ranks
cannot reach each other: `probe_links` names the node pairs that cannot open a TCP connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from orchestrator.runs.linefold import rank_ranges

DEFAULT_HANG_TIMEOUT = 300.0
ON_HANG = ("fail", "restart", "observe")
SNAPSHOT_WAIT_S = 10.0  # how long a node's agent waits for its ranks' hooks to answer (a loaded
# node's rank was seen taking 5 s to answer its first request)
DEFAULT_PG = "0"  # the default process group's id in the Flight Recorder: every rank is a member


@dataclass(frozen=True)
class Frame:
    file: str
    line: int | None
    func: str
    code: str = ""
    lib: bool = False  # under the Python or site-packages library directories

    @property
    def where(self) -> str:
        return f"{Path(self.file).name}:{self.line} {self.func}"


@dataclass(frozen=True)
class RankSnap:
    """One rank at one moment, as its node's agent and its hook saw it."""

    node: str
    rank: int
    pid: int | None = None
    state: str = "?"  # /proc state: R running, S sleeping, D uninterruptible, T stopped, Z gone
    wchan: str = ""
    cpu_s: float | None = None
    error: str | None = None  # why there is no answer (stopped, no hook, no answer in time)
    threads: tuple[tuple[str, tuple[Frame, ...]], ...] = ()  # (name, frames outermost first), main first
    pgs: Mapping[str, int] = field(default_factory=dict)  # pg id -> last collective entered
    names: Mapping[tuple[str, int], tuple[str, str]] = field(default_factory=dict)  # (pg, seq) -> (name, sizes)
    from_outside: bool = False  # the threads were read by py-spy: the hook did not answer

    @property
    def answered(self) -> bool:
        """The rank's hook answered (py-spy's stacks of a silent rank do not count)."""
        return (bool(self.threads) and not self.from_outside) or bool(self.pgs)

    @property
    def main(self) -> tuple[Frame, ...]:
        return self.threads[0][1] if self.threads else ()

    @property
    def where(self) -> str | None:
        """The innermost frame of the main thread in the script's own code (else the innermost)."""
        frames = self.main
        own = [f for f in frames if not f.lib]
        pick = own[-1] if own else (frames[-1] if frames else None)
        return pick.where if pick else None

    @property
    def in_library(self) -> bool:
        """The main thread's innermost frame is library code (torch waiting in a collective)."""
        return bool(self.main) and self.main[-1].lib

    @classmethod
    def from_agent(cls, node: str, doc: Mapping) -> RankSnap:
        ans = doc.get("answer") or {}
        outside = not ans.get("stacks") and isinstance(doc.get("pyspy"), list)  # node_agent.py py_spy_stacks
        threads = []
        for t in (doc["pyspy"] if outside else ans.get("stacks") or []):
            frames = tuple(Frame(str(f.get("file") or "?"), f.get("line"), str(f.get("func") or "?"),
                                 str(f.get("code") or ""), bool(f.get("lib"))) for f in t.get("frames") or [])
            threads.append((str(t.get("thread") or "?"), frames))
        fr = ans.get("fr") or {}
        pgs = {str(k): int(v.get("last_enqueued_collective", -1)) for k, v in (fr.get("pg_status") or {}).items()}
        names = {}
        for e in fr.get("entries") or []:
            if e.get("is_p2p") or e.get("collective_seq_id") is None:
                continue
            names[(str(e.get("pg_id")), int(e["collective_seq_id"]))] = (str(e.get("profiling_name") or "?"),
                                                                        json.dumps(e.get("input_sizes")))
        rank = doc.get("rank")
        return cls(node, int(rank) if str(rank).isdigit() else -1, doc.get("pid"), str(doc.get("state") or "?"),
                   str(doc.get("wchan") or ""), doc.get("cpu_s"), doc.get("error") or ans.get("fr_error"),
                   tuple(threads), pgs, names, outside)


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

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes a restart should leave out: the culprits' (none for a mismatch, a deadlock or a
        partition whose side cannot be told)."""
        if self.mismatch or self.deadlock:
            return ()
        return tuple(dict.fromkeys(c.node for c in self.culprits))

    def to_json(self) -> dict:
        return {"text": self.text, "details": list(self.details), "collective": self.collective,
                "mismatch": self.mismatch, "deadlock": self.deadlock, "links": [list(p) for p in self.links],
                "culprits": [{"rank": c.rank, "node": c.node, "pid": c.pid, "why": c.why} for c in self.culprits]}


def _word(rs: Iterable[int]) -> str:
    rs = sorted(set(rs))
    return f"rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}"


def _unanswered_why(s: RankSnap) -> str:
    seen = f"; its stack (py-spy): {s.where}" if s.from_outside and s.where else ""
    if s.state in ("T", "t"):
        return "is stopped (state T: SIGSTOP, or a debugger holds it)" + seen
    if s.state == "D":
        return f"is in uninterruptible sleep (state D{', in ' + s.wchan if s.wchan and s.wchan != '0' else ''})" + seen
    if s.state in ("Z", "X"):
        return "has exited (its process is a zombie)"
    return f"did not answer ({s.error or 'no hook'}; state {s.state})" + seen


def stack_groups(snaps: Iterable[RankSnap]) -> list[tuple[str, list[int]]]:
    """(innermost own frame, ranks) per distinct main-thread stack, the most common first."""
    groups: dict[str, list[int]] = {}
    for s in snaps:
        key = s.where or ("no answer: " + _unanswered_why(s) if not s.answered else "no Python frame")
        groups.setdefault(key, []).append(s.rank)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))


def _standing(pg: str, snaps: list[RankSnap]) -> tuple[int, list[RankSnap], list[RankSnap], str]:
    """A process group's newest collective (its sequence number), the members that entered it,
    those behind, and the group's words in a verdict ("" for the default group)."""
    members = [s for s in snaps if pg in s.pgs]
    top = max((s.pgs[pg] for s in members), default=-1)
    return (top, [s for s in members if s.pgs[pg] == top], [s for s in members if s.pgs[pg] < top],
            "" if pg == DEFAULT_PG else f" of process group {pg}")


def _pg_ids(snaps: list[RankSnap]) -> list[str]:
    """Every process group the ranks entered a collective of, the default group first."""
    return sorted({pg for s in snaps for pg in s.pgs}, key=lambda p: (p != DEFAULT_PG, p))


def _group(pg: str, snaps: list[RankSnap], by_rank: Mapping[int, RankSnap], culprits: dict[int, Culprit]
           ) -> tuple[str | None, str, bool]:
    """One process group: the collective its most advanced members entered last ("name #seq"),
    a mismatch's text when they entered different ones there, and whether a member is behind
    (each one behind, or diverging, is added to `culprits`)."""
    top, waiting, behind, group = _standing(pg, snaps)
    if not waiting:
        return None, "", False
    behind_ranks = {s.rank for s in behind}
    if pg == DEFAULT_PG:  # every rank is a member: one that did not answer has not entered it either
        behind_ranks |= set(culprits)
    seen = {s.names.get((pg, top)) for s in waiting} - {None}
    what = f"{next(iter(seen))[0] if seen else 'a collective'} #{top}{group}"
    if len(seen) > 1:  # the same sequence number, different collectives: the ranks diverged
        kinds: dict[tuple[str, str], list[int]] = {}
        for s in waiting:
            kinds.setdefault(s.names.get((pg, top), ("?", "?")), []).append(s.rank)
        same_names = len(seen) != len({k[0] for k in seen})  # then the sizes tell them apart
        parts = [f"{_word(rs)} ({', '.join(dict.fromkeys(by_rank[r].node for r in rs))}) in {n}"
                 f"{' of sizes ' + sz if same_names else ''}"
                 for (n, sz), rs in sorted(kinds.items(), key=lambda kv: min(kv[1]))]
        biggest = max(kinds.values(), key=len)
        called = by_rank[biggest[0]].names[(pg, top)][0]
        for rs in (rs for rs in kinds.values() if rs is not biggest):
            for r in rs:
                s = by_rank[r]
                culprits.setdefault(r, Culprit(r, s.node, s.pid, f"called {s.names[(pg, top)][0]} as #{top} where "
                                                                 f"{_word(biggest)} called {called}"))
        # the collective is the one most ranks entered (a set's order would pick either at random)
        return f"{called} #{top}{group}", f"collective mismatch at #{top}{group}: " + "; ".join(parts), False
    wait_ranks = [s.rank for s in waiting]
    they_wait = f"that {_word(wait_ranks)} wait{'s' if len(wait_ranks) == 1 else ''} in"
    for s in behind:
        where = f"; its stack: {s.where}" if s.where else ""
        culprits[s.rank] = Culprit(s.rank, s.node, s.pid, f"never entered {what} {they_wait}{where}")
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


def analyze(snaps: list[RankSnap], world: Iterable[int], ranks_of: Mapping[int, str] | None = None) -> HangVerdict:
    """One verdict from every rank's snapshot; `world` is every global rank of the attempt and
    `ranks_of` their nodes (for a rank that has no process left)."""
    world = sorted(set(world))
    by_rank = {s.rank: s for s in snaps}
    culprits: dict[int, Culprit] = {}
    details: list[str] = []

    for r in world:
        if r not in by_rank:
            culprits[r] = Culprit(r, (ranks_of or {}).get(r, "?"), None, "has no process left on its node")
    for s in snaps:
        if not s.answered:
            culprits[s.rank] = Culprit(s.rank, s.node, s.pid, _unanswered_why(s))

    collective, mismatch, mismatch_text = None, False, ""
    for pg in _pg_ids(snaps):
        what, mismatched, behind = _group(pg, snaps, by_rank, culprits)
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
        details.append("stacks: " + "; ".join(f"{_word(rs)} at {where}" for where, rs in groups))
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
    elif collective and all(s.in_library for s in snaps):
        text = (f"hang: every rank entered {collective} and none came out: the ranks cannot reach each other "
                "(a link between nodes, or a firewall)")
    elif collective:
        text = f"hang: no rank made progress for the hang timeout; the last collective entered is {collective}"
    else:
        text = "hang: no rank made progress for the hang timeout and none is in a collective"
    return HangVerdict(text, tuple(details), tuple(ordered), collective, mismatch, deadlock=bool(loop))


BUSY = 0.5  # a rank that used this share of a core between the snapshots is working, not hung


def progressed(before: list[RankSnap], after: list[RankSnap], elapsed: float = 0.0) -> str | None:
    """Why the run is not hung, from two snapshots `elapsed` s apart: a rank entered a collective
    (of the ranks that answered both: one too slow to answer the first is not taken for one that
    moved), or a rank is busy in its own code (a long evaluation, torch.compile, tokenizing before
    the first line: CPU time, not a wait). None: no progress."""
    old = {s.rank: s for s in before}
    for s in after:
        o = old.get(s.rank)
        if o is None:
            continue
        if s.answered and o.answered and any(seq > o.pgs.get(pg, -1) for pg, seq in s.pgs.items()):
            return "the ranks still enter collectives: not a hang (the script is quiet)"
        if elapsed > 0 and s.cpu_s is not None and o.cpu_s is not None and s.cpu_s - o.cpu_s >= BUSY * elapsed:
            share = (s.cpu_s - o.cpu_s) / elapsed
            return (f"rank {s.rank} ({s.node}) is busy in its own code ({share:.0%} of a core"
                    f"{', at ' + s.where if s.where else ''}): not a hang")
    return None


def with_links(v: HangVerdict, down: list[tuple[str, str]]) -> HangVerdict:
    """The verdict with the node pairs found unable to reach each other."""
    if not down:
        return v
    pairs = ", ".join(f"{a} ↔ {b}" for a, b in down)
    text = (f"hang: every rank waits in {v.collective or 'a collective'} and the nodes {pairs} cannot reach "
            "each other (TCP to the node's SSH port times out); each still answers this machine")
    return HangVerdict(text, v.details, v.culprits, v.collective, v.mismatch, tuple(down), v.deadlock)


def stacks_text(snaps: list[RankSnap]) -> str:
    """Every rank's threads, identical main stacks printed once under their ranks (`clusterctl stack`)."""
    groups: dict[tuple, list[RankSnap]] = {}
    for s in sorted(snaps, key=lambda s: s.rank):
        key = (tuple((name, tuple((f.file, f.line, f.func) for f in frames)) for name, frames in s.threads),
               tuple(sorted(s.pgs.items()))) if s.answered else \
            ("state", s.state, s.error, tuple((f.file, f.line, f.func) for f in s.main))
        groups.setdefault(key, []).append(s)
    out = []
    for key, members in groups.items():
        head = ", ".join(f"{s.node} r{s.rank} pid {s.pid}" for s in members)
        out.append(f"---- {_word(s.rank for s in members)} ({head})")
        s = members[0]
        if not s.answered:
            out.append(f"  no answer: {_unanswered_why(s)}")
            if not s.threads:
                continue
            out.append("  read from outside by py-spy:")
        for name, frames in s.threads:
            out.append(f"  thread {name}:")
            for f in frames:
                out.append(f"    {f.file}:{f.line} in {f.func}" + (f"\n      {f.code}" if f.code else ""))
        colls = sorted(s.pgs.items())
        if colls:
            out.append("  collectives entered: " + ", ".join(
                f"pg {pg} #{seq} {s.names.get((pg, seq), ('?',))[0]}" for pg, seq in colls))
    return "\n".join(out) + "\n"

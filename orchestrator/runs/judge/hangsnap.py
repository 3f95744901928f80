"""One rank at one moment, as its node's agent and its hook saw it (`snapshot`: the rank's /proc
state and CPU, its stacks and Flight Recorder), and `clusterctl stack`'s text of many; and
`links_down`, the node pairs that cannot reach each other (the hang watch's probe when every rank
waits and none is to blame).

The Flight Recorder's pg_status gives, per process group, the newest collective the rank entered
(last_enqueued_collective) and the newest one it came out of (last_completed_collective; gloo
records the completion a moment after the call returned, and can leave it one behind for good): a
rank whose newest entered is past its newest completed, and whose main thread (when its stacks are
known) waits in library code, is inside that collective, waiting for the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from orchestrator.node import agent
from orchestrator.runs.logs.fold import rank_ranges


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


def _ints(d: Mapping, key: str) -> dict[str, int]:
    return {str(k): int(v[key]) for k, v in d.items() if isinstance(v, Mapping) and key in v}


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
    done: Mapping[str, int] = field(default_factory=dict)  # pg id -> last collective completed
    tree_cpu_s: float | None = None  # CPU seconds of every process of the rank (its data-loader workers too)
    io: int | None = None  # bytes its processes read from and wrote to storage (/proc/PID/io)
    t: float | None = None  # when its CPU and I/O were read, on the node's clock
    step: int | None = None  # the newest step the script told clusterctl_step
    replied: bool = False  # the hook answered (a progress answer before the first collective says little)
    exiting: bool = False  # its script ended: the hook's atexit ran (the run's end, not a hang)
    # pg -> when it entered its newest collective there (the Flight Recorder's time_created_ns: the
    # node's clock), where the answer carried it (a snapshot's entries, a progress answer's "entered")
    entered_at: Mapping[str, float] = field(default_factory=dict)

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

    @property
    def inside(self) -> dict[str, int]:
        """pg -> the collective the rank is inside now (entered, not completed); where the Flight
        Recorder says nothing of completions (an older torch), a rank of one process group whose main
        thread waits in library code is taken to be inside the newest collective it entered. A rank
        whose stacks show its main thread in its own code is inside none, whatever the counters say:
        torch 2.13's gloo writes "last completed" from two worker threads unordered, and an older
        number written last stays (a rank computing alone read [3, 2] for as long as it was asked)."""
        if self.done:
            if self.main and not self.in_library:
                return {}
            return {pg: seq for pg, seq in self.pgs.items() if seq > self.done.get(pg, -1)}
        return dict(self.pgs) if len(self.pgs) == 1 and self.in_library else {}

    @property
    def inside_since(self) -> float | None:
        """When the rank entered the newest of the collectives it is inside now (node clock): the
        last time its progress moved, where the Flight Recorder says so for each of them."""
        inside = self.inside
        if not inside or any(pg not in self.entered_at for pg in inside):
            return None
        return max(self.entered_at[pg] for pg in inside)

    @property
    def cpu(self) -> float | None:
        return self.tree_cpu_s if self.tree_cpu_s is not None else self.cpu_s

    @classmethod
    def from_agent(cls, node: str, doc: Mapping, t: float | None = None) -> RankSnap:
        ans = doc.get("answer") or {}
        outside = not ans.get("stacks") and isinstance(doc.get("pyspy"), list)  # remote/agent_snapshot.py py_spy_stacks
        threads = []
        for th in (doc["pyspy"] if outside else ans.get("stacks") or []):
            frames = tuple(Frame(str(f.get("file") or "?"), f.get("line"), str(f.get("func") or "?"),
                                 str(f.get("code") or ""), bool(f.get("lib"))) for f in th.get("frames") or [])
            threads.append((str(th.get("thread") or "?"), frames))
        fr = ans.get("fr") or {}
        status = fr.get("pg_status") or {}
        pgs, done = _ints(status, "last_enqueued_collective"), _ints(status, "last_completed_collective")
        if not status and isinstance(ans.get("pgs"), Mapping):  # a progress answer: {pg: [entered, completed]}
            pgs = {str(k): int(v[0]) for k, v in ans["pgs"].items()}
            done = {str(k): int(v[1]) for k, v in ans["pgs"].items()}
        names, entered = {}, {}
        for e in fr.get("entries") or []:
            if e.get("is_p2p") or e.get("collective_seq_id") is None:
                continue
            names[(str(e.get("pg_id")), int(e["collective_seq_id"]))] = (str(e.get("profiling_name") or "?"),
                                                                        json.dumps(e.get("input_sizes")))
            entered[(str(e.get("pg_id")), int(e["collective_seq_id"]))] = e.get("time_created_ns")
        for e in ans.get("entered") or []:  # a progress answer's [[pg, seq, time_created_ns]]
            if isinstance(e, (list, tuple)) and len(e) == 3 and isinstance(e[1], int):
                entered[(str(e[0]), e[1])] = e[2]
        entered_at = {pg: entered[(pg, seq)] / 1e9 for pg, seq in pgs.items()
                      if isinstance(entered.get((pg, seq)), (int, float)) and entered[(pg, seq)] > 0}
        steps = [s[0] for s in ans.get("steps") or () if isinstance(s, (list, tuple)) and s]
        step = ans.get("step") if isinstance(ans.get("step"), int) else (steps[-1] if steps else None)
        rank = doc.get("rank")
        return cls(node, int(rank) if str(rank).isdigit() else -1, doc.get("pid"), str(doc.get("state") or "?"),
                   str(doc.get("wchan") or ""), doc.get("cpu_s"), doc.get("error") or ans.get("fr_error"),
                   tuple(threads), pgs, names, outside, done, doc.get("tree_cpu_s"), doc.get("io"),
                   doc.get("at") or t or doc.get("time"), step, bool(ans), bool(doc.get("exiting")), entered_at)


def snaps_of(docs: Mapping[str, object], say=None) -> list[RankSnap]:
    """Every rank of the nodes' `snapshot` replies (node/agent.py Snapshot), each at its node's
    time; a node without a reply is said (`say`) and left out."""
    out: list[RankSnap] = []
    for name, sn in sorted(docs.items()):
        if getattr(sn, "error", None) is not None:
            if say is not None:
                say(f"{name}: no snapshot: {sn.error}")
            continue
        out.extend(RankSnap.from_agent(name, d, getattr(sn, "time", None)) for d in sn.ranks)
    return out


def word(rs: Iterable[int]) -> str:
    rs = sorted(set(rs))
    return f"rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}"


def unanswered_why(s: RankSnap) -> str:
    seen = f"; its stack (py-spy): {s.where}" if s.from_outside and s.where else ""
    if s.state in ("T", "t"):
        return "is stopped (state T: SIGSTOP, or a debugger holds it)" + seen
    if s.state == "D":
        return f"is in uninterruptible sleep (state D{', in ' + s.wchan if s.wchan and s.wchan != '0' else ''})" + seen
    if s.state in ("Z", "X"):
        return "has exited (its process is a zombie)"
    return f"did not answer ({s.error or 'no hook'}; state {s.state})" + seen


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
        out.append(f"---- {word(s.rank for s in members)} ({head})")
        s = members[0]
        if not s.answered:
            out.append(f"  no answer: {unanswered_why(s)}")
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


def links_down(cluster, inv, names: list[str]) -> list[tuple[str, str]]:
    """The node pairs among `names` that cannot open a TCP connection to each other's SSH port
    (each node's agent `reach`)."""
    nodes = {n: inv.node(n) for n in names}
    target = {n: nd.hostport(nd.ssh.port or 22) for n, nd in nodes.items()}
    got = agent.run(cluster, lambda nd: agent.reach(nd, [t for m, t in target.items() if m != nd.name]), names)
    down = set()
    for a, r in got.items():
        for b, t in target.items():
            if b != a and r.error is None and r.result.get(t, "ok") != "ok":
                down.add(tuple(sorted((a, b))))
    return sorted(down)

"""Every rank's progress as its hook answers it, kept where `watch`, `status` and the stall flag
read it: runs/RUN/progress/NODE.json (this machine's files only: a frozen node never freezes a
view).

The nodes' log streams bring each rank's progress answer every PERIOD_S (runs/logs/streams.py: the
stream process asks the hooks, remote/hook/sitecustomize.py `_progress`): the steps a script told
`clusterctl_step` (the shipped trainer does, on every rank), and the collectives it entered (its
Flight Recorder: each newest entry when it told no steps, else its process groups' newest
sequence numbers), which every rank of a distributed job has whether it prints or not. Each
node's file holds, per rank, the newest step, the collectives entered (the highest seq per
process group, summed), when either last grew and when the rank last answered, all on this
machine's clock, under the attempt's key (a file of another attempt is not this one's). The
slowest rank's step (else its collectives) goes to the attempt's step journal too
(runs/stepjournal.py), with the time it came.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from orchestrator.runs.progress import collectives
from orchestrator.runs.stepjournal import StepJournal, attempt_of

DIR = "progress"


@dataclass(frozen=True)
class RankProgress:
    """One rank's progress as its hook said it."""

    rank: int
    step: int | None  # the newest step told to clusterctl_step
    collectives: int | None  # collectives entered, every process group together
    moved: float | None  # when the step or the collectives last grew (this machine's clock)
    asked: float | None  # when the rank last answered


class ProgressLog:
    """Takes the nodes' progress documents (node agent `snapshot_doc`, what=progress) as they come
    and writes each node's file; the supervisor's, one per attempt."""

    def __init__(self, run_dir: Path, key: str):
        self.dir = run_dir / DIR
        self.key = key
        self.ranks: dict[int, dict] = {}  # rank -> {"node", "step", "pgs": {pg: seq}, "moved", "asked"}
        self.of_node: dict[str, dict[int, dict]] = {}  # node -> its ranks' entries (those of self.ranks)
        self.low: dict[str, tuple[int | None, int | None]] = {}  # node -> its slowest rank's (step, collectives)
        self.steps = StepJournal(run_dir, attempt_of(key))  # the slowest rank's progress, when it came

    def feeder(self, *then: Callable[[str, Mapping], None] | None) -> Callable[[str, Mapping], None]:
        """The sink for the nodes' streams (runs/logs/streams.py copy_logs `progress`): each document
        kept here, then handed to each of `then` that is not None (the straggler watch's feed, the
        hang watch's)."""
        sinks = [t for t in then if t is not None]

        def feed(node: str, doc: Mapping) -> None:
            self.feed(node, doc)
            for sink in sinks:
                sink(node, doc)
        return feed

    def feed(self, node: str, doc: Mapping, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for r in doc.get("ranks") or ():
            answer = r.get("answer") or {}
            if not str(r.get("rank")).isdigit() or not answer:
                continue
            mine = self.ranks.setdefault(int(r["rank"]), {"node": node, "step": None, "pgs": {}, "moved": None})
            if mine["node"] != node:  # a rank another node answered for before: no longer that node's
                self.of_node.get(mine["node"], {}).pop(int(r["rank"]), None)
                self._lowest(mine["node"])
                self.write(mine["node"])
            self.of_node.setdefault(node, {})[int(r["rank"])] = mine
            mine["node"], mine["asked"] = node, now
            grew = False
            steps = [s[0] for s in answer.get("steps") or () if isinstance(s, (list, tuple)) and s]
            if steps and (mine["step"] is None or max(steps) > mine["step"]):
                mine["step"], grew = max(steps), True
            entered = collectives(answer.get("entered") or ()) or \
                {str(pg): int(v[0]) for pg, v in (answer.get("pgs") or {}).items() if isinstance(v, list) and v}
            for pg, seq in entered.items():
                if seq > mine["pgs"].get(pg, -1):
                    mine["pgs"][pg], grew = seq, True
            if grew:
                mine["moved"] = now
        self.write(node)
        self._lowest(node)
        # the slowest rank of all from each node's slowest: a document costs its node's ranks and the
        # node count, not every rank (64 x 8: every rank for each of 64 documents a period, before)
        stepped = [lo[0] for lo in self.low.values() if lo[0] is not None]
        entered = [lo[1] for lo in self.low.values() if lo[1] is not None]
        self.steps.hook(min(stepped) if stepped else None, min(entered) if entered else None, now)

    def _lowest(self, node: str) -> None:
        mine = self.of_node.get(node) or {}
        stepped = [p["step"] for p in mine.values() if p["step"] is not None]
        entered = [sum(p["pgs"].values()) for p in mine.values() if p["pgs"]]
        self.low[node] = (min(stepped) if stepped else None, min(entered) if entered else None)

    def write(self, node: str) -> None:
        ranks = {str(r): {"step": p["step"], "collectives": sum(p["pgs"].values()) if p["pgs"] else None,
                          "moved": p["moved"], "asked": p.get("asked")}
                 for r, p in sorted((self.of_node.get(node) or {}).items())}
        tmp = self.dir / f".{node}.json.tmp"
        try:
            self.dir.mkdir(exist_ok=True)
            tmp.write_text(json.dumps({"key": self.key, "node": node, "ranks": ranks}))
            os.replace(tmp, self.dir / f"{node}.json")
        except OSError:  # the view goes without; the run goes on (a full disk: no torn file left)
            tmp.unlink(missing_ok=True)


def read(run_dir: Path, key: str | None) -> dict[int, RankProgress]:
    """Every rank's progress in the attempt `key`'s files (none: {})."""
    out: dict[int, RankProgress] = {}
    if not key:
        return out
    for path in sorted((run_dir / DIR).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("key") != key:
            continue
        for r, p in (doc.get("ranks") or {}).items():
            if str(r).isdigit() and isinstance(p, dict):
                out[int(r)] = RankProgress(int(r), p.get("step"), p.get("collectives"), p.get("moved"), p.get("asked"))
    return out

"""Every rank's progress as its hook answers it, kept where `watch`, `status` and the stall flag
read it: runs/RUN/progress/NODE.json (this machine's files only: a frozen node never freezes a
view).

The nodes' log streams bring each rank's progress answer every PERIOD_S (runs/watch.py: the
stream process asks the hooks, remote/hook/sitecustomize.py `_progress`): the steps a script told
`clusterctl_step` (the shipped trainer does, on every rank), else the collectives it entered (its
Flight Recorder), which every rank of a distributed job has whether it prints or not. Each
node's file holds, per rank, the newest step, the collectives entered (the highest seq per
process group, summed), when either last grew and when the rank last answered, all on this
machine's clock, under the attempt's key (a file of another attempt is not this one's).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from orchestrator.runs.progress import collectives

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

    def feeder(self, then: Callable[[str, Mapping], None] | None = None) -> Callable[[str, Mapping], None]:
        """The sink for the nodes' streams (runs/watch.py copy_logs `progress`): each document
        kept here, then handed to `then` (the straggler watch's feed), if any."""
        def feed(node: str, doc: Mapping) -> None:
            self.feed(node, doc)
            if then is not None:
                then(node, doc)
        return feed

    def feed(self, node: str, doc: Mapping, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for r in doc.get("ranks") or ():
            answer = r.get("answer") or {}
            if not str(r.get("rank")).isdigit() or not answer:
                continue
            mine = self.ranks.setdefault(int(r["rank"]), {"node": node, "step": None, "pgs": {}, "moved": None})
            mine["node"], mine["asked"] = node, now
            grew = False
            steps = [s[0] for s in answer.get("steps") or () if isinstance(s, (list, tuple)) and s]
            if steps and (mine["step"] is None or max(steps) > mine["step"]):
                mine["step"], grew = max(steps), True
            for pg, seq in collectives(answer.get("entered") or ()).items():
                if seq > mine["pgs"].get(pg, -1):
                    mine["pgs"][pg], grew = seq, True
            if grew:
                mine["moved"] = now
        self.write(node)

    def write(self, node: str) -> None:
        ranks = {str(r): {"step": p["step"], "collectives": sum(p["pgs"].values()) if p["pgs"] else None,
                          "moved": p["moved"], "asked": p.get("asked")}
                 for r, p in sorted(self.ranks.items()) if p["node"] == node}
        try:
            self.dir.mkdir(exist_ok=True)
            tmp = self.dir / f".{node}.json.tmp"
            tmp.write_text(json.dumps({"key": self.key, "node": node, "ranks": ranks}))
            os.replace(tmp, self.dir / f"{node}.json")
        except OSError:  # the view goes without; the run goes on
            pass


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

"""What a job's checkpoint directory held before the run is not the run's (`train --checkpoint-dir`).

A run's checkpoints are its own. Reusing `out/` between runs is the default of nanoGPT, of
Lightning's `ModelCheckpoint(dirpath=...)` and of the HF Trainer, so DIR often holds an earlier
run's `ckpt.pt`, `last.ckpt` or `step_000160/` when a run starts. Before attempt 1 launches, every
entry of DIR on each of its nodes is moved to ~/.clusterctl/artifacts/RUN/set-aside/before-run/ on
that node (remote/ckptdir.py `setaside`): the job never sees it (nanoGPT's --init_from=resume or
Lightning's --ckpt_path would load it), and no snapshot of the run takes it, so no relaunch
restores it. runs/RUN/set-aside.json records node by node where it went and every file (size,
mtime); the story says what was set aside and how to get it back.

`train --resume-from RUN:set-aside` puts it back on purpose: every node that holds a part hashes
it (`digest`, which also sees a file changed since), and the union (a file several nodes hold
from the first in RUN's rank order, as snapshots are made) is placed into DIR on every node of the
new run's first attempt, node to node, each file checked against that sha256
(runs/ckpt/jobdir_replicas.py `place`). The set-aside itself stays where it is.

A relaunch with no snapshot of the run moves what the failed attempt left in DIR aside in the same
way (set-aside/TIME/, runs/restart.py): a torn save, or one never complete everywhere, is not the
run's checkpoint either.
"""

from __future__ import annotations

import json
import posixpath
import time
from pathlib import Path
from typing import Callable

from orchestrator.errors import LaunchError
from orchestrator.node import ckptdir as door
from orchestrator.node import wire
from orchestrator.runs.ckpt.jobdir_replicas import NodeRestoreDirError, place
from orchestrator.runs.store import write_json
from orchestrator.transport import Cluster

BEFORE_RUN = "before-run"  # the set-aside directory of what DIR held when the run started
RECORD = "set-aside.json"  # in the run directory
FORM = "set-aside"  # train --resume-from RUN:set-aside


def aside_dir(dirs: dict, name: str) -> str:
    """~/.clusterctl/artifacts/RUN/set-aside/NAME on a node, from its artifact directories."""
    return posixpath.join(posixpath.dirname(dirs["checkpoints"]), "set-aside", name)


def set_aside(cluster: Cluster, paths: dict[str, str], asides: dict[str, str]) -> dict[str, dict]:
    """Every entry of DIR (`paths`: node -> DIR there) moved into `asides[node]` on each node.
    -> {node: {"path", "aside": [names moved now], "files": [[rel, size, mtime_ns]] of all there}}.
    LaunchError (nothing launched) when a node could not."""
    res = wire.run(cluster, lambda n: door.call(n, "setaside", paths[n.name], asides[n.name], timeout=600), list(paths))
    bad = [f"{k}: {got.error}" for k, got in res.items() if not got.ok]
    if bad:
        raise LaunchError("could not set aside what the checkpoint directory held, nothing was started: "
                          + "; ".join(bad))
    return {k: got.doc for k, got in res.items()}


def in_words(files: list, limit: int = 4) -> str:
    """'last.ckpt, epoch=0-step=10.ckpt; 2 files, 0.1 MB' of [[rel, size, mtime_ns]]."""
    tops = sorted({rel.split("/", 1)[0] for rel, _s, _m in files})
    shown = ", ".join(tops[:limit]) + (f" and {len(tops) - limit} more" if len(tops) > limit else "")
    n = len(files)
    return f"{shown}; {n} file{'s' if n != 1 else ''}, {sum(s for _r, s, _m in files) / 1e6:.1f} MB"


class Found:
    """runs/RUN/set-aside.json: what DIR held on each node when RUN started, and where it is now."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / RECORD

    def doc(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def write(self, checkpoint_dir: str, order: list[str], replies: dict[str, dict]) -> None:
        nodes = {n: {"path": r["path"], "files": r["files"]} for n, r in replies.items() if r["files"]}
        if nodes:
            write_json(self.path, {"checkpoint_dir": checkpoint_dir, "taken": time.time(),
                                   "order": [n for n in order if n in nodes], "nodes": nodes})

    def about(self) -> str | None:
        """'last.ckpt; 1 file, 0.1 MB, from out on node1'; None: nothing was set aside."""
        doc = self.doc()
        if not doc:
            return None
        files = [[rel, m["size"], m["mtime_ns"]] for rel, m in union(doc).items()]
        return f"{in_words(files)}, from {doc['checkpoint_dir']} on {', '.join(doc['order'])}"


def union(doc: dict) -> dict[str, dict]:
    """A Found doc's files as one directory: {rel: {"node", "size", "mtime_ns"}}, a file several
    nodes hold from the first in rank order (as runs/ckpt/jobdir_home.py `plan` makes a snapshot)."""
    files: dict[str, dict] = {}
    for node in doc["order"]:
        for rel, size, mtime_ns in doc["nodes"][node]["files"]:
            files.setdefault(rel, {"node": node, "size": size, "mtime_ns": mtime_ns})
    return files


def put_back(cluster: Cluster, doc: dict, paths: dict[str, str], aside: dict[str, str],
             say: Callable[[str], None]) -> dict[str, dict]:
    """A Found doc's files into DIR on every node of `paths` (see the module's docstring).
    -> each node's reply (ckptdir.restore_dir's shape). LaunchError when a part's holder does not
    answer, its files changed, or placing failed; nothing of DIR is changed before every part checks out."""
    files = union(doc)
    origins = sorted({m["node"] for m in files.values()})
    gone = [o for o in origins if o not in cluster.live(origins)]
    if gone:
        raise LaunchError(f"cannot put back what was set aside: {', '.join(gone)}, which "
                          f"{'holds' if len(gone) == 1 else 'hold'} part of it, cannot be reached. "
                          "Nothing was started.")
    for origin in origins:
        part = [[rel, m["size"], m["mtime_ns"]] for rel, m in sorted(files.items()) if m["node"] == origin]
        where = doc["nodes"][origin]["path"]
        ans = wire.run(cluster, lambda n: door.call(n, "digest", where, data=json.dumps(part).encode(), timeout=600),
                       [origin])[origin]
        got = ans.doc if ans.ok else {"why": ans.error}
        if got["why"]:
            raise LaunchError(f"cannot put back what was set aside on {origin} ({where}): {got['why']}. "
                              "Nothing was started.")
        for rel, sha in got["files"].items():
            files[rel]["sha256"] = sha
    try:
        return place(cluster, {"files": files}, FORM, {o: [o] for o in origins}, paths, aside, say,
                     part_dir=lambda holder, origin: doc["nodes"][origin]["path"])
    except NodeRestoreDirError as e:
        raise LaunchError(f"{e}. Nothing was started.") from e

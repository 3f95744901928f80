"""A job's checkpoint directory carried node to node (`--checkpoint-dir` with train.copy_checkpoints
false and train.checkpoint_replica true): no byte of it crosses the control machine.

The snapshots are the ones runs/ckpt/jobdir_home.py takes (the same completeness rule, the same looks that
capture each complete version on its node, the same union of the nodes' entries), but they are
kept on the nodes. When there is something new, every node that wrote part of it freezes its part
(remote/ckptdir.py `freeze`): the look's captures are linked beside its run's artifacts,
~/.clusterctl/artifacts/RUN/dirsnaps/NODE/snap-N/, out of the job's reach (nanoGPT rewrites ckpt.pt
in place; a frozen copy is never written again, and a file unchanged since the previous snapshot
is hard-linked to it). Then the part is copied to the node after it in the
attempt's rank order (`replicas.ring`), into the same place there, node to node
(transfer/pair.py `copy_files`), files the neighbour already holds linked there instead. The
control machine keeps only each snapshot's manifest, runs/RUN/checkpoints/nodes/snap-N.json:
every file's sha256 and which nodes hold which part, written once both copies are made.

`restore_from_nodes` puts the newest snapshot whose every part is still held intact somewhere
(each holder checks its copy against the manifest's sha256) into DIR on every node of the next
attempt: a part this node holds is copied locally, the others node to node from a holder, into a
staging directory beside DIR's entries; then every file is checked again and DIR is swapped as
runs/ckpt/jobdir_home.py's restore does (other entries set aside). So the cut of any one node loses no
snapshot: what it wrote is on its neighbour too.
"""

from __future__ import annotations

import json
import posixpath
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from orchestrator import shell
from orchestrator.node import ckptdir as door
from orchestrator.node import wire
from orchestrator.runs.ckpt.given_home import ArtifactCopier, CheckpointStore
from orchestrator.runs.ckpt.jobdir_home import CHANGED, INTERVAL_S, TIMEOUT, DirCopier, DirStore, roots_of, step_of_names
from orchestrator.runs.ckpt.given_replicas import Replicator, ring
from orchestrator.transfer import pair
from orchestrator.transport import Cluster

STAGED = ".clusterctl-restore-in"  # a restore's staging directory inside DIR (ckptdir `state` skips it)


class NodeSnaps(DirStore):
    """The manifests of snapshots kept on the nodes: runs/RUN/checkpoints/nodes/snap-N.json."""

    def __init__(self, run_dir: Path, keep: int = 3):
        super().__init__(run_dir, keep)
        self.dir = run_dir / "checkpoints" / "nodes"

    def names(self) -> list[str]:
        return sorted((p.stem for p in self.dir.glob("snap-*.json")), reverse=True) if self.dir.is_dir() else []

    def describe(self, name: str) -> str:
        holders = sorted({h for hs in self.doc(name)["holders"].values() for h in hs})
        return f"{name} ({self.about(name)}; on {', '.join(holders)})"

    def prune(self) -> None:
        for old in self.names()[self.keep:]:
            (self.dir / f"{old}.json").unlink(missing_ok=True)


def newest_copied(run_dir: Path) -> str | None:
    """The newest checkpoint copied home for a run, in words: a snapshot of its checkpoint directory
    ('snap-000003 (ckpt.pt; 1 file, 0.4 MB)'), one kept on the nodes ('snap-000004 (...; on node1,
    node2)', here), else the trainer's newest ckpt_N.pt; None: none."""
    if not (run_dir / "checkpoints").is_dir():
        return None
    found = [(s.doc(name)["taken"], s.describe(name)) for s in (DirStore(run_dir), NodeSnaps(run_dir))
             if (name := s.newest()) is not None]
    if found:
        return max(found)[1]
    return CheckpointStore(run_dir).newest()


class DirReplicas(DirCopier):
    """DirCopier's looks and snapshots, each snapshot kept on the node that wrote it and on its
    neighbour (see the module's docstring). `roots`: node -> its dirsnaps root (set with `paths`
    before each attempt)."""

    def __init__(self, cluster: Cluster, store: NodeSnaps, say: Callable[[str], None] = print,
                 interval: float = INTERVAL_S):
        super().__init__(cluster, store, say, interval)
        self.roots: dict[str, str] = {}
        self.order: list[str] = []  # the attempt's nodes in rank order (the ring)

    def for_attempt(self, paths: dict[str, str], dirs: dict[str, dict]) -> None:
        super().for_attempt(paths, dirs)
        self.roots = roots_of(dirs)

    def tick(self, nodes: list[str], final: bool = False, looked: dict[str, dict] | None = None) -> str | None:
        self.order = [n for n in nodes if n in self.paths]
        return super().tick(nodes, final, looked)

    def learn(self, name: str, doc: dict) -> None:
        for rel, m in doc["files"].items():
            self.known.setdefault((m["node"], rel), (m["size"], m["mtime_ns"], m["sha256"], Path()))

    def take(self, files: dict) -> str | None:
        t0 = time.monotonic()
        name = self.store.next_name()
        prev_name = self.store.newest()
        prev = self.store.doc(prev_name) if prev_name else {"files": {}, "holders": {}}
        try:
            origins = sorted({m["node"] for m in files.values()})
            for origin in origins:
                if not self._freeze(origin, name, {r: m for r, m in files.items() if m["node"] == origin},
                                    prev_name, prev):
                    return None
            holders = {o: [o] for o in origins}
            nxt = ring(self.order)
            for origin in origins:
                h = nxt.get(origin)
                if h is not None and self._replicate(origin, h, name, files, prev_name, prev):
                    holders[origin].append(h)
        finally:
            self.copy_s += time.monotonic() - t0
        doc = {"files": files, "taken": time.time(), "step": step_of_names(files), "nodes": origins,
               "holders": holders, "roots": {n: self.roots[n] for n in {h for hs in holders.values() for h in hs}}}
        self.store.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.store.dir / f".{name}.json.tmp"
        try:
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
            tmp.replace(self.store.dir / f"{name}.json")
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk leaves no torn index behind
            raise
        self.known = {}
        self.learn(name, doc)
        self.store.prune()
        self._prune_nodes()
        self.events.append((time.time(), name))
        alone = [o for o, hs in holders.items() if len(hs) < 2]
        self.say(f"checkpoint {self.store.describe(name)} kept on the nodes" +
                 (f" (no replica of {', '.join(alone)}'s part: it is lost with that node)" if alone else ""))
        return name

    def _freeze(self, origin: str, name: str, mine: dict, prev_name: str | None, prev: dict) -> bool:
        """origin's files of the snapshot frozen on origin; their sha256 into `mine` (and so `files`)."""
        old = prev["files"]
        kept = origin in prev["holders"].get(origin, [])
        line = {"files": [[rel, m["size"], m["mtime_ns"]] for rel, m in sorted(mine.items())],
                "prev": {rel: [m["size"], m["mtime_ns"], prev_name, old[rel]["sha256"]] for rel, m in mine.items()
                         if kept and rel in old and old[rel]["node"] == origin}}
        root = posixpath.join(self.roots[origin], origin)
        got = wire.run(self.cluster, lambda n: door.call(n, "freeze", self.pending[origin], root, name,
                                                         data=json.dumps(line).encode() + b"\n", timeout=TIMEOUT),
                       [origin])[origin]
        if got.exit_code == CHANGED:
            return False  # the capture was replaced meanwhile: the next look's is taken
        if not got.ok or set(got.doc) != set(mine):
            self.say(f"could not keep {origin}'s part of checkpoint {name} on {origin}: "
                     f"{got.error or 'its answer names other files'}")
            return False
        for rel, d in got.doc.items():
            mine[rel]["sha256"] = d
        return True

    def _replicate(self, origin: str, holder: str, name: str, files: dict, prev_name: str | None, prev: dict) -> bool:
        """origin's part of snapshot `name` copied to `holder`: what holder has of the previous
        snapshot's part, unchanged, linked there; the rest node to node."""
        mine = {rel: m for rel, m in files.items() if m["node"] == origin}
        root = posixpath.join(self.roots[holder], origin)
        same = [rel for rel, m in mine.items() if prev_name and holder in prev["holders"].get(origin, [])
                and prev["files"].get(rel, {}).get("sha256") == m["sha256"] and prev["files"][rel]["node"] == origin]
        linked: list[str] = []
        if same:
            got = wire.run(self.cluster, lambda n: door.call(n, "link", root, name, prev_name,
                                                             data=json.dumps(same).encode(), want=list), [holder])[holder]
            linked = got.doc if got.ok else []
        rest = sorted(set(mine) - set(linked))
        if rest:
            inv = self.cluster.inventory
            src = posixpath.join(self.roots[origin], origin, name)
            res = pair.copy_files(self.cluster, inv.node(origin), src, inv.node(holder), posixpath.join(root, name),
                                  rest, timeout=TIMEOUT)
            if not res.ok:
                self.say(f"could not copy {origin}'s part of checkpoint {name} to {holder}: {res.detail}")
                return False
        return True

    def _prune_nodes(self) -> None:
        """The snapshots no manifest here names any more, removed on every node that has them."""
        keep = json.dumps(self.store.names())
        docs = [self.store.doc(n) for n in self.store.names()]
        where = {h: r for d in docs for h, r in d.get("roots", {}).items()} | self.roots
        nodes = self.cluster.live(where)
        if nodes:
            wire.send(self.cluster, lambda n: door.command(n, "keep", where[n.name], keep), nodes,
                      timeout=door.TIMEOUT)


class NodeRestoreDirError(Exception):
    pass


def restore_from_nodes(cluster: Cluster, store: NodeSnaps, paths: dict[str, str], aside: dict[str, str],
                       say: Callable[[str], None] = print, newer_than: float = 0.0
                       ) -> tuple[str, dict[str, dict], list[str]] | None:
    """The newest snapshot `store` knows, taken after `newer_than` (this machine's newest copy),
    whose every part a reachable node holds intact, put into DIR (`paths`: node -> DIR there) on
    every node of `paths`. -> (its name, each node's reply as ckptdir.restore_dir gives it, the
    newer snapshots skipped); None: no snapshot can be put together. Raises NodeRestoreDirError
    when one could, and placing it failed."""
    skipped = []
    for name in store.names():
        doc = store.doc(name)
        if doc["taken"] <= newer_than:
            break
        found = _holders(cluster, doc, name, say)
        missing = [o for o in doc["holders"] if not found.get(o)]
        if missing:
            say(f"skipping checkpoint {name}: no reachable node holds an intact copy of "
                f"{', '.join(missing)}'s part (held on {', '.join(h for o in missing for h in doc['holders'][o])})")
            skipped.append(name)
            continue
        return name, place(cluster, doc, name, found, paths, aside, say), skipped
    return None


def _holders(cluster: Cluster, doc: dict, name: str, say) -> dict[str, list[str]]:
    """origin -> the reachable nodes whose copy of origin's part checks out against the manifest."""
    live = set(cluster.live({h for hs in doc["holders"].values() for h in hs}))
    asks = [(o, h) for o, hs in doc["holders"].items() for h in hs if h in live]
    out: dict[str, list[str]] = {o: [] for o in doc["holders"]}

    def ask(oh):
        o, h = oh
        part = {rel: m["sha256"] for rel, m in doc["files"].items() if m["node"] == o}
        got = wire.run(cluster, lambda n: door.call(n, "check", posixpath.join(doc["roots"][h], o), name,
                                                    data=json.dumps(part).encode(), timeout=TIMEOUT), [h])[h]
        verdict = got.doc if got.ok else {"ok": False, "why": got.error}
        if not verdict["ok"]:
            say(f"{h}: its copy of {o}'s part of checkpoint {name} is not usable: {verdict['why']}")
        return o, h, verdict["ok"]

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(asks)))) as pool:
        for o, h, ok in pool.map(ask, asks):
            if ok:
                out[o].append(h)
    return out


def place(cluster: Cluster, doc: dict, name: str, found: dict[str, list[str]], paths: dict[str, str],
          aside: dict[str, str], say, part_dir: Callable[[str, str], str] | None = None) -> dict[str, dict]:
    """The files of `doc` ({rel: {"node": origin, "sha256"}}) into DIR (`paths`) on every node of
    `paths`: each origin's part from one of its `found` holders (locally where the node holds it,
    else node to node), every file checked against its sha256, then swapped into DIR (the node's
    other entries set aside into `aside`). `part_dir(holder, origin)`: where a holder keeps
    origin's part (default: a snapshot's, under its dirsnaps root). -> each node's reply."""
    inv = cluster.inventory
    part_dir = part_dir or (lambda h, o: posixpath.join(doc["roots"][h], o, name))

    def one(target: str) -> tuple[str, dict]:
        staged = posixpath.join(paths[target], STAGED)
        cluster.run(lambda n: f"rm -rf {shell.quote(staged)}", nodes=[target], timeout=60)  # a failed one's
        local: dict[str, str] = {}
        for origin, holders in sorted(found.items()):
            part = sorted(rel for rel, m in doc["files"].items() if m["node"] == origin)
            if target in holders:
                src = part_dir(target, origin)
                local.update({rel: posixpath.join(src, rel) for rel in part})
                continue
            h = holders[0]
            src = part_dir(h, origin)
            r = pair.copy_files(cluster, inv.node(h), src, inv.node(target), staged, part, timeout=TIMEOUT)
            if not r.ok:
                raise NodeRestoreDirError(f"could not copy {origin}'s part of checkpoint {name} from {h} to "
                                          f"{target}: {r.detail}")
            whose = f"{origin}'s part" + (f", a replica on {h}," if h != origin else "")
            say(f"checkpoint {name}: {whose} copied from {h} to {target}, node to node")
        want = {"files": {rel: m["sha256"] for rel, m in doc["files"].items()}, "from": local}
        got = wire.run(cluster, lambda n: door.call(n, "place", paths[target], aside[target], staged,
                                                    data=json.dumps(want).encode(), timeout=TIMEOUT), [target])[target]
        if not got.ok:
            raise NodeRestoreDirError(f"could not restore checkpoint {name} on {target}: {got.error}")
        return target, got.doc

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(paths)))) as pool:
        return dict(pool.map(one, sorted(paths)))


def artifact_copier(cluster: Cluster, run_dir: Path, spec, say: Callable[[str], None]) -> ArtifactCopier:
    """What a run's spec (runs/spec.py RunSpec) asks to carry while it trains: the trainer's
    checkpoints and TensorBoard files to this machine (train.copy_checkpoints), its checkpoints node
    to node (train.checkpoint_replica), and with --checkpoint-dir the job's own directory to this
    machine, or kept on the nodes (checkpoint_replica), or both."""
    copier = ArtifactCopier(cluster, run_dir, {}, say=say, checkpoints=spec.copy_checkpoints)
    if spec.checkpoint_replica:
        copier.replicator = Replicator(cluster, copier.dirs, say=say)
    if spec.checkpoint_dir and spec.copy_checkpoints:
        copier.dirsnap = DirCopier(cluster, DirStore(run_dir), say=say, interval=spec.checkpoint_interval)
    if spec.checkpoint_dir and spec.checkpoint_replica:
        copier.dirreplica = DirReplicas(cluster, NodeSnaps(run_dir), say=say, interval=spec.checkpoint_interval)
    return copier

"""A job's own checkpoint directory carried off the nodes and back (`train --checkpoint-dir DIR`).

Any script, any names: nanoGPT's `out/ckpt.pt`, a Trainer's `checkpoint-500/` whose rng states are
written by every rank on its own node, DeepSpeed's `global_step500/` and `latest`. The script is
not asked for marks: a top-level entry of DIR counts as complete on a node when its writer closed
it (no process of the user holds a file under it open for writing and nothing under it changed
while that was looked at; a directory also once nothing under it changed for SETTLE_S, or at once
when it was renamed into place), and each complete version is captured on the node at once, out of
the job's reach (remote/ckptdir.py `look`, on the node's own /proc, inotify and clock). A save the
job rewrites every second is taken between two saves; a copy the job writes into meanwhile is
voided, never kept.

While an attempt runs, `DirCopier.tick` looks at every node's DIR at most once per `interval`
(train.checkpoint_interval, default INTERVAL_S), and never sooner after a snapshot than that
snapshot took: the copying is at most half of the time. When an entry is complete on every node
that has it and differs from the newest snapshot here, a new snapshot is taken:
runs/RUN/checkpoints/snap-NNNNNN/ holds DIR as the union of the nodes' entries (a file on several
nodes comes from the lowest-ranked one), each entry as it was last complete. Files unchanged since
the previous snapshot are hard links to it; only new bytes cross the link, read from the node's
capture. snap-N.json, written last, lists every file with its node, size, mtime and sha256: a
snapshot without it is not one. Nothing is taken from a node once a rank of the attempt there
failed or its processes began to end (a worker killed mid-write leaves a torn file that looks
closed), nor from the nodes after an attempt failed: the last snapshot taken while the job ran is
what restores.

`restore_dir` puts one snapshot into DIR on every node of the next attempt: the snapshot's entries
replace the node's, and the node's other entries (a half-written checkpoint, a newer one that was
never complete everywhere) are moved to ~/.clusterctl/artifacts/RUN/set-aside/KEY/, kept but out of
the job's way.
With train.checkpoint_replica the snapshots are (also) kept on the nodes instead: runs/ckpt/jobdir_replicas.py.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import time
from pathlib import Path
from typing import Callable

from orchestrator.inventory import Node
from orchestrator.inventory.sections import TrainSection
from orchestrator.node import ckptdir as door
from orchestrator.node import wire
from orchestrator.node.agent import node_key  # the attempt's run key on one node
from orchestrator.transfer.archive import TarStream
from orchestrator.transfer.files import sha256_file
from orchestrator.transfer.unpack import Unpacker
from orchestrator.transport import Cluster

INTERVAL_S: float = TrainSection.model_fields["checkpoint_interval"].default  # at most one look per this
SETTLE_S = 2.0  # a directory entry closed by its writers is complete once nothing under it changed this long
WAIT_S = 1.0  # a look waits this long for a save in progress to be closed
KEEP = 3  # snapshots kept on the control machine
TIMEOUT = 600.0  # one node's part of one snapshot, or one node's restore
CHANGED, PENDING = door.CHANGED, door.PENDING  # send/freeze's "not as listed"; the captures directory's name
STEP = re.compile(r"(?:checkpoint|global_step|step|iter|ckpt)[-_=]?(\d+)", re.I)  # step=20: Lightning's epoch=0-step=20.ckpt


def node_path(node: Node, checkpoint_dir: str) -> str:
    """DIR on `node`: relative to its workdir unless absolute or under ~."""
    return checkpoint_dir if checkpoint_dir.startswith(("/", "~")) else posixpath.join(node.workdir, checkpoint_dir)


def prepare(cluster: Cluster, nodes: list[Node], checkpoint_dir: str) -> dict[str, str]:
    """DIR made on every node -> {node: its absolute path there} (CLUSTERCTL_CHECKPOINT_DIR)."""
    res = wire.run(cluster, lambda n: door.prepare(n, node_path(n, checkpoint_dir)), [n.name for n in nodes])
    out, bad = {}, []
    for name, got in res.items():
        if got.ok and isinstance(got.doc.get("path"), str):
            out[name] = got.doc["path"]
        else:
            bad.append(f"{name}: {got.error or 'no path in its answer'}")
    if bad:
        from orchestrator.errors import LaunchError

        raise LaunchError(f"cannot create the checkpoint directory {checkpoint_dir}: " + "; ".join(bad))
    return out


def step_of_names(names) -> int | None:
    """The largest step a checkpoint entry's name carries (checkpoint-500, global_step500), if any."""
    found = [int(m.group(1)) for n in names if (m := STEP.search(n))]
    return max(found) if found else None


class DirStore:
    """runs/RUN/checkpoints/snap-NNNNNN/ and their snap-NNNNNN.json, newest last."""

    def __init__(self, run_dir: Path, keep: int = KEEP):
        self.dir = run_dir / "checkpoints"
        self.keep = keep

    def names(self) -> list[str]:
        """Complete snapshots here, newest first."""
        if not self.dir.is_dir():
            return []
        found = [p.stem for p in self.dir.glob("snap-*.json") if (self.dir / p.stem).is_dir()]
        return sorted(found, reverse=True)

    def newest(self) -> str | None:
        names = self.names()
        return names[0] if names else None

    def doc(self, name: str) -> dict:
        return json.loads((self.dir / f"{name}.json").read_text())

    def intact(self, name: str) -> str | None:
        """None when every file of the snapshot is there with its recorded sha256, else why not."""
        for rel, mark in self.doc(name)["files"].items():
            p = self.dir / name / rel
            if not p.is_file():
                return f"{rel} is missing"
            if sha256_file(str(p)) != mark["sha256"]:
                return f"{rel} no longer matches its sha256"
        return None

    def newest_intact(self, say: Callable[[str], None] = print) -> tuple[str | None, list[str]]:
        skipped = []
        for name in self.names():
            why = self.intact(name)
            if why is None:
                return name, skipped
            say(f"skipping checkpoint {name} in {self.dir}: {why} (damaged on this machine after it was copied)")
            skipped.append(name)
        return None, skipped

    def next_name(self) -> str:
        taken = [int(p.name[5:11]) for p in self.dir.glob("snap-[0-9]*") if p.name[5:11].isdigit()] \
            if self.dir.is_dir() else []
        return f"snap-{max(taken, default=0) + 1:06d}"

    def about(self, name: str) -> str:
        """Snapshot `name` in words: 'checkpoint-20, checkpoint-30, step 30; 14 files, 2.1 MB'."""
        doc = self.doc(name)
        size = sum(m["size"] for m in doc["files"].values())
        tops = sorted({rel.split("/", 1)[0] for rel in doc["files"]})
        shown = ", ".join(tops[:4]) + (f" and {len(tops) - 4} more" if len(tops) > 4 else "")
        step = f", step {doc['step']}" if doc.get("step") is not None else ""
        n = len(doc["files"])
        return f"{shown}{step}; {n} file{'s' if n != 1 else ''}, {size / 1e6:.1f} MB"

    def describe(self, name: str) -> str:
        return f"{name} ({self.about(name)})"

    def prune(self) -> None:
        for old in self.names()[self.keep:]:
            (self.dir / f"{old}.json").unlink(missing_ok=True)
            shutil.rmtree(self.dir / old, ignore_errors=True)
        for stage in self.dir.glob(".snap-*.partial"):
            shutil.rmtree(stage, ignore_errors=True)


def roots_of(dirs: dict[str, dict]) -> dict[str, str]:
    """Each node's dirsnaps root, beside its run's other artifacts (runs/restart.py prepare_artifacts)."""
    return {n: posixpath.join(posixpath.dirname(d["replicas"]), "dirsnaps") for n, d in dirs.items()}


def pending_of(root: str, node: str) -> str:
    """Where `node` keeps its looks' captures under its dirsnaps root `root`."""
    return posixpath.join(root, node, PENDING)


def plan(states: dict[str, dict], order: list[str], prev: dict | None) -> dict:
    """The next snapshot's files {rel: {node, size, mtime_ns}} from every node's `look`. An entry
    complete (and captured) on every node that has it is taken as the nodes have it now (a file on
    several nodes from the first in `order`); an entry still being written anywhere keeps its
    previous snapshot's files (sha256 and all); an entry no node has any more is gone."""
    prev_files = (prev or {}).get("files", {})
    tops: dict[str, list[str]] = {}
    for node in order:
        for top in states.get(node, {}).get("entries", {}):
            tops.setdefault(top, []).append(node)
    files: dict[str, dict] = {}
    for top, holders in tops.items():
        entries = [states[n]["entries"][top] for n in holders]
        if all(e["complete"] for e in entries):
            for node, e in zip(holders, entries):
                for rel, size, mtime_ns in e["files"]:
                    files.setdefault(rel, {"node": node, "size": size, "mtime_ns": mtime_ns})
        else:
            files.update({rel: dict(m) for rel, m in prev_files.items() if rel.split("/", 1)[0] == top})
    return files


class DirCopier:
    """Snapshots of DIR while an attempt runs (see the module's docstring). `paths`: node -> DIR's
    absolute path there (`prepare`); `pending`: node -> where its looks capture complete versions.
    `known`: (node, rel) -> (size, mtime_ns, sha256, a file here with those bytes), for the files of
    the newest snapshot and those a restore just wrote: a file the nodes still have as it was is
    linked, not copied again. `key`: the attempt's run key (ArtifactCopier.start), so that a node
    whose ranks began to end gives nothing; None: no job to watch (the looks take what is closed)."""

    def __init__(self, cluster: Cluster, store: DirStore, say: Callable[[str], None] = print,
                 interval: float = INTERVAL_S):
        self.cluster, self.store, self.say = cluster, store, say
        self.interval = interval
        self.paths: dict[str, str] = {}
        self.pending: dict[str, str] = {}
        self.key: str | None = None
        self.known: dict[tuple[str, str], tuple[int, int, str, Path]] = {}
        self.next_at = 0.0  # time.monotonic() of the next look
        self.copy_s = 0.0
        self.looks = self.torn = 0  # looks made; copies voided by a rewrite while they were read
        self.events: list[tuple[float, str]] = []  # (time, snapshot) as each was taken
        self.looked: dict[str, dict] | None = None  # the states the last tick read

    def for_attempt(self, paths: dict[str, str], dirs: dict[str, dict]) -> None:
        """An attempt's nodes: DIR on each (`prepare`), and their artifact directories."""
        self.paths = paths
        self.pending = {n: pending_of(r, n) for n, r in roots_of(dirs).items()}

    def due_in(self) -> float:
        """Seconds until the next look is due."""
        return max(0.0, self.next_at - time.monotonic())

    def tick(self, nodes: list[str], final: bool = False, looked: dict[str, dict] | None = None) -> str | None:
        """Look at the nodes' DIR when a look is due (`final`: now, the job having ended well, so
        nothing is being written) and take a snapshot when there is something new. -> its name.
        `looked`: the states another snapshot taker just read of the same nodes (one look at the
        nodes serves both); `self.looked` is this tick's, None when it did not look."""
        self.looked = None
        if not final and time.monotonic() < self.next_at:
            return None
        t0 = time.monotonic()
        self.next_at = t0 + self.interval
        nodes = [n for n in nodes if n in self.paths and n in self.pending]
        states = looked if looked is not None and set(looked) == set(nodes) else self.look(nodes, final)
        if states is None:
            return None
        self.looked = states
        prev_name = self.store.newest()
        prev = self.store.doc(prev_name) if prev_name else None
        if prev_name:
            self.learn(prev_name, prev)
        files = plan(states, nodes, prev)
        for rel, m in files.items():
            k = self.known.get((m["node"], rel))
            if "sha256" not in m and k is not None and (k[0], k[1]) == (m["size"], m["mtime_ns"]):
                m["sha256"] = k[2]
        old = {rel: m["sha256"] for rel, m in (prev or {}).get("files", {}).items()}
        if not files or {rel: m.get("sha256") for rel, m in files.items()} == old:
            return None
        name = self.take(files)
        self.next_at = max(self.next_at, 2 * time.monotonic() - t0)  # copying at most half of the time
        return name

    def learn(self, name: str, doc: dict) -> None:
        for rel, m in doc["files"].items():
            self.known.setdefault((m["node"], rel), (m["size"], m["mtime_ns"], m["sha256"], self.store.dir / name / rel))

    def restored(self, name: str, written: dict[str, list], store: DirStore | None = None) -> None:
        """A restore wrote snapshot `name` (of `store`, default this run's) on the nodes:
        {node: [[rel, size, mtime_ns]]}."""
        store = store or self.store
        doc = store.doc(name)["files"]
        for node, listing in written.items():
            for rel, size, mtime_ns in listing:
                if rel in doc:
                    self.known[(node, rel)] = (size, mtime_ns, doc[rel]["sha256"], store.dir / name / rel)

    def look(self, nodes: list[str], final: bool = False) -> dict[str, dict] | None:
        """Every node's `look` at DIR (its complete entries captured there), or None when one of
        them did not answer (a snapshot is of all of them or of none). `final`: the job ended well:
        nothing settles or is waited for, and no rank is watched."""
        if not nodes:
            return None

        def look(n: Node) -> wire.Call[wire.Answer]:
            key = "-" if final or self.key is None else node_key(self.key, n)
            return door.look(n, self.paths[n.name], self.pending[n.name], 0 if final else SETTLE_S,
                             0 if final else WAIT_S, key)

        res = wire.run(self.cluster, look, nodes)
        self.looks += 1
        out = {}
        for name, got in res.items():
            if not got.ok:
                return None
            out[name] = got.doc
            self.torn += len(out[name]["torn"])
        return out

    def forget(self, nodes: list[str]) -> None:
        """The nodes' captures removed (the attempt ended: the snapshots hold what is needed)."""
        live = [n for n in self.cluster.live(nodes) if n in self.pending]
        if live:
            wire.send(self.cluster, lambda n: door.forget(n, self.pending[n.name]), live, timeout=door.TIMEOUT)

    def take(self, files: dict) -> str | None:
        t0 = time.monotonic()
        name = self.store.next_name()
        stage = self.store.dir / f".{name}.partial"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        try:
            fetch = self._link_known(files, stage)
            for node in sorted({m["node"] for m in fetch.values()}):
                if not self._fetch(node, {rel: m for rel, m in fetch.items() if m["node"] == node}, stage, files):
                    return None
            doc = {"files": files, "taken": time.time(), "step": step_of_names(files),
                   "nodes": sorted({m["node"] for m in files.values()})}
            os.replace(stage, self.store.dir / name)
            tmp = self.store.dir / f".{name}.json.tmp"
            try:
                tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
                os.replace(tmp, self.store.dir / f"{name}.json")  # last: now it is a snapshot
            except OSError:
                tmp.unlink(missing_ok=True)  # a full disk leaves no torn index behind
                raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
            self.copy_s += time.monotonic() - t0
        self.known = {}
        self.learn(name, doc)
        self.store.prune()
        self.events.append((time.time(), name))
        self.say(f"checkpoint {self.store.describe(name)} copied to the control machine")
        return name

    def _link_known(self, files: dict, stage: Path) -> dict:
        """Hard-link every file whose bytes are already here (its sha256 known); -> those to fetch."""
        fetch = {}
        for rel, m in files.items():
            k = self.known.get((m["node"], rel))
            src = k[3] if k is not None and k[2] == m.get("sha256") else None
            if src is not None and src.is_file():
                dst = stage / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.link(src, dst)
            else:
                m.pop("sha256", None)
                fetch[rel] = m
        return fetch

    def _fetch(self, node: str, mine: dict, stage: Path, files: dict) -> bool:
        line = json.dumps([[rel, m["size"], m["mtime_ns"]] for rel, m in sorted(mine.items())]).encode() + b"\n"
        into = Unpacker(stage, checksums=True, name=f"unpack-ckptdir-{node}")
        try:
            r = wire.send(self.cluster, lambda n: door.send(n, self.pending[node]), [node], data=lambda n: [line],
                          timeout=TIMEOUT, capture=False,
                          on_bytes=lambda _n, stream, data: into.feed(data) if stream == "stdout" else None)[node]
        finally:
            error = into.close(TIMEOUT)
        if r.exit_code == CHANGED:
            return False  # the capture was replaced meanwhile (a look of another snapshot taker)
        if not r.ok or error is not None:
            self.say(f"could not copy the checkpoint directory from {node}: {error or r.describe()}")
            return False
        for rel in mine:
            digest = into.digests.get(stage / rel)
            if digest is None:
                self.say(f"could not copy the checkpoint directory from {node}: {rel} did not arrive")
                return False
            files[rel]["sha256"] = digest
        return True


def restore_dir(cluster: Cluster, store: DirStore, name: str, paths: dict[str, str], nodes: list[Node],
                aside: dict[str, str]) -> dict[str, list[str]]:
    """Snapshot `name` into DIR on every node of `nodes` (see the module's docstring).
    -> {node: its reply: "aside" (the entries set aside), "files" ([rel, size, mtime_ns] written)}.
    Raises RestoreDirError naming the nodes that failed."""
    files = sorted(store.doc(name)["files"])
    src = str(store.dir / name)
    res = wire.send(cluster, lambda n: door.restore(n, paths[n.name], aside[n.name]), [n.name for n in nodes],
                    data=lambda n: TarStream(src, files), timeout=TIMEOUT)
    got = {k: wire.read_answer(v, dict, "ckptdir", 300) for k, v in res.items()}
    bad = {k: a.error for k, a in got.items() if not a.ok}
    if bad:
        raise RestoreDirError(name, bad)
    return {k: a.doc for k, a in got.items()}


class RestoreDirError(Exception):
    def __init__(self, name: str, failed: dict[str, str]):
        self.name, self.failed = name, failed
        super().__init__(f"could not restore {name}: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))

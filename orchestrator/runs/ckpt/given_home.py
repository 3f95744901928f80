"""A run's checkpoints and TensorBoard files leave the nodes: runs/RUN/checkpoints/, runs/RUN/tensorboard/.

The job writes checkpoints to CLUSTERCTL_CHECKPOINT_DIR and TensorBoard events to
CLUSTERCTL_TENSORBOARD_DIR (~/.clusterctl/artifacts/RUN/ on each node, see
orchestrator/remote/artifacts.py). While it trains, each node's log stream (runs/logs/streams.py,
the agent's `tail ... stream`) tells `ArtifactCopier` what finished there and carries the new
TensorBoard bytes (into one directory for the whole run: runs/curves.py); the copier copies new
checkpoints here over the run's SSH connections, on its own thread, as a tar stream unpacked as it arrives (transfer/unpack.py: each file written once
and hashed on the way in). A checkpoint counts as complete by the trainer's own marks: a file's
sha256 sidecar, a directory's MANIFEST.sha256 of every file. An FSDP checkpoint written without
a shared filesystem is spread over the nodes (each holds its ranks' shards, the manifest lists
them all): the pieces are merged into one directory here, complete once the manifest checks.
The names and marks are remote/common.py's, the rules the nodes' artifacts.py applies.
Before a relaunch, `restore` streams the newest complete checkpoint to the nodes that need it.
With train.checkpoint_replica the same thread also runs runs/ckpt/given_replicas.py's `Replicator`
(node-to-node copies that never pass through this machine).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tarfile
import threading
import time
from pathlib import Path
from typing import Callable

from orchestrator.inventory import Node
from orchestrator.node import artifacts, wire
from orchestrator.node.agent import StreamFrom
from orchestrator.probe import common
from orchestrator.runs.curves import Curves
from orchestrator.transfer.archive import TarStream
from orchestrator.transfer.files import sha256_file
from orchestrator.transfer.unpack import Unpacker
from orchestrator.transport import Cluster

MANIFEST: str = common().MANIFEST
KEEP = 3  # complete checkpoints kept on the control machine
POLL_S = 2.0  # how often a copy that failed is tried again (the nodes' streams say what is new)
TIMEOUT = 600.0  # one copy of one checkpoint


def is_complete(path: Path, known: dict[Path, str] | None = None) -> bool:
    """The trainer's completion marks hold: the file matches its .sha256, or every file the
    directory's MANIFEST names is there and matches. `known`: digests already taken of files
    as they were written (not read again)."""
    known = known or {}

    def digest(p: str) -> str:
        return known.get(Path(p)) or sha256_file(p)

    return common().checkpoint_verified(str(path), digest)


def step_of(name: str) -> int:
    """The step of a checkpoint's name (ckpt_NNNNNNNN.pt or ckpt_NNNNNNNN); ValueError for another name."""
    step = common().checkpoint_step(name)
    if step is None:
        raise ValueError(f"not a checkpoint name: {name!r}")
    return step


class CheckpointStore:
    """runs/RUN/checkpoints/: complete checkpoints under their own names, pieces being gathered
    under .NAME.partial/ (an FSDP directory whose shards come from several nodes). A stage lives
    only while its checkpoint is being gathered: a copy that fails or breaks off takes its stage
    with it (`discard`), and `clean_partials` removes whatever an ended attempt or run left."""

    def __init__(self, run_dir: Path, keep: int = KEEP):
        self.dir = run_dir / "checkpoints"
        self.keep = keep
        self.dir.mkdir(parents=True, exist_ok=True)

    def complete(self) -> list[str]:
        """Complete checkpoint names here, newest first."""
        names = [p.name for p in self.dir.iterdir() if common().checkpoint_step(p.name) is not None]
        return sorted(names, key=step_of, reverse=True)

    def newest(self) -> str | None:
        done = self.complete()
        return done[0] if done else None

    def newest_intact(self, say: Callable[[str], None] = print) -> tuple[str | None, list[str]]:
        """(the newest checkpoint here whose bytes still match their marks, the newer ones skipped):
        each is read again before it is chosen, since a copy verified on arrival can rot on this
        disk or be cut by a full one later. Each skipped one is said, with why."""
        skipped = []
        for name in self.complete():
            if is_complete(self.dir / name):
                return name, skipped
            mark = common().SIDECAR if (self.dir / name).is_file() else common().MANIFEST
            say(f"skipping checkpoint {name} in {self.dir}: its bytes no longer match its {mark} "
                f"(damaged on this machine after it was copied)")
            skipped.append(name)
        return None, skipped

    def has(self, name: str) -> bool:
        return (self.dir / name).exists()

    def stage(self, name: str) -> Path:
        return self.dir / f".{name}.partial"

    def receiving(self, name: str) -> Unpacker:
        """Where a node's tar stream of checkpoint `name` goes (`feed`): unpacked into
        .NAME.partial/ as it arrives, each file hashed on the way in."""
        stage = self.stage(name)
        stage.mkdir(exist_ok=True)
        return Unpacker(stage, checksums=True, name=f"unpack-{name}")

    def finish(self, unpacker: Unpacker, name: str, kind: str) -> bool:
        """The stream has ended: True once checkpoint `name` is complete here (moved into place).
        A directory missing pieces stays staged for the other nodes' pieces; a file that does not
        match its checksum is dropped. Raises tarfile.TarError for a stream that was refused or
        broke off, its stage removed."""
        if (error := unpacker.close(TIMEOUT)) is not None:
            self.discard(name)
            raise tarfile.TarError(error)
        src = unpacker.dest / name
        if not is_complete(src, unpacker.digests):
            if kind == "file":
                self.discard(name)
            return False
        stage = unpacker.dest
        if kind == "file":
            os.replace(Path(str(src) + common().SIDECAR), self.dir / (name + common().SIDECAR))
        os.replace(src, self.dir / name)
        shutil.rmtree(stage, ignore_errors=True)
        self.prune()
        return True

    def discard(self, name: str) -> None:
        """Drop checkpoint `name`'s stage and every piece gathered in it."""
        shutil.rmtree(self.stage(name), ignore_errors=True)

    def clean_partials(self) -> list[str]:
        """Remove every stage left here (a copy cut off with its process, an FSDP checkpoint whose
        last piece never came): at the end of an attempt and of the run. -> the names dropped."""
        dropped = []
        for stage in sorted(self.dir.glob(".*.partial")):
            shutil.rmtree(stage, ignore_errors=True)
            dropped.append(stage.name[1:-len(".partial")])
        return dropped

    def prune(self) -> None:
        for old in self.complete()[self.keep:]:
            for part in common().checkpoint_parts(old):
                p = self.dir / part
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        newest = self.complete()
        floor = step_of(newest[-1]) if len(newest) >= self.keep else -1
        for stage in self.dir.glob(".ckpt_*.partial"):  # pieces older than what is kept never complete
            step = common().checkpoint_step(stage.name[1:-len(".partial")])
            if step is not None and step < floor:
                shutil.rmtree(stage, ignore_errors=True)


class ArtifactCopier:
    """Copies finished checkpoints and new TensorBoard bytes from the nodes to the run directory:
    as the nodes' streams report them while the run trains (`start`/`stop`: the copying thread),
    and once more with `sweep` (one `poll` process per node)."""

    def __init__(self, cluster: Cluster, run_dir: Path, dirs: dict[str, dict], say: Callable[[str], None] = print,
                 checkpoints: bool = True):
        self.cluster, self.dirs, self.say = cluster, dirs, say
        self.checkpoints = checkpoints  # False (train.copy_checkpoints): TensorBoard files only
        self.replicator = None  # a runs/ckpt/given_replicas.py Replicator (train.checkpoint_replica): node-to-node copies
        self.dirsnap = None  # a runs/ckpt/jobdir_home.py DirCopier (--checkpoint-dir): the job's own directory
        self.dirreplica = None  # a runs/ckpt/jobdir_replicas.py DirReplicas (--checkpoint-dir, checkpoint_replica)
        self.space = None  # the control machine's disk (runs/space.py Space): no copy while it has no room
        self.store = CheckpointStore(run_dir)
        self.curves = Curves(run_dir)  # one TensorBoard run: every node's, every attempt's files
        self.fetched: set[tuple[str, str]] = set()  # (node, checkpoint) pieces already taken
        self.copy_s = 0.0  # seconds spent copying checkpoints (the benchmark reads it)
        self.events: list[tuple[float, str]] = []  # (time, checkpoint) as each became complete here
        self.latest: dict[str, list[dict]] = {}  # node -> its complete checkpoints, as last reported
        self._news: queue.Queue[str] = queue.Queue()  # nodes whose checkpoints changed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ a node's stream (runs/logs/streams.py)
    def stream_from(self, node: str) -> StreamFrom | None:
        """What `node`'s log stream carries besides the log: its checkpoints (when they are copied or
        replicated) and its TensorBoard files from their sizes here; None before its directories are known."""
        d = self.dirs.get(node)
        if d is None:
            return None
        want = self.checkpoints or self.replicator is not None
        return StreamFrom(d["checkpoints"] if want else None, d["tensorboard"], self.tb_have(node))

    def on_checkpoints(self, node: str, found: list[dict]) -> None:
        """The node's complete checkpoints changed: copied on the copying thread, not the stream's."""
        self.latest[node] = found
        self._news.put(node)

    def on_tb(self, node: str, head: dict, body: bytes) -> None:
        self.curves.frame(head, body)

    def tb_have(self, node: str) -> dict[str, int]:
        """The event files here (every node's, runs/curves.py) and their sizes."""
        return self.curves.have()

    # ------------------------------------------------------------ one poll
    def poll(self, nodes: list[str]) -> dict[str, list[dict]]:
        """Every node at once, one process each: its complete checkpoints (when they are copied or
        replicated; newest first, as remote/artifacts.py `poll` prints them) and the bytes its
        TensorBoard event files gained since the last poll, which are appended here."""
        names = self.cluster.live(nodes)
        want = self.checkpoints or self.replicator is not None
        have, bufs = {n: self.tb_have(n) for n in names}, {n: bytearray() for n in names}
        if not names:
            return {}
        res = wire.send(self.cluster, lambda n: artifacts.poll(n, self.dirs[n.name]["checkpoints"] if want else None,
                                                               self.dirs[n.name]["tensorboard"], have[n.name]),
                        names, timeout=60, capture=False,
                        on_bytes=lambda n, stream, data: bufs[n].extend(data) if stream == "stdout" else None)
        found = {}
        for node, r in res.items():
            ckpts, frames = artifacts.read_poll(bytes(bufs[node])) if r.ok else (None, b"")
            if ckpts is None:
                continue
            found[node] = ckpts
            self.curves.frames(frames)
        return found

    def fetch_new(self, found: dict[str, list[dict]]) -> None:
        """Copy each node's newest checkpoints (up to what the store keeps) not yet here."""
        for node, ckpts in found.items():
            for c in ckpts[: self.store.keep]:
                if self.store.has(c["name"]) or self.taken(node, c["name"]):
                    continue
                self.fetch(node, c["name"], c["kind"])

    def taken(self, node: str, name: str) -> bool:
        """This node's piece of checkpoint `name` is here, in its stage (a stage dropped after a
        failed copy or by clean_partials takes the pieces with it: they are fetched again)."""
        return (node, name) in self.fetched and self.store.stage(name).is_dir()

    def fetch(self, node: str, name: str, kind: str) -> None:
        """One node's copy of checkpoint `name` (or its piece of it). A copy that fails or breaks
        off drops the whole stage: the other nodes' pieces are fetched again with the next try."""
        t0 = time.monotonic()
        into = self.store.receiving(name)
        failed = True
        try:
            r = wire.send(self.cluster, lambda n: artifacts.send(n, self.dirs[node]["checkpoints"], name), [node],
                          timeout=TIMEOUT, capture=False,
                          on_bytes=lambda _n, stream, data: into.feed(data) if stream == "stdout" else None)[node]
            if not r.ok:
                self.say(f"could not copy {name} from {node}: {r.describe()}")
                return
            self.fetched.add((node, name))
            failed = False
            if self.store.finish(into, name, kind):
                self.events.append((time.time(), name))
                self.say(f"checkpoint {name} copied to the control machine")
        except (OSError, tarfile.TarError) as e:
            failed = True
            if self.space is None or not self.space.full(e, "the checkpoint copies"):
                self.say(f"could not unpack {name} from {node}: {e}")
        finally:
            into.close()  # the unpacking thread ends with the stream, whatever happened
            if failed:
                self.store.discard(name)
            self.copy_s += time.monotonic() - t0

    @property
    def snaps(self) -> list:
        """What takes snapshots of the job's checkpoint directory (--checkpoint-dir): to this
        machine (dirsnap), kept on the nodes (dirreplica)."""
        return [s for s in (self.dirsnap, self.dirreplica) if s is not None]

    # ------------------------------------------------------------ the loop
    def sweep(self, nodes: list[str], finished: bool = False) -> None:
        """Once more at an attempt's end; `finished`: it ended well (the checkpoint directory is
        looked at only then: nothing was cut mid-write)."""
        if self.full():
            return
        with self._lock:
            found = self.poll(nodes)
            if self.checkpoints:
                self.fetch_new(found)
            if self.replicator is not None:
                self.replicator.poll(nodes, found)
            looked = None
            for snaps in self.snaps if finished else ():
                snaps.tick(nodes, final=True, looked=looked)
                looked = snaps.looked  # one look at the nodes serves both
            for snaps in self.snaps[:1]:  # the nodes' captures (both share them): the snapshots hold what counts
                snaps.forget(nodes)

    def copy_new(self, nodes: list[str], which: list[str]) -> None:
        """What the streams reported for the nodes `which`: their new checkpoints copied here, and
        every node's newest replicated."""
        with self._lock:
            latest = dict(self.latest)  # the streams' thread adds to it meanwhile
            if self.checkpoints:
                self.fetch_new({n: latest[n] for n in which if n in latest})
            if self.replicator is not None:
                self.replicator.poll(nodes, {n: c for n, c in latest.items() if n in nodes})
            looked = None
            for snaps in self.snaps:  # when a look is due (ckptdir's interval); one look serves both
                snaps.tick(nodes, looked=looked)
                looked = snaps.looked

    def start(self, nodes: Callable[[], list[str]], key: str | None = None) -> None:
        """The copying thread: each node's news as its stream brings it; every POLL_S s without
        news (sooner when a look at a checkpoint directory is due), what was reported is looked
        over again (a copy that failed is tried again). `key`: the attempt's run key."""
        for snaps in self.snaps:
            snaps.key = key

        def loop():
            with contextlib.suppress(OSError):  # behind the job's processes when they share this machine
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            while not self._stop.is_set():
                try:
                    which = [self._news.get(timeout=min([POLL_S] + [s.due_in() for s in self.snaps]))]
                except queue.Empty:
                    which = list(self.latest)
                if self._stop.is_set():
                    break
                if self.full():  # nothing is copied here until there is room; the nodes keep their own
                    continue
                try:
                    self.copy_new(nodes(), which)
                except Exception as e:  # noqa: BLE001 - a failed copy is tried again
                    self.say(f"artifact copy: {type(e).__name__}: {e}")

        self._stop.clear()
        self._thread = threading.Thread(target=loop, daemon=True, name="artifacts")
        self._thread.start()

    def full(self) -> bool:
        return self.space is not None and self.space.is_full

    def stop(self) -> None:
        """End the copying thread once its copy in progress is done (`sweep` takes what is left)."""
        self._stop.set()
        self._news.put("")  # wakes the thread
        if self._thread is not None:
            self._thread.join(TIMEOUT)
            self._thread = None
        self.latest.clear()
        while not self._news.empty():
            self._news.get_nowait()


def restore(cluster: Cluster, store: CheckpointStore, dirs: dict[str, dict], nodes: list[Node],
            name: str | None = None) -> list[str]:
    """Put checkpoint `name` (default: the newest complete one, unverified: the caller chose it
    with newest_intact) on the nodes that need it: a file checkpoint (DDP, rank 0 loads and
    broadcasts) on the first node only, a directory (FSDP shards) on every node. Returns the nodes
    written to; raises RestoreError naming the nodes that failed."""
    name = name or store.newest()
    if name is None:
        return []
    kind = "dir" if (store.dir / name).is_dir() else "file"
    targets = nodes if kind == "dir" else nodes[:1]
    files = ([str(p.relative_to(store.dir)) for p in sorted((store.dir / name).rglob("*")) if p.is_file()]
             if kind == "dir" else list(common().checkpoint_parts(name)))
    res = wire.send(cluster, lambda n: artifacts.receive(n, dirs[n.name]["checkpoints"]), [n.name for n in targets],
                    data=lambda n: TarStream(str(store.dir), files), timeout=TIMEOUT)
    bad = {k: v.describe() + " " + v.stderr.strip()[-300:] for k, v in res.items() if not v.ok}
    if bad:
        raise RestoreError(name, bad)
    return [n.name for n in targets]


class RestoreError(Exception):
    def __init__(self, name: str, failed: dict[str, str]):
        self.name, self.failed = name, failed
        super().__init__(f"could not restore {name}: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))


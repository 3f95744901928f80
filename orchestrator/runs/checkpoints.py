"""A run's checkpoints and TensorBoard files leave the nodes: runs/RUN/checkpoints/, runs/RUN/tensorboard/.

The job writes checkpoints to CLUSTERCTL_CHECKPOINT_DIR and TensorBoard events to
CLUSTERCTL_TENSORBOARD_DIR (~/.clusterctl/artifacts/RUN/ on each node, see
orchestrator/remote/artifacts.py). While it trains, `ArtifactCopier` asks every node what
finished and copies it here over the run's SSH connections, as a tar stream written to disk
chunk by chunk. A checkpoint counts as complete by the trainer's own marks: a file's sha256
sidecar, a directory's MANIFEST.sha256 of every file. An FSDP checkpoint written without a
shared filesystem is spread over the nodes (each holds its ranks' shards, the manifest lists
them all): the pieces are merged into one directory here, complete once the manifest checks.
Before a relaunch, `restore` streams the newest complete checkpoint to the nodes that need it.
With train.checkpoint_replica the same poll loop also runs runs/replicas.py's `Replicator`
(node-to-node copies that never pass through this machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tarfile
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Callable

from orchestrator import shell
from orchestrator.inventory import Node
from orchestrator.transfer.archive import TarStream
from orchestrator.transfer.files import sha256_file
from orchestrator.transport import Cluster

AGENT = resources.files("orchestrator").joinpath("remote/artifacts.py").read_bytes()
MANIFEST = "MANIFEST.sha256"
KEEP = 3  # complete checkpoints kept on the control machine
POLL_S = 2.0  # how often the nodes are asked for new checkpoints and event bytes
TIMEOUT = 600.0  # one copy of one checkpoint


def artifacts_cmd(node: Node, *args: object) -> str:
    return f"{shell.path(node.python)} - {shell.join(args)}"


def is_complete(path: Path) -> bool:
    """The trainer's completion marks hold: the file matches its .sha256, or every file the
    directory's MANIFEST names is there and matches."""
    try:
        if path.is_dir():
            lines = (path / MANIFEST).read_text().splitlines()
            for line in lines:
                digest, name = line.split("  ", 1)
                if sha256_file(path / name) != digest:
                    return False
            return bool(lines)
        want = (Path(str(path) + ".sha256").read_text().split() or [""])[0]
        return sha256_file(path) == want
    except (OSError, ValueError):
        return False


def step_of(name: str) -> int:
    return int(name[5:13])


class CheckpointStore:
    """runs/RUN/checkpoints/: complete checkpoints under their own names, pieces being gathered
    under .NAME.partial/ (an FSDP directory whose shards come from several nodes)."""

    def __init__(self, run_dir: Path, keep: int = KEEP):
        self.dir = run_dir / "checkpoints"
        self.keep = keep
        self.dir.mkdir(parents=True, exist_ok=True)

    def complete(self) -> list[str]:
        """Complete checkpoint names here, newest first."""
        names = [p.name for p in self.dir.iterdir() if p.name.startswith("ckpt_") and not p.name.endswith(".sha256")]
        return sorted(names, key=step_of, reverse=True)

    def newest(self) -> str | None:
        done = self.complete()
        return done[0] if done else None

    def has(self, name: str) -> bool:
        return (self.dir / name).exists()

    def take(self, tar_path: Path, name: str, kind: str) -> bool:
        """Add a node's tar of checkpoint `name`; True once the checkpoint is complete here."""
        stage = self.dir / f".{name}.partial"
        stage.mkdir(exist_ok=True)
        with tarfile.open(tar_path, "r") as tar:
            members = tar.getmembers()
            for m in members:  # only plain files and directories, only below the stage
                if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in Path(m.name).parts:
                    raise tarfile.TarError(f"refusing tar member {m.name!r}")
            tar.extractall(stage, members=members)
        src = stage / name
        if not is_complete(src):
            return False
        if kind == "file":
            os.replace(Path(str(src) + ".sha256"), self.dir / (name + ".sha256"))
        os.replace(src, self.dir / name)
        shutil.rmtree(stage, ignore_errors=True)
        self.prune()
        return True

    def prune(self) -> None:
        for old in self.complete()[self.keep:]:
            p = self.dir / old
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            Path(str(p) + ".sha256").unlink(missing_ok=True)
        newest = self.complete()
        floor = step_of(newest[-1]) if len(newest) >= self.keep else -1
        for stage in self.dir.glob(".ckpt_*.partial"):  # pieces older than what is kept never complete
            if step_of(stage.name[1:]) < floor:
                shutil.rmtree(stage, ignore_errors=True)


class ArtifactCopier:
    """Copies finished checkpoints and new TensorBoard bytes from the nodes to the run directory,
    every POLL_S seconds while the run trains (`start`/`stop`), and once more with `sweep`."""

    def __init__(self, cluster: Cluster, run_dir: Path, dirs: dict[str, dict], say: Callable[[str], None] = print,
                 checkpoints: bool = True):
        self.cluster, self.dirs, self.say = cluster, dirs, say
        self.checkpoints = checkpoints  # False (train.copy_checkpoints): TensorBoard files only
        self.replicator = None  # a runs/replicas.py Replicator (train.checkpoint_replica): node-to-node copies
        self.store = CheckpointStore(run_dir)
        self.tb_dir = run_dir / "tensorboard"
        self.tb_dir.mkdir(exist_ok=True)
        self.fetched: set[tuple[str, str]] = set()  # (node, checkpoint) pieces already taken
        self.copy_s = 0.0  # seconds spent copying checkpoints (the benchmark reads it)
        self.events: list[tuple[float, str]] = []  # (time, checkpoint) as each became complete here
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ checkpoints
    def poll_checkpoints(self, nodes: list[str]) -> None:
        names = [n for n in nodes if n in self.cluster.connections and self.cluster.connections[n].alive]
        if not names:
            return
        res = self.cluster.run(lambda n: artifacts_cmd(n, "list", self.dirs[n.name]["checkpoints"]),
                               stdin=AGENT, nodes=names, timeout=60)
        for name, r in res.items():
            if not r.ok:
                continue
            try:
                found = json.loads(r.stdout)
            except ValueError:
                continue
            for c in found[: self.store.keep]:
                if self.store.has(c["name"]) or (name, c["name"]) in self.fetched:
                    continue
                self.fetch(name, c["name"], c["kind"])

    def fetch(self, node: str, name: str, kind: str) -> None:
        t0 = time.monotonic()
        tmp = self.store.dir / f".incoming.{node}.tar"
        with open(tmp, "wb") as f:
            r = self.cluster.run(lambda n: artifacts_cmd(n, "send", self.dirs[node]["checkpoints"], name),
                                 stdin=AGENT, nodes=[node], timeout=TIMEOUT, capture=False,
                                 on_bytes=lambda _n, stream, data: f.write(data) if stream == "stdout" else None)[node]
        try:
            if not r.ok:
                self.say(f"could not copy {name} from {node}: {r.describe()}")
                return
            self.fetched.add((node, name))
            if self.store.take(tmp, name, kind):
                self.events.append((time.time(), name))
                self.say(f"checkpoint {name} copied to the control machine")
        except (OSError, tarfile.TarError) as e:
            self.say(f"could not unpack {name} from {node}: {e}")
        finally:
            tmp.unlink(missing_ok=True)
            self.copy_s += time.monotonic() - t0

    # ------------------------------------------------------------ tensorboard
    def poll_tensorboard(self, nodes: list[str]) -> None:
        """Every node at once: the bytes its event files gained since the last poll."""
        names = [n for n in nodes if (c := self.cluster.connections.get(n)) is not None and c.alive]
        have, bufs = {}, {n: bytearray() for n in names}
        for node in names:
            local = self.tb_dir / node  # one subdirectory per node: event file names may repeat
            have[node] = {str(p.relative_to(local)): p.stat().st_size for p in local.rglob("*") if p.is_file()} \
                if local.is_dir() else {}
        if not names:
            return
        res = self.cluster.run(lambda n: artifacts_cmd(n, "since", self.dirs[n.name]["tensorboard"],
                                                       json.dumps(have[n.name]).encode().hex()),
                               stdin=AGENT, nodes=names, timeout=60, capture=False,
                               on_bytes=lambda n, stream, data: bufs[n].extend(data) if stream == "stdout" else None)
        for node, r in res.items():
            if r.ok:
                write_frames(bytes(bufs[node]), self.tb_dir / node)

    # ------------------------------------------------------------ the loop
    def sweep(self, nodes: list[str]) -> None:
        with self._lock:
            if self.checkpoints:
                self.poll_checkpoints(nodes)
            if self.replicator is not None:
                self.replicator.poll(nodes)
            self.poll_tensorboard(nodes)

    def start(self, nodes: Callable[[], list[str]]) -> None:
        def loop():
            with contextlib.suppress(OSError):  # behind the job's processes when they share this machine
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            while not self._stop.wait(POLL_S):
                try:
                    self.sweep(nodes())
                except Exception as e:  # noqa: BLE001 - a failed copy is retried at the next poll
                    self.say(f"artifact copy: {type(e).__name__}: {e}")

        self._stop.clear()
        self._thread = threading.Thread(target=loop, daemon=True, name="artifacts")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(TIMEOUT)
            self._thread = None


def write_frames(data: bytes, root: Path) -> None:
    """Apply `since` frames: each header line names a file, the offset and how many bytes follow."""
    pos = 0
    while pos < len(data):
        nl = data.index(b"\n", pos)
        head = json.loads(data[pos:nl])
        body = data[nl + 1: nl + 1 + head["size"]]
        pos = nl + 1 + head["size"]
        rel = Path(head["rel"])
        if rel.is_absolute() or ".." in rel.parts:
            continue
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(dst, "ab") as f:
            if f.tell() != head["offset"]:
                continue  # out of step (a file rewritten on the node): skip rather than corrupt
            f.write(body)


def restore(cluster: Cluster, store: CheckpointStore, dirs: dict[str, dict], nodes: list[Node]) -> list[str]:
    """Put the newest complete checkpoint on the nodes that need it: a file checkpoint (DDP, rank 0
    loads and broadcasts) on the first node only, a directory (FSDP shards) on every node.
    Returns the nodes written to; raises nothing, a failed node is reported by name."""
    name = store.newest()
    if name is None:
        return []
    kind = "dir" if (store.dir / name).is_dir() else "file"
    targets = nodes if kind == "dir" else nodes[:1]
    files = ([str(p.relative_to(store.dir)) for p in sorted((store.dir / name).rglob("*")) if p.is_file()]
             if kind == "dir" else [name, name + ".sha256"])
    res = cluster.run(lambda n: f"{shell.path(n.python)} -c {shell.quote(LOADER)} "
                                f"receive {shell.quote(dirs[n.name]['checkpoints'])}",
                      stdin=lambda n: _agent_then(TarStream(str(store.dir), files)),
                      nodes=[n.name for n in targets], timeout=TIMEOUT)
    bad = {k: v.describe() + " " + v.stderr.strip()[-300:] for k, v in res.items() if not v.ok}
    if bad:
        raise RestoreError(name, bad)
    return [n.name for n in targets]


class RestoreError(Exception):
    def __init__(self, name: str, failed: dict[str, str]):
        self.name, self.failed = name, failed
        super().__init__(f"could not restore {name}: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))


# `python -c LOADER receive DIR`: the agent arrives first on stdin, length-prefixed, and the
# tar stream follows on the same stdin (`python -` would read the tar as script)
LOADER = "import sys;exec(sys.stdin.buffer.read(int(sys.stdin.buffer.readline())))"


def _agent_then(chunks):
    yield str(len(AGENT)).encode() + b"\n" + AGENT
    yield from chunks

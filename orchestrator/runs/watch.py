"""Copying every node's log into the run directory while the run goes on.

One agent `tail KEY OFFSET` per running node (runs/agent.py `tail`), all driven by the
transport's engine: stdout bytes go to runs/RUN/nodes/NODE.log as they arrive (the same offsets
as on the node), the agent's own stderr lines to the supervisor's log. `on_end` hears each node's
end, with the node's AgentStatus when the agent's tail closed with it (`tail KEY OFFSET status`:
no second session is opened to ask how the run ended there).

With `artifacts` (the run's ArtifactCopier, runs/checkpoints.py) the same process carries
everything else the control machine takes from the node while it trains: `tail KEY OFFSET
stream CKPTDIR|- TBDIR OFFSETS_HEX` sends framed records (remote/artifacts.py `frame`, read here
by `Frames`): log bytes by offset, the node's complete checkpoints whenever they change (the
copier fetches and replicates them on its own thread), TensorBoard bytes (appended here at
once), with a `progress` sink every rank's progress every `progress_s` s (the straggler
watch's, runs/straggler.py: asked by the node's stream process, not a process started per
request) and last the status. No poll process is started on the nodes while the run trains.

SSH is not the job: when a node's connection drops, it is reopened with backoff and its tail
resumes at the size of the control copy, so every byte lands exactly once. The node is reported
lost (a result with ErrorKind.LOST) only when it could not be reached for `lost_timeout`.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from typing import IO, Callable, Iterator, Protocol

from orchestrator.errors import ClusterctlError, ConnectError
from orchestrator.inventory import Node
from orchestrator.runs import agent
from orchestrator.runs.agent import AgentStatus, StreamFrom
from orchestrator.runs.rankfiles import RankFiles
from orchestrator.runs.stopping import say  # echo's lines carry no prefix: say adds it
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster, ErrorKind, NodeResult, Proc, retry_wait, stream

BACKOFF_S = (0.5, 1, 2, 4)  # waits between reconnect attempts; the last repeats
# the kinds of record on a node's stream: remote/artifacts.py's FRAME_* (a test holds them equal)
FRAME_LOG, FRAME_TB, FRAME_CKPTS, FRAME_PROGRESS, FRAME_END = "log", "tb", "ckpts", "progress", "end"


class Artifacts(Protocol):
    """What a node's stream feeds besides the log (runs/checkpoints.py ArtifactCopier)."""

    def stream_from(self, node: str) -> StreamFrom | None: ...

    def on_checkpoints(self, node: str, found: list[dict]) -> None: ...

    def on_tb(self, node: str, head: dict, body: bytes) -> None: ...


class Frames:
    """Splits a byte stream into records: a JSON header line with "size", then that many bytes."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.broken = False  # a record could not be read: the rest is ignored

    def feed(self, data: bytes) -> Iterator[tuple[dict, bytes]]:
        self.buf += data
        while (nl := self.buf.find(b"\n")) >= 0:
            head = json.loads(self.buf[:nl])
            end = nl + 1 + int(head["size"])
            if len(self.buf) < end:
                return
            body = bytes(self.buf[nl + 1:end])
            del self.buf[:end]
            yield head, body


class LogCopier:
    """Byte and line sinks for the engine: a node's stdout appended to its log copy."""

    def __init__(self, run: Run, names: list[str], echo: Callable[[str], None] = say,
                 after_write: Callable[[], object] | None = None, start_at: dict[str, int] | None = None,
                 artifacts: Artifacts | None = None, progress: Callable[[str, dict], None] | None = None,
                 progress_s: float = 0.0):
        self.files: dict[str, IO[bytes]] = {name: open(run.node_log(name), "ab") for name in names}
        self.echo, self.after_write, self.artifacts = echo, after_write, artifacts
        self.progress, self.progress_s = progress, progress_s  # (node, the ranks' progress document)
        self.start_at = start_at or {}  # where the node's log begins in the copy (a restart appends)
        self.final: dict[str, AgentStatus] = {}  # node -> the agent's status that closed its tail
        self.frames: dict[str, Frames] = {}  # node -> its stream's reader (framed tails only)
        first = {nd.get("name"): nd.get("first_rank") for nd in run.record.get("nodes") or []}
        self.ranks: RankFiles | None = None  # the per-rank files (runs/rankfiles.py), split as bytes land
        try:
            self.ranks = RankFiles(run.dir, {name: run.node_log(name) for name in names}, first)
        except OSError as e:
            self.echo(f"per-rank log files not written: {e}")

    def offset(self, name: str) -> int:
        return self.files[name].tell() - self.start_at.get(name, 0)

    def tail_stream(self, name: str) -> StreamFrom | None:
        """What the node's next `tail` streams besides the log: the copier's directories for the
        node, when it knows them, and the ranks' progress when a sink takes it (the reader starts
        afresh: a dropped stream's half record is sent again); None: the plain log, closed by the
        status line."""
        more = self.artifacts.stream_from(name) if self.artifacts is not None else None
        if more is None:
            self.frames.pop(name, None)
            return None
        self.frames[name] = Frames()
        return dataclasses.replace(more, progress_s=self.progress_s) if self.progress is not None else more

    def on_bytes(self, name: str, stream: str, data: bytes) -> None:
        if stream != "stdout":
            return
        reader = self.frames.get(name)
        if reader is None:
            self.write_log(name, data)
            return
        if reader.broken:
            return
        try:
            for head, body in reader.feed(data):
                self.on_record(name, head, body)
        except (ValueError, KeyError, TypeError) as e:  # out of step: nothing after it can be trusted
            reader.broken = True
            self.echo(f"{name}: unreadable stream ({type(e).__name__}: {e}); "
                      "the rest of this tail is dropped")

    def on_record(self, name: str, head: dict, body: bytes) -> None:
        kind = head.get("t")
        if kind == FRAME_LOG:
            have = self.offset(name)
            if head["offset"] > have:
                raise ValueError(f"log bytes from {head['offset']}, the copy has {have}")
            if head["offset"] + len(body) > have:
                self.write_log(name, body[have - head["offset"]:])
        elif kind == FRAME_END:
            self.final[name] = AgentStatus.from_json(body)
        elif self.artifacts is not None and kind == FRAME_TB:
            try:
                self.artifacts.on_tb(name, head, body)
            except OSError as e:  # the log copy goes on; a reconnect or the last sweep sends them again
                self.echo(f"{name}: TensorBoard bytes of {head.get('rel')!r} not written: {e}")
        elif self.artifacts is not None and kind == FRAME_CKPTS:
            self.artifacts.on_checkpoints(name, json.loads(body))
        elif self.progress is not None and kind == FRAME_PROGRESS:
            self.progress(name, json.loads(body))

    def write_log(self, name: str, data: bytes) -> None:
        f = self.files[name]
        f.write(data)
        f.flush()
        if self.ranks is not None:
            try:
                self.ranks.feed(name, data)
            except OSError as e:  # the node's log copy goes on; the rank files stop here
                self.echo(f"per-rank log files stopped: {e}")
                self.ranks = None
        if self.after_write is not None:
            self.after_write()

    def on_line(self, name: str, stream: str, line: str) -> None:
        if stream != "stderr":
            return
        try:
            end = agent.end_status(line)  # the node's own word on how the run ended
        except ValueError:
            self.echo(f"{name}: unreadable end status {line[-200:]!r}")
            return
        if end is not None:
            self.final[name] = end
        elif line.strip():
            self.echo(f"{name}: {line.strip()}")

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        if self.ranks is not None:
            self.ranks.close()


def reconnect(cluster: Cluster, node: Node, lost: NodeResult, tell: Callable[..., None],
              stop: threading.Event | None = None) -> str | None:
    """Reopen a node's dropped connection with backoff until `lost_timeout` after the node was
    last heard from (one attempt at least). None once it is open again, else why the node is
    lost ("no answer for 30.4s (...)"), the words its failure is then told in. Each step is told
    (the run's story: the foreground prints it) with the silence measured."""
    conn = cluster.connections[node.name]
    heard = getattr(conn, "last_heard", time.monotonic())
    deadline = heard + cluster.lost_timeout
    silent = round(time.monotonic() - heard, 1)
    tell(f"{node.name}: silent for {silent:.1f}s ({lost.error or 'connection lost'}); "
         f"reconnecting, lost after {cluster.lost_timeout:g}s", event="node_silent", node=node.name, silent_s=silent)
    for attempt in range(10_000):
        try:
            conn.reopen(timeout=deadline - time.monotonic())
            silent = round(time.monotonic() - heard, 1)
            tell(f"{node.name}: reconnected after {silent:.1f}s of silence; its log goes on where it stopped",
                 event="node_reconnected", node=node.name, silent_s=silent)
            return None
        except ClusterctlError as e:  # ConnectError, HostKeyError: not answering (yet)
            why = e.message if isinstance(e, ConnectError) else str(e)
            refused = isinstance(e, ConnectError) and e.refused
        # a node that refuses us (host key, our key) waits for a person: the slower backoff
        wait = retry_wait(attempt) if refused else BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
        if time.monotonic() + wait > deadline or (stop is not None and stop.is_set()):
            lost_why = f"no answer for {time.monotonic() - heard:.1f}s ({why})"
            tell(f"{node.name} lost: {lost_why}")
            return lost_why
        time.sleep(wait)
    return "no answer"


class _Copy:
    """The tails of one copy_logs call: each node's tail runs on the engine; a dropped one is
    reconnected on its own thread and handed back to the engine through `events`."""

    def __init__(self, cluster: Cluster, run: Run, nodes: list[Node],
                 on_end: Callable[[NodeResult, AgentStatus | None], None],
                 copier: LogCopier, echo: Callable[[str], None], stop: threading.Event | None, key: str):
        self.cluster, self.run, self.on_end, self.copier, self.echo, self.stop, self.key = \
            cluster, run, on_end, copier, echo, stop, key
        self.tell: Callable[..., None] = lambda text, **about: echo(text)  # `about`: Book.tell's data
        self.nodes = {n.name: n for n in nodes}
        self.active = set(self.nodes)  # not ended and not lost
        self.events: queue.Queue = queue.Queue()  # a Proc to drive, or a final NodeResult

    def start_tail(self, name: str) -> Proc:
        tail = agent.tail(self.nodes[name], self.key, self.copier.offset(name), self.copier.tail_stream(name))
        return tail.start(self.cluster.connections[name])

    def recover(self, res: NodeResult) -> None:
        """On its own thread: reconnect and resume at the copy's size, or report the node lost."""
        name = res.node
        while (why := reconnect(self.cluster, self.nodes[name], res, self.tell, self.stop)) is None:
            try:
                self.events.put(self.start_tail(name))
                return
            except ClusterctlError as e:  # dropped again at once
                res = NodeResult(name, None, error=str(e), kind=ErrorKind.LOST)
        # lost: told in the words the story just used, not the first silence's
        self.events.put(dataclasses.replace(res, error=why))

    def on_done(self, res: NodeResult) -> None:
        if res.kind is ErrorKind.LOST and not (self.stop is not None and self.stop.is_set()):
            threading.Thread(target=self.recover, args=(res,), name=f"reconnect-{res.node}", daemon=True).start()
            return
        self.ended(res)

    def ended(self, res: NodeResult) -> None:
        self.active.discard(res.node)
        self.on_end(res, self.copier.final.pop(res.node, None))

    def pending(self) -> Proc | None:
        """For the engine: the next resumed tail; final results met on the way are reported."""
        while True:
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return None
            if not isinstance(item, NodeResult):
                return item
            self.ended(item)

    def copy(self) -> None:
        for name in list(self.active):
            if name not in self.cluster.connections:  # never connected (an adopted run's node that is down)
                self.ended(NodeResult(name, None, error="not connected", kind=ErrorKind.LOST))
                continue
            try:
                self.events.put(self.start_tail(name))
            except ClusterctlError as e:
                self.on_done(NodeResult(name, None, error=str(e), kind=ErrorKind.LOST))
        while self.active:
            stream((), on_bytes=self.copier.on_bytes, on_line=self.copier.on_line, on_done=self.on_done,
                   pending=self.pending, timeout=None, capture=False, stop=self.stop,
                   fanout=max(1, len(self.nodes)))
            if self.active:  # only reconnecting nodes left: wait for one to come back or be lost
                try:
                    self.events.put(self.events.get(timeout=1.0))
                except queue.Empty:
                    pass


def copy_logs(cluster: Cluster, run: Run, nodes: list[Node], on_end: Callable[[NodeResult, AgentStatus | None], None],
              *, echo: Callable[[str], None] = say, after_write: Callable[[], object] | None = None,
              stop: threading.Event | None = None, key: str | None = None,
              start_at: dict[str, int] | None = None, artifacts: Artifacts | None = None,
              tell: Callable[..., None] | None = None, progress: Callable[[str, dict], None] | None = None,
              progress_s: float = 0.0) -> None:
    """Copy each node's log until its run ended there and every byte arrived, or the node is
    lost (unreachable for `lost_timeout`: `on_end` gets a LOST result). No timeout: a run lasts as
    long as it trains. `stop` ends the copying at once (`on_end` gets STOPPED results).
    `after_write` runs after each chunk lands in a log copy (`tail` prints the new lines). `key`:
    the run's id on the nodes when it is not run.id (a restart's RUN_ID.aK); `start_at`: where
    each node's log begins in its copy; `artifacts`: where the nodes' checkpoint and TensorBoard
    records go (their tails then stream them); `progress`: where each node's progress document
    goes (node, doc), asked every `progress_s` s on those streams (the straggler watch's feed);
    `tell`: where a node's silence, reconnection and loss are told (the run's story, record.py
    Book.tell; else echoed)."""
    if not nodes:
        return
    copier = LogCopier(run, [n.name for n in nodes], echo, after_write, start_at, artifacts, progress, progress_s)
    try:
        copy = _Copy(cluster, run, nodes, on_end, copier, echo, stop, key or run.id)
        if tell is not None:
            copy.tell = tell
        copy.copy()
    finally:
        copier.close()

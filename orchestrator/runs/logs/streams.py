"""Copying every node's log into the run directory while the run goes on.

One agent `tail KEY OFFSET` per running node (node/agent.py `tail`), all driven by the
transport's engine: stdout bytes go to runs/RUN/nodes/NODE.log as they arrive (the same offsets
as on the node), the agent's own stderr lines to the supervisor's log. `on_end` hears each node's
end, with the node's AgentStatus when the agent's tail closed with it (`tail KEY OFFSET status`:
no second session is opened to ask how the run ended there).

With `artifacts` (the run's ArtifactCopier, runs/ckpt/given_home.py) the same process carries
everything else the control machine takes from the node while it trains: `tail KEY OFFSET
stream CKPTDIR|- TBDIR OFFSETS_HEX` sends framed records (remote/artifacts.py `frame`, read by
runs/logs/copier.py `LogCopier`): log bytes by offset, the node's complete checkpoints whenever they change (the
copier fetches and replicates them on its own thread), TensorBoard bytes (appended here at
once), with a `progress` sink every rank's progress every `progress_s` s (the straggler
watch's, runs/judge/straggler.py: asked by the node's stream process, not a process started per
request) and last the status. No poll process is started on the nodes while the run trains.

SSH is not the job: when a node's connection drops, it is reopened with backoff and its tail
resumes at the size of the control copy, so every byte lands exactly once. The node is reported
lost (a result with ErrorKind.LOST) when it could not be reached for `lost_timeout`, or at once
when its connection was closed on the evidence that it is gone (transport/liveness.py: its SSH
port answers no TCP handshake while the other nodes answer). A tail
is started again at the copy's size the same way when the control machine's disk had no room for
its bytes and has room again (runs/space.py), and when its stream, asked for progress, sent
nothing for `stall_s` while its node answers (the stream process there is stuck; the run's stream
stall grows with the cluster: runs/scaling.py) and the attempt is not being stopped: once `stopping` is set, a node's stream going quiet is the node
doing its part of the stop (its ranks ending, its sshd and agents crowded by every node's stop at
once), and a restart would only add a session to each node while they end.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable

from orchestrator.errors import ClusterctlError, ConnectError
from orchestrator.inventory import Node
from orchestrator.node import agent
from orchestrator.node.agent import AgentStatus
from orchestrator.runs.logs.copier import Artifacts, LogCopier
from orchestrator.runs.logs.streamask import StreamAsks
from orchestrator.runs.scaling import STREAM_STALL_S  # the default below 64 nodes: the run's own is its spec's
from orchestrator.runs.space import Space
from orchestrator.runs.stopping import say  # echo's lines carry no prefix: say adds it
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster, ErrorKind, NodeResult, Proc, open_all, retry_wait, stream

BACKOFF_S = (0.5, 1, 2, 4)  # waits between reconnect attempts; the last repeats
LOOK_S = 0.5  # how often the tails are looked over for one to start again (_Copy.look)


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
    proof = getattr(conn, "evidence", None)  # lost on evidence (transport/liveness.py): no reconnecting
    if proof:
        tell(f"{node.name} lost: {proof}", lost=node.name, silent_s=silent)
        return proof
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
            silent = round(time.monotonic() - heard, 1)
            lost_why = f"no answer for {silent:.1f}s ({why})"
            # as data too (the goodput ledger's detection); not an `event`: the record's change is that
            tell(f"{node.name} lost: {lost_why}", lost=node.name, silent_s=silent)
            return lost_why
        time.sleep(wait)
    return "no answer"


class _Copy:
    """The tails of one copy_logs call: each node's tail runs on the engine; a dropped one is
    reconnected on its own thread and handed back to the engine through `events`."""

    def __init__(self, cluster: Cluster, run: Run, nodes: list[Node],
                 on_end: Callable[[NodeResult, AgentStatus | None], None],
                 copier: LogCopier, echo: Callable[[str], None], stop: threading.Event | None, key: str,
                 stopping: threading.Event | None = None, stall_s: float = STREAM_STALL_S,
                 streams: StreamAsks | None = None):
        self.cluster, self.run, self.on_end, self.copier, self.echo, self.stop, self.key = \
            cluster, run, on_end, copier, echo, stop, key
        self.streams = streams  # the framed streams, each a door for a stop or a snapshot (streamask.py)
        if streams is not None:
            copier.answered = streams.answered
        self.stopping = stopping  # set once the attempt is being stopped: silence is expected then
        self.tell: Callable[..., None] = lambda text, **about: echo(text)  # `about`: Book.tell's data
        self.nodes = {n.name: n for n in nodes}
        self.active = set(self.nodes)  # not ended and not lost
        self.events: queue.Queue = queue.Queue()  # a Proc to drive, or a final NodeResult
        self.procs: dict[str, Proc] = {}  # each node's tail now
        self.heard: dict[str, float] = {}  # when each node's tail last sent anything (monotonic)
        self.restarting: set[str] = set()  # tails ended on purpose: started again at the copy's size
        self.again_at_end: dict[str, int] = {}  # tails started again after their end, to catch up
        self.short: set[str] = set()  # nodes whose copy ended short of their log (no room at their end)
        self.looked = float("-inf")  # when `look` last went over the nodes (monotonic)
        # a stream that asks for progress sends a record every progress_s at least: silent far
        # longer while its node answers, the stream process is stuck (not the script)
        asked = copier.progress_s if copier is not None and copier.progress is not None else 0.0
        self.stall_s = max(stall_s, 3 * asked) if asked > 0 else None

    def start_tail(self, name: str) -> Proc:
        """The node's tail, started from the copy's size (raises what the connection's exec raises).
        Several nodes' at once: each on its own thread (`copy`), each touching only its node's entries."""
        more = self.copier.tail_stream(name)
        tail = agent.tail(self.nodes[name], self.key, self.copier.offset(name), more)
        # a framed stream listens on its stdin for a stop: kept open
        proc = tail.start(self.cluster.connections[name], keep_stdin=more is not None and self.streams is not None)
        self.copier.behind.discard(name)  # from the copy's size: whatever found no room comes again
        self.procs[name], self.heard[name] = proc, time.monotonic()
        if more is not None and self.streams is not None:
            self.streams.attach(name, proc)
        return proc

    def on_bytes(self, name: str, which: str, data: bytes) -> None:
        self.heard[name] = time.monotonic()
        self.copier.on_bytes(name, which, data)

    def restart(self, name: str, why: str | None = None) -> None:
        """End the node's tail now; `on_done` starts it again at the copy's size."""
        proc = self.procs.get(name)
        if proc is None or name in self.restarting:
            return
        if why:
            self.tell(why, event="stream_restarted", node=name)
        self.restarting.add(name)
        proc.kill()

    def look(self) -> None:
        """Tails to start again: a node behind once there is room, a stream stuck while its node
        answers and the attempt is not being stopped. At most every LOOK_S: the engine asks on
        every turn of its loop (every chunk of every node's log), and a stall is tens of seconds."""
        now = time.monotonic()
        if now - self.looked < LOOK_S:
            return
        self.looked = now
        stopping = self.stopping is not None and self.stopping.is_set()
        for name in [n for n in self.active if n in self.procs and n not in self.restarting]:
            conn = self.cluster.connections.get(name)
            if name in self.copier.behind and self.copier.room():
                self.restart(name)
            elif self.stall_s and not stopping and name in self.copier.frames and now - self.heard[name] > self.stall_s \
                    and conn is not None and conn.alive:
                self.restart(name, f"{name}: its log stream sent nothing for {now - self.heard[name]:.0f}s while "
                                   "the node answers: the stream process there is stuck, not the script; started "
                                   f"again from byte {self.copier.offset(name)} of its log")

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
        name, stopped = res.node, self.stop is not None and self.stop.is_set()
        proc = self.procs.pop(name, None)
        if self.streams is not None:
            self.streams.detach(name, proc)
        if name in self.restarting:
            self.restarting.discard(name)
            if not stopped:
                try:
                    self.events.put(self.start_tail(name))
                    return
                except ClusterctlError as e:  # dropped at once: reconnected as any drop
                    res = NodeResult(name, None, error=str(e), kind=ErrorKind.LOST)
        if res.kind is ErrorKind.LOST and not stopped:
            threading.Thread(target=self.recover, args=(res,), name=f"reconnect-{name}", daemon=True).start()
            return
        if name in self.copier.behind and self.copier.room() and not stopped and self.again_at_end.get(name, 0) < 3:
            self.again_at_end[name] = self.again_at_end.get(name, 0) + 1  # ended while behind: the rest, then the end
            try:
                self.events.put(self.start_tail(name))
                return
            except ClusterctlError:
                pass
        self.ended(res)

    def ended(self, res: NodeResult) -> None:
        self.active.discard(res.node)
        if res.node in self.copier.behind:
            self.short.add(res.node)
        self.on_end(res, self.copier.final.pop(res.node, None))

    def pending(self) -> Proc | None:
        """For the engine (each turn of its loop): the next resumed tail; final results met on the
        way are reported; tails to start again are ended (`look`)."""
        self.look()
        while True:
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return None
            if not isinstance(item, NodeResult):
                return item
            self.ended(item)

    def copy(self) -> None:
        reached = []
        for name in list(self.active):
            if name not in self.cluster.connections:  # an adopted run's node that did not answer its supervisor
                err = self.cluster.unreachable.get(name)
                why = (f"no answer for {self.cluster.lost_timeout:g}s to the supervisor that took the run over "
                       f"({err.error if err is not None and err.error else 'not connected'})")
                self.tell(f"{name} lost: {why}")  # the loss a running node's silence ends in (reconnect)
                self.ended(NodeResult(name, None, error=why, kind=ErrorKind.LOST))
            else:
                reached.append(name)
        dropped: dict[str, ClusterctlError] = {}

        def one(name: str) -> Proc | None:
            try:
                return self.start_tail(name)
            except ClusterctlError as e:
                dropped[name] = e
                return None

        for proc in open_all(reached, one):  # every node's tail at once (transport/engine.py open_all)
            self.events.put(proc)
        for name, e in dropped.items():
            self.on_done(NodeResult(name, None, error=str(e), kind=ErrorKind.LOST))
        while self.active:
            # one more slot than nodes: the engine asks `pending` each turn, also with every tail running
            stream((), on_bytes=self.on_bytes, on_line=self.copier.on_line, on_done=self.on_done,
                   pending=self.pending, timeout=None, capture=False, stop=self.stop, fanout=len(self.nodes) + 1)
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
              progress_s: float = 0.0, space: Space | None = None,
              stopping: threading.Event | None = None, stall_s: float = STREAM_STALL_S,
              streams: StreamAsks | None = None) -> set[str]:
    """Copy each node's log until its run ended there and every byte arrived, or the node is
    lost (unreachable for `lost_timeout`: `on_end` gets a LOST result). No timeout: a run lasts as
    long as it trains. `stop` ends the copying at once (`on_end` gets STOPPED results).
    `after_write` runs after each chunk lands in a log copy (`tail` prints the new lines). `key`:
    the run's id on the nodes when it is not run.id (a restart's RUN_ID.aK); `start_at`: where
    each node's log begins in its copy; `artifacts`: where the nodes' checkpoint and TensorBoard
    records go (their tails then stream them); `progress`: where each node's progress document
    goes (node, doc), asked every `progress_s` s on those streams (the straggler watch's feed);
    `tell`: where a node's silence, reconnection and loss are told (the run's story, record.py
    Book.tell; else echoed); `space`: the control machine's disk (runs/space.py), whose want of room
    holds the copies back until there is room again; `stopping`: set once the attempt is being
    stopped (no stream is then restarted for its silence); `stall_s`: the silence of a stream, its node
    answering, that restarts it (at least 3 progress periods); `streams`: where each framed stream
    is kept open as a door for the attempt's stop (streamask.py). Returns the nodes whose copy ended short of
    their log (no room when their run ended there: runs/logs/catchup.py completes them later)."""
    if not nodes:
        return set()
    copier = LogCopier(run, [n.name for n in nodes], echo, after_write, start_at, artifacts, progress, progress_s,
                       space)
    try:
        copy = _Copy(cluster, run, nodes, on_end, copier, echo, stop, key or run.id, stopping, stall_s, streams)
        if tell is not None:
            copy.tell = tell
        copy.copy()
        return copy.short
    finally:
        copier.close()

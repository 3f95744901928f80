"""A node's log stream read into the run directory: the byte and record sinks of the engine.

`LogCopier` appends each node's log bytes to runs/RUN/nodes/NODE.log at the node's own offsets
and splits them into the per-rank files (runs/logs/rankfiles.py); with `artifacts` the stream's other
records (remote/artifacts.py `frame`, read by `Frames`) go to the run's ArtifactCopier
(checkpoints, TensorBoard bytes) and its progress sink. On a control machine whose disk has no room
(runs/space.py) a node's bytes are dropped and the node marked `behind`: its tail is started again
at the copy's size once there is room (runs/logs/streams.py), so the copy stays byte for byte the node's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import IO, Callable, Protocol

from orchestrator.node import agent
from orchestrator.node.agent import AgentStatus, StreamFrom
from orchestrator.node.artifacts import (FRAME_CKPTS, FRAME_END, FRAME_LOG, FRAME_PROGRESS,  # noqa: F401
                                          FRAME_CLOCK, FRAME_SNAPSHOT, FRAME_STOPPING, FRAME_TB, Frames)
from orchestrator.runs.logs.rankfiles import RankFiles
from orchestrator.runs.space import Space, write_all
from orchestrator.runs.stepjournal import StepJournal
from orchestrator.runs.stopping import say  # echo's lines carry no prefix: say adds it
from orchestrator.runs.store import Run


class Artifacts(Protocol):
    """What a node's stream feeds besides the log (runs/ckpt/given_home.py ArtifactCopier)."""

    def stream_from(self, node: str) -> StreamFrom | None: ...

    def on_checkpoints(self, node: str, found: list[dict]) -> None: ...

    def on_tb(self, node: str, head: dict, body: bytes) -> None: ...


class LogCopier:
    """Byte and line sinks for the engine: a node's stdout appended to its log copy."""

    def __init__(self, run: Run, names: list[str], echo: Callable[[str], None] = say,
                 after_write: Callable[[], object] | None = None, start_at: dict[str, int] | None = None,
                 artifacts: Artifacts | None = None, progress: Callable[[str, dict], None] | None = None,
                 progress_s: float = 0.0, space: Space | None = None):
        # unbuffered: what a full disk took of a chunk is on disk, so the copy's size is where to resume
        self.files: dict[str, IO[bytes]] = {name: open(run.node_log(name), "ab", buffering=0) for name in names}
        self.echo, self.after_write, self.artifacts = echo, after_write, artifacts
        self.progress, self.progress_s = progress, progress_s  # (node, the ranks' progress document)
        self.start_at = start_at or {}  # where the node's log begins in the copy (a restart appends)
        self.final: dict[str, AgentStatus] = {}  # node -> the agent's status that closed its tail
        self.frames: dict[str, Frames] = {}  # node -> its stream's reader (framed tails only)
        self.space = space  # the control machine's disk (runs/space.py): full, the copies wait for room
        self.behind: set[str] = set()  # nodes whose bytes found no room: their tail starts again at the copy's size
        self.run, self.names = run, names
        self.ranks: RankFiles | None = None  # the per-rank files (runs/logs/rankfiles.py), split as bytes land
        self.ranks_wait = False  # stopped by a full disk: made again (from their index) once there is room
        # when rank 0's steps arrived (the goodput ledger's); a full disk costs the ledger points, not the run
        self.steps = StepJournal(run.dir, run.record.attempt or 1)
        # a stream's answer to a request on its stdin: FRAME_STOPPING, FRAME_SNAPSHOT, FRAME_CLOCK (streamask.py)
        self.answered: Callable[[str, str, dict], None] | None = None
        self.split_ranks()

    def split_ranks(self) -> None:
        """The per-rank files, from where their index left them (runs/logs/rankfiles.py)."""
        first = {nd.name: nd.first_rank for nd in self.run.record.nodes}
        try:
            self.ranks = RankFiles(self.run.dir, {name: self.run.node_log(name) for name in self.names}, first,
                                   on_line=self.steps.rank_line)
            self.ranks_wait = False
        except OSError as e:
            self.ranks_wait = self.space is not None and self.space.full(e, "the per-rank log files")
            if not self.ranks_wait:
                self.echo(f"per-rank log files not written: {e}")

    def room(self) -> bool:
        """Whether the copies may be written (the disk is not known to be full)."""
        return self.space is None or not self.space.is_full

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
        if kind == FRAME_LOG and name in self.behind:  # no room for them: the tail starts again for them
            if self.after_write is not None:
                self.after_write()
        elif kind == FRAME_LOG:
            have = self.offset(name)
            if head["offset"] > have:
                raise ValueError(f"log bytes from {head['offset']}, the copy has {have}")
            if head["offset"] + len(body) > have:
                self.write_log(name, body[have - head["offset"]:])
        elif kind == FRAME_END:
            self.final[name] = AgentStatus.from_json(body)
        elif kind in (FRAME_STOPPING, FRAME_SNAPSHOT, FRAME_CLOCK) and self.answered is not None:
            self.answered(name, kind, json.loads(body))
        elif self.artifacts is not None and kind == FRAME_TB:
            try:
                if self.room():
                    self.artifacts.on_tb(name, head, body)
            except OSError as e:  # the log copy goes on; a reconnect or the last sweep sends them again
                if self.space is None or not self.space.full(e, "the TensorBoard files"):
                    self.echo(f"{name}: TensorBoard bytes of {head.get('rel')!r} not written: {e}")
        elif self.artifacts is not None and kind == FRAME_CKPTS:
            self.artifacts.on_checkpoints(name, json.loads(body))
        elif self.progress is not None and kind == FRAME_PROGRESS:
            self.progress(name, json.loads(body))

    def write_log(self, name: str, data: bytes) -> None:
        """`data` appended to the node's copy and split into the rank files. With no room on the
        disk the node falls behind (`behind`): its bytes are dropped until its tail starts again
        at the copy's size; `after_write` hears them all the same (they arrived)."""
        if name not in self.behind:
            try:
                write_all(self.files[name], data)
            except OSError as e:
                if self.space is None or not self.space.full(e, "the log copies"):
                    raise
                self.behind.add(name)
            else:
                self.split(name, data)
        if self.after_write is not None:
            self.after_write()

    def split(self, name: str, data: bytes) -> None:
        if self.ranks is None and self.ranks_wait and self.room():
            self.split_ranks()  # from the index: what this chunk added is split there
            return
        if self.ranks is None:
            return
        try:
            self.ranks.feed(name, data)
        except OSError as e:  # the node's log copy goes on; the rank files stop here
            self.ranks.close()
            self.ranks = None
            self.ranks_wait = self.space is not None and self.space.full(e, "the per-rank log files")
            if not self.ranks_wait:
                self.echo(f"per-rank log files stopped: {e}")

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
        self.steps.close()

"""remote/artifacts.py's client: a run's artifact directories, checkpoints polled, sent, held,
received and pruned, TensorBoard bytes, and trees packed for `fetch`/`cp`.

The stream's frame kinds and `tree`'s exit codes are read from the program itself (probe.load:
the same module the nodes run), so the two sides cannot name them differently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from orchestrator import probe
from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.form import Exec
from orchestrator.node.wire import Call, reply
from orchestrator.transport import NodeResult

PROGRAM = "artifacts"
_CODES = probe.load(PROGRAM)
# the kinds of record on a node's stream (node_agent.py writes them with remote/artifacts.py `frame`)
FRAME_LOG, FRAME_TB, FRAME_CKPTS, FRAME_PROGRESS, FRAME_END, FRAME_STOPPING, FRAME_SNAPSHOT, FRAME_CLOCK = (
    _CODES.FRAME_LOG, _CODES.FRAME_TB, _CODES.FRAME_CKPTS, _CODES.FRAME_PROGRESS, _CODES.FRAME_END,
    _CODES.FRAME_STOPPING, _CODES.FRAME_SNAPSHOT, _CODES.FRAME_CLOCK)
TREE_MISSING, TREE_OUTSIDE = _CODES.TREE_MISSING, _CODES.TREE_OUTSIDE  # `tree`'s exit codes
TIMEOUT = 60.0  # prepare, held, prune


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


def command(node: Node, verb: str, *args: object) -> Exec:
    """`PYTHON -c BOOT CODE artifacts VERB ARGS` (form.py)."""
    return form.command(node, PROGRAM, verb, *args)


@dataclass(frozen=True)
class Dirs:
    """`prepare`: the run's artifact directories on the node (absolute paths there), by kind
    ("checkpoints", "tensorboard", "replicas"), created when missing."""

    dirs: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None


def prepare(node: Node, run_id: str) -> Call[Dirs]:
    e = command(node, "prepare", run_id)
    return Call(e.command, e.stdin, TIMEOUT, lambda r: reply(r, dict, lambda d: Dirs(dict(d)),
                                                             lambda why: Dirs(error=why), PROGRAM, 300))


@dataclass(frozen=True)
class Held:
    """`held`: the complete checkpoints the node holds, its own and each origin's replicas, as the
    program prints them ({"own": [...], "replicas": {origin: [...]}})."""

    held: Mapping = field(default_factory=dict)
    error: str | None = None


def read_held(r: NodeResult) -> Held:
    return reply(r, dict, lambda d: Held(d), lambda why: Held(error=why), PROGRAM)


def held(node: Node, checkpoints: str, replicas: str) -> Call[Held]:
    e = command(node, "held", checkpoints, replicas)
    return Call(e.command, e.stdin, TIMEOUT, read_held)


def prune(node: Node, directory: str, keep: int) -> Exec:
    """`prune DIR KEEP`: the newest `keep` complete checkpoints stay in DIR."""
    return command(node, "prune", directory, keep)


def poll(node: Node, checkpoints: str | None, tensorboard: str, have: Mapping[str, int]) -> Exec:
    """`poll CKPTDIR|- TBDIR OFFSETS_HEX`: one JSON line of the complete checkpoints (newest
    first), then TensorBoard frames from the offsets the control copy has (read_poll)."""
    return command(node, "poll", checkpoints or "-", tensorboard, json.dumps(dict(have)).encode().hex())


def read_poll(data: bytes) -> tuple[list | None, bytes]:
    """poll's stdout -> (its checkpoints, the frames after them); None when the head does not read."""
    if b"\n" not in data:
        return None, b""
    head, frames = data.split(b"\n", 1)
    try:
        found = json.loads(head)
    except ValueError:
        return None, b""
    return found, frames


def send(node: Node, checkpoints: str, name: str) -> Exec:
    """`send DIR NAME`: checkpoint NAME as a tar on stdout."""
    return command(node, "send", checkpoints, name)


def pack(node: Node, run_id: str, *keys: str) -> Exec:
    """`pack RUN_ID - KEYS`: the run's artifacts as a tar on stdout."""
    return command(node, "pack", run_id, "-", *keys)


def tree(node: Node, spec: Mapping) -> Exec:
    """`tree SPEC_JSON`: what the spec names ({"path", "run", "workdir"}) as a tar on stdout."""
    return command(node, "tree", json.dumps(dict(spec)))


def receive(node: Node, checkpoints: str) -> Exec:
    """`receive DIR`: a tar stream (the caller's stdin) unpacked into DIR."""
    return form.command(node, PROGRAM, "receive", checkpoints)


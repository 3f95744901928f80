"""remote/ckptdir.py's client: a job's own checkpoint directory looked at, captured, sent,
restored, set aside, frozen into replicas and checked on the nodes.

What a verb reads (a file list, a tar stream) is its stdin. A verb that answers with JSON is a `Call`
whose reply is a wire.Answer (its `doc`, or the `error` that says why there is none).
"""

from __future__ import annotations

from orchestrator import probe
from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.form import Exec
from orchestrator.node.wire import Answer, Call, read_answer

PROGRAM = "ckptdir"
_CODES = probe.load(PROGRAM)
CHANGED: int = _CODES.CHANGED  # send/freeze's exit code: a file is not as listed
PENDING: str = _CODES.PENDING  # the last component of a node's captures directory
TIMEOUT = 60.0  # one short verb (prepare, look, link, forget, keep)


def command(node: Node, verb: str, *args: object) -> Exec:
    """`PYTHON -c BOOT CODE ckptdir VERB ARGS` (form.py); the verb's data is its stdin."""
    return form.command(node, PROGRAM, verb, *args)


def call(node: Node, verb: str, *args: object, data: bytes = b"", timeout: float = TIMEOUT,
         want: type = dict) -> Call[Answer]:
    """`verb` with `data` on stdin, its last JSON line (a `want`) read into an
    Answer (a node that failed: its exit and the end of its stderr)."""
    e = command(node, verb, *args)
    return Call(e.command, data or None, timeout, lambda r: read_answer(r, want, "ckptdir", 300))


def prepare(node: Node, path: str) -> Call[Answer]:
    """`prepare DIR`: DIR made -> {"path": its absolute path}."""
    return call(node, "prepare", path)


def look(node: Node, path: str, pending: str, settle: float, wait: float, key: str) -> Call[Answer]:
    """`look DIR PENDING SETTLE WAIT KEY|-`: the complete entries captured -> {"files", "torn", ...}."""
    return call(node, "look", path, pending, settle, wait, key)


def forget(node: Node, pending: str) -> Exec:
    return command(node, "forget", pending)


def send(node: Node, pending: str) -> Exec:
    """`send PENDING`: the listed captured files (a JSON line after the program) as a tar on stdout."""
    return command(node, "send", pending)


def restore(node: Node, path: str, aside: str) -> Exec:
    """`restore DIR ASIDE`: a tar stream (after the program) put into DIR, the rest set aside."""
    return command(node, "restore", path, aside)

"""remote/nodeinfo.py's client: a node's Python and torch facts (inside the preflight probe), its
workdir's code listed, digested, pruned and sent node to node.

`PYTHON [-S] -c BOOT CODE nodeinfo MODE ARGS` (form.py; stdin carries a manifest or a file list),
or the same line inside the preflight's shell probe (`probe_text`). `-S` where start-up counts: no
site (its .pth imports cost ~14 ms a node); nodeinfo finds site-packages itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.form import Exec, NodePath
from orchestrator.node.wire import Call, last_object
from orchestrator.transport import NodeResult

PROGRAM = "nodeinfo"
NO_SITE = ("-S",)


def command(node: Node, mode: str, *args: object, flags: tuple[str, ...] = (), xfer: str | None = None) -> Exec:
    """`[CLUSTERCTL_XFER=ID ]PYTHON [FLAGS] -c BOOT CODE nodeinfo MODE ARGS` on the node's interpreter."""
    return form.command(node, PROGRAM, mode, *args, flags=flags,
                        env={"CLUSTERCTL_XFER": xfer} if xfer else None, group_env=False)


def prune(node: Node, outputs: list[str]) -> Exec:
    """`prune WORKDIR --output DIR...`: what the manifest on stdin does not list is removed from the
    workdir (the run's outputs are not code), and the manifest recorded as the node's code."""
    return command(node, "prune", NodePath(node.workdir), *outputs)


def send(node: Node, xfer: str, src_dir: str, idle: float, connect: float) -> Exec:
    """`send DIR`: the files listed on stdin (after the receiver's address) sent to a relay's `recv`."""
    return command(node, "send", NodePath(src_dir), "--idle", f"{idle:g}", "--connect-timeout", f"{connect:g}",
                   xfer=xfer)


@dataclass(frozen=True)
class Workdir:
    """`select`/`info` of a workdir: nodeinfo's JSON (`files`, `code` ...), or why there is none
    (the last line it wrote on stderr, or the transport's word)."""

    doc: Any = None
    error: str | None = None


def why(r: NodeResult) -> str:
    """A failed nodeinfo as one line: the last it wrote on stderr, else the transport's word."""
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    return err[-1].strip() if err else r.describe()


def read_workdir(r: NodeResult) -> Workdir:
    doc = last_object(r.stdout) if r.ok else None
    return Workdir(doc) if isinstance(doc, dict) else Workdir(error=why(r))


def workdir(node: Node, mode: str, outputs: list[str], *extra: str, timeout: float) -> Call[Workdir]:
    """`-S -c NODEINFO MODE WORKDIR --output DIR... EXTRA`: `select` lists the code a sync would
    ship (EXTRA: --include/--exclude), `info` digests it."""
    e = command(node, mode, NodePath(node.workdir), *outputs, *extra, flags=NO_SITE)
    return Call(e.command, e.stdin, timeout, read_workdir)


def probe_text() -> str:
    """nodeinfo's `info` inside the preflight's `sh` probe: run by the probe's "$py" with no site,
    the workdir ("$pwd_arg", "-" skips the digest) and the probe's own arguments ("$@")."""
    return form.script_line(PROGRAM, '"$py"', "info", '"$pwd_arg"', '"$@"', flags=NO_SITE)

"""remote/pyenv.py's client: a node's Python environment probed and installed (`setup`).

The program is run by the interpreter that creates the venv (setup.base): `BASE -c BOOT CODE pyenv
VERB ARGS` (form.py); every argument is a node path or a flag (`~/` keeps meaning the node's
home). Its answer is the last JSON object it prints; a failure is told by its `error:` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.form import Exec, NodePath
from orchestrator.node.wire import last_object
from orchestrator.transport import NodeResult

PROGRAM = "pyenv"


def command(node: Node, base: str, verb: str, *args: str) -> Exec:
    """`BASE -c BOOT CODE pyenv VERB ARGS`: BASE the interpreter that makes the venv."""
    return form.command(node, PROGRAM, verb, *(NodePath(a) for a in args), python=base, group_env=False)


@dataclass(frozen=True)
class Report:
    """pyenv's answer (`probe`: the venv's state; `install`: what changed), or why there is none."""

    doc: Any = None
    error: str | None = None


def why(r: NodeResult, what: str) -> str:
    """A failed node command as one line: the script's `error:` line, else its last words."""
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    errs = [ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")]
    if errs:
        return errs[-1]
    if r.exit_code == 127 or any("not found" in ln for ln in lines[-2:]):
        return f"{what}: {lines[-1] if lines else 'command not found'}"
    return f"{what}: {r.error or (lines[-1] if lines else f'exit code {r.exit_code}')}"


def read(r: NodeResult, what: str) -> Report:
    """The report a node printed; else why (`what`: the words in front of a failure)."""
    doc = last_object(r.stdout) if r.ok else None
    return Report(doc) if doc is not None else Report(error=why(r, what))

"""remote/preflight.sh's client: the one probe script a node runs for preflight's checks.

`sh -s -- CHECKS WORKDIR OUTPUT PORT IFACE MASTER ROLE PYTHON CONNECT_S [--output D ...]`, the
script on stdin: remote/preflight.sh (its arguments, `want`, `has`), then the checks' snippets
(checks/registry.py assembles them, nodeinfo's line among them: node/nodeinfo.py probe_text).
Its output is `@@name` sections, read by probe.sections.
"""

from __future__ import annotations

from importlib import resources

from orchestrator.node import form
from orchestrator.node.form import NodePath

HEADER = resources.files("orchestrator").joinpath("remote", "preflight.sh").read_text()


def command(checks: str, workdir: str, output: str, port: int, iface: str, master: str, role: str, python: str,
            connect_s: float, options: list[str]) -> str:
    """The probe's line (paths keep `~/` as the node's home; every value one word)."""
    words = [checks, NodePath(workdir), NodePath(output), port, iface, master, role, NodePath(python),
             f"{connect_s:g}", *options]
    return "sh -s -- " + " ".join(form.word(w) for w in words)

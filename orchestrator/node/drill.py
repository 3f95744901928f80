"""remote/drill.py's client: the drill's hands on a node (a rank's processes found, signalled,
frozen, thawed, throttled; the drill's leftovers found).

`[CLUSTERCTL_DRILL=RUN ]PYTHON -c BOOT CODE drill VERB ARGS` (form.py). The marker
in its environment makes the drill's own processes findable (`left` looks for the marked ones, so
`left` itself runs unmarked: two nodes may share one machine, where each would find the other's
look). Each verb answers with one JSON object, read into a wire.Answer.
"""

from __future__ import annotations

from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.wire import Answer, Call, read_answer

PROGRAM = "drill"
DRILL_MARK = "CLUSTERCTL_DRILL"  # remote/drill.py's marker: the drill's own processes on a node


def call(node: Node, *args: object, run_id: str | None, timeout: float) -> Call[Answer]:
    """VERB ARGS on the node; run_id: the marker's value (None: unmarked)."""
    e = form.command(node, PROGRAM, *args, env={DRILL_MARK: run_id} if run_id is not None else None)
    return Call(e.command, e.stdin, timeout, lambda r: read_answer(r, dict, "drill", 300))

"""remote/warm.py's client: a run's warm interpreter on a node, for hot restarts.

`PYTHON -c BOOT CODE warm RUN_ID NODE` (form.py), the spec's JSON on stdin (the inventory's env
holds tokens: never on a command line). The program prints `ready` once it has imported what the
ranks import, then nothing: it lives while the control machine holds the command's connection open
(runs/warmpool.py) or a rank forked from it runs. It takes over from one an earlier supervisor of
the run started (an adopted run's restarts fork from the new one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

from orchestrator.inventory import Node
from orchestrator.node import form
from orchestrator.node.form import Exec

PROGRAM = "warm"
# what a training script's start imports, and torchrun's (torch.distributed.run itself is left to
# run as __main__, as `python -m` would: runpy warns about a module imported before it runs)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.optim", "torch.distributed.launcher.api",
           "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
           "torch.distributed.elastic.rendezvous.dynamic_rendezvous")


@dataclass(frozen=True)
class WarmSpec:
    """The interpreter (the ranks'), its environment and directory, and the modules it imports."""

    python: str
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = ""
    preload: tuple[str, ...] = PRELOAD

    def encoded(self) -> bytes:
        return json.dumps({"python": self.python, "env": dict(self.env), "cwd": self.cwd,
                           "preload": ",".join(self.preload)}).encode()


def start(node: Node, run_id: str, spec: WarmSpec) -> Exec:
    """`warm RUN_ID NODE`, the spec on stdin: a command held open for as long as the run wants it."""
    return form.command(node, PROGRAM, run_id, node.name, stdin=spec.encoded())

"""An attempt's nodes made ready before its preflight: claimed again, the fresh ones brought to
the run's code, every node's directories made, the newest checkpoint restored.

Which nodes are fresh is read from the record, so a supervisor that takes the run over mid-way
prepares what its predecessor did not finish: a node holds the run's code when it was one of
attempt 1's ranked nodes, or when its preparation finished (AttemptRecord.ready). A spare that was
listed in an attempt whose supervisor died while it was being prepared is prepared again.
"""

from __future__ import annotations

import time
from typing import Callable

from orchestrator.inventory import Inventory
from orchestrator.runs.ckpt import jobdir_home
from orchestrator.runs.ckpt.given_home import ArtifactCopier
from orchestrator.runs.claims import Claims
from orchestrator.runs.launch import NodesNotReady, reopen
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import AttemptRecord
from orchestrator.runs.restart import Restorer, prepare_artifacts
from orchestrator.runs.spec import RunSpec
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster


def holding_code(attempts: list[AttemptRecord]) -> set[str]:
    """The nodes known to hold the run's code: every node of an attempt that was not prepared in
    it (attempt 1's ranked nodes, or a survivor of an earlier attempt), and those whose
    preparation finished. A record older than `ready` counts its prepared nodes as ready."""
    held: set[str] = set()
    for a in attempts:
        ready = set(a.prepared if a.ready is None else a.ready)
        held |= {n for n in a.nodes if n not in a.prepared or n in ready}
    return held


def fresh_nodes(k: int, nodes: list[str], attempts: list[AttemptRecord], inv: Inventory) -> list[str]:
    """Attempt k's nodes that must be brought to the run's code first: in attempt 1 a spare (in
    the place of a node down at launch), later any node that does not hold it yet."""
    held = holding_code(attempts)
    return [n for n in nodes if n not in held and (k > 1 or inv.node(n).spare)]


class Readying:
    """Readies one run's attempts on the run's cluster (the run loop's parts it is given)."""

    def __init__(self, run: Run, spec: RunSpec, book: Book, cluster: Cluster, inv: Inventory, claims: Claims,
                 copier: ArtifactCopier, say: Callable[[str], None]):
        self.run, self.spec, self.book, self.cluster, self.inv = run, spec, book, cluster, inv
        self.claims, self.copier, self.say = claims, copier, say

    def set_up(self, k: int, nodes: list[str], fresh: list[str], first_claim: bool) -> dict[str, dict]:
        """Before attempt k's preflight: its nodes claimed (`first_claim`: attempt 1's claim, else
        claimed again), the fresh ones brought to the run's code, every node's directories made,
        the newest checkpoint restored (k > 1, or --resume-from). Returns each node's directories."""
        a = self.book.rec.current
        if first_claim:
            self.claims.take(nodes)
        if k > 1:
            reopen(self.cluster, nodes)
            why = self.claims.renew(nodes)  # a survivor's claim held until this attempt ended there
            if why:
                raise NodesNotReady(why)
        if fresh:
            t0 = time.monotonic()
            try:
                self.prepare_fresh(fresh, [n for n in nodes if n not in fresh])
            finally:
                self.book.attempt_changed(prepare_s=round(time.monotonic() - t0, 3))
        dirs = self.dirs(nodes)
        self.copier.dirs.update(dirs)
        # attempt 1 sets aside what the checkpoint directory holds (not this run's); a relaunch restores
        self.book.attempt_changed(**Restorer.of(self.cluster, self.inv, self.copier, self.spec, self.say,
                                                self.book.tell).before(k, dirs, nodes))
        if a.checkpoint and self.spec.resume_args:  # the script is told to resume (--resume-args)
            self.book.attempt_changed(resume_args=list(self.spec.resume_args))
        return dirs

    def dirs(self, names: list[str]) -> dict[str, dict]:
        """Each node's artifact directories (made by its claim's command when it was claimed: no
        round of their own), and with --checkpoint-dir the job's own ("ckptdir")."""
        found = self.claims.dirs_found
        dirs = {n: dict(found[n]) for n in names if n in found}
        dirs.update(prepare_artifacts(self.cluster, self.run.id, [n for n in names if n not in found]))
        if self.spec.checkpoint_dir:
            paths = jobdir_home.prepare(self.cluster, [self.inv.node(n) for n in names], self.spec.checkpoint_dir)
            for n, p in paths.items():
                dirs[n]["ckptdir"] = p
            for snaps in self.copier.snaps:
                snaps.for_attempt(paths, dirs)  # this attempt's nodes only
        return dirs

    def prepare_fresh(self, fresh: list[str], donors: list[str]) -> None:
        """Spares entering the run (claimed already) brought to the run's code (and venv) from a
        node that ran it; each one that finished is recorded ready at once. Raises NodesNotReady
        naming those that could not be."""
        from orchestrator.runs.spares import prepare_nodes

        self.book.tell(f"bringing {', '.join(fresh)} to the run's code from {', '.join(donors[:1]) or 'this machine'}")
        why = prepare_nodes(self.cluster, self.inv, fresh, donors, self.say)
        self.book.attempt_changed(ready=[n for n in fresh if n not in why])
        if why:
            raise NodesNotReady(why)

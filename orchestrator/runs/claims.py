"""A run's claims on its nodes (the node agent's ~/.clusterctl/claims/NODE): taken before anything
starts there, renewed as each attempt begins, and released as soon as the run no longer needs
the node, on every node, including one that does not answer at that moment.

    Claims(run, book, cluster, inv, stopper, tell)
      .take(names)        attempt 1's nodes: all or none (launch.claim_nodes)
      .wait_and_take(names, stop_requests)  with --queue: once they are free (runs/queue.py)
      .renew(names)       -> {node: why not}: each node of a later attempt claimed again, a
                          survivor's claim renewed (so the node agent holds it until this
                          attempt's processes there ended), a fresh spare's taken
      .release(names)     the run is done with these nodes (left out, or the run ended): dropped
                          now where the node answers; where it does not, a pending stop
                          (runs/stopping.py) stops what of the run may be there and drops the
                          claim once the node answers again, as a lost node's stop is
      .release_all()      every claim the run still holds, at its end

With --force no claim is taken or released.
"""

from __future__ import annotations

import getpass
import socket
import time
from typing import Callable

from orchestrator.inventory import Inventory
from orchestrator.node import agent
from orchestrator.runs.launch import ClaimFailed, claim_nodes, claim_round, refusal
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import PendingStop
from orchestrator.runs.stopping import Stopper
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster


def who() -> str:
    """Who holds a claim: the user and the control machine (`runs --cluster` shows it)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


class Claims:
    def __init__(self, run: Run, book: Book, cluster: Cluster, inv: Inventory, stopper: Stopper,
                 tell: Callable[[str], None]):
        self.run, self.book, self.cluster, self.inv, self.stopper, self.tell = run, book, cluster, inv, stopper, tell
        self.force = run.spec.force
        # the runs alive on attempt 1's nodes as `take` claimed them (the launch's check_free
        # reads it instead of asking again); empty once a later attempt renews its claims
        self.live_found: dict[str, agent.Live] = {}
        # the run's artifact directories on each node, made by its claim's command (runs/readying.py dirs)
        self.dirs_found: dict[str, dict[str, str]] = {}

    def take(self, names: list[str]) -> None:
        """Attempt 1's nodes, all or none (launch.claim_nodes): NodeBusy names the run holding one;
        ClaimLost a node that went away while it was claimed (its claim, and that of any other
        node lost meanwhile, may land there all the same: recorded as held, so the run's end drops it)."""
        if self.force:
            return
        try:
            got = claim_nodes(self.cluster, self.inv.select(names), self.run.id, who(), self.tell, live=True, dirs=True)
            self.live_found = {n: c.live for n, c in got.items() if c.live is not None}
            self.found_dirs(got)
        except ClaimFailed as e:
            if e.maybe_held:
                self.book.claimed(list(e.maybe_held))
            raise
        self.book.claimed(names)

    def wait_and_take(self, names: list[str], stop_requests: Callable[[], int]) -> None:
        """train --queue: the first attempt's nodes, claimed once they are free (runs/queue.py)."""
        from orchestrator.runs.queue import claim_when_free

        claim_when_free(self.run, self.book, self.cluster, self.inv.select(names), self.run.spec, who(),
                        stop_requests)

    def renew(self, names: list[str]) -> dict[str, str]:
        """Claim each node for the attempt beginning now (its own claim renewed, a spare's taken):
        {node: why not} for those held by another run or not answering; the others are the run's."""
        self.live_found = {}  # asked again after this attempt's preparation: the last one's may still be ending
        if self.force:
            return {}
        got = claim_round(self.cluster, names, self.run.id, who(), self.tell, dirs=True)  # at once: each node is its own
        self.found_dirs(got)
        why = {n: refusal(self.cluster, self.inv, n, g) for n, g in got.items() if g.error is not None or not g.ok}
        # taken, or lost while it was asked (it may hold the claim all the same: dropped at the end)
        self.book.claimed([n for n in names if n not in why or why[n].maybe_held])
        return {n: str(e) for n, e in why.items()}

    def found_dirs(self, got: dict[str, agent.Claimed]) -> None:
        self.dirs_found.update({n: dict(c.dirs.dirs) for n, c in got.items() if c.ok and c.dirs is not None
                                and c.dirs.error is None})

    def last_key(self, node: str) -> str:
        """The key of the last attempt that ran on `node` (the run's id when none did)."""
        return next((a.key for a in reversed(self.book.rec.attempts) if node in a.nodes and a.key), self.run.id)

    def release(self, names: list[str]) -> None:
        """Drop the run's claim on these nodes: now on those that answer; a node that does not
        gets a pending stop, which drops it once the node answers again. A node with a stop
        pending keeps its claim until that stop is carried out (it drops it then)."""
        if self.force:
            return
        held = [n for n in dict.fromkeys(names) if n in self.book.rec.claimed and not self.stopper.is_pending(n)]
        live = self.cluster.live(held)
        got = agent.run(self.cluster, lambda n: agent.release(n, self.run.id), live) if live else {}
        self.book.released([n for n, r in got.items() if r.error is None])
        for name in held:
            r = got.get(name)
            if r is None or r.error is not None:
                self.tell(f"{name} does not answer ({(r.error if r else None) or 'not connected'}): its claim is "
                          "dropped, and what of the run may be left there stopped, once it answers again")
                self.stopper.pend(PendingStop(name, self.last_key(name), self.run.spec.grace, time.time(),
                                              why=(r.error if r else None) or "not connected"))

    def release_all(self) -> None:
        self.release(list(self.book.rec.claimed))


__all__ = ["Claims", "who"]

"""The straggler watch's hold while the run's warm interpreters import torch (runs/warmpool.py
`importing`): each takes a core for seconds, one the ranks of its node compute on (on the test
cluster, the two cores every node shares), so a rank they slow is clusterctl's doing, not a
straggler. The watch (straggler.py) judges nobody while any imports; once they are done, what it
saw until then is dropped, and each rank is judged from the steps (or collectives) after."""

from __future__ import annotations

import time
from typing import Callable, Mapping

HELD, RELEASED = "held", "released"


class WarmHold:
    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.held = False
        self.floor: dict[int, int] = {}  # rank -> its newest step in its first answer after the hold
        self.released: float | None = None  # when the hold ended (this machine's clock)

    def look(self, busy: list[str]) -> str | None:
        """HELD while `busy` (the nodes importing) is not empty; RELEASED on the round after the
        last import (the watch drops what it saw); else None."""
        if busy:
            if not self.held:
                from orchestrator.checks.report import nodeset

                self.held = True
                self.say(f"straggler watch: held while the run's warm interpreters import torch on "
                         f"{nodeset(busy)} (their import takes the cores the ranks compute on)")
            return HELD
        if not self.held:
            return None
        self.held, self.released = False, time.time()
        self.floor.clear()
        self.say("straggler watch: the warm interpreters are ready; the ranks are judged again from their steps after")
        return RELEASED

    def after(self, doc: Mapping) -> Mapping:
        """A rank's document with only its steps after the hold: a rank's answer carries its newest
        steps, so its first answer since then sets its floor (none of those counts), and later ones
        count only the steps past it."""
        answer = doc.get("answer")
        if self.released is None or not str(doc.get("rank")).isdigit() or not isinstance(answer, Mapping) \
                or not answer.get("steps"):
            return doc
        steps, rank = [s for s in answer["steps"] if s], int(doc["rank"])
        if rank not in self.floor:
            self.floor[rank] = max(int(s[0]) for s in steps)
            return dict(doc, answer=dict(answer, steps=[]))
        return dict(doc, answer=dict(answer, steps=[s for s in steps if int(s[0]) > self.floor[rank]]))

    def drop_entered(self, entered: dict[int, dict]) -> None:
        """The collectives entered before the hold ended (times on this machine's clock), dropped."""
        if self.released is None:
            return
        for mine in entered.values():
            for k in [k for k, t in mine.items() if t < self.released]:
                del mine[k]

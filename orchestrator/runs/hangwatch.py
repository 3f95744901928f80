"""The hang watch over one attempt (the verdict's rules: runs/hang.py).

`heard` is called on every log byte the node streams carry (runs/watch.py); once the attempt's
first line arrived, a silence of the hang timeout makes `check` take a snapshot of every rank,
wait CONFIRM (confirm_s), and take another. Progress between the two (a collective entered, a
rank busy in its own code: hang.py `progressed`) or no rank found is told and the watch goes on;
otherwise analyze() gives the verdict, which is kept in runs/RUN/hangs/N/ and handed to
`on_hang` (runs/attempt.py: told, recorded, and the --on-hang policy applied).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from orchestrator.runs.hang import HangVerdict, RankSnap, analyze, progressed, stacks_text, with_links


@dataclass
class HangWatch:
    """Watches one attempt for a hang (see the module doc). `heard` is called on every log byte;
    `snap(request)` returns every rank's snapshot and `probe()` the node pairs that cannot reach
    each other; `on_hang(verdict, directory)` applies the policy."""

    timeout: float
    snap: Callable[[int], list[RankSnap]]
    world: list[int]
    ranks_of: Mapping[int, str]
    out_dir: Path
    on_hang: Callable[[HangVerdict, Path], None]
    say: Callable[[str], None]
    probe: Callable[[], list[tuple[str, str]]] | None = None
    observe: bool = False
    tell: Callable[[str], None] | None = None  # the run's story (the foreground prints it); else say
    last: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)
    requests: int = 0
    # armed by the attempt's first log byte: the silence of imports and rendezvous before it is
    # not a hang (an adopted attempt was running already: armed from the start)
    armed: bool = False
    verdict: HangVerdict | None = None
    thread: threading.Thread | None = None

    @property
    def confirm_s(self) -> float:
        return min(10.0, max(2.0, self.timeout / 6))

    def heard(self) -> None:
        self.last = time.monotonic()
        self.armed = True

    def start(self) -> None:
        if self.timeout > 0:
            self.last = time.monotonic()
            self.thread = threading.Thread(target=self.loop, name="hang-watch", daemon=True)
            self.thread.start()

    def close(self) -> None:
        self.stop.set()

    def loop(self) -> None:
        tick = min(5.0, max(0.5, self.timeout / 10))
        while not self.stop.wait(tick):
            if not self.armed or time.monotonic() - self.last < self.timeout:
                continue
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watch must never take the run down itself
                self.say(f"hang watch: {type(e).__name__}: {e}")
                self.last = time.monotonic()

    def take(self) -> list[RankSnap]:
        self.requests += 1
        return self.snap(self.requests)

    def check(self) -> None:
        since = self.last
        tell = self.tell or self.say
        tell(f"no rank wrote a line for {time.monotonic() - since:.0f}s: taking a snapshot of every rank's stacks "
             "and collectives")
        first, t0 = self.take(), time.monotonic()
        if self.stop.wait(self.confirm_s) or self.last != since:
            return
        second = self.take()
        if self.stop.is_set() or self.last != since:
            return
        why = progressed(first, second, time.monotonic() - t0)
        if why is None and not second:
            why = "no rank's process was found on the nodes (still starting, or ending): nothing to judge"
        if why is not None:
            tell(why)
            self.last = time.monotonic()
            return
        v = analyze(second, self.world, self.ranks_of)
        if v.links == () and not v.culprits and not v.mismatch and v.collective and self.probe is not None:
            v = with_links(v, self.probe())
        n = len([p for p in self.out_dir.glob("[0-9]*")]) + 1 if self.out_dir.is_dir() else 1
        d = self.out_dir / str(n)
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / "verdict.json").write_text(json.dumps(v.to_json(), indent=2))
            (d / "stacks.txt").write_text(stacks_text(second))
        except OSError as e:  # no room on this machine's disk: the verdict is applied without its files
            self.say(f"hang watch: the verdict's files not written: {e}")
        self.verdict = v
        self.on_hang(v, d)  # tells the verdict (the run's story) and applies the policy
        # observe: told once; the next hang is one that follows new progress
        self.last = float("inf") if self.observe else time.monotonic()

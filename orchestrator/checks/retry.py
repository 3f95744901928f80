"""Asking a node again: which nodes preflight probes once more, and for how long.

A result marked `unanswered` (orchestrator/checks/__init__.py CheckResult) says the node could
not answer this time: its probe timed out or broke off, ss could not list the sockets, a
worker's connect found no listener. Such a node is probed again, up to ROUNDS more times, PAUSE_S
apart, all the extra rounds together within BUDGET_S; the last answer stands. A finding that holds
(a DROP rule, a wrong GPU count) is not unanswered, so a first launch never asks it again, and a
check that keeps failing the same way still fails after the last round.

A relaunch is different (`ask_survivors`): its preflight runs right after a teardown, where short
disturbances are likeliest (a firewall reloading, a port still closing, a link blinking), on nodes
that ran the previous attempt and may hold the newest checkpoint. A failure on such a node, the
master above all, is asked again, whole preflight rounds RELAUNCH_WAITS_S apart, within
RELAUNCH_BUDGET_S, before the node is left out; the verdict then says how often it was asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping

from orchestrator.checks import CheckResult
from orchestrator.checks.report import PreflightReport

ROUNDS = 2  # extra probe rounds at most
PAUSE_S = 1.0  # before each extra round: a listener starting, a process ending on the node
BUDGET_S = 30.0  # every extra round together, pauses included
MIN_ROUND_S = 5.0  # a round with less time left than this is not started
RELAUNCH_WAITS_S = (1.0, 2.0, 4.0, 8.0)  # before each relaunch round asked again; the last repeats
RELAUNCH_BUDGET_S = 45.0  # a relaunch's rounds asked again, pauses included, from the first failure


def ask_again(results: Mapping[str, Mapping[str, CheckResult]]) -> list[str]:
    """The nodes (in the given order) with at least one result their probe could not answer."""
    return [name for name, rs in results.items() if any(r.unanswered for r in rs.values())]


def round_timeout(spent: float, full: float) -> float | None:
    """The next extra round's probe timeout, after `spent` seconds of extra rounds so far (None:
    the budget is spent). `full` is a first round's timeout, the most a round is given."""
    left = BUDGET_S - spent - PAUSE_S
    return min(full, left) if left >= MIN_ROUND_S else None


def still_unanswered(result: CheckResult, tries: int) -> CheckResult:
    """A result that stayed unanswered through `tries` probes says so in its detail."""
    if not result.unanswered or tries < 2:
        return result
    return replace(result, detail=f"{result.detail} (the same on {tries} tries)")


@dataclass(frozen=True)
class Asked:
    """A relaunch preflight after its survivors were asked again: the report that stands, how
    many rounds ran in all, over how many seconds, and what the first round found on them."""

    report: PreflightReport
    rounds: int = 1
    seconds: float = 0.0
    first: tuple[str, ...] = ()  # "node check: detail" of the first round's failures on survivors

    @property
    def retried(self) -> str:
        """The words a verdict adds ("" when nothing was asked again)."""
        if self.rounds < 2:
            return ""
        return f"asked {self.rounds} times over {self.seconds:.0f}s"


def failing_survivors(report: PreflightReport, survivors: set[str]) -> list[str]:
    """The survivors (nodes that ran the previous attempt) the report fails, in rank order."""
    failing = {node for node, _ in report.failures}
    return [n.node.name for n in report.nodes if n.node.name in failing and n.node.name in survivors]


def ask_survivors(report: PreflightReport, ask: Callable[[], PreflightReport], survivors: set[str],
                  stopped: Callable[[float], bool], clock: Callable[[], float] = time.monotonic) -> Asked:
    """While the report fails a survivor, preflight is asked again (`ask`, a whole round: the
    master's listener and every worker's connect belong together) after RELAUNCH_WAITS_S, until it
    no longer does or RELAUNCH_BUDGET_S is spent. `stopped(seconds)` waits that long and says
    whether the wait was cut (a stop request)."""
    t0, rounds = clock(), 1
    first = tuple(f"{node} {r.check}: {r.detail}" for node, r in report.failures if node in survivors)
    while failing_survivors(report, survivors):
        wait = RELAUNCH_WAITS_S[min(rounds - 1, len(RELAUNCH_WAITS_S) - 1)]
        if clock() - t0 + wait > RELAUNCH_BUDGET_S or stopped(wait):
            break
        report, rounds = ask(), rounds + 1
    return Asked(report, rounds, clock() - t0, first)

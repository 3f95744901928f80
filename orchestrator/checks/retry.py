"""Asking a node again: which nodes preflight probes once more, and for how long.

A result marked `unanswered` (orchestrator/checks/__init__.py CheckResult) says the node could
not answer this time: its probe timed out or broke off, ss could not list the sockets, a
worker's connect found no listener. Such a node is probed again, up to ROUNDS more times, PAUSE_S
apart, all the extra rounds together within BUDGET_S; the last answer stands. A finding that holds
(a DROP rule, a wrong GPU count) is not unanswered, so it is never asked again, and a check that
keeps failing the same way still fails after the last round.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from orchestrator.checks import CheckResult

ROUNDS = 2  # extra probe rounds at most
PAUSE_S = 1.0  # before each extra round: a listener starting, a process ending on the node
BUDGET_S = 30.0  # every extra round together, pauses included
MIN_ROUND_S = 5.0  # a round with less time left than this is not started


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

"""The failure policy, stated once, and the root cause of a failed run.

  The first node whose torchrun exits non-zero, or whose connection is lost for
  `lost_timeout`, is the root cause, and stops every other node (SIGTERM, then SIGKILL
  after `grace`). "First" is by when a rank of the node failed, on the node's own clock (else
  when its torchrun ended), not by the order the controller heard of them. A stop request is not a failure: what fails after it is not blamed, and
  a stopped run is recorded as stopped.

  The grace covers a checkpoint: at least twice the job's last save (node agent's
  save_seconds), up to MAX_GRACE; a longer grace asked for explicitly is kept. The rule and the
  cap are remote/common.py's, the ones the node agent applies.

  Which failure is retried is RETRY_RULES, by the class runs/restart.py `classify` names (the
  table in docs/runs/restarts.md is this one, checked by tests/test_retry_rules.py); `exit_code_retried` and
  `hang_retried` are the two rules that depend on settings.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from orchestrator.errors import EXIT_INTERRUPTED
from orchestrator.probe import common
from orchestrator.runs.logs.follow import rank_tail, worker_failure
from orchestrator.runs.spec import FirstFailure, NodeStatus, RunResult, RunState
from orchestrator.runs.store import exit_hint, exit_meaning

MAX_GRACE: float = common().MAX_GRACE  # the node agent's cap: remote/common.py
CAUSE_WINDOW = 3.0  # failures detected this close together are ordered by the nodes' own end times
LOG_TAIL_BYTES = 1 << 18  # how much of a node's log the root cause looks at
TAIL_LINES = 15  # the failed rank's last lines a root cause quotes


@dataclass(frozen=True)
class RetryRule:
    cause: str  # the class, as runs/restart.py classify (or the run loop) names it
    retried: str  # yes | no | when ...
    how: str


RETRY_RULES: tuple[RetryRule, ...] = (
    RetryRule("node lost", "yes", "without the node: a spare takes its place, else --min-nodes lets the run shrink"),
    RetryRule("killed by signal", "yes", "a worker killed by a signal, the OOM killer's SIGKILL included: on the "
              "same nodes"),
    RetryRule("peer failure", "yes", "a collective failed because a peer or the network went away: on the same nodes"),
    RetryRule("exit code", "when listed", "a worker exited with a code in train.restart_on_exit_codes "
              "(--restart-on-exit-codes): on the same nodes"),
    RetryRule("hang", "when its culprit's node can be left out", "only with --on-hang restart, and never a "
              "collective mismatch or a deadlock: a deterministic hang hangs again on any nodes; a broken link "
              "blames no node, and the restart goes on without one end of it"),
    RetryRule("straggler", "with --on-straggler replace", "without the straggler's node, when a restart and a "
              "spare are left (else it is only named)"),
    RetryRule("preflight failed", "yes, free", "a relaunch's node that fails the fast preflight (gpu_health "
              "included) is left out and a spare takes its place; costs no restart. At the first launch "
              "nothing starts"),
    RetryRule("script error", "no", "the script's own exception (not a communication error): it would fail "
              "the same way again"),
)


def exit_code_retried(code: int | None, listed: Iterable[int]) -> bool:
    """A worker's exit code (torchrun's -N for a signal reads as 128+N) is one the user asked to retry."""
    if code is None:
        return False
    return (128 - code if code < 0 else code) in set(listed)


def hang_retried(on_hang: str, culprit_nodes: tuple[str, ...]) -> bool:
    """A hang is retried only under --on-hang restart and when nodes can be left out: its culprits',
    or for a broken link one end of it (runs/judge/hang.py HangVerdict.nodes; a mismatch or a deadlock
    names none: the script's own bug)."""
    return on_hang == "restart" and bool(culprit_nodes)


def stop_grace(grace: float, save_seconds: float = 0.0) -> float:
    """The seconds between SIGTERM and SIGKILL: `grace`, stretched to 2x the last checkpoint save
    (remote/common.py's rule, which the node agent applies)."""
    return common().stop_grace(grace, save_seconds)


def earliest_failure(first: FirstFailure | None, statuses: list[NodeStatus]) -> FirstFailure | None:
    """The root cause by the nodes' own clocks: a node that failed before the one seen first takes
    its place (a peer seen first may only have died of the real failure). When a node failed is
    when its first rank exited non-zero, else when its torchrun ended (NodeStatus.failed_at)."""
    failed = [st for st in statuses if st.exit_code not in (None, 0) and st.failed_at is not None]
    if not failed:
        return first
    st = min(failed, key=lambda s: s.failed_at)
    if first is None or (first.ended is not None and st.failed_at < first.ended):
        return FirstFailure(st.name, st.exit_code, exit_meaning(st.exit_code), ended=st.failed_at)
    return first


class FailurePolicy:
    """Records the root cause and calls `on_first` once, when the first failure is seen."""

    def __init__(self, on_first: Callable[[FirstFailure], None]):
        self.on_first = on_first
        self.first: FirstFailure | None = None
        self.stop_requests = 0
        self._lock = threading.Lock()

    def failed(self, name: str, code: int | None, reason: str, ended: float | None = None) -> None:
        """Nodes seen within CAUSE_WINDOW s are ordered by when they failed (node clocks: the
        first rank's non-zero exit, else torchrun's end), so a peer's secondary 'connection
        closed' failure does not take the blame for the node that died first."""
        ff = FirstFailure(name, code, reason, time.time(), ended)
        with self._lock:
            cur = self.first
            first = cur is None and not self.stop_requests
            if first:
                self.first = ff
            elif (cur is not None and ended is not None and cur.ended is not None
                  and ended < cur.ended and ff.at - cur.at < CAUSE_WINDOW):
                self.first = ff
        if first:
            self.on_first(ff)

    def result(self, status_of: Callable[[str], NodeStatus], log_of: Callable[[str], Path],
               statuses: list[NodeStatus] = ()) -> RunResult:
        """How the run ended: stopped on request (130), every node finished (0), or the first
        failure's exit code (255 for a lost node) with its root cause (among `statuses`, the
        earliest by the nodes' own clocks)."""
        ff = self.first
        if ff is not None:
            ff = earliest_failure(ff, list(statuses))
        if ff is None and self.stop_requests:
            killed = " (killed)" if self.stop_requests > 1 else ""
            return RunResult(RunState.STOPPED, EXIT_INTERRUPTED, f"stopped on request{killed}")
        if ff is None:
            return RunResult(RunState.FINISHED, 0, "every node finished")
        code = ff.exit_code if ff.exit_code is not None else 255
        return RunResult(RunState.FAILED, code, root_cause(ff, status_of(ff.node), log_tail(log_of(ff.node))), ff)


def log_tail(path: Path, nbytes: int = LOG_TAIL_BYTES) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - nbytes))
            return f.read()
    except OSError:
        return b""


def root_cause(ff: FirstFailure, st: NodeStatus, log: bytes) -> str:
    """One node, one reason: its exit code and meaning, then the failing worker's own words
    (torchrun's error file, else that rank's last log lines, else the node log's last lines)."""
    if ff.exit_code is None:  # lost: the node never said how its torchrun ended
        head = (f"{ff.node} ({st.ranks_text}) failed first: lost, no exit code — its connection went silent "
                f"({ff.reason}) and it did not answer again before the lost timeout")
    else:
        head = f"{ff.node} ({st.ranks_text}) failed first: exit code {ff.exit_code} — {ff.reason}"
    detail = ""
    wf = worker_failure(log)
    if wf is not None:
        code = wf["exitcode"]
        code = 128 - code if code < 0 else code
        rank = wf["local_rank"] + (st.first_rank or 0)
        head += f"; rank {rank} exited {code} first ({exit_meaning(code)})"
        detail = "\n".join(rank_tail(log, wf["local_rank"], TAIL_LINES))
        hint = exit_hint(code, log.decode(errors="replace"))
        if hint:
            head += "\n" + hint
    if st.error_file:
        detail = _error_file_detail(st.error_file) or detail
    if not detail:
        detail = "\n".join(log.decode(errors="replace").splitlines()[-15:])
    return head + ("\n" + detail if detail else "")


def _error_file_detail(text: str) -> str:
    """torchrun's error file: the worker's Python call stack, else its message."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text[-2000:]
    msg = doc.get("message", doc)
    if isinstance(msg, dict):
        return msg.get("extraInfo", {}).get("py_callstack") or msg.get("message") or ""
    return str(msg)

"""A fault drill on a running run: each fault injected once the run trains again after the
previous one, and what the run made of it read back from its record and goodput ledger.

The drill's hands are remote/drill.py, shipped over the run's own transport (a `Cluster` of the
run's recorded inventory) with every argument quoted (orchestrator/shell.py); the processes it
signals are found there by the attempt's run key, never by name. What it measures is what the
supervisor recorded (run.json's attempts: verdict, failure time, hang verdict, straggler line)
and the ledger's view of each attempt (runs/goodput.py: the fault's declaration, the next
attempt's first step and start step, the pace); runs/drillreport.py turns those into the report.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Callable

from orchestrator.node import drill, wire
from orchestrator.runs import goodput, stepjournal
from orchestrator.runs.drillreport import RUN_S, STOP_S, THROTTLE_S, Outcome
from orchestrator.runs.liveview import SLOW
from orchestrator.runs.logs.follow import worker_failure
from orchestrator.runs.runrecord import AttemptRecord, RunRecord
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster

POLL_S = 0.5
TRAINING_STEPS = 2  # progress points after an attempt's launch that say it trains
TRAIN_WAIT_S = 900.0  # the longest a run may take to train (again)
CALL_S = 60.0  # one call of remote/drill.py (a throttle: its length more)


class Hands:
    """remote/drill.py's verbs on the run's nodes: node -> its JSON answer (a str: why not)."""

    def __init__(self, run: Run):
        self.run = run

    def call(self, names: list[str], *args: object, timeout: float = CALL_S, mark: bool = True
             ) -> dict[str, dict | str]:
        """`mark`: the program carries the drill's marker (`left` does not: it looks for the marked
        ones, and two nodes may share one machine, where each would find the other's look)."""
        spec = self.run.spec
        with Cluster(spec.load_inventory(names), connect_timeout=spec.connect_timeout, fanout=spec.fanout,
                     accept_new_host_keys=spec.accept_new_host_keys) as cluster:
            res = wire.run(cluster, lambda n: drill.call(n, *args, run_id=self.run.id if mark else None,
                                                          timeout=timeout))
        return {name: got.doc if got.ok else got.error for name, got in res.items()}


def key_on(a: AttemptRecord, node: str) -> str:
    return f"{a.key}@{node}"


class Drill:
    """One run's drill: `inject(fault)` per fault, in order; `finish()` stops the run."""

    def __init__(self, run: Run, say: Callable[[str], None]):
        self.run, self.say, self.hands = run, say, Hands(run)

    # ------------------------------------------------------------ waiting on the record
    def _until(self, cond: Callable[[RunRecord], object], timeout: float):
        """cond(record)'s first truthy value within `timeout` s; None at the timeout or once the run ended."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            rec = self.run.record
            got = cond(rec)
            if got or rec.state.terminal:
                return got or None
            time.sleep(POLL_S)
        return None

    def training(self, after: int, since: float = 0.0, timeout: float = TRAIN_WAIT_S) -> AttemptRecord | None:
        """The current attempt once it is past attempt `after` and trains (TRAINING_STEPS progress
        points since its launch and `since`); None: not within `timeout`, or the run ended."""
        def trains(rec: RunRecord):
            a = rec.current
            if a is None or a.attempt <= after or not a.launched:
                return None
            pts = stepjournal.read(self.run.dir).get(a.attempt, stepjournal.Steps()).progress
            return a if len([t for t, _ in pts if t >= max(a.launched, since)]) >= TRAINING_STEPS else None
        return self._until(trains, timeout)

    # ------------------------------------------------------------ where to inject
    def victim(self, a: AttemptRecord) -> tuple[str, int] | str:
        """(node, rank) to inject on: the attempt's last node (never the master's, which holds the
        rendezvous), its highest rank; else why none was found."""
        node = a.nodes[-1]
        got = self.hands.call([node], "ranks", key_on(a, node))[node]
        if isinstance(got, str):
            return f"{node} could not be asked for its ranks: {got}"
        ranks = sorted(int(r) for r in got.get("ranks", {}) if str(r).isdigit())
        return (node, ranks[-1]) if ranks else f"no rank of attempt {a.attempt} found on {node}"

    # ------------------------------------------------------------ one fault
    def inject(self, fault: str, a: AttemptRecord, detect_wait: float) -> Outcome:
        o = Outcome(fault, attempt=a.attempt)
        found = self.victim(a)
        if isinstance(found, str):
            o.notes.append(found)
            return o
        o.node, o.rank = found
        self.say(f"drill: {fault}: rank {o.rank} on {o.node} (attempt {a.attempt})")
        if fault == "straggler":
            return self._straggler(o, a)
        key = key_on(a, o.node)
        verb = {"kill": ("signal", key, int(signal.SIGKILL), o.rank, "top"),
                "hang": ("signal", key, int(signal.SIGSTOP), o.rank), "lost": ("freeze", key)}[fault]
        o.injected_at = time.time()
        got = self.hands.call([o.node], *verb)[o.node]
        if isinstance(got, str) or not got.get("pids"):
            o.notes.append(f"nothing was signalled on {o.node}: {got if isinstance(got, str) else 'no process'}")
            return o
        try:
            ended = self._until(lambda rec: _faulted(rec, a.attempt), detect_wait)
        finally:
            if fault != "kill":  # let what the drill stopped go, so the supervisor's stop can end it
                self.hands.call([o.node], *(("thaw", key) if fault == "lost" else
                                            ("signal", key, int(signal.SIGCONT), o.rank)))
        if ended is None:
            o.notes.append(f"no verdict on attempt {a.attempt} within {detect_wait:.0f}s")
            return o
        self._verdict(o, ended)
        nxt = self.training(a.attempt)
        lg = goodput.of_run(self.run)
        self._measure(o, lg, a.attempt, nxt)
        return o

    def _verdict(self, o: Outcome, a: AttemptRecord) -> None:
        """Who the supervisor blamed for attempt `a`'s end, and by what verdict."""
        o.detected_by, o.declared_at = a.verdict, a.failed_at or a.ended
        if a.hang_dir:
            try:
                doc = json.loads((self.run.dir / a.hang_dir / "verdict.json").read_text())
                cs = doc.get("culprits") or []
            except (OSError, ValueError):
                cs = []
            pick = next((c for c in cs if c.get("rank") == o.rank), cs[0] if cs else None)
            if pick is not None:
                o.culprit_node, o.culprit_rank = pick.get("node"), pick.get("rank")
            if len(cs) > 1:
                o.notes.append("the hang verdict names " + ", ".join(f"rank {c.get('rank')} ({c.get('node')})"
                                                                      for c in cs))
            return
        o.culprit_node = (a.bad_nodes[0] if a.bad_nodes else
                          (a.detail or "").split(":", 1)[0].split(" ")[0] or None)
        if a.verdict == "killed by signal" and o.culprit_node:
            wf = worker_failure(_log_of(self.run, a, o.culprit_node))
            o.culprit_rank = wf.get("rank") if wf else None

    def _measure(self, o: Outcome, lg: goodput.Ledger, k: int, nxt: AttemptRecord | None) -> None:
        """The fault's declaration, the next attempt's first step and the steps redone, from the ledger."""
        shares = {s.attempt: s for s in lg.shares}
        sh = shares.get(k)
        if sh is not None and sh.fault is not None:
            o.declared_at = sh.fault.declared
        if sh is not None:
            o.step_s = sh.step_s
        if nxt is None:
            o.notes.append("the run did not train again after it")
            return
        after = shares.get(nxt.attempt)
        o.recovered_at = after.first_step_at if after is not None else None
        if sh is not None and after is not None and sh.reached_step is not None and after.start_step is not None:
            o.steps_redone = max(0, sh.reached_step - after.start_step)

    def _straggler(self, o: Outcome, a: AttemptRecord) -> Outcome:
        key, done = key_on(a, o.node), threading.Event()
        o.injected_at = time.time()
        t = threading.Thread(target=lambda: (self.hands.call([o.node], "throttle", key, o.rank, THROTTLE_S, STOP_S,
                                                             RUN_S, timeout=THROTTLE_S + CALL_S), done.set()),
                             daemon=True)
        t.start()

        def named(rec: RunRecord):
            cur = rec.current
            if done.is_set() or cur is None or cur.attempt != a.attempt:
                return True
            return cur if any(str(o.rank) in m.group(2).split(",") for m in SLOW.finditer(cur.straggler or "")) \
                else None
        seen = self._until(named, THROTTLE_S + CALL_S)
        if isinstance(seen, AttemptRecord):
            o.declared_at, o.detected_by = time.time(), "straggler"
            m = next(m for m in SLOW.finditer(seen.straggler or "") if str(o.rank) in m.group(2).split(","))
            o.culprit_node, o.culprit_rank = m.group(1), o.rank
        else:
            cur = self.run.record.current
            o.notes.append(f"the straggler watch did not name rank {o.rank} within the throttle's {THROTTLE_S:g}s"
                           + (f" ({cur.straggler})" if cur is not None and cur.straggler else ""))
        t.join(THROTTLE_S + CALL_S)
        end = time.time()
        if self.training(a.attempt - 1, since=end, timeout=120) is not None:
            o.recovered_at = end
        sh = next((s for s in goodput.of_run(self.run).shares if s.attempt == a.attempt), None)
        o.straggler_s = sh.badput["straggler"] if sh is not None else None
        return o


def _faulted(rec: RunRecord, k: int) -> AttemptRecord | None:
    """Attempt k once the supervisor has its verdict (or has moved past it)."""
    a = next((x for x in rec.attempts if x.attempt == k), None)
    if a is not None and (a.verdict is not None or any(x.attempt > k for x in rec.attempts)):
        return a
    return None


def _log_of(run: Run, a: AttemptRecord, node: str) -> bytes:
    try:
        return run.node_log(node).read_bytes()[a.log_start.get(node, 0):]
    except OSError:
        return b""


def stop_run(run: Run, timeout: float) -> bool:
    """Ask the run's supervisor to stop the run (as `clusterctl stop` does); whether it ended within `timeout`."""
    import os

    if not run.terminal:
        run.request_stop(None, by="clusterctl drill")
        pid = run.record.supervisor_pid
        if pid and run.supervisor_alive():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + timeout
    while not run.terminal and time.time() < deadline:
        time.sleep(POLL_S)
    return run.terminal


def leftovers(run: Run, timeout: float) -> tuple[dict[str, list[int]], dict[str, str]]:
    """What of the run (any attempt) and of its drill is still on any node of its inventory,
    spares included, asked again until nothing is or `timeout` passed: (node -> pids, node ->
    why it could not be asked)."""
    names = [n.name for n in run.spec.load_inventory().nodes]
    deadline = time.time() + timeout
    while True:
        got = Hands(run).call(names, "left", run.id, mark=False)
        left = {n: d["pids"] for n, d in got.items() if isinstance(d, dict) and d.get("pids")}
        unchecked = {n: d for n, d in got.items() if isinstance(d, str)}
        if (not left and not unchecked) or time.time() > deadline:
            return left, unchecked
        time.sleep(2.0)

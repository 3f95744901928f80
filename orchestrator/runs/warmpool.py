"""The run's warm interpreters (remote/warm.py): one on every node the run may use (the attempt's
and the spares left; none quarantined or left out of the run). An attempt's nodes get theirs right
before its launch (`before_launch`: started, and waited for until their sockets listen), so the
first attempt's torchrun and ranks already fork from them, waiting for their imports, instead of
importing torch beside them: one import of torch on a node instead of 2 + nproc. The spares get
theirs once the run's progress shows (its first step or collective, in the step journal) or
`after` seconds into the run, whichever comes first, so that their imports do not share the
first attempt's start. A restart's torchrun and ranks fork from an interpreter that has imported
torch (one still importing is waited for: remote/warm_client.py IMPORT_WAIT_S): on the test
cluster a restart reaches its first step 2.5 s after detection instead of 12.8 s
(bench/bench_warm_start.py, bench/bench_recovery.py --warm-compare). A node without one (not
reached, or `--no-warm`) starts its ranks cold, as before: the ranks ask, and nobody answering is
not an error.

Each is held by keeping its command's connection open; `close` lets go, and an interpreter with no
rank of its own running then ends. One whose command ended (its connection dropped, it died) is
started again, looked for every RECHECK_S, at most MAX_STARTS times on a node. A node cut off from
the control machine ends its own once its claim is no longer the run's (the run's end, or the node
left out of it), after its ranks.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from orchestrator.inventory import Inventory
from orchestrator.node import warm
from orchestrator.torchrun import node_env
from orchestrator.transport import Cluster

WARM_AFTER_S = 20.0  # into the run, the spares' at the latest (sooner, their imports would share the launch's cores)
AFTER_ENV = "CLUSTERCTL_WARM_AFTER_S"  # the supervisor's environment may say sooner (the tests do)
POLL_S = 1.0  # how often the run's progress is looked at before `after`
RECHECK_S = 10.0  # then how often each node's is looked at: one gone (its connection dropped) starts again
MAX_STARTS = 3  # on one node: an interpreter that keeps ending there is not started again
LISTEN_WAIT_S = 5.0  # before a launch: how long a just-started one's socket is waited for (`before_launch`)
LISTEN_POLL_S = 0.02
IMPORT_HOLD_S = 60.0  # one not `ready` this long after its start no longer counts as importing (`importing`)


def restart_nodes(inv: Inventory, current: list[str] | None, spares: list[str], barred: set[str]) -> list[str]:
    """The nodes a restart may use: the current attempt's (before the first, the ranked nodes) and
    the spares left, none barred (quarantined, left out of the run)."""
    now = current if current is not None else [n.name for n in inv.nodes if not n.spare]
    return [n for n in dict.fromkeys([*now, *spares]) if n not in barred]


class WarmPool:
    def __init__(self, cluster: Cluster, inv: Inventory, run_id: str, say: Callable[[str], None],
                 nodes: Callable[[], list[str]], after: float | None = None,
                 progressed: Callable[[], bool] = lambda: False, recheck: float = RECHECK_S):
        self.cluster, self.inv, self.run_id, self.say, self.nodes = cluster, inv, run_id, say, nodes
        self.progressed = progressed  # whether the run has made progress: start without waiting `after`
        self.after = float(os.environ.get(AFTER_ENV, WARM_AFTER_S)) if after is None else after
        self.recheck = recheck
        self.procs: dict = {}  # node -> the running command (transport Proc)
        self.began: dict[str, float] = {}  # node -> when its running one was started (monotonic)
        self.heard: dict[str, bytes] = {}  # node -> what its running one printed, until `ready` (then dropped)
        self.ready: set[str] = set()  # the nodes whose running one said `ready` (torch imported)
        self.listening: set[str] = set()  # ... said `listening` (its socket is there: ranks may ask it)
        self.starts: dict[str, int] = {}  # node -> how many times one was started there
        self.starting: set[str] = set()  # nodes one is being started on now (by the run loop or the pool's thread)
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Every node `nodes()` names then (those a restart may use) that is connected, once the
        run progressed or `after` seconds from now."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._later, name="warm-pool", daemon=True)
            self.thread.start()

    def _later(self) -> None:
        deadline = time.monotonic() + self.after
        while not self._progressed():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self.closed.wait(min(POLL_S, left)):
                return
        while not self.closed.is_set():
            try:
                self.add(self.nodes())
            except Exception as e:  # noqa: BLE001 - a warm start is a saving, never a failure of the run
                self.say(f"warm interpreters: {type(e).__name__}: {e}")
            self.closed.wait(self.recheck)

    def _progressed(self) -> bool:
        try:
            return bool(self.progressed())
        except Exception:  # noqa: BLE001 - a journal being written: looked at again next time
            return False

    def add(self, names: list[str]) -> None:
        """Start one on each of `names` that is connected and has none running (none yet, or its
        command ended: the connection dropped, the interpreter died), MAX_STARTS times at most."""
        started = []
        for name in names:
            conn = self.cluster.connections.get(name)
            with self.lock:  # the run loop (before a launch) and the pool's thread may both be here
                if self.closed.is_set() or conn is None or self.starts.get(name, 0) >= MAX_STARTS or \
                        name in self.starting or (name in self.procs and not self._ended(name)):
                    continue
                self.starts[name] = self.starts.get(name, 0) + 1
                self.starting.add(name)
                gone = self.procs.pop(name, None)
            try:
                if gone is not None:
                    _close(gone)
                if self._start(name, conn):
                    started.append(name)
            finally:
                with self.lock:
                    self.starting.discard(name)
        if started:
            again = [n for n in started if self.starts[n] > 1]
            self.say(f"warm interpreters: starting on {', '.join(started)}" +
                     (f" ({', '.join(again)} again: the one there ended)" if again else
                      " (the ranks fork from them)"))

    def _start(self, name: str, conn) -> bool:
        node = self.inv.node(name)
        spec = warm.WarmSpec(node.python, node_env(self.inv, node, extra={"CLUSTERCTL_RUN_ID": self.run_id}),
                             node.workdir)
        try:
            proc = warm.start(node, self.run_id, spec).start(conn)
        except Exception as e:  # noqa: BLE001 - a lost connection: that node restarts cold
            self.say(f"warm interpreters: {name}: not started ({type(e).__name__}: {e})")
            return False
        with self.lock:
            if self.closed.is_set():
                proc.close()
                return False
            self.procs[name], self.began[name], self.heard[name] = proc, time.monotonic(), b""
            self.ready.discard(name)
            self.listening.discard(name)
        return True

    def before_launch(self, nodes: list[str], timeout: float = LISTEN_WAIT_S) -> list[str]:
        """Right before an attempt's launch on `nodes`: one started on each that has none (the
        first attempt's nodes, a spare the pool had not reached yet), and waited for until its
        socket is there (`listening`, or it ended), `timeout` seconds at most, so that the launch's
        torchrun and ranks find it and fork from it, waiting for its imports, rather than import
        torch beside it (one import on a node instead of 2 + nproc). -> the nodes whose one listens."""
        self.add(nodes)
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                waiting = [n for n in nodes if n in self.starting or (
                    n in self.procs and n not in self.listening and n not in self.ready and not self._ended(n))]
                up = [n for n in nodes if n in self.listening or n in self.ready]
            if not waiting or time.monotonic() >= deadline or self.closed.is_set():
                return up
            time.sleep(LISTEN_POLL_S)

    def importing(self) -> list[str]:
        """The nodes whose warm interpreter is importing torch now: started, not `ready` yet, not
        ended, for IMPORT_HOLD_S at most (the straggler watch's hold: runs/judge/warmhold.py)."""
        now, out = time.monotonic(), []
        with self.lock:
            for name in sorted(self.procs):
                if name in self.ready or now - self.began.get(name, now) >= IMPORT_HOLD_S:
                    continue
                if not self._ended(name) and name not in self.ready:  # (read now: it may have said it)
                    out.append(name)
        return out

    def _ended(self, name: str) -> bool:
        """Whether the node's warm interpreter's command ended; what it printed is read (its `ready`
        noted) and dropped. Called holding the lock."""
        proc = self.procs[name]
        try:
            got, _ = proc.read()
            if got and name not in self.ready:
                self.heard[name] = heard = (self.heard.get(name, b"") + got)[-4096:]
                if b"listening\n" in heard:
                    self.listening.add(name)
                if b"ready\n" in heard:
                    self.ready.add(name)
                    del self.heard[name]  # nothing reads it once ready
            return proc.done()
        except Exception:  # noqa: BLE001 - a connection torn down under it
            return True

    def close(self) -> None:
        """Let every one go (each ends once no rank of its own runs)."""
        self.closed.set()
        with self.lock:
            procs, self.procs = self.procs, {}
        for proc in procs.values():
            _close(proc)


def _close(proc) -> None:
    try:
        proc.close()
    except Exception:  # noqa: BLE001 - a connection already gone: its node ends its own
        pass

"""The fan-out engine: the one select loop over running commands, the one fan-out cap, and the
Cluster of connections.

Output flows as events to sinks (ClusterShell's EventHandler): `on_bytes` gets raw chunks as
they arrive (a log copied byte for byte), `on_line` whole lines per node and stream (a terminal
prefixer), `on_done` each node's NodeResult as it ends. Callers never poll a Proc themselves.
"""

from __future__ import annotations

import contextlib
import selectors
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

from orchestrator.errors import CommandFailed, CommandTimeout, ConnectError
from orchestrator.inventory import Inventory, Node
from orchestrator.transport.base import (
    DEFAULT_LOST_TIMEOUT,
    BytesCallback,
    ClusterResult,
    Connection,
    ErrorKind,
    LineCallback,
    NodeResult,
    Proc,
)
from orchestrator.transport.liveness import PROBE_S, SUSPECT_S, Heard
from orchestrator.transport.local import LocalConnection

DEFAULT_FANOUT = 64  # the most nodes contacted at once, by anything (ClusterShell's default too)
SWEEP_S = 0.2  # how often every running command is checked for deadlines, lost links and stop
OPEN_AT_ONCE = 32  # channels opened at once when a command starts on many nodes (see `open_all`)


def connection_for(node: Node, **kw) -> Connection:
    """The node's transport: a subprocess for `connection: local`, else SSH."""
    if node.is_local:
        return LocalConnection(node)
    from orchestrator.transport.ssh import SSHConnection  # paramiko (0.2 s to import) only for SSH nodes

    return SSHConnection(node, **kw)


# ------------------------------------------------------------------ the engine


class _Lines:
    """Turns a byte stream into whole lines; never tears a line across calls."""

    __slots__ = ("buf",)

    def __init__(self):
        self.buf = b""

    def feed(self, data: bytes) -> list[str]:
        self.buf += data
        if b"\n" not in data:
            return []
        *lines, self.buf = self.buf.split(b"\n")
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]

    def flush(self) -> list[str]:
        if not self.buf:
            return []
        ln, self.buf = self.buf.decode("utf-8", "replace").rstrip("\r"), b""
        return [ln]


@dataclass
class _Run:
    proc: Proc
    deadline: float | None
    fds: set[int] = field(default_factory=set)  # registered with the selector
    out: list[bytes] = field(default_factory=list)
    err: list[bytes] = field(default_factory=list)
    lines: dict[str, _Lines] = field(default_factory=lambda: {"stdout": _Lines(), "stderr": _Lines()})


class Engine:
    """Drives running procs to completion with one select loop.

    Only the procs whose descriptors fired are read; a sweep over all of them every SWEEP_S
    catches deadlines, lost connections and stop requests (checking every proc on every event
    would cost O(nodes^2) per command at 256 nodes)."""

    def __init__(self, *, on_line: LineCallback | None = None, on_bytes: BytesCallback | None = None,
                 on_done: Callable[[NodeResult], None] | None = None, timeout: float | None = None,
                 capture: bool = True, fanout: int = DEFAULT_FANOUT):
        self.on_line, self.on_bytes, self.on_done = on_line, on_bytes, on_done
        self.timeout, self.capture, self.fanout = timeout, capture, fanout
        self.sel = selectors.DefaultSelector()
        self.runs: dict[str, _Run] = {}
        self.results: dict[str, NodeResult] = {}

    # ---------------------------------------------------------------- procs in and out
    def add(self, proc: Proc) -> None:
        r = _Run(proc, None if self.timeout is None else time.monotonic() + self.timeout)
        self.runs[proc.node] = r
        self._sync_fds(r)

    def _sync_fds(self, r: _Run) -> None:
        """Poll exactly the descriptors the proc still offers (one at EOF stays readable forever)."""
        want = set(r.proc.fds())
        for fd in r.fds - want:
            self._unregister(fd)
        for fd in want - r.fds:
            self.sel.register(fd, selectors.EVENT_READ, r.proc.node)
        r.fds = want

    def _unregister(self, fd: int) -> None:
        try:
            self.sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _emit(self, r: _Run, out: bytes, err: bytes) -> None:
        for stream, data, store in (("stdout", out, r.out), ("stderr", err, r.err)):
            if not data:
                continue
            if self.capture:
                store.append(data)
            if self.on_bytes:
                self.on_bytes(r.proc.node, stream, data)
            if self.on_line:
                for ln in r.lines[stream].feed(data):
                    self.on_line(r.proc.node, stream, ln)

    def _finish(self, name: str, kind: ErrorKind | None = None, error: str | None = None) -> None:
        r = self.runs.pop(name)
        for fd in r.fds:
            self._unregister(fd)
        if self.on_line:
            for stream, lines in r.lines.items():
                for ln in lines.flush():
                    self.on_line(name, stream, ln)
        code = None if kind else r.proc.exit_code()
        if code is None and kind is None:
            kind = ErrorKind.LOST
            error = r.proc.lost_reason() or "the connection closed before the command reported an exit code"
        r.proc.close()
        res = NodeResult(name, code, b"".join(r.out).decode("utf-8", "replace"),
                         b"".join(r.err).decode("utf-8", "replace"), time.monotonic() - r.proc.started,
                         error, kind, self.timeout)
        self.results[name] = res
        if self.on_done:
            self.on_done(res)

    def _check(self, name: str, r: _Run, now: float, stop: threading.Event | None) -> None:
        if r.proc.done():
            self._emit(r, *r.proc.read())
            self._finish(name)
        elif r.deadline is not None and now > r.deadline:
            self._emit(r, *r.proc.read())
            r.proc.kill()
            self._finish(name, ErrorKind.TIMEOUT, f"timed out after {self.timeout:g}s")
        elif (why := r.proc.lost_reason()) is not None:
            self._emit(r, *r.proc.read())
            self._finish(name, ErrorKind.LOST, why)
        elif stop is not None and stop.is_set():
            r.proc.kill()
            self._finish(name, ErrorKind.STOPPED, "stopped")

    # ---------------------------------------------------------------- the loop
    def run(self, *, pending: Callable[[], Proc | None] | None = None, stop: threading.Event | None = None,
            until: Callable[[], bool] | None = None) -> dict[str, NodeResult]:
        """Run until every proc ended; `pending` is asked for more as slots free up (the fan-out
        cap); `stop` kills what still runs; `until` returning true ends the loop early and leaves
        the procs still running to the caller (unpolled)."""
        self._refill(pending)
        last_sweep = time.monotonic()
        released = False
        try:
            while self.runs:
                fired = {key.data for key, _ in self.sel.select(timeout=SWEEP_S)}
                now = time.monotonic()
                for name in fired:
                    if (r := self.runs.get(name)) is not None:
                        self._emit(r, *r.proc.read())
                        self._sync_fds(r)
                        self._check(name, r, now, stop)
                if now - last_sweep >= SWEEP_S:
                    last_sweep = now
                    for name, r in list(self.runs.items()):
                        if name not in fired:
                            self._check(name, r, now, stop)
                if until is not None and until():
                    released = True
                    break
                self._refill(pending)
        finally:
            self._close(kill=not released)
        return self.results

    def _refill(self, pending: Callable[[], Proc | None] | None) -> None:
        while pending is not None and len(self.runs) < self.fanout and (p := pending()) is not None:
            self.add(p)

    def _close(self, kill: bool) -> None:
        for r in self.runs.values():
            if kill:
                r.proc.kill()
                r.proc.close()
        self.runs.clear()
        self.sel.close()


def stream(procs: Iterable[Proc], *, on_line: LineCallback | None = None, on_bytes: BytesCallback | None = None,
           timeout: float | None = None, capture: bool = True, stop: threading.Event | None = None,
           on_done: Callable[[NodeResult], None] | None = None,
           pending: Callable[[], Proc | None] | None = None,
           fanout: int = DEFAULT_FANOUT) -> dict[str, NodeResult]:
    """Drive running procs to completion (see Engine): node name -> NodeResult."""
    engine = Engine(on_line=on_line, on_bytes=on_bytes, on_done=on_done, timeout=timeout, capture=capture,
                    fanout=fanout)
    for p in procs:
        engine.add(p)
    return engine.run(pending=pending, stop=stop)


def first_line(proc: Proc, timeout: float) -> str:
    """The first stdout line of a running proc, which keeps running (a server saying where it
    listens). Raises CommandTimeout when none came within `timeout` (the proc is then killed),
    CommandFailed when the proc ended without one."""
    lines: list[str] = []
    engine = Engine(on_line=lambda _n, s, ln: lines.append(ln) if s == "stdout" else None, timeout=timeout)
    engine.add(proc)
    res = engine.run(until=lambda: bool(lines)).get(proc.node)
    if lines:
        return lines[0]
    if res is not None and res.kind is ErrorKind.TIMEOUT:
        raise CommandTimeout(res, timeout, f"{proc.node}: no answer within {timeout:g}s: "
                                           f"{res.stderr.strip()[-500:]}")
    raise CommandFailed(res, f"{proc.node}: ended before saying anything ({res.describe()}): "
                             f"{res.stderr.strip()[-500:]}")


def wait(proc: Proc, timeout: float) -> NodeResult:
    """Drive one proc to its end (killed after `timeout`)."""
    return stream([proc], timeout=timeout)[proc.node]


def open_all(items: list, open_one: Callable[[object], Proc | None], at_once: int = OPEN_AT_ONCE) -> list[Proc]:
    """open_one(item) for each item, up to `at_once` at the same time: the procs it returned (None:
    it could not, and recorded why itself), in the order given. Starting a command on a node waits
    for two round trips (the channel's open, then the exec's reply, which sshd sends once it
    forked the session): one node after the other, 64 nodes waited 64 times over (3.5 s on the
    64-node test cluster). When one open raises, the others are still waited for, the commands they
    started are killed and closed (none left running unowned), and the first error is raised."""
    if len(items) <= 1 or at_once <= 1:
        outcomes = []
        for item in items:
            try:
                outcomes.append((open_one(item), None))
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the opened ones are closed
                outcomes.append((None, e))
                break
    else:
        with ThreadPoolExecutor(max_workers=min(at_once, len(items)), thread_name_prefix="open") as ex:
            outcomes = [(f.result(), None) if f.exception() is None else (None, f.exception())
                        for f in [ex.submit(open_one, item) for item in items]]
    opened = [p for p, _ in outcomes if p is not None]
    error = next((e for _, e in outcomes if e is not None), None)
    if error is not None:
        for p in opened:
            with contextlib.suppress(Exception):
                p.kill()
            with contextlib.suppress(Exception):
                p.close()
        raise error
    return opened


# ------------------------------------------------------------------ the cluster


class Cluster:
    """One connection per node, opened in parallel, reused for the whole command."""

    def __init__(self, inventory: Inventory, *, fanout: int = DEFAULT_FANOUT,
                 accept_new_host_keys: bool = False, connect_timeout: float | None = None,
                 lost_timeout: float = DEFAULT_LOST_TIMEOUT, lost_evidence: bool = True,
                 suspect_s: float = SUSPECT_S, probe_s: float = PROBE_S):
        if fanout < 1:
            raise ValueError("fanout must be at least 1")
        self.inventory = inventory
        self.fanout = fanout
        self.accept_new_host_keys = accept_new_host_keys
        self.connect_timeout = connect_timeout
        self.lost_timeout = lost_timeout
        # the nodes' answered pings, shared: a silent node is lost on evidence (transport/liveness.py)
        self.heard = Heard(suspect_s, probe_s) if lost_evidence else None
        self.connections: dict[str, Connection] = {}
        self.unreachable: dict[str, NodeResult] = {}
        self.handshakes = 0  # counted, so tests can prove one handshake per node per command

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.inventory.nodes

    def live(self, names) -> list[str]:
        """Those of `names` whose connection is open and alive now, in the order given."""
        return [n for n in names if (c := self.connections.get(n)) is not None and c.alive]

    def connection_for(self, node: Node, *, connect_timeout: float | None = None) -> Connection:
        """A new, unopened connection to `node` with this cluster's settings."""
        return connection_for(node, accept_new_host_keys=self.accept_new_host_keys,
                              connect_timeout=connect_timeout or self.connect_timeout,
                              lost_timeout=self.lost_timeout, heard=self.heard)

    def connect(self) -> ClusterResult:
        """Open every node's connection (skipping those already open)."""
        todo = [n for n in self.nodes if n.name not in self.connections]

        def one(node: Node) -> NodeResult:
            t0 = time.monotonic()
            c = self.connection_for(node)
            try:
                c.open()
            except ConnectError as e:
                return NodeResult(node.name, None, duration=time.monotonic() - t0, error=e.message,
                                  kind=ErrorKind.CONNECT)
            self.connections[node.name] = c
            if not node.is_local:
                self.handshakes += 1
            return NodeResult(node.name, 0, duration=time.monotonic() - t0)

        results = {}
        if todo:
            with ThreadPoolExecutor(max_workers=min(self.fanout, len(todo)),
                                    thread_name_prefix="connect") as ex:
                for r in ex.map(one, todo):
                    results[r.node] = r
        for name, r in results.items():
            if r.error:
                self.unreachable[name] = r
            else:
                self.unreachable.pop(name, None)
        return ClusterResult((n.name, results.get(n.name) or NodeResult(n.name, 0)) for n in self.nodes)

    def run(self, command: str | Callable[[Node], str], *, timeout: float | None = 60,
            stdin: bytes | Callable[[Node], bytes | None] | None = None,
            on_line: LineCallback | None = None, on_bytes: BytesCallback | None = None,
            nodes: Iterable[str] | None = None, capture: bool = True, stop: threading.Event | None = None,
            on_done: Callable[[NodeResult], None] | None = None, follow: bool = False,
            fanout: int | None = None) -> ClusterResult:
        """Run on every (selected) connected node at once; at most `fanout` in flight (the
        cluster's, unless given). Unreachable nodes appear in the result with their connection
        error. follow=True: a command that lasts as long as a run (a log follow) holds its slot all
        that time, so every node's starts at once, uncapped; a node past the cap would go unwatched."""
        chosen = None if nodes is None else set(nodes)
        wanted = [n for n in self.nodes if chosen is None or n.name in chosen]
        results: dict[str, NodeResult] = {}
        for n in wanted:
            if n.name in self.unreachable:
                results[n.name] = self.unreachable[n.name]
            elif n.name not in self.connections:
                results[n.name] = NodeResult(n.name, None, error="not connected", kind=ErrorKind.CONNECT)
        todo = [n for n in wanted if n.name in self.connections]
        width = max(1, len(wanted)) if follow else fanout or self.fanout
        ready: list[Proc] = []

        def open_one(node: Node) -> Proc | None:
            try:
                return self.connections[node.name].exec(command(node) if callable(command) else command,
                                                        stdin=stdin(node) if callable(stdin) else stdin)
            except ConnectError as e:  # ConnectionLost: the node went away since connect()
                results[node.name] = NodeResult(node.name, None, error=e.message, kind=ErrorKind.LOST)
                return None

        first = True  # the first ask fills every slot (opened at once); each later one takes a freed slot

        def pending() -> Proc | None:
            nonlocal first
            while not ready and todo:
                batch = todo[:width] if first else todo[:1]
                del todo[:len(batch)]
                first = False
                ready.extend(open_all(batch, open_one))
            return ready.pop(0) if ready else None

        results.update(stream((), on_line=on_line, on_bytes=on_bytes, timeout=timeout, capture=capture,
                              stop=stop, on_done=on_done, pending=pending,
                              fanout=max(1, len(wanted)) if follow else fanout or self.fanout))
        return ClusterResult((n.name, results[n.name]) for n in wanted)

    def close(self):
        for c in self.connections.values():
            c.close()
        self.connections.clear()

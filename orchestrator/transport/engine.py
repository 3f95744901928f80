"""The fan-out engine: one select loop over every running command, and the Cluster of connections."""

from __future__ import annotations

import selectors
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import paramiko

from orchestrator.errors import ConnectError
from orchestrator.inventory import Inventory, Node
from orchestrator.transport.base import (
    DEFAULT_FANOUT,
    DEFAULT_LOST_TIMEOUT,
    SWEEP_S,
    ClusterResult,
    Connection,
    LineCallback,
    NodeResult,
    Proc,
)
from orchestrator.transport.local import LocalConnection, _LocalProc
from orchestrator.transport.ssh import SSHConnection, _SSHProc


def connection_for(node: Node, **kw) -> Connection:
    if node.is_local:
        return LocalConnection(node)
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
    out: list[bytes] = field(default_factory=list)
    err: list[bytes] = field(default_factory=list)
    lines_out: _Lines = field(default_factory=_Lines)
    lines_err: _Lines = field(default_factory=_Lines)


def stream(procs: Iterable[Proc], *, on_line: LineCallback | None = None, timeout: float | None = None,
           capture: bool = True, stop: threading.Event | None = None,
           on_done: Callable[[NodeResult], None] | None = None,
           pending: Callable[[], Proc | None] | None = None,
           fanout: int = DEFAULT_FANOUT) -> dict[str, NodeResult]:
    """Drive running procs to completion with one select loop.

    Lines go to `on_line` whole, per node and per stream; a proc past `timeout`
    is closed and reported as timed out; `stop` ends everything early; `pending`
    is asked for more procs as slots free up (fan-out capping)."""
    sel = selectors.DefaultSelector()
    runs: dict[str, _Run] = {}
    results: dict[str, NodeResult] = {}

    def add(p: Proc):
        fds = p.fileno()
        for fd in fds if isinstance(fds, list) else [fds]:
            sel.register(fd, selectors.EVENT_READ, p.node)
        runs[p.node] = _Run(p, None if timeout is None else time.monotonic() + timeout)

    def emit(r: _Run, out: bytes, err: bytes):
        if capture:
            if out:
                r.out.append(out)
            if err:
                r.err.append(err)
        if on_line:
            for ln in r.lines_out.feed(out) if out else ():
                on_line(r.proc.node, "stdout", ln)
            for ln in r.lines_err.feed(err) if err else ():
                on_line(r.proc.node, "stderr", ln)

    def finish(name: str, error: str | None = None):
        r = runs.pop(name)
        fds = r.proc.fileno()
        for fd in fds if isinstance(fds, list) else [fds]:
            try:
                sel.unregister(fd)
            except (KeyError, ValueError):
                pass
        if on_line:
            for ln in r.lines_out.flush():
                on_line(name, "stdout", ln)
            for ln in r.lines_err.flush():
                on_line(name, "stderr", ln)
        code = None if error else r.proc.exit_code()
        r.proc.close()
        if code is None and not error:
            lost = r.proc.lost_reason() if isinstance(r.proc, _SSHProc) else None
            error = lost or "the connection closed before the command reported an exit code"
        res = NodeResult(name, code, b"".join(r.out).decode("utf-8", "replace"),
                         b"".join(r.err).decode("utf-8", "replace"),
                         time.monotonic() - r.proc.started, error)
        results[name] = res
        if on_done:
            on_done(res)

    def refill():
        while pending is not None and len(runs) < fanout and (p := pending()) is not None:
            add(p)

    for p in procs:
        add(p)
    refill()
    def check(name: str, r: _Run, now: float) -> None:
        if r.proc.done():
            emit(r, *r.proc.read())
            finish(name)
        elif r.deadline is not None and now > r.deadline:
            emit(r, *r.proc.read())
            r.proc.kill()
            finish(name, f"timed out after {timeout:g}s")
        elif isinstance(r.proc, _SSHProc) and not r.proc.chan.get_transport().is_active():
            emit(r, *r.proc.read())
            finish(name, r.proc.lost_reason() or "the SSH connection was lost")
        elif stop is not None and stop.is_set():
            r.proc.kill()
            finish(name, "stopped")

    last_sweep = time.monotonic()
    try:
        while runs:
            # Only the procs whose fd fired are read and checked; a sweep over all of them every
            # SWEEP_S catches deadlines, lost transports and stop requests. (Checking every proc on
            # every event would cost O(nodes^2) per command at 256 nodes.)
            fired = {key.data for key, _ in sel.select(timeout=SWEEP_S)}
            now = time.monotonic()
            for name in fired:
                r = runs.get(name)
                if r is None:
                    continue
                emit(r, *r.proc.read())
                if isinstance(r.proc, _LocalProc):
                    for fd in r.proc.eof_fds():  # an fd at EOF stays readable: stop polling it
                        try:
                            sel.unregister(fd)
                        except (KeyError, ValueError):
                            pass
                check(name, r, now)
            if now - last_sweep >= SWEEP_S:
                last_sweep = now
                for name, r in list(runs.items()):
                    if name not in fired:
                        check(name, r, now)
            refill()
    finally:
        for r in runs.values():
            r.proc.kill()
            r.proc.close()
        sel.close()
    return results


class Cluster:
    """One connection per node, opened in parallel, reused for the whole command."""

    def __init__(self, inventory: Inventory, *, fanout: int = DEFAULT_FANOUT,
                 accept_new_host_keys: bool = False, connect_timeout: float | None = None,
                 lost_timeout: float = DEFAULT_LOST_TIMEOUT):
        if fanout < 1:
            raise ValueError("fanout must be at least 1")
        self.inventory = inventory
        self.fanout = fanout
        self.accept_new_host_keys = accept_new_host_keys
        self.connect_timeout = connect_timeout
        self.lost_timeout = lost_timeout
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

    def connect(self) -> ClusterResult:
        """Open every node's connection (skipping those already open)."""
        todo = [n for n in self.nodes if n.name not in self.connections]

        def one(node: Node) -> NodeResult:
            t0 = time.monotonic()
            c = connection_for(node, accept_new_host_keys=self.accept_new_host_keys,
                               connect_timeout=self.connect_timeout, lost_timeout=self.lost_timeout)
            try:
                c.open()
            except ConnectError as e:
                msg = str(e).removeprefix(f"{node.name}: ")
                return NodeResult(node.name, None, duration=time.monotonic() - t0, error=msg)
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
            on_line: LineCallback | None = None, nodes: Iterable[str] | None = None,
            capture: bool = True, stop: threading.Event | None = None,
            on_done: Callable[[NodeResult], None] | None = None) -> ClusterResult:
        """Run on every (selected) connected node at once; at most `fanout` in flight.
        Unreachable nodes appear in the result with their connection error."""
        wanted = [n for n in self.nodes if nodes is None or n.name in set(nodes)]
        queue = [n for n in wanted if n.name in self.connections]
        results: dict[str, NodeResult] = {}
        for n in wanted:
            if n.name in self.unreachable:
                results[n.name] = self.unreachable[n.name]
            elif n.name not in self.connections:
                results[n.name] = NodeResult(n.name, None, error="not connected")

        def start(node: Node) -> Proc | None:
            cmd = command(node) if callable(command) else command
            data = stdin(node) if callable(stdin) else stdin
            try:
                return self.connections[node.name].exec(cmd, stdin=data)
            except (ConnectError, paramiko.SSHException, OSError, EOFError) as e:
                msg = str(e).removeprefix(f"{node.name}: ")
                results[node.name] = NodeResult(node.name, None, error=msg or "the SSH connection was lost")
                return None

        it = iter(queue)

        def pending() -> Proc | None:
            for node in it:
                p = start(node)
                if p is not None:
                    return p
            return None

        results.update(stream((), on_line=on_line, timeout=timeout, capture=capture, stop=stop,
                              on_done=on_done, pending=pending, fanout=self.fanout))
        return ClusterResult((n.name, results[n.name]) for n in wanted)

    def close(self):
        for c in self.connections.values():
            c.close()
        self.connections.clear()

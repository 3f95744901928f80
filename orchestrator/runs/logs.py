"""Reading a run's logs: byte-offset following and `node/rank` prefixes.

The supervisor copies each node's torchrun output byte for byte into
runs/RUN/nodes/NODE.log. Each worker runs under remote/rank_lines.py, which
writes whole lines prefixed `[default<local_rank>]:` (torchrun's `--tee` format);
the global rank is the node's first rank plus the local rank. Lines from torchrun
itself keep the bare node label.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable, Protocol

_RANK_RE = re.compile(rb"^\[[A-Za-z_]*?(\d+)\]:")


class NodeLog:
    """Follows one node's log file from a byte offset; yields whole lines only."""

    def __init__(self, node: str, path: Path, first_rank: int | None, offset: int = 0):
        self.node, self.path, self.first_rank, self.offset = node, path, first_rank, offset
        self._partial = b""

    def read_lines(self, final: bool = False) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return lines

    def label(self, line: bytes) -> tuple[str, int | None, bytes]:
        m = _RANK_RE.match(line)
        if m and self.first_rank is not None:
            rank = self.first_rank + int(m.group(1))
            return f"{self.node}/r{rank}", rank, line[m.end():]
        return self.node, None, line


def last_lines_offset(path: Path, n: int) -> int:
    """Byte offset where the last `n` lines of a file begin (0 when it has fewer)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    pos, data = size, b""
    with open(path, "rb") as f:
        while pos > 0 and data.count(b"\n") <= n:
            pos = max(0, pos - 65536)
            f.seek(pos)
            data = f.read(size - pos)
    idx = len(data) - (1 if data.endswith(b"\n") else 0)
    for _ in range(n):
        j = data.rfind(b"\n", 0, idx)
        if j < 0:
            return pos
        idx = j
    return pos + idx + 1


class LinePrinter(Protocol):
    """Where a Follower's lines go: `(label, stream, text, key)` per line, and `widen(label)` when
    a label longer than those it was made with appears (cli/output.py's Prefixer is one)."""

    def __call__(self, label: str, stream: str, text: str, key: str | None = None) -> None: ...

    def widen(self, label: str) -> None: ...


# What ranks print while they go down: Python tracebacks, C++ frames, torchrun's own exceptions.
TRACE_START = re.compile(r"Traceback \(most recent call last\)|^Exception raised from |^frame #\d+|^#\d+ |"
                         r"SignalException|Failed to recv|Error waiting on exit barrier|^terminate called|"
                         r"^\S+ \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/")
TRACE_BODY = re.compile(r"^\s|^\^+$|^frame #\d+|^#\d+ |^Exception raised from |^$|^During handling of|"
                        r"^The above exception|^\S+ \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/")
TRACE_END = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\b")
RANK_TAG = re.compile(r"^\[rank\d+\]:")
FOLD_FLUSH_S = 2.0  # a folded block with no line for this long is told


class Folder:
    """The screen's account of what ranks print while they go down: on a `quiet` node (one
    clusterctl stopped after another failed, or any node once one finished cleanly) each block of
    traceback, C++ frames or torchrun shutdown lines is counted instead of printed, and told as
    one line. The log files keep every byte; other lines pass."""

    def __init__(self) -> None:
        self.quiet: set[str] = set()
        self.open: dict[str, list] = {}  # node -> [lines folded, label, last fold time]

    def fold(self, node: str, label: str, text: str) -> bool:
        """True when the line is folded (not to be printed)."""
        if node not in self.quiet:
            return False
        t = RANK_TAG.sub("", text)
        block = self.open.get(node)
        if block is not None and (TRACE_BODY.match(t) or TRACE_START.search(t) or TRACE_END.match(t)):
            block[0] += 1
            block[2] = time.monotonic()
            return True
        if block is None and TRACE_START.search(t):
            self.open[node] = [1, label, time.monotonic()]
            return True
        return False

    def told(self, node: str, log: Path | None = None, idle: float | None = None) -> tuple[str, str] | None:
        """(label, the one line) for `node`'s open block, closing it (with `idle`: only once it has
        had no line for that long)."""
        block = self.open.get(node)
        if block is None or (idle is not None and time.monotonic() - block[2] < idle):
            return None
        del self.open[node]
        where = f"; {log} has them" if log is not None else ""
        n = block[0]
        return block[1], f"[clusterctl: {n} line{'s' if n != 1 else ''} of a stopped rank's traceback folded{where}]"


def quiet_nodes(rec: dict) -> set[str]:
    """The nodes whose tracebacks are noise on screen (runs/logs.py Folder): every node but the
    one that failed first once clusterctl tears the attempt down (a user's stop: every node), and
    every node once one finished cleanly (torchrun's shutdown after a success)."""
    names = {nd.get("name") for nd in rec.get("nodes") or []}
    why = rec.get("teardown") or ""
    if why:
        return names - {why[:-len(" failed")]} if why.endswith(" failed") else names
    if any(nd.get("state") == "finished" for nd in rec.get("nodes") or []):
        return names
    return set()


class Follower:
    """Prints every node's new lines with `node/rN | ` prefixes, filtered by node or rank."""

    def __init__(self, logs: list[NodeLog], printer: LinePrinter, *, node: str | None = None,
                 rank: int | None = None, sink: Callable[[str, str, str], None] | None = None):
        self.logs, self.printer, self.node, self.rank = logs, printer, node, rank
        self.sink = sink
        self.folder = Folder()  # the screen only: --json's sink gets every line

    def _tell_fold(self, lg: NodeLog, idle: float | None = None) -> None:
        told = self.folder.told(lg.node, lg.path, idle)
        if told is not None:
            self.printer(told[0], "stdout", told[1], lg.node)

    def close(self) -> None:
        """Tell the blocks still folded (the run ended)."""
        for lg in self.logs:
            self._tell_fold(lg)

    def retarget(self, nodes: list[tuple[str, Path, int | None]]) -> None:
        """A restarted run's next attempt: follow its nodes too (a spare's log is new) and label
        each node's lines with its new first rank. Logs already followed keep their offsets."""
        by_name = {lg.node: lg for lg in self.logs}
        for name, path, first_rank in nodes:
            lg = by_name.get(name)
            if lg is None:
                self.logs.append(NodeLog(name, path, first_rank))
            elif first_rank is not None:
                lg.first_rank = first_rank
            if first_rank is not None:
                self.printer.widen(f"{name}/r{first_rank}")

    def poll(self, final: bool = False) -> int:
        """Print what is new; returns the number of lines printed."""
        count = 0
        for lg in self.logs:
            if self.node and lg.node != self.node:
                lg.read_lines(final)
                continue
            for raw in lg.read_lines(final):
                label, rank, text = lg.label(raw)
                if self.rank is not None and rank != self.rank:
                    continue
                s = text.decode("utf-8", "replace").rstrip("\r")
                if self.sink is None and "\r" in s:  # a progress bar's updates: the screen shows the
                    s = s.rsplit("\r", 1)[-1]       # last, as a terminal would (the file keeps them all)
                if self.sink is None:
                    if self.folder.fold(lg.node, label, s):
                        continue
                    self._tell_fold(lg)  # a line that is not the block's: the block ended
                (self.sink or self.printer)(label, "stdout", s, lg.node)
                count += 1
            self._tell_fold(lg, idle=0.0 if final else FOLD_FLUSH_S)
        return count


_CAUSE = b"Root Cause (first observed failure):"
_FIELD_RE = re.compile(rb"^\s*(rank|exitcode)\s*:\s*(-?\d+)(?:\s*\(local_rank:\s*(\d+)\))?", re.M)


def worker_failure(log: bytes) -> dict | None:
    """torchrun's own verdict from a node log: the 'Root Cause' block of its ChildFailedError
    -> {"rank", "local_rank", "exitcode"} (exitcode < 0: killed by that signal), or None."""
    at = log.rfind(_CAUSE)
    if at < 0:
        return None
    block = log[at + len(_CAUSE):].split(b"=" * 20, 1)[0]
    out: dict = {}
    for m in _FIELD_RE.finditer(block):
        if m.group(1) == b"rank":
            out["rank"] = int(m.group(2))
            if m.group(3) is not None:
                out["local_rank"] = int(m.group(3))
        else:
            out["exitcode"] = int(m.group(2))
    return out if "local_rank" in out and "exitcode" in out else None


def rank_tail(log: bytes, local_rank: int, n: int) -> list[str]:
    """The last `n` lines one worker wrote (its traceback, usually), without the rank tag."""
    tag = b"[default%d]:" % local_rank
    lines = [ln[len(tag):] for ln in log.split(b"\n") if ln.startswith(tag)]
    return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines[-n:]]

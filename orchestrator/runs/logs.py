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
from typing import Callable, Collection, Protocol

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


FOLD_WINDOW_S = 1.0  # identical lines from several ranks this close together print once


def rank_ranges(ranks) -> str:
    """0,2,5-7 style."""
    rs, out = sorted(set(ranks)), []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


class _Group:
    def __init__(self, seq: int, t0: float, text: str, key: str):
        self.seq, self.t0, self.text, self.key = seq, t0, text, key
        self.members: dict[tuple[str, int | None], str] = {}  # (node, rank) -> its own label

    def label(self) -> str:
        if len(self.members) == 1:
            return next(iter(self.members.values()))
        from orchestrator.checks.report import nodeset

        nodes = nodeset([n for n, _ in self.members])
        ranks = [r for _, r in self.members if r is not None]
        if not ranks:
            return nodes
        return f"{nodes}/r{ranks[0]}" if len(ranks) == 1 else f"{nodes}/r[{rank_ranges(ranks)}]"


class LineFold:
    """Identical lines from many ranks within `window` seconds print once under their node and
    rank ranges (`n[1-8]/r[0-63] | text`), as monarch folds its ranks' logs and `clush -b` its
    nodes' output. Lines that differ are never folded. Each rank's lines keep their order: a line
    joins an open group only if that rank's previous line is not in a later group, and groups
    print in the order they began, each once `window` has passed since its first line (or at
    `flush(all=True)`). The screen only: the files and --json keep every line."""

    def __init__(self, out: Callable[[str, str, str], None], window: float = FOLD_WINDOW_S):
        self.out, self.window = out, window
        self.groups: list[_Group] = []  # open, in the order they began
        self.by_text: dict[tuple[str, bool], _Group] = {}
        self.last: dict[tuple[str, int | None], int] = {}  # (node, rank) -> its newest group's seq
        self.seq = 0

    def add(self, node: str, rank: int | None, label: str, text: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        who, key = (node, rank), (text, rank is None)
        g = self.by_text.get(key)
        if g is None or who in g.members or self.last.get(who, -1) > g.seq or now - g.t0 >= self.window:
            g = self.by_text[key] = _Group(self.seq, now, text, node)
            self.groups.append(g)
            self.seq += 1
        g.members[who] = label
        self.last[who] = g.seq

    def flush(self, now: float | None = None, all: bool = False) -> None:
        now = time.monotonic() if now is None else now
        while self.groups and (all or now - self.groups[0].t0 >= self.window):
            g = self.groups.pop(0)
            if self.by_text.get((g.text, next(iter(g.members))[1] is None)) is g:
                del self.by_text[(g.text, next(iter(g.members))[1] is None)]
            self.out(g.label(), g.text, g.key)


class Follower:
    """Prints every node's new lines with `node/rN | ` prefixes, filtered by nodes or ranks;
    on screen identical lines of many ranks fold (LineFold) and stopped ranks' tracebacks fold
    (Folder), unless `fold` is False."""

    def __init__(self, logs: list[NodeLog], printer: LinePrinter, *, node: str | None = None,
                 rank: int | None = None, sink: Callable[[str, str, str], None] | None = None,
                 nodes: Collection[str] | None = None, ranks: Collection[int] | None = None, fold: bool = True):
        self.logs, self.printer, self.sink = logs, printer, sink
        self.nodes = set(nodes or ()) | ({node} if node else set())
        self.ranks = set(ranks or ()) | ({rank} if rank is not None else set())
        self.folder = Folder()  # the screen only: --json's sink gets every line
        self.lines = LineFold(lambda label, text, key: self.printer(label, "stdout", text, key)) \
            if fold and sink is None else None
        self.fold = fold

    def _tell_fold(self, lg: NodeLog, idle: float | None = None) -> None:
        told = self.folder.told(lg.node, lg.path, idle)
        if told is not None:
            self._print(lg.node, None, told[0], told[1])

    def _print(self, node: str, rank: int | None, label: str, text: str) -> None:
        if self.sink is not None:
            self.sink(label, "stdout", text, node)
        elif self.lines is not None:
            self.lines.add(node, rank, label, text)
        else:
            self.printer(label, "stdout", text, node)

    def flush(self) -> None:
        """Print the lines held for folding now (clusterctl is about to say something)."""
        if self.lines is not None:
            self.lines.flush(all=True)

    def close(self) -> None:
        """Tell the blocks still folded (the run ended)."""
        for lg in self.logs:
            self._tell_fold(lg)
        if self.lines is not None:
            self.lines.flush(all=True)

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
        """Print what is new; returns the number of lines read for printing."""
        count = 0
        for lg in self.logs:
            if self.nodes and lg.node not in self.nodes:
                lg.read_lines(final)
                continue
            for raw in lg.read_lines(final):
                label, rank, text = lg.label(raw)
                if self.ranks and rank not in self.ranks:
                    continue
                s = text.decode("utf-8", "replace").rstrip("\r")
                if self.sink is None and "\r" in s:  # a progress bar's updates: the screen shows the
                    s = s.rsplit("\r", 1)[-1]       # last, as a terminal would (the file keeps them all)
                if self.sink is None and self.fold:
                    if self.folder.fold(lg.node, label, s):
                        continue
                    self._tell_fold(lg)  # a line that is not the block's: the block ended
                self._print(lg.node, rank, label, s)
                count += 1
            if self.fold:
                self._tell_fold(lg, idle=0.0 if final else FOLD_FLUSH_S)
        if self.lines is not None:
            self.lines.flush(all=final)
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

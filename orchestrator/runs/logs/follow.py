"""Reading a run's logs: byte-offset following and `node/rank` prefixes.

The supervisor copies each node's torchrun output byte for byte into
runs/RUN/nodes/NODE.log. Each worker's output is written there by the node's waiter
(remote/agent_lines.py RankLines) as whole lines prefixed `[default<local_rank>]:`
(torchrun's `--tee` format);
the global rank is the node's first rank plus the local rank. Lines from torchrun
itself keep the bare node label.
"""

from __future__ import annotations

import re
import time
from itertools import repeat
from pathlib import Path
from typing import Callable, Collection, Iterable, Protocol

from orchestrator.runs.logs.fold import rank_label
from orchestrator.runs.logs.screen import Screen
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.spec import NodeState

_RANK_RE = re.compile(r"^\[[A-Za-z_]+(\d+)\]:")  # as runs/logs/rankfiles.py RANK_TAG


class NodeLog:
    """Follows one node's log file from a byte offset; yields whole lines only, decoded."""

    def __init__(self, node: str, path: Path, first_rank: int | None, offset: int = 0, last_rank: int | None = None):
        self.node, self.path, self.first_rank, self.offset = node, path, first_rank, offset
        self.last_rank = last_rank  # the node's last global rank, where known (the fold's expected ranks)
        self._partial = b""
        self.at_end = True  # the last read reached the end of the file
        self.labels: dict[str, tuple[str, int]] = {}  # rank tag -> (label, global rank)
        self.text = ""  # the last read's complete lines, as one text

    def read_lines(self, final: bool = False) -> list[str]:
        """The complete lines written since the last read (at most READ_MAX bytes of them; with
        `final`, a last line without its newline too once the end is reached)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(READ_MAX)
                self.at_end = len(data) < READ_MAX
        except FileNotFoundError:
            self.at_end = True
            return []
        self.offset += len(data)
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        self.text = data[:cut].decode("utf-8", "replace")
        lines = self.text.split("\n")
        lines.pop()  # what follows the last newline: nothing
        if final and self.at_end and self._partial:
            lines.append(self._partial.decode("utf-8", "replace"))
            self.text += lines[-1]
            self._partial = b""
        return lines

    def label(self, line: str) -> tuple[str, int | None, str]:
        """(`node/rN` or `node`, the global rank or None, the text without its rank tag)."""
        if line[:1] == "[" and self.first_rank is not None and (end := line.find("]:", 1, 24)) > 0:
            tag = self.labels.get(line[:end]) or self.tag(line, end)
            if tag is not None:
                return tag[0], tag[1], line[end + 2:]
        return self.node, None, line

    def tag(self, line: str, end: int) -> tuple[str, int] | None:
        """The label and global rank of a rank tag `[default3]` (line[:end] + `]:`), kept."""
        m = _RANK_RE.match(line)
        if m is None or m.end() != end + 2:
            return None
        rank = self.first_rank + int(m.group(1))
        self.labels[line[:end]] = (rank_label(self.node, rank), rank)
        return self.labels[line[:end]]


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
    """Where a Follower's lines go: `many([(label, text, key), ...])` for a poll's lines, and
    `widen(label)` when a label longer than those it was made with appears (cli/output.py's
    Prefixer is one)."""

    def many(self, lines: Iterable[tuple[str, str, str | None]]) -> None: ...

    def widen(self, label: str) -> None: ...


def quiet_nodes(rec: RunRecord) -> set[str]:
    """The nodes whose tracebacks are noise on screen (runs/logs/screen.py): every node but the one
    that failed first once clusterctl tears the attempt down (a user's stop: every node), and
    every node once one finished cleanly (torchrun's shutdown after a success)."""
    names = {nd.name for nd in rec.nodes}
    why = rec.teardown or ""
    if why:
        return names - {why[:-len(" failed")]} if why.endswith(" failed") else names
    if any(nd.state is NodeState.FINISHED for nd in rec.nodes):
        return names
    return set()


READ_MAX = 1 << 20  # the most of one node's log read per look (a final poll reads on until the end)


class Follower:
    """Prints every node's new lines with `node/rN | ` prefixes, filtered by nodes or ranks;
    on screen (runs/logs/screen.py) tracebacks and identical lines of many ranks fold, stopped ranks'
    tracebacks fold, and torchrun's noise is hidden, unless `fold` is False. Lines are written a
    poll's worth at a time."""

    def __init__(self, logs: list[NodeLog], printer: LinePrinter, *, node: str | None = None,
                 rank: int | None = None, sink: Callable[[str, str, str], None] | None = None,
                 nodes: Collection[str] | None = None, ranks: Collection[int] | None = None, fold: bool = True):
        self.logs, self.printer, self.sink = logs, printer, sink
        self.nodes = set(nodes or ()) | ({node} if node else set())
        self.ranks = set(ranks or ()) | ({rank} if rank is not None else set())
        self.fold = fold and sink is None  # the screen only: --json's sink gets every line
        where = str(logs[0].path.parent) if logs and logs[0].path is not None else "the node logs"
        self.screen = Screen(where)
        self.screen.logs = {lg.node: str(lg.path) for lg in logs}
        self.whole = {lg.node for lg in logs if lg.offset == 0}  # followed from their first line
        self.expect([(lg.node, lg.first_rank, lg.last_rank) for lg in logs])

    def expect(self, nodes: list[tuple[str, int | None, int | None]]) -> None:
        """The attempt's nodes and their ranks (name, first, last): the labels whose lines the fold
        can expect (runs/logs/fold.py LineFold.expect), through the filters; a node whose ranks are
        not known leaves the ranks' unknown."""
        nodes = [(name, first, last) for name, first, last in nodes if not self.nodes or name in self.nodes]
        ranks: list[str] | None = []
        for name, first, last in nodes:
            if first is None or last is None:
                ranks = None
                break
            ranks.extend(rank_label(name, r) for r in range(first, last + 1) if not self.ranks or r in self.ranks)
        self.screen.fold.expect(ranks, [name for name, _, _ in nodes])

    @property
    def quiet(self) -> set[str]:
        return self.screen.quiet

    @quiet.setter
    def quiet(self, nodes: set[str]) -> None:
        self.screen.quiet = nodes

    def showed(self, node: str, rank: int) -> bool:
        """Every line of `rank` on `node` went to the screen (folded or not): none was filtered
        out and its node's log was followed from its start."""
        return node in self.whole and (not self.nodes or node in self.nodes) and (not self.ranks or rank in self.ranks)

    def flush(self) -> None:
        """Print the lines held for folding now (clusterctl is about to say something)."""
        if self.fold:
            self.screen.flush(time.monotonic(), self.printer.many, all=True)

    def close(self) -> None:
        """Print everything still held (the run ended)."""
        self.flush()

    def retarget(self, nodes: list[tuple[str, Path, int | None, int | None]]) -> None:
        """A restarted run's next attempt (name, log, first rank, last rank): follow its nodes too (a
        spare's log is new) and label each node's lines with its new first rank. Logs already
        followed keep their offsets."""
        by_name = {lg.node: lg for lg in self.logs}
        for name, path, first_rank, last_rank in nodes:
            lg = by_name.get(name)
            if lg is None:
                self.logs.append(NodeLog(name, path, first_rank, last_rank=last_rank))
                self.whole.add(name)
                self.screen.logs[name] = str(path)
            elif first_rank is not None:
                lg.first_rank, lg.last_rank = first_rank, last_rank
                lg.labels.clear()
            if first_rank is not None:
                self.printer.widen(rank_label(name, first_rank))
        self.expect([(name, first, last) for name, _, first, last in nodes])

    def poll(self, final: bool = False) -> int:
        """Print what is new; returns the number of lines read for printing. A piece of each
        node's log is read in turn; with `final`, piece after piece until every log is read, each
        round printed before the next is read, one fold window later on the fold's clock (lines
        that far apart in the files are not folded, and a finished run's logs are never held
        whole)."""
        count = 0
        now = time.monotonic()
        todo = self.logs
        while todo:
            for lg in todo:
                lines = lg.read_lines(final)
                if lines and (not self.nodes or lg.node in self.nodes):
                    count += self._lines(lg, lines, now)
            todo = [lg for lg in todo if final and not lg.at_end]
            if self.fold:
                self.screen.tick(now, final and not todo)
                self.screen.flush(now, self.printer.many, all=final and not todo)
            now += self.screen.fold.window
        return count

    def _lines(self, lg: NodeLog, lines: list[str], now: float) -> int:
        """One node's new lines to the screen (or the sink); how many passed the filters."""
        only, node, first, known = self.ranks, lg.node, lg.first_rank, lg.labels
        labels, texts, ranks = [], [], []
        torchrun = False  # a line of torchrun's own among them
        for raw in lines:
            tag = None
            if raw[:1] == "[" and first is not None and (end := raw.find("]:", 1, 24)) > 0:
                tag = known.get(raw[:end]) or lg.tag(raw, end)
            if tag is None:
                label, rank, text, torchrun = node, None, raw, True
            else:
                label, rank, text = tag[0], tag[1], raw[end + 2:]
            if only and rank not in only:
                continue
            if "\r" in text:
                text = text.rstrip("\r")
                if self.sink is None and "\r" in text:  # a progress bar's updates: the screen shows the
                    text = text.rsplit("\r", 1)[-1]  # last, as a terminal would (the file keeps them all)
            labels.append(label)
            texts.append(text)
            ranks.append(rank)
        if self.sink is not None:
            for label, text in zip(labels, texts):
                self.sink(label, "stdout", text, node)
        elif self.fold:
            self.screen.lines(node, labels, texts, ranks, now, torchrun, lg.text)
        elif texts:
            self.printer.many(zip(labels, texts, repeat(node)))
        return len(texts)


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

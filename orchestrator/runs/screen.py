"""What the foreground shows of a run's lines. The files (runs/RUN/nodes/NODE.log byte for byte,
runs/RUN/ranks/rankN.log) and --json keep every line; this decides only what is printed.

- torch's `[rankN]: ` prefix (its excepthook's and its C++ warnings') is taken off: the label
  names the rank, and without it the same traceback from many ranks is the same text.
- A Python traceback is gathered whole per rank (`Block`) and folds as one piece: identical
  tracebacks of many ranks print once under their ranges (`node[1-3]/r[0-2]`), and one that
  arrives after its twin was printed is one line that refers to it.
- Identical lines from many ranks within FOLD_WINDOW_S print once under their node and rank
  ranges (`n[1-8]/r[0-63] | text`), as `clush -b` gathers its nodes' output (LineFold). Lines that
  differ are never folded, and each rank's lines keep their order.
- On a quiet node (runs/logs.py quiet_nodes: stopped by clusterctl after another node failed) a
  traceback, C++ frames or torchrun's shutdown lines that are not a traceback already shown are
  counted, and told as one line.
- Noise is hidden, and said once with where it is kept (HIDDEN): c10d's "hostname of the client
  socket cannot be retrieved" (every node, every launch) and torchrun's ChildFailedError report
  (the run's summary names the rank that failed and its exit code).
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from itertools import repeat
from typing import Callable, NamedTuple

FOLD_WINDOW_S = 1.0  # identical lines from several ranks this close together print once
BLOCK_IDLE_S = 1.0  # a traceback with no new line for this long is complete
FOLD_FLUSH_S = 2.0  # a quiet node's folded lines with no new one for this long are told
BATCH = 8192  # held lines printed with one write
SHOWN_KEEP = 256  # tracebacks remembered as printed, for the late twins' one line
REPORT_MAX = 200  # the most lines of a ChildFailedError report hidden, should its last rule not come

RANK_PREFIX = re.compile(r"\[rank\d+\]: ?")
C10D_HOSTNAME = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved")
# torchrun's log line that opens its ChildFailedError echo: `E1128 19:13:41.631000 9445 .../elastic/
# multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 9565) of binary: ...`
ELASTIC_FAILED = re.compile(r"^[EW]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/\S+\] failed \(exitcode")
CHILD_FAILED = re.compile(r"^\S*ChildFailedError:")
REPORT_RULE = "=" * 20

# What ranks print while they go down: Python tracebacks, C++ frames, torchrun's own exceptions.
PY_TRACE = "Traceback (most recent call last)"
TRACE_START = re.compile(r"Traceback \(most recent call last\)|^Exception raised from |^frame #\d+|^#\d+ |"
                         r"SignalException|Failed to recv|Error waiting on exit barrier|^terminate called|"
                         r"^\S+ \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/")
TRACE_BODY = re.compile(r"^\s|^\^+$|^frame #\d+|^#\d+ |^Exception raised from |^$|^During handling of|"
                        r"^The above exception|^\S+ \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/|"
                        r"Traceback \(most recent call last\)")
TRACE_END = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\b")


def hidden_kind(text: str) -> str | None:
    """Which noise a line (its rank prefix off) is, or None: a line of the job."""
    if "[c10d]" in text and C10D_HOSTNAME.search(text):
        return "c10d"
    return None


def job_text(text: str) -> str | None:
    """A rank's line as the job said it (torch's `[rankN]: ` off), or None when it is noise."""
    if text.startswith("[rank"):
        m = RANK_PREFIX.match(text)
        if m:
            text = text[m.end():]
    return None if hidden_kind(text) else text


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


def group_label(members) -> str:
    """`node[1-3]/r[0-2]` for the (node, rank) pairs of a folded line."""
    from orchestrator.checks.report import nodeset

    members = list(members)
    nodes = nodeset(list(dict.fromkeys(n for n, _ in members)))
    ranks = [r for _, r in members if r is not None]
    if not ranks:
        return nodes
    return f"{nodes}/r{ranks[0]}" if len(ranks) == 1 else f"{nodes}/r[{rank_ranges(ranks)}]"


class Same(NamedTuple):
    """A traceback already printed: said as one line that refers to it."""

    block: tuple


class Entry:
    """A held line (or a whole traceback: `text` a tuple of lines, or Same) and the ranks that
    printed it: `members` is None while only the first has, else {label: (node, rank)}."""

    __slots__ = ("seq", "t0", "text", "label", "node", "rank", "members")

    def __init__(self, seq: int, t0: float, text, label: str, node: str, rank: int | None):
        self.seq, self.t0, self.text, self.label, self.node, self.rank = seq, t0, text, label, node, rank
        self.members: dict | None = None

    def join(self, label: str, node: str, rank: int | None) -> None:
        if self.members is None:
            self.members = {self.label: (self.node, self.rank)}
        self.members[label] = (node, rank)

    def shown_label(self) -> str:
        return self.label if self.members is None or len(self.members) == 1 else group_label(self.members.values())


class Chunk:
    """One node's lines from one poll, none of them a twin of a line held: printed as they are
    unless a twin arrives while they are held (then `entries`, one Entry per line)."""

    __slots__ = ("seq", "t0", "node", "labels", "texts", "ranks", "keys", "entries", "done", "who")

    def __init__(self, seq: int, t0: float, node: str, labels: list, texts: list, ranks: list, keys: set):
        self.seq, self.t0, self.node, self.labels, self.texts, self.ranks = seq, t0, node, labels, texts, ranks
        self.keys = keys
        self.entries: list[Entry] | None = None
        self.done = False
        self.who: dict[str, int] | None = None  # label -> the seq of its last line here, when asked

    def last_of(self, label: str) -> int:
        if self.who is None:
            self.who = dict(zip(self.labels, range(self.seq, self.seq + len(self.labels))))
        return self.who.get(label, -1)


class LineFold:
    """Identical lines (or whole tracebacks) from many ranks within `window` seconds print once
    under their ranges. A line joins a held one only if its rank's previous line is not held
    after it (each rank's lines keep their order); what is held prints in the order it began,
    once `window` has passed since its first line (or at `flush(all=True)`).

    Distinct lines cost little: a node's poll of lines none of which has a twin held is one
    Chunk, checked against the texts held with a few set operations, and printed as it is. Only
    a line with a twin takes the slower way (Entry). The texts held are looked up in two
    generations (this window's, the last one's), each of at most GENERATION lines (reading a
    finished run's logs at once, `now` never moves: lines that far apart are not folded)."""

    GENERATION = 200_000

    def __init__(self, window: float = FOLD_WINDOW_S):
        self.window = window
        self.pending: deque = deque()  # Chunks and Entries, in the order they began
        self.chunks: deque[Chunk] = deque()  # the Chunks held, oldest first
        self.open_rank: dict = {}  # text -> its newest held Entry (ranks' lines)
        self.open_node: dict = {}  # the same for torchrun's own lines (no rank)
        self.recent: tuple[set, set] = (set(), set())  # the Chunks' texts: this generation's, the last one's
        self.turned = float("-inf")  # when recent[0] began
        self.last: dict[str, int] = {}  # label -> the seq of its newest line held as an Entry
        self.seq = 0
        self.shown: OrderedDict[tuple, str] = OrderedDict()  # traceback -> the label it printed under

    def knows(self, block: tuple) -> bool:
        """The traceback is held to print, or was printed."""
        return block in self.open_rank or block in self.shown

    def lines(self, node: str, labels: list, texts: list, ranks: list, now: float) -> None:
        """A node's lines from one poll, in order."""
        if now - self.turned >= self.window or len(self.recent[0]) > self.GENERATION:
            self.recent, self.turned = (set(), self.recent[0]), now
        keys = set(texts)
        if len(keys) == len(texts) and keys.isdisjoint(self.recent[0]) and keys.isdisjoint(self.recent[1]) \
                and (not self.open_rank or keys.isdisjoint(self.open_rank.keys())) \
                and (not self.open_node or keys.isdisjoint(self.open_node.keys())):
            c = Chunk(self.seq, now, node, labels, texts, ranks, keys)
            self.seq += len(texts)
            self.recent[0].update(keys)
            self.pending.append(c)
            self.chunks.append(c)
            return
        for label, text, rank in zip(labels, texts, ranks):
            self.add(node, rank, label, text, now)

    def _held(self, text, rank: int | None) -> Entry | None:
        """The newest held Entry with `text` (a held Chunk that has it is split into Entries)."""
        opens = self.open_node if rank is None else self.open_rank
        e = opens.get(text)
        if e is None and type(text) is str and (text in self.recent[0] or text in self.recent[1]):
            c = next((c for c in reversed(self.chunks) if c.entries is None and text in c.keys), None)
            if c is not None:
                self._split(c)
                e = opens.get(text)
        return e

    def _split(self, c: Chunk) -> None:
        """A held Chunk's lines become Entries: one of them has a twin."""
        c.entries = [Entry(c.seq + i, c.t0, t, lb, c.node, r)
                     for i, (lb, t, r) in enumerate(zip(c.labels, c.texts, c.ranks))]
        for x in c.entries:
            (self.open_node if x.rank is None else self.open_rank).setdefault(x.text, x)
            if self.last.get(x.label, -1) < x.seq:
                self.last[x.label] = x.seq

    def _last(self, label: str, node: str, after: int) -> int:
        """The seq of `label`'s newest held line, as far as it is after `after`."""
        last = self.last.get(label, -1)
        for c in reversed(self.chunks):
            if c.seq + len(c.texts) <= max(after, last):
                break
            if c.node == node and c.entries is None:
                last = max(last, c.last_of(label))
        return last

    def add(self, node: str, rank: int | None, label: str, text, now: float) -> None:
        """One line (or a traceback: a tuple of lines)."""
        e = self._held(text, rank)
        if e is not None and self._joins(e, label, node, now):
            e.join(label, node, rank)
            self.last[label] = e.seq
            return
        if type(text) is tuple and (e is not None or text in self.shown):
            text = Same(text)  # its twin prints (or printed) whole: this rank's is one line
            e = (self.open_node if rank is None else self.open_rank).get(text)
            if e is not None and self._joins(e, label, node, now):
                e.join(label, node, rank)
                self.last[label] = e.seq
                return
        e = Entry(self.seq, now, text, label, node, rank)
        self.seq += 1
        (self.open_node if rank is None else self.open_rank)[text] = e
        self.pending.append(e)
        self.last[label] = e.seq

    def _joins(self, e: Entry, label: str, node: str, now: float) -> bool:
        return now - e.t0 < self.window and label != e.label and (e.members is None or label not in e.members) \
            and self._last(label, node, e.seq) <= e.seq

    def flush(self, now: float, out: Callable[[list], None], all: bool = False) -> None:
        """Every line whose time came, in order, to `out` as lists of (label, text, key): a Chunk's
        lines as one list, Entries' gathered into lists of at most BATCH."""
        pending, window = self.pending, self.window
        held: list[tuple[str, str, str]] = []
        while pending and (all or now - pending[0].t0 >= window):
            x = pending.popleft()
            if type(x) is Chunk:
                x.done = True
                if self.chunks and self.chunks[0] is x:
                    self.chunks.popleft()
                if x.entries is None:
                    if held:
                        out(held)
                        held = []
                    out(list(zip(x.labels, x.texts, repeat(x.node))))
                    continue
                for e in x.entries:
                    self._emit(e, held)
            else:
                self._emit(x, held)
            if len(held) >= BATCH:
                out(held)
                held = []
        if held:
            out(held)

    def _emit(self, e: Entry, out: list) -> None:
        text = e.text
        opens = self.open_node if e.rank is None else self.open_rank
        if opens.get(text) is e:
            del opens[text]
        label = e.shown_label()
        if type(text) is str:
            out.append((label, text, e.node))
        elif type(text) is Same:
            first = self.shown.get(text.block, "another rank")
            out.append((label, f"[clusterctl: the same traceback as {first} above]", e.node))
        else:
            out.extend((label, line, e.node) for line in text)
            self.shown[text] = label
            if len(self.shown) > SHOWN_KEEP:
                self.shown.popitem(last=False)


class Block:
    """One rank's traceback as it arrives; `python`: a Python traceback (complete at its
    exception line)."""

    __slots__ = ("label", "lines", "at", "python")

    def __init__(self, label: str, line: str, at: float):
        self.label, self.lines, self.at = label, [line], at
        self.python = PY_TRACE in line


NOTES = {
    "c10d": "[clusterctl: c10d's warning \"The hostname of the client socket cannot be retrieved\" is not shown "
            "(harmless: every node prints it at each launch); {where} keeps every line]",
    "child": "[clusterctl: torchrun's ChildFailedError report is not shown (clusterctl's summary names the rank "
             "that failed first and its exit code); {where} keeps it]",
}


class Screen:
    """The lines of every node on their way to the screen: `line()` each (from one poll, with the
    poll's `now`), then `tick()` and `flush()` for what to print. `where` is said with what is
    hidden (the node logs' directory); `quiet` is the set of quiet nodes, kept up to date by the
    caller."""

    def __init__(self, where: str = "the node logs", window: float = FOLD_WINDOW_S):
        self.where = where
        self.logs: dict[str, str] = {}  # node -> its log, named when a quiet node's lines are folded
        self.quiet: set[str] = set()
        self.fold = LineFold(window)
        self.blocks: dict[tuple[str, int | None], Block] = {}
        self.report: dict[str, int] = {}  # node -> lines of its ChildFailedError report hidden so far
        self.hidden: dict[str, int] = {}  # kind -> lines hidden
        self.folded: dict[str, list] = {}  # quiet node -> [lines folded, label, last fold]
        self.ended: dict[tuple[str, int | None], float] = {}  # who just ended a traceback -> when

    def lines(self, node: str, labels: list, texts: list, ranks: list, now: float) -> None:
        """A node's lines from one poll. Plain lines (no rank prefix, traceback, noise or
        torchrun echo among them, on a node that is not quiet and has nothing open) go to the
        fold as one batch; otherwise line by line."""
        if node in self.quiet or node in self.report or node in self.folded or \
                (self.blocks and any(w[0] == node for w in self.blocks)) or (self.ended and any(w[0] == node for w in self.ended)):
            plain = False
        else:
            big = "\n".join(texts)
            plain = "[rank" not in big and "[c10d]" not in big and PY_TRACE not in big and "/elastic/" not in big
        if plain:
            self.fold.lines(node, labels, texts, ranks, now)
            return
        line = self.line
        for label, text, rank in zip(labels, texts, ranks):
            line(node, rank, label, text, now)

    def line(self, node: str, rank: int | None, label: str, text: str, now: float) -> None:
        """One line (see `lines`)."""
        if text.startswith("[rank") and (m := RANK_PREFIX.match(text)):
            text = text[m.end():]
        if "[c10d]" in text and C10D_HOSTNAME.search(text):
            return self.hide(node, "c10d", now)
        who = (node, rank)
        if self.ended and self.ended.pop(who, None) is not None:
            if not text.strip():  # the blank line a traceback ends with (torch's excepthook)
                return None
        quiet = node in self.quiet
        b = self.blocks.get(who) if self.blocks else None
        if b is not None:
            if TRACE_BODY.match(text) or TRACE_END.match(text) or (quiet and TRACE_START.search(text)):
                b.lines.append(text)
                b.at = now
                if b.python and TRACE_END.match(text):  # the exception: a Python traceback is complete
                    self.close(who, now)
                    self.ended[who] = now
                return None
            self.tell(node, now) if quiet else self.close(who, now)
        elif quiet and node in self.folded and not TRACE_START.search(text):
            self.tell(node, now)  # a line that is not a traceback's: what was folded is told first
        if rank is None and self.torchrun_echo(node, text, now):
            return None
        if PY_TRACE in text or (quiet and TRACE_START.search(text)):
            self.blocks[who] = Block(label, text, now)
            return None
        self.fold.add(node, rank, label, text, now)
        return None

    def hide(self, node: str, kind: str, now: float, n: int = 1) -> None:
        """Noise of `kind` not shown; the first time, a line says so and where it is kept."""
        if kind not in self.hidden:
            self.hidden[kind] = 0
            self.fold.add(node, None, node, NOTES[kind].format(where=self.where), now)
        self.hidden[kind] += n

    def torchrun_echo(self, node: str, text: str, now: float) -> bool:
        """torchrun's own line that is part of its ChildFailedError echo (hidden: True)."""
        seen = self.report.get(node)
        if seen is not None:
            if seen == 0 and not text.startswith(REPORT_RULE):  # no report after all
                del self.report[node]
                return False
            self.report[node] = seen + 1
            if (text.startswith(REPORT_RULE) and seen > 0) or seen + 1 >= REPORT_MAX:
                del self.report[node]  # its closing rule
            self.hidden["child"] += 1
            return True
        if text[:1] in "EW" and ELASTIC_FAILED.match(text):
            self.hide(node, "child", now)
            return True
        return False

    def close(self, who: tuple[str, int | None], now: float) -> None:
        """A rank's traceback is complete: hidden (torchrun's ChildFailedError), folded (a quiet
        node's, not one shown), or on to the screen as one piece."""
        node, rank = who
        b = self.blocks.pop(who)
        lines = b.lines
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            return
        if rank is None and CHILD_FAILED.match(lines[-1]):
            self.hide(node, "child", now, len(lines))
            self.report[node] = 0
            return
        block = tuple(lines)
        if node in self.quiet and not self.fold.knows(block):
            f = self.folded.setdefault(node, [0, b.label, now])
            f[0] += len(b.lines)
            f[2] = now
            return
        self.fold.add(node, rank, b.label, block, now)

    def tell(self, node: str, now: float) -> None:
        """A quiet node's folded lines, told as one line (its open tracebacks first ended)."""
        for who in [w for w in self.blocks if w[0] == node]:
            self.close(who, now)
        f = self.folded.pop(node, None)
        if f is None:
            return
        n = f[0]
        self.fold.add(node, None, f[1], f"[clusterctl: {n} line{'s' if n != 1 else ''} of a stopped rank's "
                                        f"traceback folded; {self.logs.get(node, self.where)} has them]", now)

    def tick(self, now: float, final: bool = False) -> None:
        """Tracebacks idle for BLOCK_IDLE_S are complete, a quiet node's folds idle for
        FOLD_FLUSH_S are told (with `final`: all of them)."""
        for who in [w for w, b in self.blocks.items() if final or now - b.at >= BLOCK_IDLE_S]:
            self.close(who, now)
        for node in [n for n, f in self.folded.items() if final or now - f[2] >= FOLD_FLUSH_S]:
            self.tell(node, now)
        for who in [w for w, at in self.ended.items() if now - at >= BLOCK_IDLE_S]:
            del self.ended[who]

    def flush(self, now: float, out: Callable[[list], None], all: bool = False) -> None:
        """What to print now, to `out` (LineFold.flush): with `all`, every line held (the
        tracebacks still open included)."""
        if all:
            self.tick(now, final=True)
        self.fold.flush(now, out, all)

"""Identical lines from many ranks, printed once under their node and rank ranges
(`n[1-8]/r[0-63] | text`), as `clush -b` gathers its nodes' output; the screen's last step
(runs/logs/screen.py Screen feeds it). Lines that differ are never folded, and each rank's lines keep
their order."""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import Callable, NamedTuple

FOLD_WINDOW_S = 1.0  # identical lines from several ranks this close together print once
BATCH = 8192  # held lines printed with one write
SHOWN_KEEP = 256  # tracebacks remembered as printed, for the late twins' one line
LABELS_KEPT = 4096  # group labels remembered (the same ranks fold the same lines again and again)


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


def rank_label(node: str, rank: int) -> str:
    """`node/rN`: how one rank's lines are labelled, on screen, in `tail`, `watch` and the folds."""
    return f"{node}/r{rank}"


def group_label(members) -> str:
    """`node[1-3]/r[0-2]` for the (node, rank) pairs of a folded line."""
    from orchestrator.checks.report import nodeset

    members = list(members)
    nodes = nodeset(list(dict.fromkeys(n for n, _ in members)))
    ranks = [r for _, r in members if r is not None]
    if not ranks:
        return nodes
    return rank_label(nodes, ranks[0]) if len(ranks) == 1 else f"{nodes}/r[{rank_ranges(ranks)}]"


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

    def shown_label(self, known: dict) -> str:
        """The label it prints under; `known`: labels of member sets already worded (identical
        lines of the same ranks, again and again, are worded once)."""
        if self.members is None or len(self.members) == 1:
            return self.label
        key = frozenset(self.members)
        label = known.get(key)
        if label is None:
            if len(known) > LABELS_KEPT:
                known.clear()
            label = known[key] = group_label(self.members.values())
        return label


class Chunk:
    """One node's lines from one poll, none of them a twin of a line held: printed as they are
    unless a twin arrives while they are held (then `entries`, one Entry per line)."""

    __slots__ = ("seq", "t0", "node", "labels", "texts", "ranks", "keys", "entries", "done", "who")

    def __init__(self, seq: int, t0: float, node: str, labels: list, texts: list, ranks: list):
        self.seq, self.t0, self.node, self.labels, self.texts, self.ranks = seq, t0, node, labels, texts, ranks
        self.keys: set | None = None  # its texts as a set, made when a twin is looked for
        self.entries: list[Entry] | None = None
        self.done = False
        self.who: dict[str, int] | None = None  # label -> the seq of its last line here, when asked

    def has(self, text: str) -> bool:
        if self.keys is None:
            self.keys = set(self.texts)
        return text in self.keys

    def last_of(self, label: str) -> int:
        if self.who is None:
            self.who = dict(zip(self.labels, range(self.seq, self.seq + len(self.labels))))
        return self.who.get(label, -1)


class LineFold:
    """Identical lines (or whole tracebacks) from many ranks within `window` seconds print once
    under their ranges. A line joins a held one only if its rank's previous line is not held
    after it (each rank's lines keep their order); what is held prints in the order it began,
    once `window` has passed since its first line (or at `flush(all=True)`), or sooner once no
    rank can join it any more: given the ranks that print (`expect`), when every one of them
    printed it too or has a line held after it (identical lines from every rank print as soon as
    the last rank's arrives). What folds is the same either way.

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
        self.labels: dict[frozenset, str] = {}  # the labels of member sets worded so far
        self.newest: dict[str, int] = {}  # label -> the seq of its newest line, while `expect` is known
        self.expected: tuple[frozenset, frozenset] | None = None  # (the ranks' labels, the nodes'), or not known

    def expect(self, ranks, nodes) -> None:
        """The labels whose lines come here: every rank's (`node/rN`) and every node's (torchrun's own
        lines); None: not known (then only the window lets a held line go)."""
        self.expected = None if ranks is None or nodes is None else (frozenset(ranks), frozenset(nodes))

    def knows(self, block: tuple) -> bool:
        """The traceback is held to print, or was printed."""
        return block in self.open_rank or block in self.shown

    def lines(self, node: str, labels: list, texts: list, ranks: list, now: float) -> None:
        """A node's lines from one poll, in order."""
        if now - self.turned >= self.window or len(self.recent[0]) > self.GENERATION:
            self.recent, self.turned = (set(), self.recent[0]), now
        held, before = self.recent[0], len(self.recent[0])
        held.update(texts)  # every text new (none held, none twice): it grew by all of them
        if len(held) - before == len(texts) and self.recent[1].isdisjoint(texts) \
                and (not self.open_rank or self.open_rank.keys().isdisjoint(texts)) \
                and (not self.open_node or self.open_node.keys().isdisjoint(texts)):
            c = Chunk(self.seq, now, node, labels, texts, ranks)
            self.seq += len(texts)
            self.pending.append(c)
            self.chunks.append(c)
            if self.expected is not None:
                self.newest.update(zip(labels, range(c.seq, self.seq)))
            return
        for label, text, rank in zip(labels, texts, ranks):
            self.add(node, rank, label, text, now)

    def _held(self, text, rank: int | None) -> Entry | None:
        """The newest held Entry with `text` (a held Chunk that has it is split into Entries)."""
        opens = self.open_node if rank is None else self.open_rank
        e = opens.get(text)
        if e is None and type(text) is str and (text in self.recent[0] or text in self.recent[1]):
            c = next((c for c in reversed(self.chunks) if c.entries is None and c.has(text)), None)
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
            self.last[label] = self.newest[label] = e.seq
            return
        if type(text) is tuple and (e is not None or text in self.shown):
            text = Same(text)  # its twin prints (or printed) whole: this rank's is one line
            e = (self.open_node if rank is None else self.open_rank).get(text)
            if e is not None and self._joins(e, label, node, now):
                e.join(label, node, rank)
                self.last[label] = self.newest[label] = e.seq
                return
        e = Entry(self.seq, now, text, label, node, rank)
        self.seq += 1
        (self.open_node if rank is None else self.open_rank)[text] = e
        self.pending.append(e)
        self.last[label] = self.newest[label] = e.seq

    def _joins(self, e: Entry, label: str, node: str, now: float) -> bool:
        return now - e.t0 < self.window and label != e.label and (e.members is None or label not in e.members) \
            and self._last(label, node, e.seq) <= e.seq

    def flush(self, now: float, out: Callable[[list], None], all: bool = False) -> None:
        """Every line whose time came, in order, to `out` as lists of (label, text, key): a Chunk's
        lines as one list, Entries' gathered into lists of at most BATCH."""
        pending, window = self.pending, self.window
        held: list[tuple[str, str, str]] = []
        order: dict = {}  # the expected labels by their newest line, once asked (`_settled`)
        while pending and (all or now - pending[0].t0 >= window or self._settled(pending[0], order)):
            x = pending.popleft()
            if type(x) is Chunk:
                x.done = True
                if self.chunks and self.chunks[0] is x:
                    self.chunks.popleft()
                if x.entries is None:
                    if held:
                        out(held)
                        held = []
                    out(zip(x.labels, x.texts, repeat(x.node)))  # an iterator: its tuples are reused
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

    def _settled(self, x, order: dict) -> bool:
        """No expected label can join the held `x` any more (a Chunk: any of its lines): each has a
        line after it (`_joins` refuses it then), or printed it too. `order` caches, per flush, each
        kind's expected labels by their newest seq (only those at or before `x` are looked at)."""
        if self.expected is None:
            return False
        if type(x) is Chunk:
            return None not in x.ranks and self._order(order, 0)[0][0] >= x.seq + len(x.texts) - 1
        seq, label, members = x.seq, x.label, x.members
        for newest, lb in self._order(order, 0 if x.rank is not None else 1):
            if newest > seq:
                return True
            if lb != label and (members is None or lb not in members):
                return False
        return True

    def _order(self, order: dict, kind: int) -> list:
        """kind 0 (ranks) or 1 (nodes): [(its newest seq, label)] for every expected label, least first."""
        got = order.get(kind)
        if got is None:
            newest = self.newest
            got = order[kind] = sorted((newest.get(lb, -1), lb) for lb in self.expected[kind]) or [(-1, "")]
        return got

    def _emit(self, e: Entry, out: list) -> None:
        text = e.text
        opens = self.open_node if e.rank is None else self.open_rank
        if opens.get(text) is e:
            del opens[text]
        label = e.shown_label(self.labels)
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

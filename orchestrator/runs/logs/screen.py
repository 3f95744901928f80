"""What the foreground shows of a run's lines. The files (runs/RUN/nodes/NODE.log byte for byte,
runs/RUN/ranks/rankN.log) and --json keep every line; this decides only what is printed.

- torch's `[rankN]: ` prefix (its excepthook's and its C++ warnings') is taken off: the label
  names the rank, and without it the same traceback from many ranks is the same text.
- A Python traceback is gathered whole per rank (`Block`) and folds as one piece: identical
  tracebacks of many ranks print once under their ranges (`node[1-3]/r[0-2]`), and one that
  arrives after its twin was printed is one line that refers to it.
- Identical lines from many ranks within FOLD_WINDOW_S print once under their node and rank
  ranges (runs/logs/fold.py LineFold).
- On a quiet node (runs/logs/follow.py quiet_nodes: stopped by clusterctl after another node failed) a
  traceback, C++ frames or torchrun's shutdown lines that are not a traceback already shown are
  counted, and told as one line.
- Noise is hidden, and said once with where it is kept (NOTES): c10d's "hostname of the client
  socket cannot be retrieved" (every node, every launch), torchrun's OMP_NUM_THREADS notice (every
  node with more than one process, every launch; torchrun's blank lines go with it) and its
  ChildFailedError report (the run's summary names the rank that failed and its exit code).
"""

from __future__ import annotations

import re
from typing import Callable

from orchestrator.runs.logs.fold import FOLD_WINDOW_S, LineFold

BLOCK_IDLE_S = 1.0  # a traceback with no new line for this long is complete
FOLD_FLUSH_S = 2.0  # a quiet node's folded lines with no new one for this long are told
REPORT_MAX = 200  # the most lines of a ChildFailedError report hidden, should its last rule not come

RANK_PREFIX = re.compile(r"\[rank\d+\]: ?")
C10D_HOSTNAME = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved")
# torchrun's log line that opens its ChildFailedError echo: `E1128 19:13:41.631000 9445 .../elastic/
# multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 9565) of binary: ...`
ELASTIC_FAILED = re.compile(r"^[EW]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/\S+\] failed \(exitcode")
CHILD_FAILED = re.compile(r"^\S*ChildFailedError:")
REPORT_RULE = "=" * 20
OMP_NOTICE = "Setting OMP_NUM_THREADS environment variable for each process"  # between two rules of *

# What ranks print while they go down: Python tracebacks, C++ frames, torchrun's own exceptions.
PY_TRACE = "Traceback (most recent call last)"
TRACE_START = re.compile(r"Traceback \(most recent call last\)|^Exception raised from |^frame #\d+|^#\d+ |"
                         r"SignalException|Failed to recv|Error waiting on exit barrier|^terminate called|"
                         r"^\S+ \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/")
TRACE_BODY = re.compile(r"^\s|^\^+$|^frame #\d+|^#\d+ |^Exception raised from |^$|^During handling of|"
                        r"^The above exception|^\S+ \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/|"
                        r"Traceback \(most recent call last\)")
# TRACE_START's words, looked for in a quiet node's whole poll of lines at once
QUIET_HINTS = ("Exception raised from ", "frame #", "SignalException", "Failed to recv", "Error waiting on exit barrier",
               "terminate called", "torch/distributed/elastic/")
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
    "omp": "[clusterctl: torchrun's notice that it set OMP_NUM_THREADS=1 for each process is not shown; {where} "
           "keeps it]",
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

    def lines(self, node: str, labels: list, texts: list, ranks: list, now: float, torchrun: bool = True,
              raw: str | None = None) -> None:
        """A node's lines from one poll (`torchrun`: some are torchrun's own, not a rank's; `raw`:
        the text they were read from, rank tags and all, when there is one). Plain ranks' lines
        (no rank prefix, traceback or noise among them, on a node that is not quiet or prints
        nothing a stopped rank does, with nothing open) go to the fold as one batch; otherwise
        line by line."""
        if torchrun or node in self.report or node in self.folded or \
                (self.blocks and any(w[0] == node for w in self.blocks)) or \
                (self.ended and any(w[0] == node for w in self.ended)):
            plain = False
        else:
            big = "\n".join(texts) if raw is None else raw  # `]:[rank`: torch's prefix behind a rank tag
            plain = ("[rank" not in big if raw is None else "]:[rank" not in big) and "[c10d]" not in big \
                and PY_TRACE not in big
            if plain and node in self.quiet:  # what a stopped rank prints while it goes down
                plain = not any(h in big for h in QUIET_HINTS) and big[:1] != "#" and "\n#" not in big \
                    and "]:#" not in big
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
        if (kind := hidden_kind(text)) is not None:
            return self.hide(node, kind, now)
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
        if not text.strip():  # torchrun's blank lines (its notices begin with one)
            return True
        if (text[:1] == "*" and text.strip("*") == "" and len(text) >= 20) or text.startswith(OMP_NOTICE):
            self.hide(node, "omp", now)
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

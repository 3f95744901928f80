"""`clusterctl watch [RUN]`: a run live, one row per node (or per rank with --ranks).

Every row says the node's state, its newest step, the step time, tokens/s where the log says,
how long since it was last heard, and the stall, hang and straggler flags (runs/liveview.py);
under the run's line, its goodput so far, the ETA toward a known last step and the largest
causes of badput (runs/goodput.py, read every GOODPUT_EVERY_S).
Everything shown is read on this machine (the run record, the per-rank log files), so a frozen
node never freezes the view; only a rank's stack is asked of its node, on a thread of its own
(`clusterctl stack`'s machinery). Keys: q quits (the run goes on), r switches nodes and ranks,
a rank's number then Enter shows its stack and last lines, Esc closes them. Not on a terminal
(or with --once) it prints the table once, and with --rank R that rank's stack and last lines.
The view ends with the run, with its summary line, and exits with the run's exit code.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from contextlib import contextmanager

import click

from orchestrator.cli import tables
from orchestrator.cli.runs import _summary, complete_run_ids, ensure_supervisor
from orchestrator.errors import EXIT_INTERRUPTED, ClusterctlError
from orchestrator.runs.goodput import Ledger, of_run
from orchestrator.runs.liveview import COLLECTIVES_NOTE, LiveView, Row
from orchestrator.runs.record import story
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.store import Run

STACK_WAIT_S = 10.0  # how long the rank's hook has to answer
LAST_LINES = 3  # a rank's last lines in its detail
STACK_LINES = 12  # its stack's lines: the innermost frames (80 x 24 leaves room for 3 nodes' rows)
GOODPUT_EVERY_S = 5.0  # the ledger reads the run's journal and story: not on every frame


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1e3:.0f}ms"
    return f"{s:.2f}s" if s < 60 else f"{s / 60:.1f}m"


def _ago(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f}s" if s < 90 else f"{s / 60:.0f}m" if s < 5400 else f"{s / 3600:.0f}h"


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x < 1e5 else f"{x / 1e3:,.0f}k" if x < 1e8 else f"{x / 1e6:,.0f}M"


def fit(rows: list[Row], room: int) -> tuple[list[Row], int]:
    """The rows that fit `room` lines: every flagged row, then the others in order; and how many
    were left out."""
    if len(rows) <= room:
        return rows, 0
    room = max(room, 1)
    flagged = {i for i, r in enumerate(rows) if r.flags}
    keep = set(sorted(flagged)[:room])
    keep |= set([i for i in range(len(rows)) if i not in keep][: room - len(keep)])
    return [r for i, r in enumerate(rows) if i in keep], len(rows) - len(keep)


def table(rows: list[Row], by_rank: bool):
    from rich.table import Table

    t = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False, header_style="bold")
    t.add_column("rank" if by_rank else "node", no_wrap=True)
    t.add_column("state", no_wrap=True)
    for name in ("step", "s/step", "tok/s", "heard"):
        t.add_column(name, no_wrap=True, justify="right")
    t.add_column("flags", no_wrap=True, overflow="ellipsis", ratio=1)
    for r in rows:
        flags = ", ".join(r.flags)
        t.add_row(r.name, r.state, r.progress, _secs(r.step_s), _rate(r.tokens_s),
                  _ago(r.heard_s), f"[bold red]{flags}[/]" if flags else "")
    return t


def stack_lines(text: str, room: int, width: int) -> list[str]:
    """`clusterctl stack`'s text (runs/judge/hang.py stacks_text) in at most `room` lines of `width`:
    each thread's innermost frames, the ones that say where it is, with the outer ones elided
    (main thread first, the others as room is left), its header and collectives kept; a frame's
    path cut from the left, so its line number and function stay."""
    head, threads, tail = [], [], []  # threads: [title, [frames: [line, code?]]]
    for line in text.splitlines():
        if line.startswith("  thread "):
            threads.append([line, []])
        elif threads and line.startswith("      ") and threads[-1][1]:
            threads[-1][1][-1].append(line)
        elif threads and line.startswith("    "):
            threads[-1][1].append([line])
        elif line.startswith("  collectives entered") or (threads and line.startswith("---- ")):
            tail.append(line)
        else:
            head.append(line)
    left = room - len(head) - len(tail)
    out_threads = []
    for title, frames in threads:
        if left < 2:
            break
        left -= 1
        shown: list = []
        for frame in reversed(frames):  # innermost first, while it and the elision line fit
            if len(frame) + (1 if len(frames) - len(shown) - 1 > 0 else 0) > left:
                break
            shown.insert(0, frame)
            left -= len(frame)
        elided = len(frames) - len(shown)
        if elided:
            left -= 1
        out_threads.append((title, elided, shown))
    out = list(head)
    for title, elided, shown in out_threads:
        out.append(title)
        if elided:
            out.append(f"    … {elided} outer frame{'s' if elided != 1 else ''}")
        out.extend(ln for frame in shown for ln in frame)
    out += tail
    return [_fit(ln, width) for ln in out[:room]]


def _fit(line: str, width: int) -> str:
    """A line cut to `width`: a frame's path from the left (`…/distributed_c10d.py:3252 in all_reduce`)."""
    if len(line) <= width:
        return line
    body = line.lstrip()
    indent = line[:len(line) - len(body)]
    if line.startswith("    ") and not line.startswith("      ") and " in " in body:
        keep = width - len(indent) - 1
        return indent + "…" + body[-keep:] if keep > 0 else line[:width]
    return line[:width - 1] + "…"


class StackAsk:
    """One rank's stack, asked of its node on a thread: `text` is what to show meanwhile and after."""

    def __init__(self, run: Run, rank: int, node: str | None):
        self.rank, self.node = rank, node
        self.done = threading.Event()
        self.text = f"asking {node} for rank {rank}'s stack…" if node else f"rank {rank} is not in this attempt"
        if node is None:
            self.done.set()
        else:
            threading.Thread(target=self._ask, args=(run,), daemon=True, name="stack").start()

    def _ask(self, run: Run) -> None:
        from orchestrator.cli.stack import take_stacks
        from orchestrator.runs.judge.hang import stacks_text

        try:
            rec = run.record
            a = rec.current
            if a is None or rec.state.terminal:
                self.text = f"the run has ended: {self.node} has no rank {self.rank} to ask"
                return
            snaps, _, unreachable = take_stacks(run, a, [self.node], [self.rank], STACK_WAIT_S)
            self.text = (stacks_text(snaps).rstrip() if snaps else
                         f"{self.node}: {unreachable.get(self.node) or f'no rank {self.rank} there now'}")
        except (ClusterctlError, OSError) as e:
            self.text = f"{self.node}: {e}"
        finally:
            self.done.set()


class Screen:
    """What the view holds between frames: the mode, the rank asked about, the story's last lines."""

    def __init__(self, run: Run, by_rank: bool):
        self.run, self.by_rank = run, by_rank
        self.view = LiveView(run.dir, run.spec.hang_timeout)
        self.typed = ""
        self.detail: StackAsk | None = None
        self.told: list[str] = []
        self.story_at = 0
        self.ledger: Ledger | None = None
        self.ledger_at = float("-inf")

    def look(self, rec: RunRecord) -> None:
        self.view.look(rec.nodes, rec.current)
        lines, self.story_at = story(self.run, self.story_at)
        self.told = (self.told + lines)[-2:]
        if time.monotonic() - self.ledger_at >= GOODPUT_EVERY_S or rec.state.terminal:
            self.ledger, self.ledger_at = of_run(self.run), time.monotonic()

    def goodput(self) -> str | None:
        """The header's second line: goodput so far, the ETA toward a known target, the largest badput."""
        lg = self.ledger
        if lg is None or lg.goodput is None or not any(s.launched for s in lg.shares):
            return None
        eta = tables.eta_words(lg)
        worst = ", ".join(f"{c} {tables.dur(v)}" for c, v in lg.largest(2))
        return f"goodput {lg.goodput:.2f}" + (f" · {eta}" if eta else "") + (f" · badput {worst}" if worst else "")

    def ask(self, rank: int) -> None:
        self.detail = StackAsk(self.run, rank, self.view.node_of(rank))

    def key(self, ch: str) -> bool:
        """One key; False to quit."""
        if ch in ("q", "Q"):
            return False
        if ch == "r":
            self.by_rank = not self.by_rank
        elif ch.isdigit():
            self.typed += ch
        elif ch in ("\r", "\n", "s") and self.typed:
            self.ask(int(self.typed))
            self.typed = ""
        elif ch in ("\x1b", "\x7f"):
            self.typed, self.detail = "", None if ch == "\x1b" else self.detail
        return True

    def render(self, rec: RunRecord, width: int, height: int, live: bool = True):
        from rich.console import Group
        from rich.text import Text

        a = rec.current
        head = Text(f"{self.run.id}: {rec.state}" + (f", attempt {a.attempt} of at most "
                    f"{tables.at_most(rec, self.run.spec.max_restarts)}" if a is not None else ""), style="bold", overflow="ellipsis", no_wrap=True)
        parts = [head]
        gp = self.goodput()
        if gp:
            parts.append(Text(gp, overflow="ellipsis", no_wrap=True))
        detail = self._detail(width) if self.detail else []
        told = [Text(f"clusterctl: {t}", overflow="ellipsis", no_wrap=True) for t in self.told]
        every = self.view.rows(self.by_rank, lambda s: tables.shown_state(s, rec))
        note = any(r.collectives is not None for r in every)
        room = height - 4 - len(detail) - len(told) - note - bool(gp) if live else 10**6
        rows, left = fit(every, room)
        parts.append(table(rows, self.by_rank))
        if note:
            parts.append(Text(COLLECTIVES_NOTE, style="dim", overflow="ellipsis", no_wrap=True))
        if left:
            parts.append(Text(f"… {left} more {'ranks' if self.by_rank else 'nodes'} (the flagged ones are shown)"))
        parts += told + detail
        if live:
            keys = "q quit · r " + ("nodes" if self.by_rank else "ranks") + " · a rank's number+Enter: its stack"
            parts.append(Text(keys + (f" · rank {self.typed}_" if self.typed else ""), style="dim",
                              overflow="ellipsis", no_wrap=True))
        return Group(*parts)

    def _detail(self, width: int) -> list:
        from rich.text import Text

        d = self.detail
        lines = [f"rank {d.rank}" + (f" on {d.node}" if d.node else "") + ": last lines"]
        lines += [f"  {ln}" for ln in self.view.last_lines(d.rank)[-LAST_LINES:]] + ["stack:"]
        lines += [f"  {ln}" for ln in stack_lines(d.text, STACK_LINES, width - 2)]
        return [Text(_fit(ln, width), no_wrap=True) for ln in lines]


@contextmanager
def _keys():
    """A function that waits up to `timeout` s for keys typed (cbreak: Ctrl-C still interrupts);
    one that only sleeps when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield lambda timeout: (time.sleep(timeout), "")[1]
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield lambda timeout: os.read(fd, 64).decode(errors="replace") if select.select([fd], [], [], timeout)[0] \
            else ""
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _live(screen: Screen, console, interval: float) -> bool:
    """Redraw until the run ends (True) or q (False)."""
    from rich.live import Live

    with _keys() as keys, Live(console=console, auto_refresh=False, screen=True, transient=True) as live:
        while True:
            rec = screen.run.record
            screen.look(rec)
            live.update(screen.render(rec, console.width, console.height), refresh=True)
            if rec.state.terminal:
                return True
            deadline = time.monotonic() + interval
            while (left := deadline - time.monotonic()) > 0:
                typed = keys(left)
                if typed and not all(screen.key(ch) for ch in typed):
                    return False
                if typed:
                    break


@click.command("watch")
@click.argument("run_id", required=False, shell_complete=complete_run_ids)
@click.option("--ranks", "by_rank", is_flag=True, help="One row per rank instead of one per node (key r).")
@click.option("--rank", type=click.IntRange(0), default=None,
              help="Show this rank's stack and last lines (asked of its node; interactively: its number, Enter).")
@click.option("--once", is_flag=True, help="Print the view once and return (what happens off a terminal).")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=1.0, show_default=True,
              help="Seconds between redraws.")
def watch_command(run_id, by_rank, rank, once, interval):
    """A run live (the latest by default): per node (or --ranks, per rank) its state, step, step
    time, tokens/s, when last heard, and stall, hang and straggler flags.

    q or Ctrl-C leaves the view; the run goes on. Ends with the run, with its summary line, and
    exits with the run's exit code (like tail)."""
    from rich.console import Console

    run = Run.find(run_id)
    ensure_supervisor(run)
    console = Console()
    screen = Screen(run, by_rank)
    screen.look(run.record)
    live = console.is_terminal and not once
    if rank is not None:
        screen.ask(rank)
    if live:
        try:
            ended = _live(screen, console, interval)
        except KeyboardInterrupt:
            ended = None
        if not ended:
            click.echo(f"clusterctl: stopped watching {run.id}; it keeps running (clusterctl tail {run.id} "
                       "follows its lines)", err=True)
            sys.exit(EXIT_INTERRUPTED if ended is None else 0)
    if rank is not None and not live:
        screen.ask(rank)  # now that the rank's node is known
        screen.detail.done.wait(STACK_WAIT_S + 60)
    rec = run.record
    screen.look(rec)  # after the stack's wait: the table says now, not when it was asked
    console.print(screen.render(rec, console.width, console.height, live=False))
    if rec.state.terminal or live:
        _summary(rec)
        code = rec.exit_code
        sys.exit(1 if code is None else int(code))


__all__ = ["watch_command"]

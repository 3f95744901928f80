"""The tables of `status` and `runs`, built from records alone (no clock, no node asked), so the
same records always render the same (tests/test_golden.py holds them at 80 and 120 columns).

Every row is one line whatever the width: the columns that cannot give way (a run id, a node
name, a state) never wrap, and a last line too long for the screen ends in `…`.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from rich.table import Table
from rich.text import Text

from orchestrator.runs.logs.follow import last_lines_offset
from orchestrator.runs.logs.rankfiles import RANK_TAG
from orchestrator.runs.logs.screen import job_text
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.spec import NodeState, NodeStatus, RunState

# torchrun's, c10d's and torch's own chatter (`W1124 20:13:59.129000 4242 torch/...`, `[W1128
# 19:22:04.564295190 reducer.cpp:1529] Warning: ...`): not the job's last word
_TORCH_LOG = re.compile(r"^[WIEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ |^\[[WIEF]\d+ |^\[c10d\]")
# torchrun's ChildFailedError report (`====`, `----`, `  exitcode  : 1 (pid: 9565)`): the summary says it
_REPORT = re.compile(r"^[=-]{20}|^\s*(?:time|host|rank|exitcode|error_file|traceback)\s*:|^Root Cause|^Failures:|"
                     r"^\[\d+\]:$|<NO_OTHER_FAILURES>| FAILED$|ChildFailedError")


def runtime(nd: NodeStatus, rec: RunRecord, now: float) -> str:
    start = rec.started
    if not start:
        return "-"
    s = int((nd.ended or rec.ended or now) - start)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def job_line(text: str) -> str | None:
    """A log line as the job said it (torch's `[rankN]: ` off, a progress bar's last update), or
    None when it is torchrun's, c10d's or torch's own chatter."""
    text = job_text(text.rsplit("\r", 1)[-1].strip()) or ""
    return text.strip() if text.strip() and not _TORCH_LOG.search(text) else None


def last_line(path: Path, first_rank: int | None, n: int = 40) -> str:
    """The job's last word on a node: the last line a rank wrote (`r5: step 40 | loss 2.1`), past
    torchrun's, c10d's and torch's warnings; else the last line torchrun wrote that is not its
    own chatter (a rank's tagged line never shows with its tag)."""
    try:
        with open(path, "rb") as f:
            f.seek(last_lines_offset(path, n))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    plain = ""
    for ln in reversed(lines):
        text, ranked = node_line(ln, first_rank)
        if ranked:
            return text
        plain = plain or text
    return plain


def node_line(line: str, first_rank: int | None) -> tuple[str, bool]:
    """A node log's line as `last line` shows it: (`r5: text` for a rank's, True), (torchrun's
    own that is not its chatter or its ChildFailedError report, False), ("", False) otherwise."""
    m = RANK_TAG.match(line.encode())
    text = job_line(line if m is None else line.encode()[m.end():].decode(errors="replace"))
    if text is None:
        return "", False
    if m is not None:
        return (f"r{first_rank + int(m.group(1))}: " if first_rank is not None else "") + text, True
    return ("" if _REPORT.search(text) else text), False


def at_most(rec: RunRecord, max_restarts: int) -> int:
    """The highest attempt number the run may reach: an attempt before the current one that never
    launched spent no restart (runs/controller.py), so the last number grows by one for each."""
    return max_restarts + 1 + sum(1 for a in rec.attempts[:-1] if not a.launched)


def shown_state(state: NodeState, rec: RunRecord) -> str:
    """A node torchrun left non-zero because the user stopped the run was stopped, not failed;
    one whose attempt ended before it launched there was never started, not still pending."""
    if state is NodeState.PENDING and rec.state.terminal:
        return "not started"
    by_user = rec.state is RunState.STOPPED or rec.teardown == "stop"
    return "stopped" if by_user and state is NodeState.FAILED else str(state)


def _table(title: str | None = None) -> Table:
    """No borders (two spaces between columns): a table's width is its cells'."""
    return Table(title=title, box=None, padding=(0, 1), pad_edge=False, title_justify="left",
                 header_style="bold", title_style="bold")


def one_line(text: str) -> Text:
    """A cell that never wraps: cut with `…` when its column is narrowed."""
    return Text(text, no_wrap=True, overflow="ellipsis")


def status_table(title: str, rows: list[tuple[str, ...]]) -> Table:
    """node, ranks, state, pid, exit, runtime, step, last line: one line per node. Only the last
    line's column gives way to a narrow screen."""
    t = _table(title)
    for c in ("node", "ranks", "state", "pid", "exit", "runtime", "step"):
        t.add_column(c, no_wrap=True, justify="right" if c in ("pid", "exit", "step") else "left")
    t.add_column("last line", min_width=9)
    for row in rows:
        t.add_row(*row[:-1], one_line(row[-1]))
    return t


def runs_table(recs: list[RunRecord]) -> Table:
    """run, state, tries (attempts), nodes, world, created (month-day time), exit: one line per run."""
    t = _table()
    # the id is what `tail`/`status`/`stop` take: never cut short, the other columns give way (they
    # wrap only on a screen too narrow for one line, which 80 columns is not)
    t.add_column("run", no_wrap=True, min_width=max((len(r.id) for r in recs), default=3))
    for c in ("state", "tries", "nodes", "world", "created", "exit"):
        t.add_column(c, justify="right" if c in ("tries", "nodes", "world", "exit") else "left")
    for rec in recs:
        created = time.strftime("%m-%d %H:%M", time.localtime(rec.created))
        t.add_row(rec.id, rec.state.value, str(len(rec.attempts) or "-"), str(len(rec.nodes)),
                  "-" if rec.world_size is None else str(rec.world_size), created,
                  "-" if rec.exit_code is None else str(rec.exit_code))
    return t


def dur(s: float | None) -> str:
    """Seconds as a person reads them: 0.4s, 12.3s, 4m05s, 2h03m."""
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def goodput_line(lg) -> str | None:
    """A run's goodput ledger (runs/goodput.py) in one line: the ratio, what it is of, the largest
    causes of badput and, while it runs toward a known target, the ETA. None before any launch."""
    if lg.goodput is None or not any(s.launched for s in lg.shares):
        return None
    causes = ", ".join(f"{c} {dur(v)}" for c, v in lg.largest(3))
    text = f"goodput {lg.goodput:.2f}: {dur(lg.productive_s)} productive of {dur(lg.wall_s)}"
    text += f"; badput {causes}" if causes else "; no badput"
    eta = eta_words(lg)
    return text + (f"; {eta}" if eta else "")


def eta_words(lg) -> str | None:
    """`step 340 of 1000, about 23m06s to go` (a live run with a known target), else None."""
    if lg.eta_s is None or lg.target is None:
        return None
    return f"step {lg.step} of {lg.target}, about {dur(lg.eta_s)} to go"

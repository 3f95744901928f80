"""Sync progress as events (planned, advanced, finished) to interchangeable sinks: nothing (the
`--json` mode), or a rich view with bytes, rate and ETA per node; plus the one-line summary."""

from __future__ import annotations


from orchestrator.node.wire import progress_of
from orchestrator.transfer import SyncReport, SyncResult


class SyncEvents:
    """The quiet sink; subclasses show what they like. Called from transfer threads."""

    def planned(self, node: str, method: str, total: int) -> None:
        pass

    def advanced(self, node: str, done: int) -> None:
        pass

    def finished(self, result: SyncResult) -> None:
        pass

    def step(self, node: str, what: str, nbytes: int | None) -> None:
        """A long step started on `node` (setup's install: its name and the bytes it handles);
        "done" when the node's command finished its steps."""

    def node_line(self, node: str, stream: str, line: str) -> None:
        """A line a node-side command wrote (the engine's on_line): its progress lines are steps."""
        got = progress_of(line) if stream == "stderr" else None
        if got is not None:
            self.step(node, *got)


class RichEvents(SyncEvents):
    """One bar per node: bytes received / expected, rate, time left."""

    def __init__(self, console):
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)

        from rich.progress import ProgressColumn
        from rich.table import Column
        from rich.text import Text

        class Bytes(ProgressColumn):  # a transfer's bytes, rate, time left; a step's bytes
            def __init__(self, *cols):
                super().__init__(table_column=Column(no_wrap=True))
                self.cols = cols

            def render(self, task):
                if task.fields.get("step"):
                    n = task.fields.get("nbytes")
                    return Text(f"{n / 1e6:,.1f} MB" if n else "")
                return Text(" ").join(c.render(task) for c in self.cols)

        self.progress = Progress(TextColumn("{task.description}", table_column=Column(
                                     no_wrap=True, overflow="ellipsis", max_width=30)), BarColumn(bar_width=10),
                                 Bytes(DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()),
                                 TimeElapsedColumn(), TextColumn("{task.fields[state]}"), console=console,
                                 transient=not console.is_terminal)
        self.tasks: dict[str, int] = {}
        self.steps: dict[str, int] = {}  # node -> its line for the install's steps

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def planned(self, node, method, total):
        self.tasks[node] = self.progress.add_task(f"{node} {method}", total=total or None, state="")

    def advanced(self, node, done):
        if node in self.tasks:
            self.progress.update(self.tasks[node], completed=done)

    def finished(self, result):
        task = self.tasks.get(result.node)
        if task is None:
            task = self.tasks[result.node] = self.progress.add_task(f"{result.node} {result.method}",
                                                                    total=None, state="")
        total = self.progress.tasks[task].total
        done = total if result.ok and total else result.bytes
        self.progress.update(task, completed=done, total=total or max(done, 1),
                             state="ok" if result.ok else "failed")

    def step(self, node, what, nbytes):
        """One line per node: the step now (its bytes, its time so far); each step restarts the clock."""
        task = self.steps.get(node)
        if task is None:
            task = self.steps[node] = self.progress.add_task(f"{node} {what}", total=None, state="", step=True)
        if what == "done":
            self.progress.update(task, description=f"{node} installed", total=1, completed=1, nbytes=None,
                                 state="ok")
        else:
            self.progress.reset(task, total=None, description=f"{node} {what}", nbytes=nbytes, state="", step=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def summary(report: SyncReport) -> str:
    """One line: what was shipped, how long it took, and what left this machine."""
    pushed = [r for r in report.results if r.ok and r.method != "skip"]
    rate = report.tree_bytes / report.seconds / 1e6 if report.seconds > 0 else 0.0
    ratio = f" ({report.bytes_sent / report.tree_bytes:.2f} x the files)" if report.tree_bytes else ""
    return (f"synced {report.files} files ({_mb(report.tree_bytes)}) to {len(pushed)}/"
            f"{len(report.results)} nodes in {report.seconds:.1f}s ({rate:.1f} MB/s per node); "
            f"{_mb(report.bytes_sent)} left this machine{ratio}")

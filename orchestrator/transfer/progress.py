"""Sync progress as events (planned, advanced, finished) to interchangeable sinks: nothing (the
`--json` mode), or a rich view with bytes, rate and ETA per node; plus the one-line summary."""

from __future__ import annotations

from orchestrator.transfer import SyncReport, SyncResult


class SyncEvents:
    """The quiet sink; subclasses show what they like. Called from transfer threads."""

    def planned(self, node: str, method: str, total: int) -> None:
        pass

    def advanced(self, node: str, done: int) -> None:
        pass

    def finished(self, result: SyncResult) -> None:
        pass


class RichEvents(SyncEvents):
    """One bar per node: bytes received / expected, rate, time left."""

    def __init__(self, console):
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[state]}"), console=console,
                                 transient=not console.is_terminal)
        self.tasks: dict[str, int] = {}

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

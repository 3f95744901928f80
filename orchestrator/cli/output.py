"""Output sinks for per-node lines (ClusterShell's event handlers, compose's log colors).

A line event is (label, stream, text).  `Prefixer` writes `label | text` whole,
one write per line (or per batch of lines, `many`) under a lock so lines from
different nodes never tear or merge; colors only when the output is a terminal.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Iterable

_COLORS = [36, 33, 32, 35, 34, 31, 96, 93, 92, 95, 94, 91]  # compose-like cycle


def use_color(stream: IO) -> bool:
    import os

    if os.environ.get("NO_COLOR"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Prefixer:
    """Print `label | line` with the labels padded to one width."""

    def __init__(self, labels: Iterable[str], out: IO | None = None, err: IO | None = None,
                 color: bool | None = None):
        labels = list(labels)
        self.width = max((len(x) for x in labels), default=0)
        self.out = out or sys.stdout
        self.err = err or self.out
        self.color = use_color(self.out) if color is None else color
        self._colors = {lab: _COLORS[i % len(_COLORS)] for i, lab in enumerate(labels)}
        self._lock = threading.Lock()

    def widen(self, label: str) -> None:
        self.width = max(self.width, len(label))

    def fmt(self, label: str, text: str, key: str | None = None) -> str:
        pad = label.ljust(self.width)
        if self.color:
            c = self._colors.setdefault(key or label, _COLORS[len(self._colors) % len(_COLORS)])
            return f"\x1b[{c}m{pad} |\x1b[0m {text}\n"
        return f"{pad} | {text}\n"

    def __call__(self, label: str, stream: str, text: str, key: str | None = None) -> None:
        line = self.fmt(label, text, key)
        target = self.err if stream == "stderr" else self.out
        with self._lock:
            target.write(line)
            target.flush()

    def many(self, lines: Iterable[tuple[str, str, str | None]]) -> None:
        """Several stdout lines in one write (a log poll's worth): the same text as one call each."""
        if self.color:
            text = "".join([self.fmt(label, line, key) for label, line, key in lines])
        else:
            width = self.width
            text = "".join([f"{label.ljust(width)} | {line}\n" for label, line, _ in lines])
        with self._lock:
            self.out.write(text)
            self.out.flush()

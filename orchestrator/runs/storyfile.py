"""The run's story on disk, runs/RUN/story.jsonl: one JSON line per thing clusterctl saw and did
(record.py `Book.tell` writes it; the foreground, `tail` and `watch` read it with `story`)."""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path

from orchestrator.runs.space import Space, write_all
from orchestrator.runs.store import Run

STORY = "story.jsonl"
UNTOLD_MAX = 10_000  # story lines kept in memory while the disk has no room (the oldest go first)


def add_line(path: Path, doc: dict, untold: deque[dict], space: Space | None) -> None:
    """Append `doc` behind the lines held in `untold` for want of room (the story keeps its order),
    or, the disk being full (`space`: runs/space.py), hold it there too."""
    if untold and space is not None and space.is_full:
        untold.append(doc)
        return
    try:
        append_lines(path, [*untold, doc])
        untold.clear()
    except OSError as e:
        if space is None or not space.full(e, "the run's story"):
            raise
        untold.append(doc)


def append_lines(path, docs: list[dict]) -> None:
    """Append one JSON line per doc, whole or not at all (a full disk must not leave half a line
    that the next line would be glued to)."""
    data = "".join(json.dumps(d) + "\n" for d in docs).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            with open(fd, "ab", buffering=0, closefd=False) as f:
                write_all(f, data)
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def story(run: Run, offset: int = 0) -> tuple[list[str], int]:
    """The story's lines from byte `offset` on (whole lines only) and the offset after them."""
    try:
        with open(run.dir / STORY, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    out = []
    for raw in data[:end].splitlines():
        try:
            out.append(str(json.loads(raw)["text"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out, offset + end

"""One log file per global rank: runs/RUN/ranks/rankN.log, written as the node logs' lines arrive.

The node log copies (runs/RUN/nodes/NODE.log) stay the byte-for-byte truth; this splits their
complete lines by the rank tag each worker's line writer puts in front (`[default<local>]:`,
runs/logs/follow.py) into one file per global rank (the node's first rank + the local rank), the tag
left out. At 64 nodes x 8 ranks, rank 0's file is the one place to read rank 0. Lines torchrun
itself prints carry no rank and stay in the node's log only.

Every line lands exactly once, also across a controller crash: `ranks/index.json` holds, for each
node, the offset in its copy up to which lines were split, and every rank file's size at that
moment; it is replaced atomically after a chunk, at most every SAVE_S (at 64 nodes x 8 ranks it
holds ~600 entries, and writing it after every node's chunk cost the supervisor ~0.5 % of a core).
A new splitter (the next attempt, or a supervisor that adopted the run) cuts each rank file back
to its recorded size and splits again from the recorded offsets, so lines written after the last
index are written once more, not twice.
A rank's file holds its lines from every attempt, in order.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import IO, Callable

RANK_TAG = re.compile(rb"^\[[A-Za-z_]+(\d+)\]:")  # a role name, then the local rank: torchrun's `[0]:` is not one
INDEX = "index.json"
SAVE_S = 1.0  # the index is written after a chunk once this long has passed since it last was: a
# crash re-splits at most what arrived since (cut back first, so never twice)


def rank_file(run_dir: Path, rank: int) -> Path:
    """Where global rank `rank`'s lines are kept."""
    return run_dir / "ranks" / f"rank{rank}.log"


class RankFiles:
    """Splits each node's new log bytes into the rank files; `first_rank[node]` places the
    node's local ranks (a node without one is not split)."""

    def __init__(self, run_dir: Path, node_logs: dict[str, Path], first_rank: dict[str, int | None],
                 on_line: Callable[[int, bytes], None] | None = None):
        self.dir = run_dir / "ranks"
        self.on_line = on_line  # (global rank, line) of each line as it arrives (not those split again)
        self.dir.mkdir(exist_ok=True)
        self.first_rank = first_rank
        self.clock = time.monotonic
        self.saved = float("-inf")  # when the index was last written (self.clock)
        self.files: dict[int, IO[bytes]] = {}
        self.partial: dict[str, bytes] = {name: b"" for name in node_logs}
        index = self._read_index()
        self.at: dict[str, int] = index.get("at", {})
        self.sizes: dict[str, int] = index.get("sizes", {})
        for path in self.dir.glob("rank*.log"):  # what was written after the last index is written again
            if path.stat().st_size > self.sizes.get(path.name, 0):
                os.truncate(path, self.sizes.get(path.name, 0))
        for name, path in node_logs.items():
            self._catch_up(name, path)
        self.save()

    def _read_index(self) -> dict:
        try:
            doc = json.loads((self.dir / INDEX).read_text())
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}

    def _catch_up(self, name: str, path: Path) -> None:
        """The node's copy from where the index left it (nothing on a first start)."""
        try:
            with open(path, "rb") as f:
                f.seek(self.at.get(name, 0))
                data = f.read()
        except FileNotFoundError:
            return
        self.at.setdefault(name, 0)
        self.feed(name, data, save=False)

    def _file(self, rank: int) -> IO[bytes]:
        f = self.files.get(rank)
        if f is None:
            f = self.files[rank] = open(rank_file(self.dir.parent, rank), "ab")
        return f

    def feed(self, node: str, data: bytes, save: bool = True) -> None:
        """`data` was just appended to `node`'s copy: its complete lines go to their ranks."""
        data = self.partial.get(node, b"") + data
        cut = data.rfind(b"\n") + 1
        self.partial[node] = data[cut:]
        first = self.first_rank.get(node)
        touched = set()
        for line in data[:cut].splitlines(keepends=True):
            m = RANK_TAG.match(line)
            if m is None or first is None:
                continue
            rank = first + int(m.group(1))
            self._file(rank).write(line[m.end():])
            touched.add(rank)
            if save and self.on_line is not None:
                self.on_line(rank, line[m.end():])
        for rank in touched:
            f = self.files[rank]
            f.flush()
            self.sizes[f"rank{rank}.log"] = f.tell()
        self.at[node] = self.at.get(node, 0) + cut
        if save and cut and self.clock() - self.saved >= SAVE_S:
            self.save()

    def save(self) -> None:
        self.saved = self.clock()
        tmp = self.dir / f"{INDEX}.tmp{os.getpid()}"
        try:
            tmp.write_text(json.dumps({"at": self.at, "sizes": self.sizes}))
            os.replace(tmp, self.dir / INDEX)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk leaves no half-written index behind
            raise

    def close(self) -> None:
        """Every rank file closed, also after a write failed (what it could not write is dropped:
        the next splitter writes it again from the index)."""
        for f in self.files.values():
            try:
                f.close()
            except OSError:
                pass
        self.files.clear()

"""A run's TensorBoard files on this machine: runs/RUN/tensorboard/, one TensorBoard run per run.

Every node's event files land in that one directory, by their path under the node's
CLUSTERCTL_TENSORBOARD_DIR, so `tensorboard --logdir runs/RUN/tensorboard` draws one curve per
scalar however many attempts and nodes wrote it:

- a restart's new master (another node, or the same one) writes a new file beside the old ones;
  TensorBoard reads a directory's files in name order (the writer names them by time, host and
  pid) and the trainer's `purge_step` drops the old file's steps past the checkpoint it resumed;
- two local nodes (`connection: local`) share one artifacts directory, so both streams carry the
  same file: a frame lands only at its offset, so its bytes are written once;
- `train --resume-from RUN` starts with RUN's files linked in (`carry_over`), so the resumed run
  continues RUN's curve instead of starting a second one.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from orchestrator.node.artifacts import Frames


def write_frames(data: bytes, root: Path) -> None:
    """Apply a poll's TensorBoard frames (node/artifacts.py Frames): each header names a file, the
    offset and how many bytes follow; a frame cut short is not written."""
    for head, body in Frames().feed(data):
        write_frame(head, body, root)


def write_frame(head: dict, body: bytes, root: Path) -> None:
    """One frame's bytes appended to root/REL when the file here ends at its offset."""
    rel = Path(head["rel"])
    if rel.is_absolute() or ".." in rel.parts:
        return
    dst = root / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "ab") as f:
        if f.tell() != head["offset"]:
            return  # out of step (a file rewritten on the node, or already written by a local twin)
        f.write(body)


class Curves:
    """runs/RUN/tensorboard/: every node's frames written into it, one writer at a time."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / "tensorboard"
        self.dir.mkdir(exist_ok=True)
        self._lock = threading.Lock()  # two local nodes' streams may carry the same file's frames

    def have(self) -> dict[str, int]:
        """Every event file here and its size: what a node's stream need not send again."""
        return {str(p.relative_to(self.dir)): p.stat().st_size for p in self.dir.rglob("*") if p.is_file()}

    def frame(self, head: dict, body: bytes) -> None:
        with self._lock:
            write_frame(head, body, self.dir)

    def frames(self, data: bytes) -> None:
        with self._lock:
            write_frames(data, self.dir)


def carry_over(from_run_dir: Path, to_run_dir: Path) -> int:
    """Link (else copy) a finished run's event files into a new run's directory, each at its path,
    so the new run continues the same curves. Returns how many files."""
    src, dst = from_run_dir / "tensorboard", to_run_dir / "tensorboard"
    n = 0
    for p in sorted(src.rglob("*")) if src.is_dir() else []:
        if not p.is_file() or p.is_symlink():
            continue
        target = dst / p.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, target)  # the ended run writes no more to it
        except OSError:
            shutil.copy2(p, target)
        n += 1
    return n

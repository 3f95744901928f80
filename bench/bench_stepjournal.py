"""What the goodput ledger costs: the step journal in the supervisor, and the ledger in `status`,
`watch` and the exporter.

    .venv/bin/python bench/bench_stepjournal.py [--lines 200000] [--repeat 3]

1. The supervisor splits every node's log into the rank files as it arrives (runs/logs/rankfiles.py);
   with the journal, each of rank 0's lines is also parsed for its step (runs/stepjournal.py).
   The same node log (the shipped trainer's lines: rank 0 a step line every step, rank 1 none) is
   split with and without the journal, in chunks as a stream delivers them: the CPU per line, and
   the ratio.
2. The ledger of a week-long attempt: a journal as thinned for 7 days of a step every 50 ms, with a
   lost node and a restart; the time `goodput.of_dir` takes (what `status` spends, and `watch`
   every 5 s), and the journal's size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from orchestrator.runs import goodput
from orchestrator.runs.logs.rankfiles import RankFiles
from orchestrator.runs.stepjournal import StepJournal

LINE = ("[default0]:step {s} | loss 2.123456 | lr 3.000e-04 | tok/s 12,345 | mfu n/a | step 52 ms\n"
        "[default1]:[W1128 21:19:15.290247033 reducer.cpp:1400] Warning: a rank 1 line\n")


def split(log: bytes, journal: bool, chunk: int = 64 << 10) -> float:
    """CPU seconds to split `log` into rank files, in stream-sized chunks."""
    d = Path(tempfile.mkdtemp())
    try:
        (d / "nodes").mkdir()
        src = d / "nodes" / "node1.log"
        src.write_bytes(b"")
        j = StepJournal(d, 1) if journal else None
        rf = RankFiles(d, {"node1": src}, {"node1": 0}, on_line=j.rank_line if j else None)
        t0 = time.process_time()
        for i in range(0, len(log), chunk):
            rf.feed("node1", log[i:i + chunk])
        if j:
            j.close()
        rf.close()
        return time.process_time() - t0
    finally:
        shutil.rmtree(d)


def week(d: Path) -> None:
    """A run directory: attempt 1 a week of steps every 50 ms through the journal, then a lost node
    and attempt 2 from the step 50 before the fault."""
    (d / "progress").mkdir(parents=True)
    j = StepJournal(d, 1)
    t0, step_s, n = 1.8e9, 0.05, int(7 * 86400 / 0.05)
    for s in range(0, n, 7):  # every 7th step, so the loop ends: the thinning keeps far fewer
        j.log.note(s, t0 + s * step_s)
    j.close()
    end = t0 + n * step_s
    rec = {"id": "week", "state": "finished", "created": t0 - 60, "ended": end + 600, "attempt": 2, "attempts": [
        {"attempt": 1, "key": "week", "nodes": ["n1", "n2"], "started": t0 - 50, "launched": t0 - 30,
         "failed_at": end + 10, "ended": end + 12, "verdict": "node lost", "bad_nodes": ["n2"]},
        {"attempt": 2, "key": "week.a2", "nodes": ["n1", "n3"], "started": end + 12, "launched": end + 40,
         "ended": end + 590, "verdict": "finished", "checkpoint": f"ckpt_{n - 50:08d}.pt"}]}
    (d / "run.json").write_text(json.dumps(rec))
    (d / "story.jsonl").write_text(json.dumps({"at": end + 9, "text": "n2 lost: no answer for 9.0s", "lost": "n2",
                                               "silent_s": 9.0}) + "\n")
    j2 = StepJournal(d, 2)
    for k in range(0, 10000):
        j2.log.note(n - 50 + k, end + 60 + k * step_s)
    j2.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    log = "".join(LINE.format(s=s) for s in range(a.lines // 2)).encode()
    plain = [split(log, False) for _ in range(a.repeat)]
    journaled = [split(log, True) for _ in range(a.repeat)]
    per = 1e6 / a.lines
    print(f"split {a.lines:,} lines ({len(log) / 1e6:.1f} MB), median of {a.repeat}: without the journal "
          f"{statistics.median(plain) * per:.2f} us/line, with it {statistics.median(journaled) * per:.2f} us/line: "
          f"ratio {statistics.median(journaled) / statistics.median(plain):.2f} "
          f"(+{(statistics.median(journaled) - statistics.median(plain)) * 2e6 / a.lines:.2f} us per rank-0 line)")
    d = Path(tempfile.mkdtemp())
    try:
        week(d)
        size = sum(p.stat().st_size for p in (d / "progress").glob("*.jsonl"))
        points = sum(len(p.read_text().splitlines()) for p in (d / "progress").glob("*.jsonl"))
        took = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            lg = goodput.of_dir(d)
            took.append(time.perf_counter() - t0)
        print(f"a week of steps every 50 ms: journal {points:,} points, {size / 1e6:.2f} MB; the ledger in "
              f"{statistics.median(took) * 1e3:.0f} ms (median of {a.repeat}); goodput {lg.goodput:.4f}, "
              f"recompute {lg.badput['recompute']:.2f} s (50 steps x {lg.shares[0].step_s:.3f} s)")
    finally:
        shutil.rmtree(d)


if __name__ == "__main__":
    main()

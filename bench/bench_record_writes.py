"""A teardown's node ends through the run record, before and after they were coalesced, in one run.

    .venv/bin/python bench/bench_record_writes.py [64 256] [--repeat 3] [--dir DIR]

Control side only, no cluster: a run record of N nodes, attempt 1 running on all of them (the
real Book and AttemptRunner in a run directory under DIR, default a temporary one), then every
node ends in one burst, handed in as the log copies' loop hands a node's end
(AttemptRunner.node_ended with the status its stream closed with; a stop was asked, so no node is
the first failure). "before": each end written at once (`nodes_changed(later=False)`, the path
every node end took before: the whole record, JSON, fsync); "after": as the product does now
(`later=True`: marked, then one write by the flush).

  writes       run.json writes for the burst
  loop held    seconds the burst's calls took on the calling thread: the log copies' loop, which
               reads no stream meanwhile
  on disk      burst start -> every node's end written (after: the burst, then its flush, timed
               directly rather than waiting for the flush's timer)

Medians of --repeat; each figure with its ratio before/after. No assertions on seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from orchestrator.runs import record  # noqa: E402
from orchestrator.runs.attempt import AttemptRunner  # noqa: E402
from tests.recordrun import end, running  # noqa: E402 - the run of N nodes the tests count over too


def burst(n: int, later: bool, k: int) -> dict:
    run, book, runner = running(n, stop_requests=1, run_id=f"r-{n}-{k}-{'after' if later else 'before'}")
    writes = []
    real = record.write_json
    record.write_json = lambda path, doc, *a, **k: (writes.append(path.name), real(path, doc, *a, **k))[1]
    if not later:
        runner.save = lambda later=False: AttemptRunner.save(runner, later=False)
    try:
        t0 = time.perf_counter()
        for i, name in enumerate(runner.statuses):
            end(runner, name, 0 if i % 2 else 143, 100.0 + i)
        held = time.perf_counter() - t0
        book.flush()
        on_disk = time.perf_counter() - t0
    finally:
        record.write_json = real
    assert all(nd.exit_code is not None for nd in run.record.nodes), "a node's end missing on disk"
    return {"writes": writes.count("run.json"), "held": held, "on_disk": on_disk}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=int, default=[64, 256])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="where the run records go (default: a temporary directory)")
    args = ap.parse_args(argv)
    os.environ["CLUSTERCTL_HOME"] = args.dir or tempfile.mkdtemp(prefix="bench-record-")
    print(f"records under {os.environ['CLUSTERCTL_HOME']}; median of {args.repeat}")
    print(f"{'N':>5} {'writes before':>14} {'after':>6} {'loop held before':>17} {'after':>9} {'ratio':>7} "
          f"{'on disk before':>15} {'after':>9} {'ratio':>7}")
    for n in args.sizes:
        got = {later: [burst(n, later, k) for k in range(args.repeat)] for later in (False, True)}
        med = {later: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for later, rs in got.items()}
        b, a = med[False], med[True]
        print(f"{n:>5} {b['writes']:>14.0f} {a['writes']:>6.0f} {b['held']:>16.3f}s {a['held']:>8.4f}s "
              f"{b['held'] / a['held']:>6.0f}x {b['on_disk']:>14.3f}s {a['on_disk']:>8.4f}s "
              f"{b['on_disk'] / a['on_disk']:>6.0f}x")


if __name__ == "__main__":
    main()

"""Does a rank forked from the warm interpreter step as fast as a cold one?

    sudo .venv/bin/python bench/bench_warm_steps.py [--trials 2] [--steps 4000]

3 test nodes, the trainer (preset nano, one rank a node, a checkpoint every 50 steps),
`--max-restarts 1`. Once steps flow (and, warm, once every node holds its warm interpreter) and
40 s more, node3's rank gets SIGKILL; the run restarts and finishes. Printed per trial: the median
of the trainer's own `step N ms` over attempt 1's last 600 steps (cold) and over attempt 2 after
its first 50 (the restart), and their ratio. Warm (the default) and `--no-warm` alternate, --trials
times each, so a cold restart is the control: it shows how much a restart's steps differ from the
first attempt's when nothing is forked. Every node shares this machine's cores. No assertions:
this prints figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import STEP, record, start_nano, stop_by_id, text_of, training_process, wait_for  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402


def step_ms(data: bytes) -> list[int]:
    """Each step line's own step time (ms), in log order."""
    return [int(m[2]) for line in data.decode(errors="replace").splitlines() if (m := STEP.match(text_of(line)))]


def trial(warm: bool, steps: int) -> tuple[float, float]:
    """(attempt 1's median step ms, attempt 2's) for one run."""
    with TestCluster(n=3, gpus=0, name_prefix="ccws") as cluster, tempfile.TemporaryDirectory() as td:
        proc, log = start_nano(cluster, Path(td), steps, warm)
        run_dir = log.parent.parent
        try:
            time.sleep(40)
            cut = len(log.read_bytes())
            victim = wait_for(lambda: training_process(cluster, cluster.nodes[2]), 30, "node3's rank")
            os.kill(victim.pid, signal.SIGKILL)
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:  # it did not end by itself: stopped by its id, not left training
                stop_by_id(Path(td) / "home", proc)
        data = log.read_bytes()
        verdicts = [a.get("verdict") for a in record(run_dir).get("attempts") or []]
        if verdicts != ["killed by signal", "finished"]:
            raise SystemExit(f"bench: the run did not restart once and finish: {verdicts}")
        first = step_ms(data[:cut])[-600:]
        second = step_ms(data[cut:])[50:]
        return statistics.median(first), statistics.median(second)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=2, help="runs each way, alternating")
    ap.add_argument("--steps", type=int, default=4000)
    args = ap.parse_args(argv)
    ratios: dict[str, list[float]] = {"warm": [], "cold": []}
    for i in range(args.trials):
        for way in ("warm", "cold"):
            a1, a2 = trial(way == "warm", args.steps)
            ratios[way].append(a2 / a1)
            print(f"trial {i + 1} {way}: attempt 1 (cold) median {a1:g} ms a step, attempt 2 ({way}) {a2:g} ms: "
                  f"{a2 / a1:.2f}x", flush=True)
    for way, r in ratios.items():
        print(f"{way} restart: attempt 2 / attempt 1 step time, median of {len(r)}: {statistics.median(r):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

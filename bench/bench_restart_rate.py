"""How fast does a run step after a restart, warm and cold, against its own first attempt?

    sudo .venv/bin/python bench/bench_restart_rate.py [--nodes 5] [--trials 1] [--window 60] [--perf] [--threads]

`--nodes` test nodes, the trainer (preset nano, one rank a node, a checkpoint every 50 steps),
`--max-restarts 1`. Once steps flow (and, warm, once every node holds its warm interpreter), the
bench counts node1's steps and the ranks' CPU over `--window` seconds; it then kills the last
node's rank with SIGKILL and, 35 s into the restart, counts again over two windows. Printed per
run: steps/s and the ranks' CPU per step (ms, every rank summed) in each window, and attempt 2
against attempt 1. Warm (the default) and `--no-warm` alternate, so the cold restart is the
control. Where `bench/bench_warm_steps.py` compares the trainer's own step times, this counts
steps over wall time, which is what the goodput bench's 13 % gap was measured in. Every node
shares this machine's cores. `--perf` also counts each window with `perf stat` (software events:
page faults, context switches; this machine's VM has no hardware counters); `--threads` splits each
window's CPU per step by the ranks' thread names, so a window where every thread grew together
(this machine slower, not a part of the rank) shows as such. No assertions: this prints figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import STEP, record, start_nano, stop_by_id, text_of, training_process, wait_for  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402


def last_step(log: Path) -> int:
    """The newest step line's step in the log's last 4 KB (0 before the first)."""
    for line in reversed(log.read_bytes()[-4000:].decode(errors="replace").splitlines()):
        if m := STEP.match(text_of(line)):
            return int(m[1])
    return 0


def ranks_cpu(cluster) -> float:
    """CPU seconds used so far by the process training on each node (the fork, where warm)."""
    total = 0.0
    for node in cluster.nodes:
        p = training_process(cluster, node)
        if p is not None:
            t = p.cpu_times()
            total += t.user + t.system
    return total


PERF_EVENTS = "task-clock,page-faults,context-switches,cpu-migrations"  # software ones: VMs lack the rest


def perf_counts(pids: list[int], seconds: float) -> subprocess.Popen:
    """`perf stat` of the ranks' processes for `seconds` (CSV on stderr): what a step costs beside
    CPU, the page faults (a fork's copy-on-write) and the context switches."""
    return subprocess.Popen(["perf", "stat", "-x", ",", "-e", PERF_EVENTS, "-p", ",".join(map(str, pids)),
                             "--", "sleep", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def perf_read(proc: subprocess.Popen, steps: int) -> str:
    """Each counter per step, from perf stat's CSV."""
    err = proc.communicate(timeout=120)[1]
    got = []
    for line in err.splitlines():
        f = line.split(",")
        if len(f) > 2 and f[2] in PERF_EVENTS.split(","):
            try:
                got.append(f"{f[2]} {float(f[0]) / max(1, steps):.1f}{f[1] or ''}/step")
            except ValueError:
                got.append(f"{f[2]} {f[0]}")
    return ", ".join(got) or err.strip()[-300:]


def thread_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of the ranks' threads, summed by thread name (psutil's times per thread;
    the name from /proc/PID/task/TID/comm, which psutil does not give)."""
    got: dict[str, float] = {}
    for pid in pids:
        try:
            threads = psutil.Process(pid).threads()
        except psutil.Error:
            continue
        for t in threads:
            try:
                name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
            except OSError:
                continue  # ended meanwhile
            got[name] = got.get(name, 0.0) + t.user_time + t.system_time
    return got


def by_thread(before: dict[str, float], after: dict[str, float], steps: int) -> str:
    """Each thread name's CPU ms per step of one rank over a window, the busiest first."""
    used = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return ", ".join(f"{k} {v / max(1, steps) * 1e3:.2f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1])
                     if v > 0)


def window(cluster, log: Path, seconds: float, perf: bool = False, threads: bool = False) -> tuple[float, float, str]:
    """(steps/s, the ranks' CPU ms per step, perf's counters and the threads' CPU per step where
    asked) over `seconds`."""
    pids = [p.pid for p in (training_process(cluster, n) for n in cluster.nodes) if p is not None]
    s0, c0, t0, th0 = last_step(log), ranks_cpu(cluster), time.monotonic(), thread_cpu(pids) if threads else {}
    counting = perf_counts(pids, seconds) if perf else None
    time.sleep(seconds)
    s1, c1, dt = last_step(log), ranks_cpu(cluster), time.monotonic() - t0
    counts = perf_read(counting, (s1 - s0) * len(pids)) if counting else ""  # per step of one rank
    if threads:  # per step of one rank, too
        split = by_thread(th0, thread_cpu(pids), (s1 - s0) * len(pids))
        counts = "; ".join(filter(None, [counts, f"threads (ms/step): {split}"]))
    return (s1 - s0) / dt, (c1 - c0) / max(1, s1 - s0) * 1e3, counts


def trial(warm: bool, nodes: int, seconds: float, perf: bool = False, threads: bool = False) -> tuple[tuple, list[tuple]]:
    """(attempt 1's window, attempt 2's two windows) for one run."""
    with TestCluster(n=nodes, gpus=0, name_prefix="ccrr") as cluster, tempfile.TemporaryDirectory() as td:
        proc, log = start_nano(cluster, Path(td), 1_000_000, warm)
        run_dir = log.parent.parent
        try:
            time.sleep(10)
            first = window(cluster, log, seconds, perf, threads)
            victim = wait_for(lambda: training_process(cluster, cluster.nodes[-1]), 30, "the last node's rank")
            os.kill(victim.pid, signal.SIGKILL)
            wait_for(lambda: len(record(run_dir).get("attempts") or []) >= 2, 120, "attempt 2")
            time.sleep(35)
            second = [window(cluster, log, seconds, perf, threads) for _ in range(2)]
        finally:
            stop_by_id(Path(td) / "home", proc)
        return first, second


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--trials", type=int, default=1, help="runs each way, alternating")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per measuring window")
    ap.add_argument("--perf", action="store_true", help="also count each window with `perf stat` "
                    f"({PERF_EVENTS}, per step of one rank)")
    ap.add_argument("--threads", action="store_true", help="also print each window's CPU per step by the "
                    "ranks' thread names (the training thread, gloo's, the hook's, the checkpoint writer's)")
    args = ap.parse_args(argv)
    if args.perf and shutil.which("perf") is None:
        ap.error("--perf needs perf(1) (Debian: apt-get install linux-perf)")
    for i in range(args.trials):
        for way in ("warm", "cold"):
            (r1, c1, p1), second = trial(way == "warm", args.nodes, args.window, args.perf, args.threads)
            if p1:
                print(f"trial {i + 1} {way}: attempt 1: {p1}", flush=True)
            for k, (r2, c2, p2) in enumerate(second, 1):
                print(f"trial {i + 1} {way}: attempt 1 {r1:.2f} steps/s, {c1:.1f} ms CPU a step; attempt 2 "
                      f"(window {k}) {r2:.2f} steps/s, {c2:.1f} ms: {r2 / r1:.2f}x the rate, {c2 / c1:.2f}x the CPU",
                      flush=True)
                if p2:
                    print(f"trial {i + 1} {way}: attempt 2 (window {k}): {p2}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

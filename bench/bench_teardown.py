"""A teardown timed on the nodes: kill one rank, then when each node got the stop, ended, and was clean.

    sudo .venv/bin/python bench/bench_teardown.py [64] [--trials 3] [--shared-proc]

One test cluster of N nodes x 8 ranks with the torchrun stand-in (bench/bench_scale.py's), on which
`clusterctl train` is launched --trials times; each time, once every rank is up, the last rank is
SIGKILLed and these are taken, in seconds after the kill:

  decided    the supervisor's "failed first" in the run's story (this machine's clock)
  stop at    each node's stop marker (RUNDIR/stop, "at": when the node took the stop), min/median/max
  ended      each node's torchrun reaped by its waiter (RUNDIR/ended)
  exit code  each node's exit code written (RUNDIR/exit_code's mtime)
  clean      no process carrying the run's key left on any node (bench_scale.py gone_everywhere)
  train exit the foreground `train`'s exit

Each test node has its own PID namespace (as in bench_scale.py); --shared-proc for the harness
before 2026-12-01, where every node's /proc shows every node's processes. Node-side times are read
from the nodes' run directories through their homes on this machine, after the run.
No assertions on seconds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale as bs  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"


def node_times(cluster, run_id: str, t0: float) -> dict[str, list[float]]:
    """Each node's stop marker, torchrun's end and exit code, in s after `t0` (this machine's clock)."""
    out: dict[str, list[float]] = {"stop at": [], "ended": [], "exit code": []}
    for nd in cluster.nodes:
        for d in glob.glob(str(nd.home / ".clusterctl" / "node-runs" / f"{run_id}*")):
            try:
                out["stop at"].append(json.loads(Path(d, "stop").read_text())["at"] - t0)
            except (OSError, ValueError, KeyError):
                pass  # the node that failed first may have ended before any stop reached it
            try:
                out["ended"].append(float(Path(d, "ended").read_text()) - t0)
                out["exit code"].append(os.path.getmtime(Path(d, "exit_code")) - t0)
            except (OSError, ValueError):
                pass
    return out


def trial(cluster, inv: Path, home: Path, world: int) -> dict:
    for old in (home / "runs").glob("*") if (home / "runs").exists() else ():
        shutil.rmtree(old)
    fg = bs.Foreground(inv, home, world)
    try:
        first = fg.wait_all_up(240)
        run_dir = next((home / "runs").glob("*/run.json")).parent
        time.sleep(3)
        pid = bs.rank_pid(run_dir.name, world - 1)
        wall0, t0 = time.time(), time.monotonic()
        os.kill(pid, signal.SIGKILL)
        if not bs.gone_everywhere(run_dir.name, time.monotonic() + 180):
            raise SystemExit("bench: not clean 180 s after the kill; left: " + "; ".join(bs.left_of(run_dir.name)))
        clean = time.monotonic() - t0
        fg.proc.wait(180)
        exited = time.monotonic() - t0
    finally:
        if fg.proc.poll() is None:
            fg.proc.kill()
    story = [json.loads(line) for line in (run_dir / "story.jsonl").read_text().splitlines()]
    decided = next((s["at"] - wall0 for s in story if "failed first" in s["text"]), None)
    return {"first line s": first, "decided s": decided, **node_times(cluster, run_dir.name, wall0),
            "clean s": clean, "train exit s": exited}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("nodes", type=int, nargs="?", default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--shared-proc", action="store_true", help="every node's /proc shows every node's processes")
    args = ap.parse_args(argv)
    world = args.nodes * bs.RANKS_PER_NODE
    with TestCluster(n=args.nodes, gpus=bs.RANKS_PER_NODE, name_prefix="cctd", own_pids=not args.shared_proc) \
            as cluster, tempfile.TemporaryDirectory(prefix="bench-teardown-") as td:
        bs.make_workdirs(cluster)
        env = {"CLUSTERCTL_STANDIN_TICK": "5", "OMP_NUM_THREADS": "1", "CLUSTERCTL_STANDIN_BURST": "1"}
        inv = bs.standin_inventory(cluster, Path(td) / "nodes.yaml", cluster.inventory()["nodes"], env)
        print(f"bench_teardown: {args.nodes} nodes x {bs.RANKS_PER_NODE} ranks (stand-in), "
              f"{'shared /proc' if args.shared_proc else 'each node its own /proc'}; s after the kill, "
              "node columns min / median / max", flush=True)
        for k in range(args.trials):
            r = trial(cluster, inv, Path(td) / "home", world)
            print(f"trial {k + 1}: first line {r['first line s'] or float('nan'):.2f}; decided "
                  f"{r['decided s'] if r['decided s'] is not None else float('nan'):.2f}; stop at {spread(r['stop at'])}; "
                  f"ended {spread(r['ended'])}; exit code {spread(r['exit code'])}; clean {r['clean s']:.2f}; "
                  f"train exit {r['train exit s']:.2f}", flush=True)


if __name__ == "__main__":
    main()

"""The first launch with the warm interpreters (the default) against --no-warm: one import of torch
on a node, or 2 + nproc of them.

    sudo .venv/bin/python bench/bench_warm_launch.py [--rounds 3] [--nodes 3] [--nproc 2] [--steps 20]

Each round runs the same job twice on the same test cluster, alternating which arm goes first:
`clusterctl train --max-restarts 1` (the warm interpreters exist for restarts; since 2026-12-02
the first attempt's nodes get theirs right before its launch and its torchrun and ranks fork from
them, runs/warmpool.py `before_launch`) and the same with `--no-warm` (every process imports torch
itself, the old way of the first attempt). The job is the shipped trainer (preset nano, a step line
each step). Printed per run and as medians with the ratio:

  first step   the train command → the master's first step line, as it reached the run directory
  run          the train command → its exit
  CPU          this machine's busy CPU-seconds over the run (/proc/stat: every node shares these
               cores, so this is the nodes' processes, the supervisor and the command together)
  forked       whether every node's torchrun of attempt 1 was forked (its torchrun.fork note)

No assertions: this prints figures. The test nodes share this machine's cores, so on a node of
its own the imports beside each other would cost wall time only where they share cores or a disk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.harness import STEP, LogClock, end_supervisor, record, run_dir_of, start  # noqa: E402
from bench.harness import text_of as _text  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402


def busy_cpu_s() -> float:
    """This machine's busy CPU-seconds since boot (/proc/stat: user, nice, system, irq, softirq, steal)."""
    import os

    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def one_run(cluster, td: Path, label: str, warm: bool, steps: int, nproc: int) -> dict:
    home = td / f"home-{label}"
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    inv = cluster.write_inventory(td / f"{label}.yaml", checks={"disk_min_gb": 0.1}, output_dir="out",
                                  env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                                  train={"module": "trainer", "max_restarts": 1, "nproc_per_node": nproc,
                                         "args": ["--preset", "nano", "--max-steps", str(steps), "--batch-size",
                                                  "2", "--block-size", "32", "--log-every", "1", "--ckpt-every",
                                                  "1000", "--eval-steps", "1", "--sample-tokens", "0",
                                                  "--output-dir", "out"]})
    cpu0, t0 = busy_cpu_s(), time.time()
    proc = start(home, "train", "-i", str(inv), *([] if warm else ["--no-warm"]))
    try:
        run_dir = run_dir_of(home)
        clock = LogClock(run_dir / "nodes")
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    t_end, cpu1 = time.time(), busy_cpu_s()
    clock.stop()
    rec = record(run_dir)
    end_supervisor(rec)
    if proc.returncode != 0:
        raise SystemExit(f"bench: the {label} run failed (exit {proc.returncode}):\n{err[-3000:]}")
    master = rec["attempts"][0]["nodes"][0]
    t_step = next(t for t, s in clock.lines[master] if STEP.match(_text(s)))
    forked = all(nd.run(f"test -s ~/.clusterctl/node-runs/{run_dir.name}@{nd.name}/torchrun.fork",
                        check=False).returncode == 0 for nd in cluster.nodes)
    return {"first step": t_step - t0, "run": t_end - t0, "CPU": cpu1 - cpu0, "forked": forked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2, help="ranks per node")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    got: dict[bool, list[dict]] = {True: [], False: []}
    print(f"{args.nodes} test nodes x {args.nproc} ranks, the trainer (nano) for {args.steps} steps, "
          f"--max-restarts 1; {args.rounds} rounds, arms alternated", flush=True)
    with TestCluster(n=args.nodes, gpus=0, name_prefix="ccwl") as cluster, tempfile.TemporaryDirectory() as td:
        for i in range(args.rounds):
            for warm in (True, False) if i % 2 == 0 else (False, True):
                name = "warm" if warm else "cold"
                r = one_run(cluster, Path(td), f"{name}{i}", warm, args.steps, args.nproc)
                got[warm].append(r)
                print(f"  round {i + 1} {name} (--{'' if warm else 'no-'}warm): first step {r['first step']:.2f} s, "
                      f"run {r['run']:.2f} s, CPU {r['CPU']:.1f} s, torchrun forked on every node: {r['forked']}",
                      flush=True)
    for k, unit in (("first step", "s"), ("run", "s"), ("CPU", "CPU-s")):
        w, c = (statistics.median(r[k] for r in got[x]) for x in (True, False))
        print(f"{k}, median of {args.rounds}: warm {w:.2f} {unit}, --no-warm {c:.2f} {unit}: {w / c:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

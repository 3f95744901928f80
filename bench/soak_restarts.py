"""Restarts in a row: the master cut for good, a spare takes its place, N trials, each on a fresh cluster.

    sudo .venv/bin/python bench/soak_restarts.py [--trials 5] [--victim 1] [--steps 150]

Each trial: 5 test nodes (node5 `spare: true`, never used before), the shipped trainer with its
defaults (its out/ inside the workdir), the fast preflight on, `--max-restarts 1 --lost-timeout 5`.
Once a checkpoint is home, the victim's link is cut for good. Printed per trial: the exit code, the
attempts with their verdicts and nodes, the checkpoint attempt 2 started from, and any
`.partial` staging directory left in the control machine's copies. Then: completions out of N.
This is the soak the run loop must pass every time; a single trial is in the test suite
(tests/test_restarts_cluster.py), five in a row are too slow for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery import run_dir_of, start, wait_for, write_inventory  # noqa: E402

from tests.cluster import TestCluster  # noqa: E402


def trial(victim: int, steps: int) -> dict:
    with TestCluster(n=5, gpus=0, name_prefix="ccsk") as cluster, tempfile.TemporaryDirectory() as td:
        home = Path(td) / "home"
        inv = write_inventory(cluster, Path(td) / "nodes.yaml", spare=True, train={
            "module": "trainer", "max_restarts": 1,
            "args": ["--preset", "nano", "--max-steps", str(steps), "--batch-size", "2", "--block-size", "32",
                     "--log-every", "1", "--ckpt-every", "10", "--eval-steps", "1", "--sample-tokens", "0"]})
        t0 = time.monotonic()
        proc = start(home, "train", "-i", inv, "--lost-timeout", "5")
        try:
            run_dir = run_dir_of(home)
            wait_for(lambda: list((run_dir / "checkpoints").glob("ckpt_*.pt")) or proc.poll() is not None, 300,
                     "a checkpoint on the control machine")
            cluster.nodes[victim - 1].link_down()
            _, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        rec = json.loads((run_dir / "run.json").read_text())
        partial = [p.name for p in (run_dir / "checkpoints").glob(".*partial*")]
        return {"exit": proc.returncode, "seconds": time.monotonic() - t0, "partial": partial,
                "attempts": [(a["attempt"], a.get("verdict"), a["nodes"], a.get("checkpoint"))
                             for a in rec.get("attempts", [])], "tail": err[-1500:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--victim", type=int, default=1, help="the node whose link is cut (1 = the master)")
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args(argv)
    done = 0
    for i in range(1, args.trials + 1):
        r = trial(args.victim, args.steps)
        ok = r["exit"] == 0 and not r["partial"] and len(r["attempts"]) == 2 and r["attempts"][-1][1] == "finished"
        done += ok
        print(f"trial {i}: exit {r['exit']} in {r['seconds']:.0f} s; " +
              "; ".join(f"attempt {k} {v} on {','.join(n)}" + (f" from {c}" if c else "") for k, v, n, c in r["attempts"])
              + (f"; partial left: {r['partial']}" if r["partial"] else "") + ("" if ok else "\n" + r["tail"]),
              flush=True)
    print(f"completions: {done} of {args.trials} (node{args.victim} cut for good, a spare in its place)")
    return 0 if done == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())

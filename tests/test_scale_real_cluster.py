"""The largest real-torchrun run of the suite: CLUSTERCTL_SCALE_NODES test nodes (default 12) ×
CLUSTERCTL_SCALE_NPROC ranks (default 4), real torchrun on every node (tests/scripts/scale_ranks.py
per rank, no torch import), through the product's `clusterctl train`:

- every rank's first line reaches the foreground;
- a line every rank prints at the same moment prints once, under a label for all of them;
- one rank killed → the run restarts (`--max-restarts 1`) on the same nodes and ends with exit 0;
- no process of either attempt is left on any node.

bench/bench_scale.py measures the same chain's costs (`--real`, up to 32 × 8 on this machine:
docs/performance.md, Scale); the suite on a 2-core CI machine affords 12 × 4 (about 50 s). The same
test at another size: CLUSTERCTL_SCALE_NODES=32 CLUSTERCTL_SCALE_NPROC=8.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_envs, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODES = int(os.environ.get("CLUSTERCTL_SCALE_NODES", 12))
NPROC = int(os.environ.get("CLUSTERCTL_SCALE_NPROC", 4))
SCRIPT = Path(__file__).parent / "scripts" / "scale_ranks.py"
SAME = "every rank says the same"


def test_the_largest_real_torchrun_run_launches_folds_restarts_and_ends_clean(make_cluster, home, tmp_path):
    cluster = make_cluster(NODES, gpus=NPROC, name_prefix="ccsr")
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    inv = cluster.write_inventory(tmp_path / "nodes.yaml", checks={"disk_min_gb": 0.1})
    world = NODES * NPROC
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    fg = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--skip-preflight",
                           "--max-restarts", "1", "--", str(SCRIPT), "--steps", "24"],
                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        run_dir = wait_for(lambda: next(iter((home / "runs").glob("*/run.json")), None) if (home / "runs").exists()
                           else None, 120, "the run record").parent
        run_id = run_dir.name
        logs = [run_dir / "nodes" / f"{nd.name}.log" for nd in cluster.nodes]

        def copied():
            return "".join(p.read_text(errors="replace") for p in logs if p.exists())
        wait_for(lambda: all(f"rank {r} step 1\n" in copied() for r in range(world)), 300,
                 "two steps of every rank in the control copy of the logs")
        ranks = {int(e["RANK"]): pid for pid, e in run_envs(cluster, run_id, every_attempt=True).items()
                 if "RANK" in e and os.path.basename(e.get("_", "")) != "torchrun"
                 and e["CLUSTERCTL_RUN_KEY"].split("@")[0] == run_id}
        victim = wait_for(lambda: ranks.get(world - 1), 10, "the last rank's process")
        os.kill(victim, signal.SIGKILL)
        out, _ = fg.communicate(timeout=600)
    finally:
        if fg.poll() is None:
            fg.kill()
    said = out.decode(errors="replace")
    rec = json.loads((run_dir / "run.json").read_text())
    assert fg.returncode == 0, said[-4000:]
    assert len(rec["attempts"]) == 2 and rec["state"] == "finished", rec.get("summary")
    for r in range(world):
        assert f"rank {r} up" in said
    same = [ln for ln in said.splitlines() if ln.endswith(SAME)]
    # 24 steps per attempt, world ranks each: folded, a step's line prints once for all of them
    assert same and len(same) <= 4 * 24, f"{len(same)} lines of {SAME!r} for {2 * 24 * world} printed by the ranks"
    everyone = [ln for ln in same if ln.startswith(f"node[1-{NODES}]/r[0-{world - 1}] ")]
    assert everyone, "\n".join(same[:10])
    wait_for(lambda: not run_envs(cluster, run_id, every_attempt=True), 60, "no process of the run left on any node")

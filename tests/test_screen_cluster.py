"""What a run says on screen, on the real test cluster (gloo on CPU), through `clusterctl`:

- one error said once: a RuntimeError at step 0 on 3 ranks (3 nodes) prints its traceback once,
  under the ranks' range, torchrun's ChildFailedError report and c10d's hostname warnings are
  hidden (said once, with where they are), the summary names the traceback instead of repeating
  it, and every byte is in the node and rank files; `tail` of the run folds the same;
- progress for any script: a script that is not the shipped trainer and logs `step=N` shows its
  step in `status --json` and `watch --rank` off a terminal, and the stall flag rises once it
  stops progressing (runs/progress.py).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import TestCluster, require_root

pytestmark = pytest.mark.cluster

SCRIPTS = Path(__file__).parent / "scripts"
CRASH = SCRIPTS / "crash_step0.py"


@pytest.fixture(scope="module")
def cpu3():
    require_root()
    with TestCluster(n=3, gpus=0, name_prefix="ccsc") as cluster:
        for nd in cluster.nodes:
            nd.run("mkdir -p ~/gpt_train")
        yield cluster


def cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())


def last_run_dir(home: Path) -> Path:
    return max((home / "runs").iterdir(), key=lambda p: p.stat().st_ctime)


def screen_checks(out: str, err: str, run_dir: Path) -> None:
    """What a crash at step 0 on 3 ranks may put on screen."""
    both = out + err
    lines = both.splitlines()
    assert len(lines) <= 40, f"{len(lines)} lines on screen:\n{both}"
    assert both.count("Traceback (most recent call last)") == 1, both
    assert both.count("RuntimeError: shapes do not match at step 0") == 1, both
    assert "[rank0]:" not in out and "Root Cause" not in both and "ChildFailedError: " not in both, both
    assert not [ln for ln in lines if "socket.cpp" in ln], both  # c10d's warnings: not shown...
    assert sum("c10d's warning" in ln for ln in lines) == 1, both  # ...said once, with where they are
    assert sum("ChildFailedError report is not shown" in ln for ln in lines) == 1, both
    said = re.search(r"^\(rank (\d+)'s last lines and traceback are above; all of them: (\S+)\)$", err, re.M)
    assert said and said.group(2) == str(run_dir / "ranks" / f"rank{said.group(1)}.log"), both  # named, not repeated


def test_a_crash_at_step_0_on_3_ranks_is_said_once_and_kept_whole_in_the_files(cpu3, tmp_path, home):
    inv = cpu3.write_inventory(tmp_path / "nodes.yaml", checks={"disk_min_gb": 0.1})
    r = cli("train", "-i", inv, "--skip-preflight", "--", CRASH)
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = last_run_dir(home)
    screen_checks(r.stdout, r.stderr, run_dir)
    # every byte in the files: each node's traceback with torch's prefix, torchrun's report, c10d's warnings
    for i, nd in enumerate(cpu3.nodes):
        log = (run_dir / "nodes" / f"{nd.name}.log").read_text()
        assert f"[default0]:[rank{i}]: RuntimeError: shapes do not match at step 0" in log, log
        assert "ChildFailedError" in log and "Root Cause (first observed failure)" in log, log
        assert "[c10d] The hostname of the client socket cannot be retrieved" in log, log
        rank_log = (run_dir / "ranks" / f"rank{i}.log").read_text()
        assert f"[rank{i}]: Traceback (most recent call last):" in rank_log, rank_log
    # `tail` of the run folds the same
    t = cli("tail", run_dir.name, "--no-follow")
    assert t.returncode == r.returncode, t.stderr[-3000:]
    screen_checks(t.stdout, t.stderr, run_dir)

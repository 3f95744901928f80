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
from tests.conftest import wait_for

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


STEP_LOGGER = SCRIPTS / "step_logger.py"


def ranks_now(run_id: str) -> dict[int, dict]:
    r = cli("status", run_id, "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    return {d["rank"]: d for d in json.loads(r.stdout)["ranks_now"]}


def test_a_script_logging_step_equals_n_on_rank_0_shows_progress_on_every_rank_and_its_stall(cpu3, tmp_path, home):
    inv = cpu3.write_inventory(tmp_path / "nodes.yaml", checks={"disk_min_gb": 0.1})
    r = cli("train", "-i", inv, "--skip-preflight", "--detach", "--hang-timeout", "15", "--on-hang", "observe", "--",
            STEP_LOGGER, "--steps", "400", "--step-s", "0.3", "--stop-at", "45", "--pause", "300")
    assert r.returncode == 0, r.stderr
    run_id = r.stdout.strip()
    try:
        # rank 0's step from its `step=N` lines; ranks 1 and 2 print nothing: their collectives
        now = wait_for(lambda: (lambda d: d if (d[0]["step"] or 0) >= 5 and all(
            (d[r]["collectives"] or 0) > 0 for r in (1, 2)) else None)(ranks_now(run_id)), 120,
            "rank 0's step and every rank's collectives in status --json", interval=2)
        assert now[0]["step_from"] == "log" and now[0]["last_line"].startswith("step="), now[0]
        assert not any(d["stall"] for d in now.values()), now
        w = cli("watch", run_id, "--once", "--ranks", timeout=60)
        assert w.returncode == 0, w.stderr
        rows = {m[1]: m[2] for m in re.finditer(r"^(node\d/r\d)\s+running\s+(\S+)", w.stdout, re.M)}
        assert rows["node1/r0"].isdigit() and int(rows["node1/r0"]) >= 5, w.stdout
        assert re.fullmatch(r"c\d+", rows["node2/r1"]) and re.fullmatch(r"c\d+", rows["node3/r2"]), w.stdout
        assert "cN: collectives the rank entered" in w.stdout
        st = cli("status", run_id, timeout=60)  # its step column: node1's step, the others' collectives
        cells = {m[1]: m[2] for m in re.finditer(r"^(node\d)\s+\d+\s+running\s+\d+\s+-\s+[\d:]+\s+(\S+)", st.stdout, re.M)}
        assert cells["node1"].isdigit() and re.fullmatch(r"c\d+", cells["node2"]), st.stdout
        assert "clusterctl: cN: collectives the rank entered" in st.stderr, st.stderr
        detail = cli("watch", run_id, "--rank", "0", timeout=90)
        assert re.search(r"^node1\s+running\s+\d+", detail.stdout, re.M), detail.stdout
        assert "step=" in detail.stdout.split("rank 0 on node1: last lines", 1)[1], detail.stdout
        # at step 45 it stops progressing: every rank's stall flag rises past the hang timeout
        stalled = wait_for(lambda: (lambda d: d if all(x["stall"] for x in d.values()) else None)(ranks_now(run_id)),
                           120, "every rank flagged stalled in status --json", interval=2)
        assert stalled[0]["step"] == 44, stalled[0]  # the last step it finished
        w = cli("watch", run_id, "--once", timeout=60)
        flagged = {m[1] for m in re.finditer(r"^(node\d)\s+running\s+\S+.*\bstall \d+s", w.stdout, re.M)}
        assert flagged == {"node1", "node2", "node3"}, w.stdout
    finally:
        cli("stop", run_id)

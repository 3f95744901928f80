"""No rank map for a launch that does not happen: a failed preflight's table carries none, and the
foreground prints an attempt's map once it launched (cli/runs.py _Show). Local nodes, no cluster."""

import os
import subprocess
import sys

import pytest

from orchestrator.cli.runs import _Show
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.spec import RunSpec
from orchestrator.runs.store import Run

MAP = "world size 2 on 2 nodes: rank 0 → local0 (127.0.0.1), rank 1 → local1 (127.0.0.1)"


@pytest.mark.slow
def test_a_failed_preflight_shows_its_table_without_a_rank_map(tmp_path):
    inv = tmp_path / "local.yaml"
    inv.write_text("nodes:\n" + "".join(f"  - {{name: local{i}, connection: local, gpus: 64}}\n" for i in (0, 1)))
    env = dict(os.environ, CLUSTERCTL_HOME=str(tmp_path / "home"))
    (tmp_path / "job.py").write_text("pass\n")
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--", "job.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "preflight failed on local0, local1" in r.stderr, r.stderr[-3000:]
    assert "gpu" in r.stderr and "world size" not in r.stderr and "rank 0 →" not in r.stderr, r.stderr[-3000:]


def test_the_foreground_prints_an_attempts_rank_map_once_it_launched(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    run = Run.create("run-20261128-120000-abcd", RunSpec())
    nodes = [{"name": f"local{i}", "rank": i, "host": "127.0.0.1", "state": "pending", "first_rank": i,
              "last_rank": i} for i in (0, 1)]
    rec = {"id": run.id, "state": "launching", "rank_map": MAP, "nodes": nodes,
           "attempts": [{"attempt": 1, "key": run.id, "nodes": ["local0", "local1"]}]}
    show = _Show(run, None, (), (), show_preflight=False)
    show.header(RunRecord.from_json(rec))  # launching: its torchrun may never start (a node lost on the way)
    assert MAP not in capsys.readouterr().err and show.follower is None
    rec["attempts"][0]["launched"] = 1.0
    rec["state"] = "running"
    show.header(RunRecord.from_json(rec))
    assert MAP in capsys.readouterr().err and show.follower is not None

"""The README's first command: `clusterctl train` on the embedded default (two local nodes),
the whole pipeline — preflight, launch in rank order, streamed logs — on a tiny CPU run."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # a real training run on two local nodes: the full suite's, not the fast tier's
def test_embedded_default_runs_the_whole_pipeline(tmp_path):
    env = dict(os.environ, CLUSTERCTL_HOME=str(tmp_path / "home"))
    env.pop("CLUSTERCTL_INVENTORY", None)
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # preflight ran first and its table was shown
    assert "preflight: 2 nodes" in r.stderr and "reachable" in r.stderr
    assert "rank 0 → local0 (127.0.0.1), rank 1 → local1 (127.0.0.1)" in r.stderr
    lines = r.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("local0/r0 | step ") and "| loss " in ln]
    assert len(steps) >= 2
    losses = [float(ln.split("| loss ")[1].split()[0]) for ln in steps]
    assert losses[-1] < losses[0]  # it trained
    run = next((tmp_path / "home" / "runs").iterdir())
    rec = json.loads((run / "run.json").read_text())
    assert rec["state"] == "finished" and rec["world_size"] == 2
    # the trainer wrote its checkpoint to $CLUSTERCTL_CHECKPOINT_DIR, and the supervisor copied it
    # off the node into the run's directory on this machine
    assert list((run / "checkpoints").glob("ckpt_*")), sorted(p.name for p in run.iterdir())

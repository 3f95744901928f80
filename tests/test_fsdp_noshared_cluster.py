"""FSDP checkpoints without a shared filesystem, on the real test cluster (gloo on CPU).

Two nodes, each with its own home: each node writes only its own ranks' shards. A run that ends
at step 6 leaves its checkpoint spread over both nodes; clusterctl merges the pieces on the
control machine, and a new run started with `--resume-from` puts that checkpoint back on every
node and goes on. Its loss curve must be the uninterrupted run's, step for step (1e-4, as in
tests/test_trainer_dist.py's exactness tests)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = str(Path(__file__).resolve().parent.parent)
LOSS = re.compile(r"^(?:\[default0\]:)?step (\d+) \| loss ([0-9.]+)", re.M)
CKPT = "ckpt_00000006"


def inventory(cluster, path, steps):
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    return str(cluster.write_inventory(
        path, env={"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
        train={"module": "trainer",
               "args": ["--strategy", "fsdp", "--preset", "nano", "--seed", "1337", "--max-steps", str(steps),
                        "--lr", "3e-3", "--warmup-steps", "2", "--grad-accum", "2", "--lr-decay-steps", "12",
                        "--batch-size", "2", "--block-size", "32", "--log-every", "1", "--ckpt-every", "6",
                        "--eval-steps", "1", "--sample-tokens", "0", "--output-dir", "out"]}))


def train(inv, *flags):
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--skip-preflight",
                        "--json", *flags], capture_output=True, text=True, timeout=420, env=os.environ.copy())
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and doc["state"] == "finished", r.stderr[-3000:]
    return doc["run_id"]


def losses(home, run_id, node):
    text = (home / "runs" / run_id / "nodes" / f"{node}.log").read_text()
    return {int(s): float(v) for s, v in LOSS.findall(text)}, text


def test_fsdp_resumed_on_other_homes_continues_the_uninterrupted_loss_curve(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    master = cluster.nodes[0].name

    ref = train(inventory(cluster, tmp_path / "ref.yaml", 12))
    first = train(inventory(cluster, tmp_path / "first.yaml", 6))
    # no shared filesystem: each node holds only its own rank's shards of the step-6 checkpoint
    for rank, node in enumerate(cluster.nodes):
        part = node.home / ".clusterctl" / "artifacts" / first / "checkpoints" / CKPT
        shards = {p.name.split("_")[2] for p in part.glob("__*_*.distcp")}
        assert shards == {str(rank)}, (node.name, sorted(p.name for p in part.iterdir()))
    merged = home / "runs" / first / "checkpoints" / CKPT
    assert {p.name.split("_")[2] for p in merged.glob("__*_*.distcp")} == {"0", "1"}

    resumed = train(inventory(cluster, tmp_path / "resumed.yaml", 12), "--resume-from", first)
    la, _ = losses(home, ref, master)
    lb, text = losses(home, resumed, master)
    assert "start step 6" in text, text[-3000:]
    assert sorted(lb) == list(range(7, 13)), text[-3000:]
    for s in range(7, 13):
        assert abs(la[s] - lb[s]) < 1e-4, (s, la[s], lb[s])
    rec = json.loads((home / "runs" / resumed / "run.json").read_text())
    assert rec["attempts"][0]["checkpoint"] == CKPT
    assert sorted(rec["attempts"][0]["restored"]) == sorted(n.name for n in cluster.nodes)


def test_resume_from_a_run_without_a_checkpoint_is_a_usage_error(make_cluster, tmp_path, home):
    from orchestrator.runs.spec import RunSpec
    from orchestrator.runs.store import Run
    cluster = make_cluster(1, gpus=0)
    inv = str(cluster.write_inventory(tmp_path / "nodes.yaml"))
    empty = Run.create("empty-run", RunSpec()).id  # recorded, never trained: nothing copied home
    for run_id, says in (("nope", "no run 'nope'"), (empty, f"run {empty} has no complete checkpoint")):
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--resume-from", run_id],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert [p.name for p in (home / "runs").iterdir()] == [empty]  # no run was started

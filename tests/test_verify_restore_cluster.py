"""Verify before restore: a run's checkpoint copies on the control machine are read again before
one is chosen, so a copy damaged after it came home is skipped (and said), and with none intact
`--resume-from` exits 2 before anything starts. The relaunch after a lost node does the same
(tests/test_restarts_cluster.py, the master case)."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster

# the job: which checkpoints did clusterctl put in its checkpoint directory before it started?
LIST = "import os; d = os.environ['CLUSTERCTL_CHECKPOINT_DIR']; print('restored:', sorted(os.listdir(d)))\n"


def fake_run(name, steps, damaged):
    """A recorded run whose copies are ckpt_<step>.pt + sidecar, those in `damaged` altered after
    their sidecar was written (as a disk would, one byte)."""
    from orchestrator.runs.spec import RunSpec
    from orchestrator.runs.store import Run

    run = Run.create(name, RunSpec())
    d = run.dir / "checkpoints"
    d.mkdir(parents=True, exist_ok=True)
    for step in steps:
        name = f"ckpt_{step:08d}.pt"
        body = f"weights at step {step}\n".encode() * 100
        (d / name).write_bytes(body)
        (d / (name + ".sha256")).write_text(f"{hashlib.sha256(body).hexdigest()}  {name}\n")
        if step in damaged:
            (d / name).write_bytes(body[:50] + b"X" + body[51:])
    return run.id


def train(inv, *flags):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--skip-preflight",
                           *flags], capture_output=True, text=True, timeout=180, env=os.environ.copy())


def test_resume_from_skips_a_damaged_copy_and_refuses_when_none_is_intact(make_cluster, tmp_path, home):
    cluster = make_cluster(1, gpus=0)
    cluster.nodes[0].run("mkdir -p ~/gpt_train && cat > ~/gpt_train/job.py", input=LIST)
    inv = str(cluster.write_inventory(tmp_path / "nodes.yaml", train={"script": "job.py"}))

    donor = fake_run("donor", [10, 20, 30], damaged={30})
    r = train(inv, "--json", "--resume-from", donor)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipping checkpoint ckpt_00000030.pt" in r.stderr and "damaged" in r.stderr, r.stderr
    assert f"attempt 1 on {cluster.nodes[0].name} starts from checkpoint ckpt_00000020.pt (run {donor})" in r.stderr
    run_id = json.loads(r.stdout.strip().splitlines()[-1])["run_id"]
    log = (home / "runs" / run_id / "nodes" / f"{cluster.nodes[0].name}.log").read_text()
    assert "restored: ['ckpt_00000020.pt', 'ckpt_00000020.pt.sha256']" in log, log[-2000:]
    a = json.loads((home / "runs" / run_id / "run.json").read_text())["attempts"][0]
    assert a["checkpoint"] == "ckpt_00000020.pt" and a["skipped"] == ["ckpt_00000030.pt"], a

    before = sorted(p.name for p in (home / "runs").iterdir())
    node_state = cluster.nodes[0].run("find ~/.clusterctl -newer ~/gpt_train/job.py | sort").stdout
    broken = fake_run("broken", [10, 20], damaged={10, 20})
    r = train(inv, "--resume-from", broken)
    assert r.returncode == 2 and "no intact checkpoint" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "ckpt_00000020.pt, ckpt_00000010.pt are all damaged" in r.stderr, r.stderr
    assert sorted(p.name for p in (home / "runs").iterdir()) == sorted([*before, broken])  # no run started
    assert cluster.nodes[0].run("find ~/.clusterctl -newer ~/gpt_train/job.py | sort").stdout == node_state

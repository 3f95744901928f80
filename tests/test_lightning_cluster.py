"""A stock Lightning Trainer through a lost worker, on the real test cluster (gloo on CPU).

Lightning's default logger writes lightning_logs/version_N/ into the working directory on rank 0
only, and jobs leave other tools' folders (wandb/, runs/, outputs/, multirun/) and files of their
own in it. None of that is code: the relaunch's preflight does not blame the nodes that lack rank
0's logs, the spare is brought to the code without any of it, and the next `train` on the same
nodes passes preflight without a `sync`."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_ckptdir_cluster import home_snapshots, inventory
from tests.test_restarts_cluster import cut_mid_run, sync_code

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
LIGHTNING = str(REPO / "tests" / "scripts" / "lightning_tiny.py")

# what jobs leave in the workdir besides Lightning's logs: W&B, TensorBoard, Hydra, a file of its own
JOB_OUTPUTS = ["wandb/run-20261128_120000-abc/files/config.yaml", "runs/Nov28_12-00-00_n1/events.out.tfevents.1",
               "outputs/2026-11-28/12-00-00/.hydra/config.yaml", "multirun/2026-11-28/12-00-00/0/main.log",
               "metrics.csv"]


def saved(run_dir):
    """Home snapshots holding Lightning's last.ckpt."""
    out = []
    for s in home_snapshots(run_dir):
        try:
            doc = json.loads((run_dir / "checkpoints" / f"{s}.json").read_text())
        except FileNotFoundError:  # pruned meanwhile
            continue
        if "last.ckpt" in doc["files"]:
            out.append(s)
    return out


def starts(text):
    """(rank, global step) of every "starts at global_step N" line of a node's log."""
    return [(int(r), int(s)) for r, s in re.findall(r"rank (\d+) starts at global_step (\d+)", text)]


def test_a_stock_lightning_trainer_survives_a_lost_worker_and_the_next_train_needs_no_sync(
        make_cluster, tmp_path, home, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cluster = make_cluster(4, gpus=0)
    names = [n.name for n in cluster.nodes]
    inv = inventory(cluster, tmp_path, {"max_restarts": 1})
    sync_code(inv, tmp_path, names[:3])
    # earlier jobs' outputs, the same on every node of the run (so they alone change no verdict)
    for nd in cluster.nodes[:3]:
        nd.run(" && ".join(f"mkdir -p ~/gpt_train/{os.path.dirname(p) or '.'} && echo out > ~/gpt_train/{p}"
                           for p in JOB_OUTPUTS))
    run_dir, _, out, err, code, rec = cut_mid_run(
        inv, home, cluster.nodes[1], saved, "Lightning's last.ckpt copied home",
        flags=("--checkpoint-dir", "out/ckpt", "--resume-args", "--ckpt_path out/ckpt/last.ckpt", "--",
               LIGHTNING, "--max_steps", "200", "--every_n_steps", "20", "--step_s", "0.3", "--resumed_step_s", "0.05"))
    assert code == 0, err[-4000:]
    attempts = rec["attempts"]
    assert [a["nodes"] for a in attempts] == [names[:3], [names[0], names[3], names[2]]], (attempts, err[-3000:])
    assert attempts[0]["verdict"] == "node lost" and attempts[1]["verdict"] == "finished", attempts
    assert attempts[1]["resume_args"] == ["--ckpt_path", "out/ckpt/last.ckpt"]
    spare = cluster.nodes[3]
    assert cluster.nodes[0].run("ls ~/gpt_train/lightning_logs").stdout.split() == ["version_0", "version_1"]
    # the spare got the code, none of the donors' outputs; its own out/ckpt is the restored snapshot
    # (rank 0 alone saves with Lightning, so nothing overwrote it)
    there = spare.run("cd ~/gpt_train && find . -type f | sort").stdout.split()
    assert not [p for p in there if p.split("/")[1] in ("lightning_logs", "wandb", "runs", "outputs", "multirun",
                                                        "metrics.csv")], there
    assert {"./helpers.py", "./README.md", "./out/ckpt/last.ckpt"} <= set(there), there
    step = int(spare.run(f"cd ~/gpt_train && {sys.executable} -c \"import torch; print(torch.load("
                         "'out/ckpt/last.ckpt', weights_only=False, map_location='cpu')['global_step'])\"").stdout)
    assert 0 < step < 200, step  # a checkpoint from the middle of the run
    # every rank of attempt 2 starts at the saved step; attempt 1 started at 0
    logs = {n: (run_dir / "nodes" / f"{n}.log").read_text() for n in attempts[1]["nodes"]}
    assert starts(logs[names[3]]) == [(1, step)], {n: starts(t) for n, t in logs.items()}
    assert sorted(starts(logs[names[0]]) + starts(logs[names[2]])) == [(0, 0), (0, step), (2, 0), (2, step)], \
        {n: starts(t) for n, t in logs.items()}

    # the next train on the nodes the run ended on: rank 0's logs, the spare's restored checkpoint,
    # the outputs left behind: no sync needed
    after = tmp_path / "after.yaml"
    doc = yaml.safe_load(Path(inv).read_text())
    doc["nodes"] = [dict(n, spare=False) for n in doc["nodes"] if n["name"] in attempts[1]["nodes"]]
    after.write_text(yaml.safe_dump(doc))
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(after), "--", LIGHTNING,
                        "--max_steps", "3", "--step_s", "0", "--dirpath", "out/again"],
                       capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-4000:]
    assert "preflight failed" not in r.stderr and "code_sync" not in r.stderr, r.stderr[-3000:]
    assert cluster.nodes[0].run("ls ~/gpt_train/lightning_logs").stdout.split() == \
        ["version_0", "version_1", "version_2"]

"""A run's checkpoints are its own, on the real test cluster (gloo on CPU), with scripts that know
nothing of clusterctl and reuse their output directory between runs as their users do: a stock
Lightning Trainer (`ModelCheckpoint(dirpath=out/ckpt, save_last=True)`, resumed with `--ckpt_path
out/ckpt/last.ckpt`) and a nanoGPT-shaped script (`out/ckpt.pt`, resumed with `--init_from=resume`).
What the directory held when a run started is set aside, never restored as the run's; a relaunch
with no snapshot of the run starts from scratch without the resume args; `--resume-from RUN` alone
resumes what RUN ran, and `--resume-from RUN:set-aside` starts from what RUN set aside."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
LIGHTNING = str(REPO / "tests" / "scripts" / "lightning_tiny.py")
NANOGPT = str(REPO / "tests" / "scripts" / "nanogpt_like.py")


def inventory(cluster, tmp_path, spare, **train):
    nodes = cluster.inventory()["nodes"]
    if spare:
        nodes[-1]["spare"] = True
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    return str(cluster.write_inventory(tmp_path / "nodes.yaml", nodes=nodes, train=train,
                                       env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}))


def train(inv, *args, timeout=400):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--skip-preflight",
                           "--nproc-per-node", "1", *args], capture_output=True, text=True, timeout=timeout,
                          env=os.environ.copy())


def run_of(home, r):
    """The run directory a finished `train` names in its first line."""
    return home / "runs" / re.search(r"clusterctl: run (\S+) on ", r.stderr).group(1)


def record(run_dir):
    return json.loads((run_dir / "run.json").read_text())


def attempt_log(run_dir, node, a):
    return (run_dir / "nodes" / f"{node}.log").read_text()[a["log_start"].get(node, 0):]


def snapshot_files(run_dir):
    """Every snapshot of the run on this machine -> its files."""
    d = run_dir / "checkpoints"
    return {p.stem: json.loads(p.read_text())["files"] for p in sorted(d.glob("snap-*.json"))}


def said(r):
    return [ln[len("clusterctl: "):] for ln in r.stderr.splitlines() if ln.startswith("clusterctl: ")]


def test_lightning_run_twice_in_one_directory_the_second_hangs_before_its_first_checkpoint(
        make_cluster, tmp_path, home):
    """The first run trains 30 steps and leaves last.ckpt (step 30) and epoch=0-step=10/20/30.ckpt in
    out/ckpt on node1. The same command again, with rank 1 hanging at step 3, before the second
    run's first checkpoint: --on-hang restart relaunches on node1 and the spare. The first run's
    files were set aside when the second started, so no snapshot of them exists: attempt 2 gets no
    --ckpt_path and both ranks start at global step 0 (before, it was restored from the first run's
    last.ckpt and ended at once, 'finished')."""
    cluster = make_cluster(3, gpus=0)
    names = [n.name for n in cluster.nodes]
    inv = inventory(cluster, tmp_path, spare=True)
    # --hang_once: the hang happens once; the spare, which takes the hung rank's place, has the mark
    # (in its home: bringing the spare to the run's code replaces its workdir)
    mark = f"/home/{cluster.user}/hang-once"
    cluster.nodes[2].run(f"touch {mark}")
    # importing lightning on the shared test machine is silent for 15-30 s: the watch is off for the
    # first run, and the second's timeout is longer than that
    flags = ("--checkpoint-dir", "out/ckpt", "--resume-args", "--ckpt_path out/ckpt/last.ckpt", "--on-hang",
             "restart", "--max-restarts", "1")
    script = ("--", LIGHTNING, "--every_n_steps", "10", "--step_s", "0.05")
    first = train(inv, *flags, "--hang-timeout", "0", *script, "--max_steps", "30")
    assert first.returncode == 0, first.stderr[-4000:]
    first_dir = run_of(home, first)
    theirs = snapshot_files(first_dir)[max(snapshot_files(first_dir))]
    assert {"last.ckpt", "epoch=0-step=30.ckpt"} <= set(theirs), theirs

    second = train(inv, *flags, "--hang-timeout", "45", *script, "--max_steps", "20", "--hang_at", "3",
                   "--hang_rank", "1", "--hang_once", mark)
    assert second.returncode == 0, second.stderr[-4000:]
    run_dir = run_of(home, second)
    a1, a2 = record(run_dir)["attempts"]
    assert a1["verdict"] == "hang" and a1["bad_nodes"] == [names[1]], a1
    assert a2["nodes"] == [names[0], names[2]] and a2["verdict"] == "finished", a2
    assert not a2.get("checkpoint") and not a2.get("resume_args"), a2
    starts = {}
    for node in a2["nodes"]:
        starts.update(re.findall(r"rank (\d) starts at global_step (\d+)", attempt_log(run_dir, node, a2)))
    assert starts == {"0": "0", "1": "0"}, (starts, second.stderr[-3000:])
    assert "rank 0 ends at global_step 20" in attempt_log(run_dir, names[0], a2)
    # the first run's files are kept on node1, byte for byte, out of the job's way
    kept = cluster.nodes[0].home / ".clusterctl" / "artifacts" / run_dir.name / "set-aside" / "before-run"
    found = json.loads((run_dir / "set-aside.json").read_text())
    assert found["order"] == [names[0]] and found["checkpoint_dir"] == "out/ckpt"
    assert {"last.ckpt", "epoch=0-step=30.ckpt"} <= {p.name for p in kept.iterdir()}, list(kept.iterdir())
    assert torch.load(kept / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 30
    # no snapshot of the second run holds the first run's step-30 files
    for snap, files in snapshot_files(run_dir).items():
        assert "epoch=0-step=30.ckpt" not in files, (snap, sorted(files))
    told = said(second)
    assert any(t.startswith(f"{names[0]}: out/ckpt held ") and "from before this run: set aside, not taken as this "
               f"run's checkpoint (kept in " in t and t.endswith(f"/.clusterctl/artifacts/{run_dir.name}/set-aside/"
                                                                  "before-run there)") for t in told), told
    assert f"to start a run from what was set aside, on purpose: clusterctl train --resume-from " \
           f"{run_dir.name}:set-aside" in told, told
    assert any(t.startswith(f"attempt 2 on {names[0]}, {names[2]} starts from scratch: no checkpoint of this run "
                            "was copied (--resume-args not added)") for t in told), told
    # the end offers this run's own snapshots, and names what was set aside as not its own
    assert f"  a new run from those files: clusterctl train --resume-from {run_dir.name}:set-aside" in told, told


def worker_of(cluster, run_dir, node):
    """The process of run_dir's run on `node` that runs the script: the rank itself (where the warm
    interpreter forked it, the fork)."""
    key = f"{run_dir.name}@{node.name}"
    return wait_for(lambda: cluster.job_process(node, lambda env, argv: env.get("CLUSTERCTL_RUN_KEY") == key and any(
        "nanogpt_like.py" in a for a in argv)), 60, f"{node.name}'s rank")


def test_nanogpt_fresh_run_on_an_old_ckpt_pt_then_resume_from_with_nothing_else(make_cluster, tmp_path, home):
    """Run A leaves out/ckpt.pt at iteration 40 on node1. Run B, the same script in the same
    directory, has A's ckpt.pt set aside; node2's rank is killed while node1 is in the middle of
    B's first save (half a ckpt.pt written, the file open): the relaunch has no snapshot of B, sets
    the torn file aside too, and starts from scratch without --init_from=resume (before: A's
    ckpt.pt was B's first snapshot and B went on from iteration 40; and a torn file left in out/
    became B's next snapshot). Then `train --resume-from A` with nothing else resumes A's script
    at iteration 40, and `--resume-from B:set-aside` starts from A's ckpt.pt that B set aside."""
    cluster = make_cluster(2, gpus=0)
    names = [n.name for n in cluster.nodes]
    inv = inventory(cluster, tmp_path, spare=False)
    ckpt = ("--checkpoint-dir", "out", "--resume-args", "--init_from=resume")
    a = train(inv, *ckpt, "--", NANOGPT, "--max_iters=50", "--eval_interval=20", "--iter_s=0.05")
    assert a.returncode == 0, a.stderr[-4000:]
    a_dir = run_of(home, a)
    assert "done at iter 50" in (a_dir / "nodes" / f"{names[0]}.log").read_text()

    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--skip-preflight",
                             "--nproc-per-node", "1", "--max-restarts", "1", *ckpt, "--", NANOGPT, "--max_iters=70",
                             "--eval_interval=30", "--iter_s=0.25", "--slow_save_at=30", "--slow_save_s=10"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        b_dir = wait_for(lambda: next((p for p in (home / "runs").iterdir() if p != a_dir
                                       and (p / "run.json").exists()), None), 60, "run B's directory")
        wait_for(lambda: cluster.nodes[0].run("test -e ~/gpt_train/slow-save-started", check=False).returncode == 0,
                 120, "node1 in the middle of B's first save")
        worker_of(cluster, b_dir, cluster.nodes[1]).send_signal(signal.SIGKILL)
        killed = time.time()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    b1, b2 = record(b_dir)["attempts"]
    assert b1["verdict"] == "killed by signal" and b1["ended"] >= killed - 1, b1
    assert not b2.get("checkpoint") and not b2.get("resume_args"), b2
    for node in names:
        text = attempt_log(b_dir, node, b2)
        assert re.findall(r"rank \d init_from (\w+) at iter (\d+)", text) == [("scratch", "0")], text[-2000:]
    # every snapshot of B is B's own, and whole: the torn save was set aside before attempt 2 launched
    snaps = snapshot_files(b_dir)
    assert snaps, err[-3000:]
    for snap in snaps:
        assert torch.load(b_dir / "checkpoints" / snap / "ckpt.pt", map_location="cpu")["iter_num"] in (30, 60), snap
    assert b2["set_aside"] == {names[0]: ["ckpt.pt"]}, b2
    # A's ckpt.pt (iteration 40) kept on node1 as B found it
    kept = cluster.nodes[0].home / ".clusterctl" / "artifacts" / b_dir.name / "set-aside" / "before-run" / "ckpt.pt"
    assert torch.load(kept, map_location="cpu")["iter_num"] == 40
    told = [ln for ln in err.splitlines() if ln.startswith("clusterctl: ")]
    assert any(t.startswith(f"clusterctl: {names[0]}: ckpt.pt in out, left by the failed attempt and in no snapshot of "
                            "this run, set aside (kept in ") for t in told), told
    assert any(t.startswith(f"clusterctl: {names[0]}: out held ckpt.pt; 1 file, 0.0 MB from before this run: set "
                            "aside, not taken as this run's checkpoint (kept in ")
               and t.endswith(f"/.clusterctl/artifacts/{b_dir.name}/set-aside/before-run there)") for t in told), told

    # --resume-from A alone: A's script, arguments, --checkpoint-dir and --resume-args from its record
    c = train(inv, "--resume-from", a_dir.name)
    assert c.returncode == 0, c.stderr[-4000:]
    c_dir = run_of(home, c)
    assert f"resuming run {a_dir.name} as it ran: the script and its arguments ({NANOGPT} --max_iters=50 " \
           "--eval_interval=20 --iter_s=0.05), --checkpoint-dir out, --resume-args --init_from=resume, from its " \
           "record (give one again to change it)" in said(c), said(c)
    [c1] = record(c_dir)["attempts"]
    assert c1["resumed_from"] == a_dir.name and c1["resume_args"] == ["--init_from=resume"], c1
    text = (c_dir / "nodes" / f"{names[1]}.log").read_text()
    assert re.findall(r"rank \d init_from (\w+) at iter (\d+)", text) == [("resume", "40")], text[-2000:]
    assert "done at iter 50" in (c_dir / "nodes" / f"{names[0]}.log").read_text()

    # --resume-from B:set-aside: A's ckpt.pt, which B set aside, starts B's script again
    d = train(inv, "--resume-from", f"{b_dir.name}:set-aside", "--", NANOGPT, "--max_iters=45", "--iter_s=0.05")
    assert d.returncode == 0, d.stderr[-4000:]
    d_dir = run_of(home, d)
    [d1] = record(d_dir)["attempts"]
    assert d1["checkpoint"] == "set-aside" and d1["resumed_from"] == b_dir.name, d1
    for node in names:
        text = (d_dir / "nodes" / f"{node}.log").read_text()
        assert re.findall(r"rank \d init_from (\w+) at iter (\d+)", text) == [("resume", "40")], text[-2000:]
    assert torch.load(kept, map_location="cpu")["iter_num"] == 40  # still kept where B set it aside

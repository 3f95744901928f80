"""Any script's checkpoints carried (train --checkpoint-dir), on the real test cluster (gloo on CPU):
the job's own directory is copied off the nodes once complete, without a mark from the script, and
put back on every node of a restart, so a script that knows nothing of clusterctl resumes on a spare."""

import json
import random
import re
import time
from pathlib import Path

import pytest
import torch

from orchestrator.runs.ckpt import jobdir_home as ckptdir
from tests.test_restarts_cluster import cut_mid_run, sync_code

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
NANOGPT = str(REPO / "tests" / "scripts" / "nanogpt_like.py")


def inventory(cluster, tmp_path, train):
    nodes = cluster.inventory()["nodes"]
    nodes[-1]["spare"] = True
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    return str(cluster.write_inventory(tmp_path / "nodes.yaml", nodes=nodes,
                                       env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, train=train))


def home_snapshots(run_dir):
    d = run_dir / "checkpoints"
    return sorted(p.stem for p in d.glob("snap-*.json")) if d.is_dir() else []


def node_snapshots(run_dir):
    d = run_dir / "checkpoints" / "nodes"
    return sorted(p.stem for p in d.glob("snap-*.json")) if d.is_dir() else []


snapshots = home_snapshots


def iter_of(run_dir, snap):
    return torch.load(run_dir / "checkpoints" / snap / "ckpt.pt", map_location="cpu")["iter_num"]


@pytest.mark.parametrize("kept", ["home", "nodes"])
def test_nanogpt_s_ckpt_pt_resumes_on_a_spare_and_a_save_cut_mid_write_is_never_restored(
        make_cluster, tmp_path, home, monkeypatch, kept):
    """nanoGPT's habits (rank 0 saves out/ckpt.pt in place; --init_from=resume loads it on every
    rank). The master checkpoints at iteration 30 (copied home; or, `nodes`, with copy_checkpoints
    false and checkpoint_replica, kept on node1 and replicated to node2, never crossing this
    machine), then starts writing iteration 60's and is cut off mid-write, for good, holding the
    file open: that half file must never be taken, and the spare and node2 both resume from
    iteration 30 through --resume-args."""
    monkeypatch.chdir(tmp_path)
    cluster = make_cluster(3, gpus=0)
    names = [n.name for n in cluster.nodes]
    train = {"max_restarts": 1} | ({"copy_checkpoints": False, "checkpoint_replica": True} if kept == "nodes" else {})
    inv = inventory(cluster, tmp_path, train)
    snapshots = home_snapshots if kept == "home" else node_snapshots
    sync_code(inv, tmp_path, names[:2])
    seen = {}

    def mid_save(run_dir):
        """A snapshot is home, node1 is in its slow save, and long enough has passed since for a
        half-written file that is merely unchanged to be looked at twice: only its open file keeps
        it from being taken. -> the snapshots taken so far."""
        if "t" not in seen:
            if not snapshots(run_dir) or cluster.nodes[0].run("test -e ~/gpt_train/slow-save-started",
                                                              check=False).returncode:
                return None
            seen["t"] = time.monotonic()
        return time.monotonic() - seen["t"] >= ckptdir.SETTLE_S + 2 * ckptdir.INTERVAL_S and snapshots(run_dir)

    run_dir, before_cut, out, err, code, rec = cut_mid_run(
        inv, home, cluster.nodes[0], mid_save, "node1 in its slow save after a first checkpoint home",
        flags=("--checkpoint-dir", "out", "--resume-args", "--init_from=resume", "--", NANOGPT, "--max_iters=70",
               "--iter_s=0.5", "--slow_save_at=60", "--slow_save_s=120", "--resumed_iter_s=0.05"))
    assert code == 0, err[-4000:]
    attempts = rec["attempts"]
    assert [a["nodes"] for a in attempts] == [names[:2], [names[2], names[1]]], (attempts, err[-3000:])
    assert attempts[0]["verdict"] == "node lost" and attempts[1]["verdict"] == "finished"
    snap = attempts[1]["checkpoint"]
    if kept == "home":
        assert iter_of(run_dir, snap) == 30, (snap, snapshots(run_dir))
        assert all(iter_of(run_dir, s) == 30 for s in before_cut), before_cut  # the torn save never came home
    else:  # node2's replica of node1's part, put on the spare node to node; only manifests here
        assert attempts[1]["restored_from"] == "nodes"
        assert not [p for p in (run_dir / "checkpoints").rglob("*") if p.is_file() and p.suffix != ".json"]
        doc = json.loads((run_dir / "checkpoints" / "nodes" / f"{snap}.json").read_text())
        assert doc["holders"] == {names[0]: [names[0], names[1]]}, doc
        sup = (run_dir / "supervisor.log").read_text()
        assert re.search(rf"checkpoint {snap}: {names[0]}'s part, a replica on {names[1]}, copied from "
                         rf"{names[1]} to {names[2]}, node to node", sup), sup
    assert attempts[1]["resume_args"] == ["--init_from=resume"]
    # attempt 2 starts from the checkpoint's iteration on every rank, the spare included
    for node in (names[2], names[1]):
        text = (run_dir / "nodes" / f"{node}.log").read_text()
        assert re.findall(r"rank (\d) init_from resume at iter (\d+)", text), text[-2000:]
        assert all(it == "30" for _r, it in re.findall(r"rank (\d) init_from resume at iter (\d+)", text))
    assert "done at iter 70" in (run_dir / "nodes" / f"{names[2]}.log").read_text()
    told = [ln for ln in err.splitlines() if ln.startswith("clusterctl: ")]
    where = {"home": "this machine", "nodes": "the nodes"}[kept]
    assert f"clusterctl: attempt 2 on {names[2]}, {names[1]} starts from checkpoint {snap} ({where}: " \
           "ckpt.pt; 1 file, 0.0 MB in out) with --init_from=resume" in told, told
    # node2 never wrote a ckpt.pt (rank 1 does not save): it holds the restored bytes
    r = cluster.nodes[1].run("sha256sum ~/gpt_train/out/ckpt.pt")
    doc = json.loads((run_dir / "checkpoints" / ("nodes" if kept == "nodes" else "") / f"{snap}.json").read_text())
    assert r.stdout.split()[0] == doc["files"]["ckpt.pt"]["sha256"]


HF = str(REPO / "tests" / "scripts" / "hf_trainer.py")


def gathered(run_dir):
    """The newest snapshot holding a whole checkpoint-N/ with node2's rng_state_1.pth -> (snapshot, N)."""
    for s in reversed(snapshots(run_dir)):
        try:
            doc = json.loads((run_dir / "checkpoints" / f"{s}.json").read_text())
        except FileNotFoundError:  # pruned meanwhile
            continue
        steps = [int(rel.split("/")[0][11:]) for rel in doc["files"] if rel.endswith("/rng_state_1.pth")
                 and f"{rel.split('/')[0]}/model.safetensors" in doc["files"]]
        if steps:
            return s, max(steps)
    return None


def test_a_trainer_checkpoint_written_by_every_node_is_gathered_and_restored_whole_on_every_node(
        make_cluster, tmp_path, home, monkeypatch):
    """transformers.Trainer: rank 0 writes checkpoint-N/'s model and state on node1, rank 1 its
    rng_state_1.pth into checkpoint-N/ on node2. node2 is cut for good once a checkpoint with both
    is home: the spare and node1 get the whole checkpoint-N/ (node2's piece from the control
    machine), --resume-args '--resume' makes the unedited script call
    trainer.train(resume_from_checkpoint=True), and both ranks go on from step N."""
    monkeypatch.chdir(tmp_path)
    cluster = make_cluster(3, gpus=0)
    names = [n.name for n in cluster.nodes]
    inv = inventory(cluster, tmp_path, {"max_restarts": 1, "checkpoint_dir": "out", "resume_args": ["--resume"]})
    sync_code(inv, tmp_path, names[:2])
    run_dir, (snap, step), out, err, code, rec = cut_mid_run(
        inv, home, cluster.nodes[1], gathered, "a checkpoint with node2's rng state copied home",
        flags=("--", HF, "--max_steps", "150", "--save_steps", "30", "--step_s", "0.3", "--resumed_step_s", "0.05"))
    assert code == 0, err[-4000:]
    attempts = rec["attempts"]
    assert [a["nodes"] for a in attempts] == [names[:2], [names[0], names[2]]], attempts
    assert attempts[1]["verdict"] == "finished" and attempts[1]["resume_args"] == ["--resume"]
    # the restored snapshot (pruned by now: newer ones came home) was at least the one seen before the cut
    newest = int(re.search(r"step (\d+);", attempts[1]["checkpoint_about"]).group(1))
    assert attempts[1]["checkpoint"] >= snap and newest >= step, (attempts[1], snap, step)
    # both ranks start from that checkpoint's step
    starts = {}
    for node in (names[0], names[2]):
        text = (run_dir / "nodes" / f"{node}.log").read_text()[attempts[1]["log_start"].get(node, 0):]
        starts.update(re.findall(r"rank (\d) starts at step (\d+)", text))
    assert starts == {"0": str(newest), "1": str(newest)}, (starts, newest)
    assert "rank 0 finished at step 150" in (run_dir / "nodes" / f"{names[0]}.log").read_text()
    # the spare got node2's rng state of that checkpoint, byte for byte as node2 wrote it (read
    # inside node2's namespace: its link is still down)
    rel = f"~/gpt_train/out/checkpoint-{newest}/rng_state_1.pth"
    theirs = cluster.nodes[1].run(f"sha256sum {rel}").stdout.split()[0]
    assert cluster.nodes[2].run(f"sha256sum {rel}").stdout.split()[0] == theirs


def test_nanogpt_saving_every_second_is_carried_while_it_trains_and_a_cut_costs_a_few_checkpoints(
        make_cluster, tmp_path, home, monkeypatch):
    """nanoGPT with always_save_checkpoint and eval_interval 10 at 0.1 s an iteration rewrites
    out/ckpt.pt in place every ~1 s: never quiet for 5 s, so under the old rule no snapshot came
    home while it trained and a lost node restarted it from nothing. Now snapshots come home as it
    trains (at the default interval); the master is cut for good at a random moment after two are
    home, and the spare and node2 resume at most a few checkpoints behind the iteration at the cut
    (the widest gap seen between two snapshots, plus 3 checkpoints for one to come home), from a
    snapshot at least as new as the newest home at the cut. Every snapshot loads."""
    monkeypatch.chdir(tmp_path)
    cluster = make_cluster(3, gpus=0)
    names = [n.name for n in cluster.nodes]
    inv = inventory(cluster, tmp_path, {"max_restarts": 1})
    sync_code(inv, tmp_path, names[:2])
    seen: dict[str, int] = {}  # snapshot -> its iteration, as each came home before the cut
    wait = {}

    def two_home_then_a_random_moment(run_dir):
        for s in home_snapshots(run_dir):
            if s not in seen:
                try:
                    seen[s] = iter_of(run_dir, s)
                except FileNotFoundError:  # pruned meanwhile: newer ones are home
                    continue
        if len(seen) < 2:
            return None
        wait.setdefault("until", time.monotonic() + random.uniform(0, ckptdir.INTERVAL_S))
        return time.monotonic() >= wait["until"] and dict(seen)

    run_dir, before_cut, out, err, code, rec = cut_mid_run(
        inv, home, cluster.nodes[0], two_home_then_a_random_moment, "two snapshots home while it trains",
        flags=("--checkpoint-dir", "out", "--resume-args", "--init_from=resume", "--", NANOGPT, "--max_iters=300",
               "--eval_interval=10", "--iter_s=0.1", "--always_save_checkpoint=True", "--n_embd=256",
               "--resumed_iter_s=0.03"))
    assert code == 0, err[-4000:]
    attempts = rec["attempts"]
    assert [a["nodes"] for a in attempts] == [names[:2], [names[2], names[1]]], (attempts, err[-3000:])
    assert attempts[0]["verdict"] == "node lost" and attempts[1]["verdict"] == "finished"
    # the iteration node1 had reached when its link went down, from its own log (both ranks stall
    # in the next all-reduce once the link is gone)
    log = cluster.nodes[0].run(f"cat ~/.clusterctl/node-runs/{rec['id']}@{names[0]}/log").stdout
    at_cut = int(re.findall(r"iter (\d+): loss", log)[-1])
    resumed = set()
    for node in (names[2], names[1]):
        text = (run_dir / "nodes" / f"{node}.log").read_text()
        resumed |= {int(it) for it in re.findall(r"rank \d init_from resume at iter (\d+)", text)}
    assert len(resumed) == 1, resumed
    (resumed,) = resumed
    iters = sorted(before_cut.values())
    print(f"snapshots home before the cut (iteration): {before_cut}; cut at iteration {at_cut}; resumed at {resumed}")
    widest = max(b - a for a, b in zip(iters, iters[1:]))
    assert widest <= 6 * 10, f"snapshots did not keep up with a save every ~1 s: {before_cut}"
    assert resumed >= iters[-1], (resumed, before_cut)
    # behind the cut by at most one gap between snapshots and the time one takes to come home
    assert at_cut - resumed <= widest + 3 * 10, (at_cut, resumed, before_cut)
    assert "rank 0 done at iter 300" in (run_dir / "nodes" / f"{names[2]}.log").read_text()
    for s in home_snapshots(run_dir):  # none torn: each loads and matches its manifest
        assert iter_of(run_dir, s) % 10 == 0 and ckptdir.DirStore(run_dir).intact(s) is None

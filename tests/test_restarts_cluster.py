"""Restarts on the real test cluster (gloo on CPU): a node cut off for good mid-run, the run goes
on from the last checkpoint copied to the control machine, with the spare node in its place."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import wait_for

pytestmark = pytest.mark.cluster

REPO = str(Path(__file__).resolve().parent.parent)


def inventory(cluster, tmp_path, steps, *extra, train=None):
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    nodes = cluster.inventory()["nodes"]
    nodes[-1]["spare"] = True
    return str(cluster.write_inventory(
        tmp_path / "nodes.yaml", nodes=nodes, env={"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
        train={"module": "trainer", "max_restarts": 2, **(train or {}),
               "args": ["--preset", "nano", "--max-steps", str(steps), "--batch-size", "2", "--block-size", "32",
                        "--log-every", "1", "--ckpt-every", "10", "--eval-steps", "1", "--sample-tokens", "0",
                        "--output-dir", "out", *extra]}))


def start(inv, *flags):
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--lost-timeout", "5",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ.copy())


def sync_code(inv, tmp_path, nodes):
    """Push a small code tree into the workdir of `nodes` only (the spare never had it)."""
    src = tmp_path / "code"
    src.mkdir()
    (src / "helpers.py").write_text("VALUE = 1\n")
    (src / "README.md").write_text("the run's code\n")
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sync", "-i", inv, "--src", str(src), "--nodes",
                        ",".join(nodes)], capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 0, r.stderr


def run_dir_of(home):
    return wait_for(lambda: next((p for p in (home / "runs").glob("*") if (p / "run.json").exists()), None)
                    if (home / "runs").exists() else None, 60, "the run directory")


def copies(run_dir):
    """The complete checkpoint copies on the control machine (a .sha256 sidecar beside each)."""
    return [p for p in (run_dir / "checkpoints").glob("ckpt_*.pt") if Path(f"{p}.sha256").exists()]


def damage_newest(run_dir, held):
    """One byte of the newest copy changed, as a disk would after it was verified on arrival."""
    newest = max(copies(run_dir), key=lambda p: p.name)
    with open(newest, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def copied(run_dir, name):
    return (run_dir / "checkpoints" / name).exists()


def start_steps(text):
    return [int(s) for s in re.findall(r"start step (\d+)", text)]


def cut_mid_run(inv, home, node, ready, what, after_cut=None, flags=()):
    """Start the run (train with `flags`), wait until `ready(run_dir)` holds, cut `node`'s link for
    good (never brought back during the run), call `after_cut(run_dir, ready's value)`, wait for
    the end. -> (run_dir, ready's value, stdout, stderr, exit code, run.json)."""
    proc = start(inv, *flags)
    try:
        run_dir = run_dir_of(home)
        got = wait_for(lambda: ready(run_dir) or (proc.poll() is not None and pytest.fail(
            f"the run ended before {what}:\n{proc.stderr.read()[-3000:]}")), 240, what)
        node.link_down()
        if after_cut:
            after_cut(run_dir, got)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return run_dir, got, out, err, proc.returncode, json.loads((run_dir / "run.json").read_text())


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-n2", "master-n1"])
def test_a_node_cut_for_good_is_replaced_by_the_spare_and_the_run_resumes(make_cluster, tmp_path, home, victim):
    """The trainer with its defaults (its out/ inside the workdir), preflight on, and a spare that never
    trained nor had the code: the spare is brought to the run's code node to node before its preflight."""
    cluster = make_cluster(5, gpus=0)
    inv = inventory(cluster, tmp_path, 120)
    names = [n.name for n in cluster.nodes]
    sync_code(inv, tmp_path, names[:4])
    # the master is the only writer: with it cut, the relaunch restores this machine's copy. The
    # newest copy is damaged right after the cut (no copy arrives any more): it must be skipped.
    ready = (lambda d: copies(d)) if victim else (lambda d: len(copies(d)) >= 2 and copies(d))
    run_dir, held, out, err, code, rec = cut_mid_run(
        inv, home, cluster.nodes[victim], ready, "checkpoints on the control machine",
        after_cut=None if victim else damage_newest)
    assert code == 0, err[-3000:]
    assert rec["state"] == "finished" and rec["exit_code"] == 0
    names = [n.name for n in cluster.nodes]
    want = names[:4]
    want[victim] = names[4]
    attempts = rec["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2]
    assert attempts[0]["nodes"] == names[:4] and attempts[0]["verdict"] == "node lost"
    assert attempts[1]["nodes"] == want and attempts[1]["verdict"] == "finished"
    assert attempts[1]["prepared"] == [names[4]] and attempts[1]["preflight_ok"] is True, attempts[1]
    assert cluster.nodes[4].run("cat ~/gpt_train/helpers.py").stdout == "VALUE = 1\n"
    assert "2 attempts" in rec["summary"]
    master_log = (run_dir / "nodes" / f"{want[0]}.log").read_text()
    resumed = [s for s in start_steps(master_log) if s]
    assert resumed and resumed[-1] >= 10 and resumed[-1] % 10 == 0, master_log[-2000:]
    assert "step 120 | loss" in master_log
    if not victim:
        newest = max(p.name for p in held)
        assert attempts[1]["skipped"] == [newest], (attempts[1], err[-3000:])
        assert f"skipping checkpoint {newest}" in err + out and resumed[-1] < int(newest[5:13]), resumed
        assert attempts[1]["checkpoint"] == f"ckpt_{resumed[-1]:08d}.pt", attempts[1]
    # the foreground follows the new attempt's nodes, with their new ranks
    assert re.search(rf"^{want[0]}/r0 +\| step 120 \| loss", out, re.M), out[-2000:]
    assert copied(run_dir, "ckpt_00000120.pt")
    # TensorBoard events from both attempts' masters came home
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents*"))
    # the story on screen: the node lost and the restart told by clusterctl, the stopped ranks'
    # tracebacks folded, and where the results are
    lost = names[victim]
    told = [ln for ln in err.splitlines() if ln.startswith("clusterctl: ")]
    assert any(ln.startswith(f"clusterctl: {lost} lost: no answer for ") for ln in told), told
    assert any(ln.startswith("clusterctl: attempt 1 failed (node lost: ") and "restarting as attempt 2 of at most 3 "
               f"on {', '.join(want)} ({names[4]} in {lost}'s place)" in ln for ln in told), told
    assert (out + err).count("Traceback (most recent call last)") <= 2, out[-4000:]
    assert f"clusterctl: TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}" in told, told[-5:]
    assert f"clusterctl: checkpoints: {run_dir / 'checkpoints'} (newest ckpt_00000120.pt)" in err


def test_a_replica_on_the_next_node_outlives_the_master_without_crossing_the_control_machine(
        make_cluster, tmp_path, home):
    """copy_checkpoints: false, checkpoint_replica: true: node1 (the master, which writes every
    checkpoint) replicates to node2; node1 cut for good, the spare resumes from node2's replica.
    The trainer is told `--resume none`: it resumes only because train.resume_args adds `--resume
    auto` to the relaunch that starts from the restored checkpoint (a script that resumes on a flag)."""
    cluster = make_cluster(5, gpus=0)
    inv = inventory(cluster, tmp_path, 150, "--resume", "none",
                    train={"copy_checkpoints": False, "checkpoint_replica": True, "resume_args": ["--resume", "auto"]})

    def replica_on_node2(run_dir):
        """A verified replica of a checkpoint at step <= 100: at least 50 steps still to train."""
        replicas = f"~/.clusterctl/artifacts/{run_dir.name}/replicas/node1"
        r = cluster.nodes[1].run(f"cd {replicas} 2>/dev/null && for f in ckpt_*.pt; do [ -f \"$f.sha256\" ] && "
                                 '[ "$(sha256sum "$f" | cut -c1-64)" = "$(cut -c1-64 "$f.sha256")" ] && echo "$f"; '
                                 "done", check=False)
        return [f for f in r.stdout.split() if int(f[5:13]) <= 100]

    # node1 is the only node that wrote checkpoints
    run_dir, held, out, err, code, rec = cut_mid_run(inv, home, cluster.nodes[0], replica_on_node2,
                                                     "a verified replica of node1's checkpoint on node2")
    assert code == 0, err[-3000:]
    names = [n.name for n in cluster.nodes]
    attempts = rec["attempts"]
    assert attempts[1]["nodes"] == [names[4], *names[1:4]] and attempts[1]["verdict"] == "finished"
    assert attempts[1].get("restored_from") == "nodes", (attempts[1], err[-3000:])
    assert not attempts[0].get("resume_args") and attempts[1]["resume_args"] == ["--resume", "auto"], attempts
    assert re.search(rf"^clusterctl: attempt 2 on .* starts from checkpoint {attempts[1]['checkpoint']} "
                     r"\(the nodes\) with --resume auto$", err, re.M), err[-3000:]
    master_log = (run_dir / "nodes" / f"{names[4]}.log").read_text()
    resumed = [s for s in start_steps(master_log) if s]
    # at least the replica seen before the cut (the newest one the nodes held is taken)
    assert resumed and resumed[-1] >= min(int(f[5:13]) for f in held) and resumed[-1] % 10 == 0, master_log[-2000:]
    assert "step 150 | loss" in master_log
    # no checkpoint byte crossed the control machine
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(("ckpt_", ".ckpt_"))]


def test_preflight_says_whether_the_output_directory_is_shared(make_cluster, tmp_path):
    cluster = make_cluster(3, gpus=0)
    # the host's /tmp: every node's namespace sees it (pytest's tmp_path is root's alone)
    shared_dir = Path(tempfile.mkdtemp(prefix="cc-shared-", dir="/tmp"))
    shared_dir.chmod(0o777)
    verdicts = {}
    for label, out in (("home", "~/own-out"), ("tmp", str(shared_dir))):
        inv = str(cluster.write_inventory(tmp_path / f"{label}.yaml", output_dir=out))
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "preflight", "-i", inv, "--only",
                            "output_shared", "--json"], capture_output=True, text=True, timeout=120)
        doc = json.loads(r.stdout)
        verdicts[label] = {n["name"]: next(c for c in n["checks"] if c["check"] == "output_shared")
                           for n in doc["nodes"]}
    assert "not shared" in verdicts["home"]["node1"]["detail"]
    assert all(v["status"] == "ok" for v in verdicts["home"].values())
    assert verdicts["tmp"]["node1"]["detail"] == "shared with every node"
    assert "(shared)" in verdicts["tmp"]["node2"]["detail"]
    shutil.rmtree(shared_dir, ignore_errors=True)


def test_fsdp_pieces_replicate_around_the_ring_and_merge_node_to_node_without_the_writer(make_cluster, tmp_path):
    """Each node's FSDP shards go to the next node; with node1 gone, node2 and node3 each end up
    with every file the manifest lists, copied node to node (or from their own replicas)."""
    import hashlib
    import secrets

    import yaml

    from orchestrator.inventory import parse_inventory
    from orchestrator.node import artifacts, wire
    from orchestrator.runs.ckpt.given_home import ArtifactCopier
    from orchestrator.runs.ckpt.given_replicas import Replicator, restore_from_nodes
    from orchestrator.transport import Cluster

    cluster = make_cluster(3, gpus=0)
    inv = parse_inventory(yaml.safe_dump(cluster.inventory()), "<t>")
    content = {f"__{i}_0.distcp": secrets.token_hex(50_000) for i in range(3)} | {".metadata": "m", "extra.pt": "e"}
    manifest = "".join(f"{hashlib.sha256(v.encode()).hexdigest()}  {k}\n" for k, v in sorted(content.items()))
    own = [["__0_0.distcp", ".metadata", "extra.pt"], ["__1_0.distcp"], ["__2_0.distcp"]]
    with Cluster(inv) as c:
        dirs = {k: dict(got.dirs) for k, got in wire.run(c, lambda n: artifacts.prepare(n, "run-x")).items()}
        for i, node in enumerate(cluster.nodes):
            d = dirs[node.name]["checkpoints"] + "/ckpt_00000020"
            node.run(f"mkdir -p {d}")
            for f in own[i] + ["MANIFEST.sha256"]:
                node.run(f"cat > {d}/{f}", input=content.get(f, manifest))
        rep = Replicator(c, dirs, say=print)
        copier = ArtifactCopier(c, tmp_path, dirs, say=print, checkpoints=False)  # the run's poll loop, once
        copier.replicator = rep
        copier.sweep(["node1", "node2", "node3"])
        assert not (tmp_path / "checkpoints" / "ckpt_00000020").exists()  # nothing crossed to this machine
        assert sorted((s, h) for _, s, h, _ in rep.events) == [("node1", "node2"), ("node2", "node3"),
                                                               ("node3", "node1")]
        assert rep.bytes > 100_000
        found = restore_from_nodes(c, dirs, ["node3", "node2"], -1, say=print)  # node1 lost
    assert found == ("ckpt_00000020", ["node2", "node3"])
    for node in cluster.nodes[1:]:
        d = dirs[node.name]["checkpoints"] + "/ckpt_00000020"
        r = node.run(f"cd {d} && sha256sum -c MANIFEST.sha256", check=False)
        assert r.returncode == 0 and r.stdout.count(": OK") == 5, (node.name, r.stdout, r.stderr)

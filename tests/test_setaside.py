"""A run's checkpoints are its own (runs/ckpt/jobdir_setaside.py): what the job's checkpoint directory holds when
a run starts is set aside on each node, never snapshotted nor restored as the run's; a relaunch with
no snapshot starts from an empty directory; `--resume-from RUN:set-aside` puts it back on purpose;
`--resume-from RUN` resumes what RUN ran. Over `connection: local` nodes (the node program as
shipped, node-to-node copies through the real relay over loopback). The same on the real test
cluster with a stock Lightning Trainer and a nanoGPT-shaped script: test_setaside_cluster.py."""

import json
import subprocess
import sys

import pytest

from orchestrator.errors import LaunchError
from orchestrator.runs.ckpt import jobdir_home as ckptdir, jobdir_setaside as setaside
from orchestrator.runs.ckpt.given_home import CheckpointStore
from orchestrator.runs.ckpt.jobdir_home import DirCopier, DirStore
from orchestrator.runs.restart import Restorer
from orchestrator.runs.spec import RunSpec
from orchestrator.runs.store import Run
from tests.test_ckptdir import attach, local_cluster, node_program, old


def files_under(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_setaside_moves_every_entry_keeps_a_name_taken_and_digest_sees_a_change(tmp_path):
    d, aside = tmp_path / "out", tmp_path / "aside"
    (d / "step_000160").mkdir(parents=True)
    (d / "step_000160" / "__0_0.distcp").write_bytes(b"shard")
    (d / "ckpt.pt").write_bytes(b"weights")
    (d / ".clusterctl-restore.77").mkdir()  # a restore's own staging: not the job's, left alone
    (aside / "ckpt.pt").parent.mkdir()
    (aside / "ckpt.pt").write_bytes(b"set aside before")
    r = node_program("setaside", str(d), str(aside))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["aside"] == ["ckpt.pt.1", "step_000160"] and got["path"] == str(aside)
    assert sorted(rel for rel, _s, _m in got["files"]) == ["ckpt.pt", "ckpt.pt.1", "step_000160/__0_0.distcp"]
    assert sorted(p.name for p in d.iterdir()) == [".clusterctl-restore.77"]
    assert (aside / "ckpt.pt").read_bytes() == b"set aside before" and (aside / "ckpt.pt.1").read_bytes() == b"weights"
    listing = json.dumps([f for f in got["files"] if f[0] == "ckpt.pt.1"]).encode()
    r = node_program("digest", str(aside), stdin=listing)
    assert json.loads(r.stdout)["why"] == "" and len(json.loads(r.stdout)["files"]["ckpt.pt.1"]) == 64
    (aside / "ckpt.pt.1").write_bytes(b"rewritten")
    r = node_program("digest", str(aside), stdin=listing)
    assert json.loads(r.stdout) == {"files": {}, "why": "ckpt.pt.1 is missing or has changed since it was set aside"}


def dirs_of(tmp_path, paths):
    return {n: {"checkpoints": str(tmp_path / f"art-{n}" / "checkpoints"), "ckptdir": p} for n, p in paths.items()}


@pytest.fixture
def nodes(tmp_path, home):
    with local_cluster(tmp_path) as c:
        yield c, ckptdir.prepare(c, list(c.nodes), "out")


def restorer(c, run, told, origin=None, from_set_aside=False):
    copier = DirCopier(c, DirStore(run.dir), say=told.append)
    return copier, Restorer(c, c.inventory, CheckpointStore(run.dir), origin, told.append, copier, "out",
                            tell=lambda line: told.append(f"story: {line}"), from_set_aside=from_set_aside)


def test_a_fresh_run_sets_aside_what_its_dir_holds_takes_no_snapshot_of_it_and_relaunches_from_scratch(
        nodes, tmp_path):
    """An earlier run's ckpt.pt on n0 and its rng state on n1, quiet for an hour: attempt 1 moves
    both aside before the job starts, so the first look takes no snapshot of them (it took them as
    the run's own before). The failed attempt's torn save is set aside at the relaunch, which finds
    no snapshot of the run: no checkpoint, so no resume args."""
    c, paths = nodes
    w0, w1 = tmp_path / "w0" / "out", tmp_path / "w1" / "out"
    (w0 / "ckpt.pt").write_bytes(b"the last run's weights")
    (w1 / "rng_state_1.pth").write_bytes(b"the last run's rng")
    old(w0), old(w1)
    run = Run.create("fresh-1", RunSpec(args=("t.py",), checkpoint_dir="out"))
    told = []
    copier, r = restorer(c, run, told)
    attach(copier, paths, tmp_path)
    dirs = dirs_of(tmp_path, paths)
    assert r.before(1, dirs, ["n0", "n1"]) == {}
    assert files_under(w0) == files_under(w1) == []
    kept = tmp_path / "art-n0" / "set-aside" / "before-run"
    assert (kept / "ckpt.pt").read_bytes() == b"the last run's weights"
    assert (tmp_path / "art-n1" / "set-aside" / "before-run" / "rng_state_1.pth").read_bytes() == b"the last run's rng"
    assert f"story: n0: out held ckpt.pt; 1 file, 0.0 MB from before this run: set aside, not taken as this run's " \
           f"checkpoint (kept in {kept} there)" in told, told
    assert f"story: to start a run from what was set aside, on purpose: clusterctl train --resume-from " \
           f"{run.id}:set-aside" in told, told
    doc = setaside.Found(run.dir).doc()
    assert doc["order"] == ["n0", "n1"] and doc["checkpoint_dir"] == "out"
    assert setaside.Found(run.dir).about() == "ckpt.pt, rng_state_1.pth; 2 files, 0.0 MB, from out on n0, n1"
    assert copier.tick(["n0", "n1"], final=True) is None and copier.store.names() == []
    # attempt 1 dies mid-save: the relaunch has no snapshot of the run, and the torn file goes aside
    (w0 / "ckpt.pt").write_bytes(b"torn")
    told.clear()
    got = r.before(2, dirs, ["n0", "n1"])
    assert "checkpoint" not in got and got["set_aside"] == {"n0": ["ckpt.pt"]}, got
    assert files_under(w0) == []
    assert "restarting from scratch: no checkpoint of out was copied in this run" in told
    assert any(t.startswith("story: n0: ckpt.pt in out, left by the failed attempt and in no snapshot of this run, "
                            "set aside (kept in ") for t in told), told


def test_resume_from_set_aside_puts_it_back_on_every_node_and_refuses_a_changed_file(nodes, tmp_path):
    """--resume-from RUN:set-aside: n0's part (ckpt.pt) and n1's (rng_state_1.pth) are hashed where
    they were set aside and placed into DIR on both nodes (n1 gets n0's part node to node); the
    set-aside copy stays. A part changed since is refused before DIR is touched."""
    c, paths = nodes
    w0, w1 = tmp_path / "w0" / "out", tmp_path / "w1" / "out"
    (w0 / "ckpt.pt").write_bytes(b"weights at 40")
    (w1 / "rng_state_1.pth").write_bytes(b"rng")
    first = Run.create("first-1", RunSpec(args=("t.py",), checkpoint_dir="out"))
    dirs = dirs_of(tmp_path, paths)
    restorer(c, first, [])[1].before(1, dirs, ["n0", "n1"])
    (w0 / "own.pt").write_bytes(b"the first run's own")
    told = []
    nxt = Run.create("next-1", RunSpec(args=("t.py",), checkpoint_dir="out", resume_from=first.id,
                                       resume_set_aside=True))
    got = restorer(c, nxt, told, first.id, from_set_aside=True)[1].before(1, dirs, ["n0", "n1"])
    assert got["checkpoint"] == "set-aside" and got["resumed_from"] == first.id and got["restored"] == ["n0", "n1"]
    assert got["checkpoint_about"] == f"ckpt.pt, rng_state_1.pth; 2 files, 0.0 MB, from out on n0, n1, set aside " \
                                      f"when run {first.id} started"
    for w in (w0, w1):
        assert files_under(w) == ["ckpt.pt", "rng_state_1.pth"]
        assert (w / "ckpt.pt").read_bytes() == b"weights at 40" and (w / "rng_state_1.pth").read_bytes() == b"rng"
    # the next run set aside the first run's own file before putting those back; the originals stay
    assert files_under(tmp_path / "art-n0" / "set-aside" / "before-run") == ["ckpt.pt", "own.pt"]
    assert any("checkpoint set-aside: n0's part copied from n0 to n1, node to node" in t for t in told), told
    (tmp_path / "art-n1" / "set-aside" / "before-run" / "rng_state_1.pth").write_bytes(b"changed")
    (w0 / "mine.pt").write_bytes(b"untouched")
    third = Run.create("third-1", RunSpec(args=("t.py",), checkpoint_dir="out", resume_from=first.id,
                                          resume_set_aside=True))
    r = restorer(c, third, [], first.id, from_set_aside=True)[1]
    with pytest.raises(LaunchError, match="cannot put back what was set aside on n1 .*rng_state_1.pth is missing "
                                          "or has changed since it was set aside. Nothing was started"):
        r.restore(dirs, ["n0", "n1"], relaunch=False)
    assert (w0 / "mine.pt").read_bytes() == b"untouched"


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


@pytest.mark.slow
def test_resume_from_takes_what_the_run_ran_from_its_record_and_flags_given_again_win(tmp_path, home, monkeypatch):
    """`train --resume-from RUN` alone: RUN's script and arguments, --checkpoint-dir and
    --resume-args from its record, said; each flag given again wins. RUN without a snapshot: one
    paragraph, exit 2, nothing started, pointing at what it set aside."""
    from orchestrator.cli import train as cli_train

    origin = Run.create("dcp1-1", RunSpec(args=("dcp.py", "--steps", "200"), checkpoint_dir="out/dcp",
                                          resume_args=("--resume",)))
    snap = origin.dir / "checkpoints" / "snap-000001"
    (snap / "step_000160").mkdir(parents=True)
    (snap / "step_000160" / "__0_0.distcp").write_bytes(b"shard")
    (origin.dir / "checkpoints" / "snap-000001.json").write_text(json.dumps({"files": {}}))
    from orchestrator.inventory import parse_inventory

    inv = parse_inventory("nodes:\n  - {name: n0, connection: local, gpus: 0}\n")
    said = []
    monkeypatch.setattr(cli_train, "_err", said.append)
    got, script = cli_train._checkpoints(inv, "dcp1", None, None, ())
    assert script == ("dcp.py", "--steps", "200")
    assert got == {"checkpoint_dir": "out/dcp", "resume_from": origin.id, "resume_set_aside": False,
                   "resume_args": ("--resume",)}
    assert said == [f"clusterctl: resuming run {origin.id} as it ran: the script and its arguments (dcp.py --steps "
                    "200), --checkpoint-dir out/dcp, --resume-args --resume, from its record (give one again to "
                    "change it)"]
    said.clear()
    got, script = cli_train._checkpoints(inv, origin.id, "--resume --strict", None, ("dcp.py", "--steps", "400"))
    assert script == ("dcp.py", "--steps", "400") and got["resume_args"] == ("--resume", "--strict")
    assert said == [f"clusterctl: resuming run {origin.id} as it ran: --checkpoint-dir out/dcp, from its record "
                    "(give one again to change it)"]
    # a run with nothing copied home, which set aside what its directory held: exit 2, one paragraph
    empty = Run.create("hung-1", RunSpec(args=("dcp.py",), checkpoint_dir="out/dcp"))
    (empty.dir / "set-aside.json").write_text(json.dumps({"checkpoint_dir": "out/dcp", "order": ["n0"], "nodes": {
        "n0": {"path": "/x", "files": [["step_000160/__0_0.distcp", 5, 1]]}}}))
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text("nodes:\n  - {name: n0, connection: local, gpus: 0}\n")
    before = sorted(p.name for p in (home / "runs").iterdir())
    r = cli("train", "-i", str(nodes), "--resume-from", empty.id, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    text = " ".join(r.stderr.split())
    assert f"run {empty.id} has no snapshot of its checkpoint directory out/dcp in" in text, text
    assert f"What out/dcp held when it started was set aside (step_000160; 1 file, 0.0 MB, from out/dcp on n0): " \
           f"`clusterctl train --resume-from {empty.id}:set-aside` starts a run from that. Nothing was started." in text
    assert "resuming run" not in text  # the record's settings are told only for a run that starts
    r = cli("train", "-i", str(nodes), "--resume-from", f"{origin.id}:set-aside", cwd=tmp_path)
    assert r.returncode == 2 and f"run {origin.id} set nothing aside" in " ".join(r.stderr.split()), r.stderr
    r = cli("train", "-i", str(nodes), "--resume-from", f"{origin.id}:latest", cwd=tmp_path)
    assert r.returncode == 2 and "RUN:set-aside" in r.stderr, r.stderr
    assert sorted(p.name for p in (home / "runs").iterdir()) == before  # nothing was started

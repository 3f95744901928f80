"""A job's own checkpoint directory (train --checkpoint-dir): remote/ckptdir.py as shipped and
runs/ckpt/jobdir_home.py's snapshots and restores, over `connection: local` nodes (the same code paths as
over SSH), each node's DIR its own directory here."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from orchestrator import probe
from orchestrator.inventory import parse_inventory
from orchestrator.runs.ckpt import jobdir_home as ckptdir
from orchestrator.runs.ckpt.jobdir_home import DirCopier, DirStore, plan, restore_dir
from orchestrator.transport import Cluster


def node_program(*args, stdin=b"", cwd=None):
    return subprocess.run(probe.local_argv("ckptdir", *args), input=stdin, capture_output=True, timeout=60, cwd=cwd)


def look(path, pending=None, settle_s=ckptdir.SETTLE_S, wait_s=0, key="-"):
    """The node program's `look` at path, its captures in `pending` (default: beside path)."""
    pending = pending or os.path.join(os.path.dirname(path), "art", ckptdir.PENDING)
    r = node_program("look", str(path), str(pending), str(settle_s), str(wait_s), key)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def attach(copier, paths, tmp_path):
    """An attempt's DIR on each node, and its artifact directories under tmp_path/art-NODE."""
    copier.for_attempt(paths, {n: {"replicas": str(tmp_path / f"art-{n}" / "replicas")} for n in paths})


PAST = time.time() - 3600


def old(path, later=0):
    """Make everything under path look written an hour ago (`later` seconds after that)."""
    t = PAST + later
    for d, _dirs, names in os.walk(path):
        for n in names:
            os.utime(os.path.join(d, n), (t, t))
        os.utime(d, (t, t))


def holding(path, mode):
    """A process holding path open in `mode` until killed."""
    p = subprocess.Popen([sys.executable, "-c", f"f=open({str(path)!r}, {mode!r}); import time; "
                          "print('open', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"open\n"
    return p


def test_an_entry_is_complete_once_its_writer_closed_it_and_captured_as_it_was(tmp_path):
    d = tmp_path / "out"
    (d / "checkpoint-10").mkdir(parents=True)
    (d / "checkpoint-10" / "model.bin").write_bytes(b"m" * 100)
    old(d)
    (d / "ckpt.pt").write_bytes(b"c" * 10)  # written and closed just now: complete at once
    (d / "checkpoint-20").mkdir()
    (d / "checkpoint-20" / "model.bin").write_bytes(b"new")  # a directory still filling: it must settle
    s = look(d)
    assert s["path"] == str(d) and s["torn"] == [] and s["guard"] == ""
    e = s["entries"]
    assert e["checkpoint-10"]["complete"] and e["checkpoint-10"]["files"][0][:2] == ["checkpoint-10/model.bin", 100]
    assert e["ckpt.pt"]["complete"] and not e["checkpoint-20"]["complete"]
    pending = tmp_path / "art" / ckptdir.PENDING
    assert (pending / "ckpt.pt").read_bytes() == b"c" * 10 and not (pending / "checkpoint-20").exists()
    assert os.stat(pending / "ckpt.pt").st_mtime_ns == e["ckpt.pt"]["files"][0][2]
    # a directory renamed into place once written (a careful writer's tmp-checkpoint-30): complete at once
    (d / "tmp-checkpoint-30").mkdir()
    (d / "tmp-checkpoint-30" / "model.bin").write_bytes(b"30")
    assert not look(d)["entries"]["tmp-checkpoint-30"]["complete"]  # filling in place: it settles first
    time.sleep(0.05)  # the rename lands on a later tick of the file clock than the writes
    os.rename(d / "tmp-checkpoint-30", d / "checkpoint-30")
    assert look(d)["entries"]["checkpoint-30"]["complete"]
    # a process holding ckpt.pt open for writing: not complete, however long it has not changed
    os.utime(d / "ckpt.pt", (PAST, PAST))
    holder = holding(d / "ckpt.pt", "r+b")
    try:
        e = look(d)["entries"]
        assert not e["ckpt.pt"]["complete"] and e["ckpt.pt"]["writing"] == ["ckpt.pt"]
        assert e["checkpoint-10"]["complete"]
    finally:
        holder.kill()
        holder.wait()
    # open for reading only does not count
    reader = holding(d / "ckpt.pt", "rb")
    try:
        assert look(d)["entries"]["ckpt.pt"]["complete"]
    finally:
        reader.kill()
        reader.wait()
    # a file removed from a directory (a rotation in progress) makes the directory new again
    (d / "checkpoint-10" / "model.bin").unlink()
    (d / "checkpoint-10" / "other.bin").write_bytes(b"o")
    os.utime(d / "checkpoint-10" / "other.bin", (PAST, PAST))
    assert not look(d)["entries"]["checkpoint-10"]["complete"]
    # captures of what DIR no longer has are dropped
    shutil.rmtree(d / "checkpoint-30")
    look(d)
    assert not (pending / "checkpoint-30").exists()
    assert "checkpoint-30/model.bin" not in json.loads((pending / ".index.json").read_text())


def test_send_refuses_a_file_that_changed_since_it_was_listed(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    (d / "ckpt.pt").write_bytes(b"x" * 1000)
    st = os.stat(d / "ckpt.pt")
    line = json.dumps([["ckpt.pt", st.st_size, st.st_mtime_ns]]).encode() + b"\n"
    r = node_program("send", str(d), stdin=line)
    assert r.returncode == 0 and b"x" * 1000 in r.stdout
    (d / "ckpt.pt").write_bytes(b"y" * 1001)
    r = node_program("send", str(d), stdin=line)
    assert r.returncode == ckptdir.CHANGED and b"changed: ckpt.pt" in r.stderr
    r = node_program("send", str(d), stdin=json.dumps([["../etc", 1, 1]]).encode() + b"\n")
    assert r.returncode == ckptdir.CHANGED


def test_plan_takes_complete_entries_from_every_node_and_keeps_the_previous_copy_of_one_being_written():
    def entry(files, complete=True):
        return {"files": files, "complete": complete, "writing": []}

    states = {
        "n1": {"entries": {"checkpoint-20": entry([["checkpoint-20/model.bin", 5, 1], ["checkpoint-20/rng_state_0.pth", 2, 1]]),
                           "checkpoint-30": entry([["checkpoint-30/model.bin", 3, 9]], complete=False),
                           "latest": entry([["latest", 2, 1]])}},
        "n2": {"entries": {"checkpoint-20": entry([["checkpoint-20/rng_state_1.pth", 2, 2]]),
                           "latest": entry([["latest", 2, 7]])}},
    }
    prev = {"files": {"checkpoint-30/model.bin": {"node": "n1", "size": 1, "mtime_ns": 0, "sha256": "aa"},
                      "checkpoint-10/model.bin": {"node": "n1", "size": 1, "mtime_ns": 0, "sha256": "bb"}}}
    files = plan(states, ["n1", "n2"], prev)
    assert files["checkpoint-20/rng_state_1.pth"]["node"] == "n2"  # gathered from the node that wrote it
    assert files["checkpoint-20/model.bin"]["node"] == "n1"
    assert files["latest"] == {"node": "n1", "size": 2, "mtime_ns": 1}  # on both: the first node's
    assert files["checkpoint-30/model.bin"]["sha256"] == "aa"  # being written: the previous copy
    assert "checkpoint-10/model.bin" not in files  # no node has it any more
    # an entry not yet complete on one of its nodes is not taken from any of them
    states["n2"]["entries"]["checkpoint-20"]["complete"] = False
    assert not any(r.startswith("checkpoint-20/") for r in plan(states, ["n1", "n2"], None))


def local_cluster(tmp_path, n=2):
    nodes = "\n".join(f"  - {{name: n{i}, connection: local, gpus: 0, workdir: '{tmp_path}/w{i}'}}" for i in range(n))
    return Cluster(parse_inventory(f"nodes:\n{nodes}\n"))


@pytest.fixture
def copier(tmp_path):
    with local_cluster(tmp_path) as c:
        told = []
        paths = ckptdir.prepare(c, list(c.nodes), "out")
        dc = DirCopier(c, DirStore(tmp_path / "run"), say=told.append)
        attach(dc, paths, tmp_path)
        dc.told = told
        yield dc


def test_snapshots_gather_every_node_copy_only_new_bytes_and_restore_on_every_node(copier, tmp_path):
    w0, w1 = tmp_path / "w0" / "out", tmp_path / "w1" / "out"
    assert copier.paths == {"n0": str(w0), "n1": str(w1)}
    (w0 / "checkpoint-10").mkdir()
    (w0 / "checkpoint-10" / "model.bin").write_bytes(os.urandom(3000))
    (w0 / "checkpoint-10" / "rng_state_0.pth").write_bytes(b"r0")
    (w1 / "checkpoint-10").mkdir()
    (w1 / "checkpoint-10" / "rng_state_1.pth").write_bytes(b"r1")
    assert copier.tick(["n0", "n1"]) is None  # just written: not complete yet
    old(w0), old(w1)
    first = copier.tick(["n0", "n1"], final=True)
    store = copier.store
    assert first == "snap-000001" and store.names() == [first]
    snap = store.dir / first
    assert sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()) == [
        "checkpoint-10/model.bin", "checkpoint-10/rng_state_0.pth", "checkpoint-10/rng_state_1.pth"]
    assert store.doc(first)["step"] == 10 and store.intact(first) is None
    assert any("checkpoint snap-000001 (checkpoint-10, step 10; 3 files" in t for t in copier.told), copier.told
    assert copier.tick(["n0", "n1"], final=True) is None  # nothing new
    # a new checkpoint: only its bytes cross, the old one's are linked
    (w0 / "checkpoint-20").mkdir()
    (w0 / "checkpoint-20" / "model.bin").write_bytes(b"m20")
    old(w0)
    second = copier.tick(["n0", "n1"], final=True)
    assert second == "snap-000002"
    assert os.stat(store.dir / second / "checkpoint-10" / "model.bin").st_ino == \
        os.stat(snap / "checkpoint-10" / "model.bin").st_ino
    assert store.doc(second)["step"] == 20
    # restore onto both nodes: n1 gets every piece; a torn checkpoint-30 on n0 is set aside
    (w0 / "checkpoint-30").mkdir()
    (w0 / "checkpoint-30" / "model.bin").write_bytes(b"torn")
    (w1 / "checkpoint-10" / "rng_state_1.pth").write_bytes(b"damaged")
    aside = {n: str(tmp_path / f"aside-{n}") for n in ("n0", "n1")}
    with copier.cluster as c:
        replies = restore_dir(c, store, second, copier.paths, list(c.nodes), aside)
    assert replies["n0"]["aside"] == ["checkpoint-30"] and replies["n1"]["aside"] == []
    assert (tmp_path / "aside-n0" / "checkpoint-30" / "model.bin").read_bytes() == b"torn"
    for w in (w0, w1):
        assert sorted(str(p.relative_to(w)) for p in w.rglob("*") if p.is_file()) == [
            "checkpoint-10/model.bin", "checkpoint-10/rng_state_0.pth", "checkpoint-10/rng_state_1.pth",
            "checkpoint-20/model.bin"]
        assert (w / "checkpoint-10" / "rng_state_1.pth").read_bytes() == b"r1"
    # what the restore wrote is known: the next look copies nothing and takes no snapshot
    copier.restored(second, {n: r["files"] for n, r in replies.items()})
    old(w0), old(w1)
    assert copier.tick(["n0", "n1"], final=True) is None


def test_a_damaged_snapshot_is_skipped_for_the_previous_intact_one(copier, tmp_path):
    w0 = tmp_path / "w0" / "out"
    for i, data in enumerate([b"one", b"two"]):
        (w0 / "ckpt.pt").write_bytes(data)
        old(w0, i)
        assert copier.tick(["n0", "n1"], final=True) == f"snap-00000{i + 1}"
    store = copier.store
    (store.dir / "snap-000002" / "ckpt.pt").write_bytes(b"tw0")
    said = []
    assert store.newest_intact(said.append) == ("snap-000001", ["snap-000002"])
    assert "ckpt.pt no longer matches its sha256" in said[0]


def test_a_save_after_the_look_changes_nothing_the_capture_is_what_is_copied(copier, tmp_path, monkeypatch):
    """The look captured the complete version on the node: the job saving again before the control
    machine reads it neither voids nor tears the snapshot."""
    w0 = tmp_path / "w0" / "out"
    (w0 / "ckpt.pt").write_bytes(b"a" * 10)
    real = copier._fetch

    def rewrite_first(node, mine, stage, files):
        (w0 / "ckpt.pt").write_bytes(b"b" * 11)  # the job saves again between the look and the copy
        return real(node, mine, stage, files)

    monkeypatch.setattr(copier, "_fetch", rewrite_first)
    assert copier.tick(["n0", "n1"]) == "snap-000001"
    snap = copier.store.dir / "snap-000001"
    assert (snap / "ckpt.pt").read_bytes() == b"a" * 10 and copier.store.intact("snap-000001") is None
    assert not list(copier.store.dir.glob(".snap-*"))


@pytest.mark.parametrize("value, why", [("../up", "inside the workdir"), (".", "inside the workdir"),
                                        ("~", "whole filesystem or home"), ("a\nb", "one line")])
def test_a_checkpoint_dir_that_restoring_would_wreck_is_refused(tmp_path, home, value, why):
    """Restoring replaces what the directory holds: never the workdir, above it, or the home."""
    from orchestrator.errors import InventoryError

    with pytest.raises(InventoryError, match=why):
        parse_inventory("nodes:\n  - {name: n0, connection: local, gpus: 0}\ntrain:\n  checkpoint_dir: "
                        + json.dumps(value) + "\n")
    inv = tmp_path / "nodes.yaml"
    inv.write_text("nodes:\n  - {name: n0, connection: local, gpus: 0}\n")
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--checkpoint-dir", value,
                        "--", "t.py"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--checkpoint-dir" in r.stderr and why in r.stderr.replace("\n", " "), r.stderr
    assert "Traceback" not in r.stderr and not (home / "runs").exists() or not list((home / "runs").iterdir())


def test_the_checkpoint_dir_is_a_run_output_never_code(tmp_path):
    """sync never ships, prunes or hashes it (a spare's copy comes from the restore, not from sync)."""
    from orchestrator.transfer.files import run_outputs

    inv = parse_inventory("nodes:\n  - {name: n0, connection: local, gpus: 0, workdir: /w}\n"
                          "train:\n  script: train.py\n  checkpoint_dir: out/ckpts\n")
    assert run_outputs(inv, inv.nodes[0]) == ["out/ckpts"]
    from orchestrator.runs.spec import RunSpec

    spec = RunSpec(inventory_text="nodes:\n  - {name: n0, connection: local, gpus: 0, workdir: /w}\n"
                                  "train:\n  script: train.py\n", checkpoint_dir="/w/state")
    inv = spec.load_inventory()
    assert run_outputs(inv, inv.nodes[0]) == ["state"]


def test_resume_from_restores_another_runs_snapshot_and_a_damaged_one_changes_nothing(copier, tmp_path, home):
    """--resume-from with --checkpoint-dir: the origin run's newest intact snapshot goes into DIR on
    every node (Restorer.restore_dir); with every snapshot damaged it is LaunchError and no node's
    DIR is touched."""
    from orchestrator.errors import LaunchError
    from orchestrator.runs.ckpt.given_home import CheckpointStore
    from orchestrator.runs.ckpt.jobdir_replicas import newest_copied
    from orchestrator.runs.restart import Restorer
    from orchestrator.runs.spec import RunSpec
    from orchestrator.runs.store import Run

    origin = Run.create("origin-1", RunSpec(args=("t.py",), checkpoint_dir="out"))
    w0, w1 = tmp_path / "w0" / "out", tmp_path / "w1" / "out"
    (w0 / "ckpt.pt").write_bytes(b"state at 40")
    old(w0)
    copier.store = DirStore(origin.dir)
    assert copier.tick(["n0", "n1"], final=True) == "snap-000001"
    assert newest_copied(origin.dir) == "snap-000001 (ckpt.pt; 1 file, 0.0 MB)"
    (w0 / "ckpt.pt").write_bytes(b"later, torn")
    (w1 / "stray.txt").write_text("x")
    run = Run.create("next-1", RunSpec(args=("t.py",), checkpoint_dir="out", resume_from=origin.id))
    said = []
    dirs = {n: {"checkpoints": str(tmp_path / f"art-{n}" / "checkpoints"), "ckptdir": copier.paths[n]}
            for n in ("n0", "n1")}
    with copier.cluster as c:
        r = Restorer(c, c.inventory, CheckpointStore(run.dir), origin.id, said.append, None, "out")
        got = r.restore(dirs, ["n0", "n1"], relaunch=False)
        assert got["checkpoint"] == "snap-000001" and got["resumed_from"] == origin.id, got
        assert got["set_aside"] == {"n1": ["stray.txt"]}
        assert (w0 / "ckpt.pt").read_bytes() == (w1 / "ckpt.pt").read_bytes() == b"state at 40"
        (origin.dir / "checkpoints" / "snap-000001" / "ckpt.pt").write_bytes(b"rotten bits")
        (w0 / "ckpt.pt").write_bytes(b"untouched")
        with pytest.raises(LaunchError, match="no intact checkpoint.*snap-000001.*Nothing was changed"):
            r.restore(dirs, ["n0", "n1"], relaunch=False)
    assert (w0 / "ckpt.pt").read_bytes() == b"untouched"
    assert any("skipping checkpoint snap-000001" in s for s in said), said


def test_the_step_of_a_checkpoints_names_in_every_common_form():
    from orchestrator.runs.ckpt.jobdir_home import step_of_names

    assert step_of_names(["epoch=0-step=20.ckpt", "epoch=1-step=40.ckpt", "last.ckpt"]) == 40  # Lightning
    assert step_of_names(["checkpoint-500/trainer_state.json"]) == 500  # HF Trainer
    assert step_of_names(["global_step300/mp_rank_00_model_states.pt", "latest"]) == 300  # DeepSpeed
    assert step_of_names(["step_000160/.metadata"]) == 160  # DCP
    assert step_of_names(["ckpt.pt"]) is None

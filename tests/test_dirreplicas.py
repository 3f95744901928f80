"""A job's checkpoint directory kept on the nodes (`--checkpoint-dir` with copy_checkpoints false and
checkpoint_replica true, runs/ckpt/jobdir_replicas.py) over `connection: local` nodes: the node programs as
shipped, the node-to-node copies through the real relay over loopback. Nothing of the directory may
reach the control machine's run directory but the manifests."""

import os

import pytest

from orchestrator.runs.ckpt import jobdir_home as ckptdir
from orchestrator.runs.ckpt.jobdir_replicas import DirReplicas, NodeSnaps, restore_from_nodes
from tests.test_ckptdir import PAST, attach, local_cluster, old


@pytest.fixture
def reps(tmp_path):
    with local_cluster(tmp_path) as c:
        told = []
        r = DirReplicas(c, NodeSnaps(tmp_path / "run"), say=told.append)
        attach(r, ckptdir.prepare(c, list(c.nodes), "out"), tmp_path)
        assert r.roots == {n: str(tmp_path / f"art-{n}" / "dirsnaps") for n in ("n0", "n1")}
        r.told = told
        yield r


def frozen(tmp_path, holder, origin, snap, rel):
    return tmp_path / f"art-{holder}" / "dirsnaps" / origin / snap / rel


def files_under(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


@pytest.mark.slow
def test_each_part_is_frozen_where_written_and_replicated_to_the_next_node_and_only_manifests_come_home(
        reps, tmp_path):
    w0, w1 = tmp_path / "w0" / "out", tmp_path / "w1" / "out"
    (w0 / "checkpoint-10").mkdir()
    (w0 / "checkpoint-10" / "model.bin").write_bytes(b"m" * 1000)
    (w1 / "checkpoint-10").mkdir()
    (w1 / "checkpoint-10" / "rng_state_1.pth").write_bytes(b"r1")
    (w0 / "ckpt.pt").write_bytes(b"one")
    old(w0), old(w1)
    assert reps.tick(["n0", "n1"], final=True) == "snap-000001"
    doc = reps.store.doc("snap-000001")
    assert doc["holders"] == {"n0": ["n0", "n1"], "n1": ["n1", "n0"]}
    for holder in ("n0", "n1"):
        assert frozen(tmp_path, holder, "n0", "snap-000001", "ckpt.pt").read_bytes() == b"one"
        assert frozen(tmp_path, holder, "n1", "snap-000001", "checkpoint-10/rng_state_1.pth").read_bytes() == b"r1"
    # the control machine holds the manifest and nothing else
    assert files_under(tmp_path / "run") == ["checkpoints/nodes/snap-000001.json"]
    assert "kept on the nodes" in reps.told[-1] and "no replica" not in reps.told[-1]
    # nanoGPT rewrites ckpt.pt in place: the frozen copies keep the old bytes; unchanged files are links
    (w0 / "ckpt.pt").write_bytes(b"two!")
    os.utime(w0 / "ckpt.pt", (PAST + 5, PAST + 5))  # the rest untouched, as the job leaves it
    assert reps.tick(["n0", "n1"], final=True) == "snap-000002"
    assert frozen(tmp_path, "n0", "n0", "snap-000001", "ckpt.pt").read_bytes() == b"one"
    for holder in ("n0", "n1"):
        assert frozen(tmp_path, holder, "n0", "snap-000002", "ckpt.pt").read_bytes() == b"two!"
        a, b = (frozen(tmp_path, holder, "n0", s, "checkpoint-10/model.bin") for s in ("snap-000001", "snap-000002"))
        assert os.stat(a).st_ino == os.stat(b).st_ino, holder
    # nothing new: no snapshot
    assert reps.tick(["n0", "n1"], final=True) is None


@pytest.mark.slow
def test_a_restore_puts_the_parts_together_on_every_node_from_an_intact_holder(reps, tmp_path):
    w0, w1 = tmp_path / "w0" / "out", tmp_path / "w1" / "out"
    (w0 / "ckpt.pt").write_bytes(b"one")
    (w1 / "rng_state_1.pth").write_bytes(b"r1")
    old(w0), old(w1)
    assert reps.tick(["n0", "n1"], final=True) == "snap-000001"
    (w0 / "ckpt.pt").write_bytes(b"two")
    old(w0, 5)
    assert reps.tick(["n0", "n1"], final=True) == "snap-000002"
    # n0's own frozen copy of snap 2 is damaged: n1's replica serves; a torn file on n1 is set aside
    frozen(tmp_path, "n0", "n0", "snap-000002", "ckpt.pt").write_bytes(b"tw0")
    (w1 / "ckpt.pt.tmp").write_bytes(b"torn")
    said = []
    aside = {n: str(tmp_path / f"aside-{n}") for n in ("n0", "n1")}
    name, replies, skipped = restore_from_nodes(reps.cluster, reps.store, reps.paths, aside, said.append)
    assert (name, skipped) == ("snap-000002", [])
    assert any("n0: its copy of n0's part of checkpoint snap-000002 is not usable: ckpt.pt does not match" in s
               for s in said), said
    for w in (w0, w1):
        assert files_under(w) == ["ckpt.pt", "rng_state_1.pth"]
        assert (w / "ckpt.pt").read_bytes() == b"two" and (w / "rng_state_1.pth").read_bytes() == b"r1"
    assert replies["n1"]["aside"] == ["ckpt.pt.tmp"]
    assert (tmp_path / "aside-n1" / "ckpt.pt.tmp").read_bytes() == b"torn"
    assert not list(w0.glob(".clusterctl-*")) and not list(w1.glob(".clusterctl-*"))
    # both copies of n0's part of snap 2 damaged: the previous snapshot is put together instead
    frozen(tmp_path, "n1", "n0", "snap-000002", "ckpt.pt").unlink()
    name, _replies, skipped = restore_from_nodes(reps.cluster, reps.store, reps.paths, aside, said.append)
    assert (name, skipped) == ("snap-000001", ["snap-000002"])
    assert (w0 / "ckpt.pt").read_bytes() == b"one" and (w1 / "ckpt.pt").read_bytes() == b"one"
    # a snapshot older than this machine's newest copy is not looked at
    assert restore_from_nodes(reps.cluster, reps.store, reps.paths, aside, said.append,
                              newer_than=reps.store.doc("snap-000002")["taken"]) is None


@pytest.mark.slow
def test_old_snapshots_leave_the_nodes_with_their_manifests(reps, tmp_path):
    w0 = tmp_path / "w0" / "out"
    for i in range(5):
        (w0 / "ckpt.pt").write_bytes(b"x" * (i + 1))
        old(w0, i)
        assert reps.tick(["n0", "n1"], final=True) == f"snap-00000{i + 1}"
    kept = ["snap-000005", "snap-000004", "snap-000003"]
    assert reps.store.names() == kept
    for holder in ("n0", "n1"):
        snaps = [p.name for p in (tmp_path / f"art-{holder}" / "dirsnaps" / "n0").iterdir() if p.name != ".pending"]
        assert sorted(snaps) == sorted(kept)


def test_a_save_after_the_look_changes_nothing_the_capture_is_what_is_frozen(reps, tmp_path, monkeypatch):
    """The look captured the complete version on the node: the job saving again before the freeze
    neither voids nor tears the snapshot kept on the nodes."""
    w0 = tmp_path / "w0" / "out"
    (w0 / "ckpt.pt").write_bytes(b"a" * 10)
    real = reps._freeze

    def rewrite_first(*a):
        (w0 / "ckpt.pt").write_bytes(b"b" * 11)  # the job saves again between the look and the freeze
        return real(*a)

    monkeypatch.setattr(reps, "_freeze", rewrite_first)
    assert reps.tick(["n0", "n1"]) == "snap-000001"
    for holder in ("n0", "n1"):
        assert frozen(tmp_path, holder, "n0", "snap-000001", "ckpt.pt").read_bytes() == b"a" * 10


def test_with_both_kept_home_and_on_the_nodes_one_look_at_the_nodes_serves_both(reps, tmp_path):
    from orchestrator.runs.ckpt.jobdir_home import DirCopier, DirStore

    home = DirCopier(reps.cluster, DirStore(tmp_path / "run"), say=reps.told.append)
    attach(home, reps.paths, tmp_path)
    w0 = tmp_path / "w0" / "out"
    (w0 / "ckpt.pt").write_bytes(b"one")
    old(w0)
    looks = []
    for taker in (home, reps):
        real = taker.look
        taker.look = lambda nodes, final, real=real, who=taker: looks.append(who) or real(nodes, final)
    assert home.tick(["n0", "n1"], final=True) == "snap-000001"
    assert reps.tick(["n0", "n1"], final=True, looked=home.looked) == "snap-000001"
    assert looks == [home]  # the replicas' tick read the nodes' DIR through the copier's look
    assert (tmp_path / "run" / "checkpoints" / "snap-000001" / "ckpt.pt").read_bytes() == b"one"
    assert frozen(tmp_path, "n1", "n0", "snap-000001", "ckpt.pt").read_bytes() == b"one"

"""Verify before restore, on real files: the control machine's copies are read again before one
is chosen (CheckpointStore.newest_intact), and the Restorer neither restores a damaged copy nor,
when every copy is damaged, quietly starts from step 0."""

import hashlib
from pathlib import Path

import pytest

from orchestrator.errors import LaunchError
from orchestrator.runs.ckpt.given_home import CheckpointStore
from orchestrator.runs.restart import Restorer


def put_file(store: CheckpointStore, step: int, damaged: bool = False) -> str:
    name = f"ckpt_{step:08d}.pt"
    body = f"state of step {step}".encode() * 64
    (store.dir / name).write_bytes(body)
    (store.dir / f"{name}.sha256").write_text(f"{hashlib.sha256(body).hexdigest()}  {name}\n")
    if damaged:
        (store.dir / name).write_bytes(body[:-1] + b"?")
    return name


def put_dir(store: CheckpointStore, step: int, missing: bool = False) -> str:
    """An FSDP-style directory with a MANIFEST; `missing`: one shard it names is gone."""
    name = f"ckpt_{step:08d}"
    d = store.dir / name
    d.mkdir()
    shards = {"__0_0.distcp": b"a" * 99, "__1_0.distcp": b"b" * 99}
    for k, v in shards.items():
        (d / k).write_bytes(v)
    (d / "MANIFEST.sha256").write_text("".join(f"{hashlib.sha256(v).hexdigest()}  {k}\n" for k, v in shards.items()))
    if missing:
        (d / "__1_0.distcp").unlink()
    return name


def test_the_newest_intact_copy_is_chosen_and_each_damaged_one_is_named(tmp_path):
    store = CheckpointStore(tmp_path, keep=10)
    put_file(store, 10)
    put_dir(store, 20, missing=True)
    put_file(store, 30, damaged=True)
    said = []
    assert store.newest_intact(said.append) == ("ckpt_00000010.pt", ["ckpt_00000030.pt", "ckpt_00000020"])
    assert "ckpt_00000030.pt" in said[0] and ".sha256" in said[0]
    assert "ckpt_00000020" in said[1] and "MANIFEST.sha256" in said[1]
    assert store.newest() == "ckpt_00000030.pt"  # unverified: what the Restorer must not take


def test_all_damaged_is_a_launch_error_not_a_restart_from_scratch(tmp_path):
    store = CheckpointStore(tmp_path)
    put_file(store, 10, damaged=True)
    said = []
    with pytest.raises(LaunchError, match="no intact checkpoint.*not restarting from step 0"):
        Restorer(None, None, store, None, said.append).restore({}, ["n1"], relaunch=False)
    assert not any("from scratch" in s for s in said), said


def test_nothing_copied_is_said_as_a_restart_from_scratch(tmp_path):
    said = []
    assert Restorer(None, None, CheckpointStore(tmp_path), None, said.append).restore({}, ["n1"], relaunch=False) == {}
    assert said == ["restarting from scratch: no checkpoint was copied"]


def test_a_damaged_resume_from_copy_falls_back_in_the_origin_run(tmp_path, monkeypatch):
    """--resume-from's run is read the same way: its newest intact copy is what gets restored."""
    import orchestrator.runs.restart as restart

    origin_dir = tmp_path / "origin"
    origin = CheckpointStore(origin_dir)
    put_file(origin, 10)
    put_file(origin, 20, damaged=True)
    monkeypatch.setattr(restart, "Run", lambda run_id: type("R", (), {"dir": origin_dir})())
    sent = {}

    def fake_restore(cluster, store, dirs, nodes, name):
        sent.update(store=store.dir, name=name)
        return [n.name for n in nodes]

    monkeypatch.setattr(restart, "restore", fake_restore)
    inv = type("Inv", (), {"node": lambda self, n: type("N", (), {"name": n})()})()
    out = Restorer(None, inv, CheckpointStore(tmp_path / "this"), "origin-run", lambda s: None).restore(
        {}, ["n1"], relaunch=False)
    assert sent == {"store": origin_dir / "checkpoints", "name": "ckpt_00000010.pt"}
    assert out["checkpoint"] == "ckpt_00000010.pt" and out["skipped"] == ["ckpt_00000020.pt"]
    assert out["resumed_from"] == "origin-run" and Path(sent["store"]).is_dir()

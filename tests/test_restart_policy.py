"""Whose failure was it (classify), who runs the next attempt (next_nodes), and the control
machine's checkpoint store: pure functions and real files, no cluster."""

import hashlib
import io
import json
import os
import tarfile

import pytest

from orchestrator.runs.ckpt.given_home import CheckpointStore, is_complete
from orchestrator.runs.curves import write_frames
from orchestrator.runs.restart import Outcome, classify, next_nodes

TORCHRUN_KILLED = """[default0]:step 12 | loss 4.1
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_19:23:57
  host      : node3
  rank      : 2 (local_rank: 0)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
====================================================
"""

SCRIPT_ERROR = """[default0]:Traceback (most recent call last):
[default0]:  File "train.py", line 3, in <module>
[default0]:ValueError: rank 5 failing on purpose
Root Cause (first observed failure):
[0]:
  rank      : 5 (local_rank: 1)
  exitcode  : 1 (pid: 77)
====================================================
"""

PEER_DIED = """[default0]:Traceback (most recent call last):
[default0]:  File "trainer/train.py", line 240, in _loop
[default0]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:4455
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 90)
====================================================
"""


def test_a_lost_node_is_retried_and_not_used_again():
    v = classify([Outcome("n1", "failed", 1, PEER_DIED), Outcome("n2", "lost", None)], "n2")
    assert v.retry and v.cause == "node lost" and v.bad_nodes == ("n2",)


def test_a_worker_killed_by_a_signal_is_retried_on_the_same_nodes():
    v = classify([Outcome("n3", "failed", 1, TORCHRUN_KILLED), Outcome("n1", "failed", 1, PEER_DIED)], "n3")
    assert v.retry and v.cause == "killed by signal" and "SIGKILL" in v.detail and v.bad_nodes == ()


def test_the_scripts_own_exception_is_not_retried():
    v = classify([Outcome("n3", "failed", 1, SCRIPT_ERROR), Outcome("n1", "failed", 1, PEER_DIED)], "n3")
    assert not v.retry and v.cause == "script error" and "ValueError: rank 5 failing on purpose" in v.detail


def test_the_same_exception_everywhere_is_the_scripts():
    outs = [Outcome(f"n{i}", "failed", 1, SCRIPT_ERROR) for i in range(1, 4)]
    assert classify(outs, "n1").cause == "script error"


def test_a_collective_error_after_a_peer_died_is_retried():
    v = classify([Outcome("n1", "failed", 1, PEER_DIED), Outcome("n2", "finished", 0)], "n1")
    assert v.retry and v.cause == "peer failure"


def test_finished_and_stopped_are_not_retried():
    assert classify([Outcome("n1", "finished", 0)], None) .cause == "finished"
    v = classify([Outcome("n1", "lost", None)], "n1", stopped=True)
    assert not v.retry and v.cause == "stopped"


def test_a_spare_takes_the_lost_nodes_place_in_rank_order():
    assert next_nodes(["n1", "n2", "n3", "n4"], ["n5"], ("n2",), 4) == (["n1", "n5", "n3", "n4"], [])
    assert next_nodes(["n1", "n2", "n3", "n4"], ["n5", "n6"], ("n1",), 4) == (["n5", "n2", "n3", "n4"], ["n6"])


def test_without_a_spare_the_run_shrinks_only_down_to_min_nodes():
    assert next_nodes(["n1", "n2", "n3"], [], ("n2",), 2) == (["n1", "n3"], [])
    assert next_nodes(["n1", "n2", "n3"], [], ("n2",), 3) is None
    assert next_nodes(["n1", "n2"], [], (), 2) == (["n1", "n2"], [])  # killed, not lost: same nodes


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def take(store, data, name, kind):
    into = store.receiving(name)
    into.feed(data)
    return store.finish(into, name, kind)


def test_fsdp_pieces_from_two_nodes_make_one_complete_checkpoint(tmp_path):
    shards = {".metadata": b"meta", "__0_0.distcp": b"zero" * 100, "__1_0.distcp": b"one" * 100, "extra.pt": b"x"}
    manifest = "".join(f"{hashlib.sha256(v).hexdigest()}  {k}\n" for k, v in sorted(shards.items())).encode()
    name = "ckpt_00000010"
    node0 = {f"{name}/{k}": v for k, v in shards.items() if k != "__1_0.distcp"} | {f"{name}/MANIFEST.sha256": manifest}
    node1 = {f"{name}/__1_0.distcp": shards["__1_0.distcp"], f"{name}/MANIFEST.sha256": manifest}
    store = CheckpointStore(tmp_path)
    assert not take(store, _tar(node0), name, "dir") and store.newest() is None  # a shard is missing
    assert take(store, _tar(node1), name, "dir")
    assert store.newest() == name and is_complete(store.dir / name)


def test_a_torn_file_checkpoint_is_never_taken(tmp_path):
    good = b"weights" * 1000
    name = "ckpt_00000020.pt"
    store = CheckpointStore(tmp_path)
    side = (hashlib.sha256(good).hexdigest() + "\n").encode()
    assert not take(store, _tar({name: good[:-10], name + ".sha256": side}), name, "file") and store.newest() is None
    assert take(store, _tar({name: good, name + ".sha256": side}), name, "file") and store.newest() == name


def test_a_stream_is_unpacked_as_it_arrives_and_hostile_or_torn_streams_are_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    name = "ckpt_00000030.pt"
    big = os.urandom(3 << 20)  # more than the pipe and the unpacker's chunk hold
    side = (hashlib.sha256(big).hexdigest() + "\n").encode()
    into = store.receiving(name)
    data = _tar({name: big, name + ".sha256": side})
    for i in range(0, len(data), 7919):  # arbitrary pieces, as SSH delivers them
        into.feed(data[i:i + 7919])
    assert store.finish(into, name, "file") and (store.dir / name).read_bytes() == big
    staged = store.dir / f".{name}.partial" / name
    assert into.digests[staged] == hashlib.sha256(big).hexdigest()  # hashed on the way in

    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        link = tarfile.TarInfo("ckpt_00000040.pt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
        dots = tarfile.TarInfo("../outside")
        dots.size = len(big)
        tar.addfile(dots, io.BytesIO(big))
    into = store.receiving("ckpt_00000040.pt")
    into.feed(evil.getvalue())  # the reader stops at the first member; the writer is not blocked
    with pytest.raises(tarfile.TarError, match="refusing tar member"):
        store.finish(into, "ckpt_00000040.pt", "file")
    assert not (tmp_path / "outside").exists() and not (store.dir / ".ckpt_00000040.pt.partial" / "ckpt_00000040.pt").exists()

    into = store.receiving("ckpt_00000050.pt")
    into.feed(_tar({"ckpt_00000050.pt": big})[: 1 << 20])  # the node died mid-stream
    with pytest.raises(tarfile.TarError):
        store.finish(into, "ckpt_00000050.pt", "file")
    assert store.newest() == name


def test_tensorboard_frames_append_and_skip_what_is_out_of_step(tmp_path):
    def frame(rel, offset, data):
        return json.dumps({"rel": rel, "offset": offset, "size": len(data)}).encode() + b"\n" + data

    write_frames(frame("events.1", 0, b"abc") + frame("sub/events.2", 0, b"\n\nxy"), tmp_path)
    write_frames(frame("events.1", 3, b"def") + frame("events.1", 99, b"zzz") + frame("../evil", 0, b"!"), tmp_path)
    assert (tmp_path / "events.1").read_bytes() == b"abcdef"
    assert (tmp_path / "sub" / "events.2").read_bytes() == b"\n\nxy"
    assert not (tmp_path.parent / "evil").exists()


# ------------------------------------------------------------------ replicas (runs/ckpt/given_replicas.py)

from orchestrator.inventory import parse_inventory  # noqa: E402
from orchestrator.runs.ckpt.given_replicas import Move, Piece, pieces_of, plan_restore, ring  # noqa: E402


def test_each_node_replicates_to_the_next_in_rank_order_wrapping_around():
    assert ring(["n1", "n2", "n3", "n4"]) == {"n1": "n2", "n2": "n3", "n3": "n4", "n4": "n1"}
    assert ring(["n5", "n2"]) == {"n5": "n2", "n2": "n5"}
    assert ring(["n1"]) == {}  # no other node to hold a replica


def test_inventory_checkpoint_replica_defaults_off():
    base = "nodes: [{name: a, host: h}]\n"
    assert parse_inventory(base, "<t>").train.checkpoint_replica is False
    inv = parse_inventory(base + "train: {copy_checkpoints: false, checkpoint_replica: true}\n", "<t>")
    assert inv.train.checkpoint_replica is True and inv.train.copy_checkpoints is False


def _file(holder, origin, step):
    name = f"ckpt_{step:08d}.pt"
    return Piece(holder, origin, name, step, "file", frozenset({name, name + ".sha256"}))


def test_restore_picks_the_newest_file_checkpoint_on_any_surviving_node_for_the_new_master():
    # node1 (the old master) is gone; node2 holds its replicas of steps 10 and 20; node5 is the new master
    pieces = [_file("node2", "node1", 10), _file("node2", "node1", 20), _file("node3", "node3", 0)]
    name, moves = plan_restore(pieces, ["node5", "node2", "node3", "node4"])
    assert name == "ckpt_00000020.pt" and moves == [Move(pieces[1], "node5")]
    # the control machine already has step 20 (or newer): nothing from the nodes
    assert plan_restore(pieces, ["node5", "node2"], newer_than=20) is None
    assert plan_restore(pieces, ["node5", "node2"], newer_than=10)[0] == "ckpt_00000020.pt"
    # the master survived with its own newest: already in place
    own = _file("node1", "node1", 20)
    assert plan_restore(pieces + [own], ["node1", "node5"]) == ("ckpt_00000020.pt", [])
    # the new master holds a replica itself: copied from itself (a local copy), not across the network
    assert plan_restore(pieces, ["node2", "node5"]) == ("ckpt_00000020.pt", [Move(pieces[1], "node2")])
    assert plan_restore([], ["node5"]) is None


def _shards(holder, origin, step, rank, world=3):
    names = {f"__{rank}_0.distcp"} | ({".metadata", "extra.pt"} if rank == 0 else set())
    manifest = frozenset({f"__{r}_0.distcp" for r in range(world)} | {".metadata", "extra.pt"})
    return Piece(holder, origin, f"ckpt_{step:08d}", step, "dir", frozenset(names | {"MANIFEST.sha256"}), manifest)


def test_restore_merges_fsdp_pieces_on_every_node_only_when_they_cover_the_manifest():
    # step 20: node1 (rank 0) lost, its replica on node2; node3's own pieces of step 20 are missing
    p20 = [_shards("node2", "node1", 20, 0), _shards("node2", "node2", 20, 1), _shards("node1", "node3", 20, 2)]
    p10 = [_shards("node2", "node1", 10, 0), _shards("node2", "node2", 10, 1), _shards("node3", "node3", 10, 2)]
    name, moves = plan_restore(p20[:2] + p10, ["node4", "node2", "node3"])
    assert name == "ckpt_00000010"  # step 20 lacks rank 2's shards
    got = {(m.piece.holder, m.piece.origin, m.target) for m in moves}
    assert got == {("node2", "node1", "node4"), ("node2", "node2", "node4"), ("node3", "node3", "node4"),
                   ("node2", "node1", "node2"), ("node3", "node3", "node2"),
                   ("node2", "node1", "node3"), ("node2", "node2", "node3")}


def test_the_node_agents_held_answer_is_parsed_into_pieces():
    held = {"own": [{"name": "ckpt_00000010", "step": 10, "kind": "dir", "manifest": ["__1_0.distcp"],
                     "files": [["ckpt_00000010/__1_0.distcp", 5], ["ckpt_00000010/MANIFEST.sha256", 9]]}],
            "replicas": {"node1": [{"name": "ckpt_00000010.pt", "step": 10, "kind": "file",
                                    "files": [["ckpt_00000010.pt", 5], ["ckpt_00000010.pt.sha256", 9]]}]}}
    own, rep = pieces_of("node2", held)
    assert (own.holder, own.origin, own.files) == ("node2", "node2", {"__1_0.distcp", "MANIFEST.sha256"})
    assert own.manifest == {"__1_0.distcp"}
    assert (rep.holder, rep.origin, rep.kind, rep.step) == ("node2", "node1", "file", 10)

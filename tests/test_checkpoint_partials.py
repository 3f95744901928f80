"""The control machine's checkpoint copies leave no `.NAME.partial/` stage behind: a copy that fails
or breaks off drops its stage, clean_partials removes what an ended attempt left, and an FSDP
checkpoint gathered from several nodes stays staged only while its pieces arrive. Real files, a
stand-in for the Cluster (what it does is feed bytes and say whether the copy worked)."""

import hashlib
import io
import tarfile
from types import SimpleNamespace

import pytest

from orchestrator.runs.ckpt.given_home import ArtifactCopier, CheckpointStore

NAME = "ckpt_00000010"


def tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def fsdp_pieces():
    """Two nodes' pieces of one FSDP checkpoint directory: each holds its shard and the manifest."""
    shards = {"__0_0.distcp": b"zero" * 100, "__1_0.distcp": b"one" * 100, ".metadata": b"meta"}
    manifest = "".join(f"{hashlib.sha256(v).hexdigest()}  {k}\n" for k, v in sorted(shards.items())).encode()
    node0 = {f"{NAME}/__0_0.distcp": shards["__0_0.distcp"], f"{NAME}/.metadata": shards[".metadata"],
             f"{NAME}/MANIFEST.sha256": manifest}
    node1 = {f"{NAME}/__1_0.distcp": shards["__1_0.distcp"], f"{NAME}/MANIFEST.sha256": manifest}
    return tar(node0), tar(node1)


def partials(store):
    return sorted(p.name for p in store.dir.iterdir() if p.name.endswith(".partial"))


def test_a_broken_stream_and_a_torn_file_leave_no_stage(tmp_path):
    store = CheckpointStore(tmp_path)
    name = "ckpt_00000020.pt"
    good = b"weights" * 1000
    side = (hashlib.sha256(good).hexdigest() + "\n").encode()
    whole = tar({name: good, name + ".sha256": side})
    into = store.receiving(name)
    into.feed(whole[:3000])  # the connection dropped mid-file
    with pytest.raises(tarfile.TarError):
        store.finish(into, name, "file")
    assert partials(store) == []
    into = store.receiving(name)
    into.feed(tar({name: good[:-1], name + ".sha256": side}))
    assert not store.finish(into, name, "file") and partials(store) == []


def test_an_fsdp_checkpoint_stays_staged_while_its_pieces_arrive_and_clean_partials_drops_it(tmp_path):
    store = CheckpointStore(tmp_path)
    first, second = fsdp_pieces()
    into = store.receiving(NAME)
    into.feed(first)
    assert not store.finish(into, NAME, "dir") and partials(store) == [f".{NAME}.partial"]
    into = store.receiving(NAME)
    into.feed(second)
    assert store.finish(into, NAME, "dir") and store.newest() == NAME and partials(store) == []
    # an attempt ended with a piece still missing: the attempt's end removes the stage
    (store.dir / ".ckpt_00000020.partial" / "ckpt_00000020").mkdir(parents=True)
    (store.dir / ".ckpt_00000030.pt.partial").mkdir()
    assert store.clean_partials() == ["ckpt_00000020", "ckpt_00000030.pt"]
    assert partials(store) == [] and store.newest() == NAME


class FakeCluster:
    """cluster.run for `artifacts.py send`: feeds each node's stream, cut short where asked. No
    connections: the node code is not placed (node/form.py `place` finds nothing to do)."""

    connections: dict = {}

    def __init__(self, streams: dict[str, bytes], cut: set[str] = frozenset()):
        self.streams, self.cut, self.sent = streams, set(cut), []

    def run(self, cmd, *, stdin, nodes, timeout, capture, on_bytes):
        (node,) = nodes
        self.sent.append(node)
        data = self.streams[node]
        on_bytes(node, "stdout", data[: len(data) // 2] if node in self.cut else data)
        ok = node not in self.cut
        return {node: SimpleNamespace(ok=ok, exit_code=0 if ok else None, stderr="",
                                      describe=lambda: "connection lost" if not ok else "exit 0")}


def copier(tmp_path, cluster):
    return ArtifactCopier(cluster, tmp_path, {"n1": {"checkpoints": "/c"}, "n2": {"checkpoints": "/c"}},
                          say=lambda _line: None)


def test_a_copy_cut_off_drops_the_stage_and_every_piece_is_fetched_again(tmp_path):
    first, second = fsdp_pieces()
    cluster = FakeCluster({"n1": first, "n2": second}, cut={"n2"})
    c = copier(tmp_path, cluster)
    found = {"n1": [{"name": NAME, "kind": "dir"}], "n2": [{"name": NAME, "kind": "dir"}]}
    c.fetch_new(found)
    assert cluster.sent == ["n1", "n2"] and partials(c.store) == [] and c.store.newest() is None
    cluster.cut.clear()  # the next poll: n1's piece went with the stage, so it comes again
    c.fetch_new(found)
    assert cluster.sent == ["n1", "n2", "n1", "n2"] and c.store.newest() == NAME and partials(c.store) == []
    c.fetch_new(found)
    assert len(cluster.sent) == 4  # complete here: nothing fetched again


def test_pieces_dropped_by_clean_partials_are_fetched_again(tmp_path):
    first, second = fsdp_pieces()
    cluster = FakeCluster({"n1": first, "n2": second})
    c = copier(tmp_path, cluster)
    c.fetch_new({"n1": [{"name": NAME, "kind": "dir"}]})
    assert partials(c.store) == [f".{NAME}.partial"] and c.taken("n1", NAME)
    c.store.clean_partials()
    c.fetch_new({"n1": [{"name": NAME, "kind": "dir"}], "n2": [{"name": NAME, "kind": "dir"}]})
    assert cluster.sent == ["n1", "n1", "n2"] and c.store.newest() == NAME and partials(c.store) == []

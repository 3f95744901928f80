"""The sync data plane: the chunked tar stream, file selection, the method choice, the node-side
relay (token check, sha256 check), and relays on the real test cluster (gitignored data shipped
by `sync.include`, a corrupted stream detected, direct pushes when nodes cannot reach each other,
the tar path linear in size)."""

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.errors import InventoryError
from orchestrator.inventory import parse_inventory
from orchestrator.probe import local_argv
from orchestrator.sync import choose_methods, sync
from orchestrator.transfer.archive import CHUNK, TarStream, framed
from orchestrator.transfer.files import select_files
from orchestrator.transport import Cluster
from tests.conftest import scan



def data_tree(root: Path, mb: int = 3, files: int = 3) -> Path:
    """A nanoGPT-like checkout: code, a .gitignore that excludes the data, incompressible data."""
    (root / "data" / "shakespeare").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / ".gitignore").write_text("data/\n*.pkl\ninput.txt\n")
    for i in range(files):
        (root / "data" / "shakespeare" / f"train{i}.bin").write_bytes(os.urandom(mb * 1_000_000 // files))
    (root / "data" / "shakespeare" / "meta.pkl").write_bytes(b"meta")
    (root / "input.txt").write_text("text\n")
    return root


# ------------------------------------------------------------------ the stream and the choices


def test_tar_stream_is_chunked_valid_and_hashed(tmp_path):
    data_tree(tmp_path, mb=5, files=2)
    os.symlink("train.py", tmp_path / "link.py")
    files = select_files(str(tmp_path), ["data"]) + ["link.py", "vanished.bin"]
    stream = TarStream(str(tmp_path), files)
    chunks = list(stream)
    assert max(map(len, chunks)) <= 2 * CHUNK  # bounded: no whole-archive object
    blob = b"".join(chunks)
    assert stream.bytes == len(blob) and stream.sha256 == hashlib.sha256(blob).hexdigest()
    assert stream.skipped == ["vanished.bin"]
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r|") as tar:
        got = {m.name: (tar.extractfile(m).read() if m.isfile() else m.linkname) for m in tar}
    assert got["data/shakespeare/train0.bin"] == (tmp_path / "data/shakespeare/train0.bin").read_bytes()
    assert got["link.py"] == "train.py" and "vanished.bin" not in got


def test_include_ships_gitignored_paths_and_exclude_removes(tmp_path):
    data_tree(tmp_path)
    assert select_files(str(tmp_path)) == [".gitignore", "train.py"]
    with_data = select_files(str(tmp_path), ["data", "input.txt"])
    assert "data/shakespeare/train0.bin" in with_data and "data/shakespeare/meta.pkl" in with_data
    assert "input.txt" in with_data
    assert "data/shakespeare/meta.pkl" not in select_files(str(tmp_path), ["data"], ["*.pkl"])
    assert select_files(str(tmp_path), ["data/**/*.bin"], ["train1.bin", "data/shakespeare/train2*"]) == \
        [".gitignore", "data/shakespeare/train0.bin", "train.py"]


def test_inventory_sync_section():
    inv = parse_inventory("nodes: [{name: a, host: h}]\nsync: {include: [data], exclude: ['*.ckpt']}\n", "<t>")
    assert inv.sync.include == ["data"] and inv.select(["a"]).sync.exclude == ["*.ckpt"]
    for bad in ("{include: [/etc]}", "{include: [../up]}", "{inclde: [data]}"):
        with pytest.raises(InventoryError, match=r"<t>:2: sync\."):
            parse_inventory(f"nodes: [{{name: a, host: h}}]\nsync: {bad}\n", "<t>")


def test_auto_picks_rsync_only_for_small_updates():
    fresh = {"a": (100, True), "b": (100, True), "c": (100, False)}
    assert choose_methods("auto", True, fresh, 110) == {"a": "relay", "b": "relay", "c": "relay"}
    small = {"a": (3, True), "b": (3, True), "c": (100, False)}
    assert choose_methods("auto", True, small, 110) == {"a": "rsync", "b": "rsync", "c": "relay"}
    assert choose_methods("auto", False, small, 110) == {"a": "relay", "b": "relay", "c": "relay"}
    assert choose_methods("auto", True, {"a": (100, True)}, 110) == {"a": "rsync"}  # one node: same bytes
    assert choose_methods("rsync", True, small, 110)["c"] == "missing"
    assert set(choose_methods("tar", True, small, 110).values()) == {"tar"}


# ------------------------------------------------------------------ the node-side relay, locally


def _relay(tmp_path, *args):
    return subprocess.Popen(local_argv("relay", "recv", "abc123", str(tmp_path / "wd"), *args),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(p):
    p.stdin.close()
    out, err = p.stdout.read(), p.stderr.read()
    p.wait(timeout=30)
    return out, err


def test_relay_accepts_only_its_token_and_checks_the_digest(tmp_path):
    src = data_tree(tmp_path / "src", mb=1)
    files = select_files(str(src), ["data"])
    p = _relay(tmp_path, "--idle", "20")
    port = int(p.stdout.readline().split()[1])
    p.stdin.write(b"token goodtoken\nlast\nsource tcp\n")
    p.stdin.flush()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as bad:
        bad.sendall(b"badtoken!\n" + b"x" * 100)
        try:
            assert bad.recv(10) == b""  # closed without a word
        except ConnectionResetError:  # closed with our bytes unread
            pass
    stream = TarStream(str(src), files)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as good:
        good.sendall(b"goodtoken\n")
        for chunk in stream:
            good.sendall(chunk)
    p.stdin.write(f"sha256 {stream.sha256}\n".encode())
    out, err = _finish(p)
    assert p.returncode == 0, err
    assert out.decode().splitlines()[-1] == f"done {stream.bytes} {len(files)}"
    wd = tmp_path / "wd"
    assert (wd / "data/shakespeare/train1.bin").read_bytes() == (src / "data/shakespeare/train1.bin").read_bytes()
    assert sorted(os.listdir(wd)) == [".gitignore", "data", "train.py"]  # no staging left


def test_relay_refuses_a_stream_whose_digest_differs(tmp_path):
    src = data_tree(tmp_path / "src", mb=1)
    p = _relay(tmp_path, "--idle", "20")
    p.stdout.readline()
    stream = TarStream(str(src), select_files(str(src)))
    p.stdin.write(b"token t\nlast\nsource stdin\n" + b"".join(framed(stream)) + b"sha256 " + b"0" * 64 + b"\n")
    _, err = _finish(p)
    assert p.returncode == 1 and "corrupted on the way; nothing was written" in err.decode()
    assert os.listdir(tmp_path / "wd") == []


def _send(src, *names, idle="20"):
    return subprocess.Popen(local_argv("relay", "send", "abc124", str(src), *names, "--idle", idle),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_send_streams_a_checkpoint_node_to_node_and_reports_the_digest(tmp_path, kind):
    """`send` (the replica's source side) feeds `recv` over TCP with the receiver's token; the
    digest it prints is what the control machine announces to the receiver."""
    src = tmp_path / "src"
    src.mkdir()
    if kind == "file":
        (src / "ckpt_00000010.pt").write_bytes(os.urandom(300_000))
        (src / "ckpt_00000010.pt.sha256").write_text("x  ckpt_00000010.pt\n")
        want = ["ckpt_00000010.pt", "ckpt_00000010.pt.sha256"]
        name = "ckpt_00000010.pt"
    else:
        (src / "ckpt_00000010").mkdir()
        (src / "ckpt_00000010" / "__0_0.distcp").write_bytes(os.urandom(200_000))
        (src / "ckpt_00000010" / "MANIFEST.sha256").write_text("x  __0_0.distcp\n")
        want = ["ckpt_00000010"]
        name = "ckpt_00000010"
    (src / "ckpt_00000000.pt").write_bytes(b"older")  # not named: not sent
    r = _relay(tmp_path, "--idle", "20")
    port = int(r.stdout.readline().split()[1])
    r.stdin.write(b"token tok\nlast\nsource tcp\n")
    r.stdin.flush()
    s = _send(src, name)
    s.stdin.write(f"to 127.0.0.1 {port} tok\n".encode())
    out, err = _finish(s)
    assert s.returncode == 0, err
    word, nbytes, digest = out.decode().split()
    assert word == "sent" and int(nbytes) > 300_000 * (kind == "file")
    r.stdin.write(f"sha256 {digest}\n".encode())
    out, err = _finish(r)
    assert r.returncode == 0, err
    wd = tmp_path / "wd"
    assert sorted(os.listdir(wd)) == want
    for rel in ("ckpt_00000010.pt", "ckpt_00000010/__0_0.distcp"):
        if (src / rel).exists():
            assert (wd / rel).read_bytes() == (src / rel).read_bytes()


def test_send_refuses_what_is_not_a_checkpoint_and_a_wrong_token_gets_nothing(tmp_path):
    s = _send(tmp_path, "../etc")
    _, err = _finish(s)
    assert s.returncode == 1 and b"no checkpoint ../etc" in err
    (tmp_path / "ckpt_00000010.pt").write_bytes(b"x")
    r = _relay(tmp_path, "--idle", "3")
    port = int(r.stdout.readline().split()[1])
    r.stdin.write(b"token right\nlast\nsource tcp\n")
    r.stdin.flush()
    s = _send(tmp_path, "ckpt_00000010.pt", idle="3")
    s.stdin.write(f"to 127.0.0.1 {port} wrong\n".encode())
    _finish(s)
    _, err = _finish(r)
    assert r.returncode == 1 and b"no upstream node connected" in err
    assert os.listdir(tmp_path / "wd") == []


# ------------------------------------------------------------------ on the test cluster


@pytest.fixture(scope="module")
def cl():
    from tests.cluster import TestCluster, require_root

    require_root()
    with TestCluster(n=3, gpus=0, name_prefix="ccrl") as cluster:
        yield cluster


@pytest.fixture
def clean(cl):
    yield
    for nd in cl.nodes:
        nd.run("rm -rf ~/gpt_train ~/py-corrupt")


def _digest(node, path):
    return node.run(f"sha256sum ~/gpt_train/{path} | cut -c1-64").stdout.strip()


@pytest.mark.cluster
def test_gitignored_data_ships_when_the_inventory_includes_it(cl, clean, tmp_path, capsys):
    src = data_tree(tmp_path / "src")
    path = cl.write_inventory(tmp_path / "nodes.yaml", sync={"include": ["data"]})
    assert main(["sync", "-i", str(path), "--src", str(src), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(n["name"], n["ok"], n["method"]) for n in doc["nodes"]] == \
        [(nd.name, True, "relay") for nd in cl.nodes]
    assert all(n["bytes"] > 3_000_000 and n["error"] is None for n in doc["nodes"])
    assert doc["bytes_sent"] <= 1.1 * doc["tree_bytes"]  # each byte left this machine once
    want = hashlib.sha256((src / "data/shakespeare/train2.bin").read_bytes()).hexdigest()
    assert [_digest(nd, "data/shakespeare/train2.bin") for nd in cl.nodes] == [want] * 3
    assert "input.txt" not in cl.nodes[2].run("ls ~/gpt_train").stdout  # gitignored, not included


@pytest.mark.cluster
def test_a_corrupted_relay_stream_is_pushed_again_from_here_to_the_nodes_behind_it(cl, clean, tmp_path):
    """node1 flips one byte of what it forwards: node2 and node3 refuse the relayed stream (nothing
    written), and each gets it once more straight from the control machine, whole."""
    src = data_tree(tmp_path / "src")
    cl.nodes[0].run(f"printf '#!/bin/sh\\nCLUSTERCTL_RELAY_CORRUPT_AT=2000000 exec {cl.python} \"$@\"\\n' "
                    "> ~/py-corrupt && chmod +x ~/py-corrupt")
    raw = cl.inventory(sync={"include": ["data"]})
    raw["nodes"][0]["python"] = "~/py-corrupt"  # node1 flips one byte of what it forwards
    inv = parse_inventory(yaml.safe_dump(raw), "<t>")
    with Cluster(inv) as c:
        rep = sync(c, inv, str(src), method="relay")
    res = rep.results
    assert [(r.ok, r.method) for r in res] == [(True, "relay"), (True, "tar"), (True, "tar")], res
    again = [n for n in rep.notes if "pushed again from this machine" in n]
    assert again and again[0].startswith("node2, node3: the relayed stream failed (") and \
        "corrupted on the way; nothing was written" in again[0], rep.notes
    want = hashlib.sha256((src / "data/shakespeare/train0.bin").read_bytes()).hexdigest()
    assert [_digest(nd, "data/shakespeare/train0.bin") for nd in cl.nodes] == [want] * 3
    for nd in cl.nodes[1:]:  # no staging dir, no relay left running
        assert not [p for p in nd.run("ls -A ~/gpt_train").stdout.split() if p.startswith(".clusterctl-relay-")], \
            nd.name
        assert not [p for p, env in scan(nd.processes(), lambda p: p.environ()) if "CLUSTERCTL_XFER" in env]


@pytest.mark.cluster
def test_nodes_that_cannot_reach_each_other_get_direct_pushes(cl, clean, tmp_path):
    src = data_tree(tmp_path / "src", mb=1)
    rules = [(nd, other.host) for nd in cl.nodes for other in cl.nodes if other is not nd]
    for nd, peer in rules:
        nd.iptables("-I", "INPUT", "-s", peer, "-j", "DROP")
    try:
        inv = parse_inventory(yaml.safe_dump(cl.inventory(sync={"include": ["data"]})), "<t>")
        with Cluster(inv) as c:
            rep = sync(c, inv, str(src))
    finally:
        for nd, peer in rules:
            nd.iptables("-D", "INPUT", "-s", peer, "-j", "DROP")
    assert [(r.ok, r.method) for r in rep.results] == [(True, "tar")] * 3, rep.results
    assert [n for n in rep.notes if "cannot reach" in n and "directly from this machine" in n]
    assert rep.bytes_sent >= 3 * rep.tree_bytes  # every node fed from here
    want = hashlib.sha256((src / "data/shakespeare/train0.bin").read_bytes()).hexdigest()
    assert [_digest(nd, "data/shakespeare/train0.bin") for nd in cl.nodes] == [want] * 3


@pytest.mark.cluster
def test_tar_path_time_grows_linearly_with_size(cl, clean, tmp_path):
    """80 MB and 160 MB to one node over the tar path: the ratio of this process's CPU time is
    asserted, not seconds (it was quadratic: 80 MB took 47x the time of 10 MB, all of it paramiko
    re-slicing one big buffer in this process). CPU time, not wall time: the suite runs two test
    files at once, and another file's training run on the same cores stretched the wall-time
    ratio to 2.46 with nothing wrong; quadratic doubles it to 4."""
    inv = parse_inventory(yaml.safe_dump(cl.inventory(sync={"include": ["data"]})), "<t>").select(["node1"])
    best, wall = {}, {}
    with Cluster(inv) as c:
        for mb in (80, 160) * 2:
            src = tmp_path / f"s{mb}"
            if not src.exists():
                data_tree(src, mb=mb, files=mb // 10)
            cl.nodes[0].run("rm -rf ~/gpt_train")
            cpu = time.process_time()
            rep = sync(c, inv, str(src), method="tar")
            cpu = time.process_time() - cpu
            assert rep.ok and rep.results[0].method == "tar", rep.results
            best[mb] = min(best.get(mb, 1e9), cpu)
            wall[mb] = min(wall.get(mb, 1e9), rep.seconds)
    print(f"tar path to one node: 80 MB {wall[80]:.2f}s, {best[80]:.2f} CPU s; 160 MB {wall[160]:.2f}s, "
          f"{best[160]:.2f} CPU s; CPU ratio {best[160] / best[80]:.2f}")
    assert best[160] / best[80] <= 3.0

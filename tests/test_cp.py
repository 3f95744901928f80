"""`clusterctl cp` and `fetch RUN PATH` without the test cluster: the node program's `tree`, the
stream with directories and renames, the unpacker's links, the NODE:PATH rules, and whole copies
onto and off `connection: local` nodes (the same code paths as over SSH, without sshd)."""

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import jsonschema
import pytest

from orchestrator.cli.cp import split_side
from orchestrator.probe import load, local_argv
from orchestrator.transfer.archive import TarStream
from orchestrator.transfer.unpack import Unpacker

SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "orchestrator" / "schemas" / "cp.json").read_text())
CODES = load("artifacts")


def cli(*args, home):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, timeout=120,
                          env=dict(os.environ, CLUSTERCTL_HOME=str(home)))


def tree(root: Path) -> dict[str, object]:
    """rel -> bytes of a file, ("link", target) of a link, "dir" of a directory."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            rel = str(p.relative_to(root))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def make_tree(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "sub" / "all-bytes.bin").write_bytes(bytes(range(256)) * 9000 + os.urandom(1001))
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    os.symlink("sub/all-bytes.bin", root / "link")


def node_tree(spec: dict, cwd: Path) -> subprocess.CompletedProcess:
    """remote/artifacts.py `tree`, run as a node runs it (the node code's zip, probe.local_argv)."""
    return subprocess.run(local_argv("artifacts", "tree", json.dumps(spec)), stdin=subprocess.DEVNULL,
                          capture_output=True, cwd=cwd, env=dict(os.environ, HOME=str(cwd)), timeout=60)


# ------------------------------------------------------------------ the pieces


@pytest.mark.parametrize("arg,want", [("n1:x", ("n1", "x")), ("node[1-3]:~/d/", ("node[1-3]", "~/d/")),
                                      (":data", ("", "data")), ("n1:", ("n1", "")), ("./a:b", (None, "./a:b")),
                                      ("/tmp/x", (None, "/tmp/x")), ("plain", (None, "plain"))])
def test_a_node_side_has_no_slash_before_its_colon(arg, want):
    assert split_side(arg) == want


def test_the_stream_sends_directories_and_renames_its_top_entry(tmp_path):
    make_tree(tmp_path / "src")
    files = ["src", "src/empty", "src/link", "src/run.sh", "src/sub", "src/sub/all-bytes.bin"]
    names = {f: "dst" + f[3:] for f in files}
    data = b"".join(TarStream(str(tmp_path), files, dirs=True, names=names))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        got = {m.name: m.type for m in tar}
    assert got == {"dst": tarfile.DIRTYPE, "dst/empty": tarfile.DIRTYPE, "dst/link": tarfile.SYMTYPE,
                   "dst/run.sh": tarfile.REGTYPE, "dst/sub": tarfile.DIRTYPE, "dst/sub/all-bytes.bin": tarfile.REGTYPE}
    plain = b"".join(TarStream(str(tmp_path), files))  # sync's stream: no directory entries, no renames
    with tarfile.open(fileobj=io.BytesIO(plain)) as tar:
        assert [m.name for m in tar] == ["src/link", "src/run.sh", "src/sub/all-bytes.bin"]


def test_the_node_program_sends_a_tree_that_unpacks_to_the_same_tree(tmp_path):
    make_tree(tmp_path / "w" / "src")
    r = node_tree({"path": "w/src", "name": "copy"}, tmp_path)
    assert r.returncode == 0, r.stderr
    dest = tmp_path / "here"
    dest.mkdir()
    u = Unpacker(dest, tree=True)
    u.feed(r.stdout)
    assert u.close() is None and u.first == "copy"
    assert tree(dest / "copy") == tree(tmp_path / "w" / "src")
    assert os.access(dest / "copy" / "run.sh", os.X_OK)


def test_hard_links_arrive_as_two_whole_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"same inode")
    os.link(tmp_path / "d" / "a", tmp_path / "d" / "b")
    r = node_tree({"path": "d", "name": "d"}, tmp_path)
    dest = tmp_path / "here"
    dest.mkdir()
    u = Unpacker(dest, tree=True)
    u.feed(r.stdout)
    assert u.close() is None
    assert (dest / "d" / "a").read_bytes() == (dest / "d" / "b").read_bytes() == b"same inode"


def test_fetch_paths_are_found_in_the_artifacts_then_the_workdir_and_refused_outside(tmp_path):
    home = tmp_path / "home"
    (home / ".clusterctl" / "artifacts" / "r1" / "checkpoints").mkdir(parents=True)
    (home / "gpt_train" / "out").mkdir(parents=True)
    (home / "gpt_train" / "out" / "ckpt.pt").write_bytes(b"\0\1\2")
    os.symlink("/etc", home / "gpt_train" / "etc")
    (tmp_path / "elsewhere").mkdir()

    def names(path):
        r = node_tree({"path": path, "run": "r1", "workdir": "~/gpt_train"}, home)
        if r.returncode:
            return r.returncode, r.stderr.decode()
        with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
            return [m.name for m in tar]

    assert names("checkpoints") == ["artifacts/checkpoints"]
    assert names("out") == ["workdir/out", "workdir/out/ckpt.pt"]
    assert names("~/gpt_train/out/ckpt.pt") == ["workdir/out/ckpt.pt"]
    assert names(str(home / "gpt_train" / "out" / "ckpt.pt")) == ["workdir/out/ckpt.pt"]
    assert names("~/.clusterctl/artifacts/r1") == ["artifacts", "artifacts/checkpoints"]
    assert names("etc") == ["workdir/etc"]  # the link itself, never what it points at
    for outside in ("etc/passwd", str(tmp_path / "elsewhere"), "/etc/hostname"):
        code, err = names(outside)
        assert code == CODES.TREE_OUTSIDE and "lies outside" in err, outside
    code, err = names("out-shakespeare-char")
    assert code == CODES.TREE_MISSING and "gpt_train/out-shakespeare-char" in err


def test_the_unpacker_takes_links_only_for_a_tree_and_never_writes_through_one(tmp_path):
    def stream(*members):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, link, data in members:
                m = tarfile.TarInfo(name)
                if link is not None:
                    m.type, m.linkname = tarfile.SYMTYPE, link
                    tar.addfile(m)
                else:
                    m.size = len(data)
                    tar.addfile(m, io.BytesIO(data))
        return buf.getvalue()

    for i, (tree_mode, members) in enumerate([(False, [("l", "x", None)]),
                                              (True, [("out", str(tmp_path), None), ("out/evil", None, b"x")])]):
        dest = tmp_path / f"d{i}"
        dest.mkdir()
        u = Unpacker(dest, tree=tree_mode)
        u.feed(stream(*members))
        assert "refusing tar member" in (u.close() or ""), members
    assert not (tmp_path / "evil").exists()


# ------------------------------------------------------------------ whole copies, local nodes


@pytest.fixture
def local3(tmp_path):
    inv = tmp_path / "nodes.yaml"
    lines = ["nodes:"]
    for i in (1, 2, 3):
        (tmp_path / f"w{i}").mkdir()
        lines += [f"  - name: n{i}", "    connection: local", f"    workdir: {tmp_path}/w{i}", "    gpus: 0"]
    inv.write_text("\n".join(lines) + "\n")
    return str(inv)


@pytest.mark.slow
def test_a_tree_goes_onto_a_node_range_and_comes_back_the_same(tmp_path, local3):
    make_tree(tmp_path / "src")
    r = cli("cp", "-i", local3, "--json", str(tmp_path / "src"), "n[1-3]:data", home=tmp_path / "h")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["ok"] and doc["direction"] == "to_nodes" and [n["name"] for n in doc["nodes"]] == ["n1", "n2", "n3"]
    for i in (1, 2, 3):
        assert tree(tmp_path / f"w{i}" / "data") == tree(tmp_path / "src"), i
    r = cli("cp", "-i", local3, "n2:data", str(tmp_path / "back"), home=tmp_path / "h")
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "back") == tree(tmp_path / "src")
    # into an existing directory, under the source's name; a file renamed on the way
    r = cli("cp", "-i", local3, str(tmp_path / "src" / "sub" / "all-bytes.bin"), "n1:data/", home=tmp_path / "h")
    assert r.returncode == 0 and (tmp_path / "w1" / "data" / "all-bytes.bin").exists()
    r = cli("cp", "-i", local3, str(tmp_path / "src" / "run.sh"), "n1:renamed.sh", home=tmp_path / "h")
    assert r.returncode == 0 and (tmp_path / "w1" / "renamed.sh").read_bytes() == (tmp_path / "src" / "run.sh").read_bytes()


@pytest.mark.slow
def test_a_missing_path_or_a_bad_spec_is_one_paragraph_and_an_exit_code(tmp_path, local3):
    r = cli("cp", "-i", local3, "--json", "n1:nosuch", str(tmp_path / "x"), home=tmp_path / "h")
    assert r.returncode == 1 and b"nosuch does not exist on n1" in r.stderr and b"Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["nodes"][0]["error_kind"] == "missing" and not doc["ok"]
    for args in (["a", "b"], ["n1:a", "n2:b"], ["n9:a", "."], ["n[3-1]:a", "."], [str(tmp_path / "none"), "n1:x"]):
        r = cli("cp", "-i", local3, *args, home=tmp_path / "h")
        assert r.returncode == 2 and b"Traceback" not in r.stderr and r.stderr.count(b"\n") <= 2, (args, r.stderr)

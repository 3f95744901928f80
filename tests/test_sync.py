"""clusterctl sync: the file list, the rsync command line, and pushes to the real test cluster
(rsync and tar paths) after which code_sync passes."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from orchestrator.checks import load_nodeinfo
from orchestrator.cli import main
from orchestrator.inventory import parse_inventory
from orchestrator.checks.preflight import run_preflight
from orchestrator.sync import file_list, rsync_argv, ssh_argv, sync
from orchestrator.transfer.files import run_outputs, select_files
from orchestrator.transport import Cluster


def make_tree(root, git=False):
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "pkg" / "model.py").write_text("x = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / ".gitignore").write_text("data/\n*.pt\n!keep.pt\n/out\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 100)
    (root / "w.pt").write_text("weights")
    (root / "keep.pt").write_text("kept")
    (root / "out").mkdir()
    (root / "out" / "log").write_text("log")
    (root / "pkg" / "out").mkdir()
    (root / "pkg" / "out" / "x").write_text("not anchored: shipped")
    if git:
        env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                   GIT_COMMITTER_EMAIL="t@t")
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        subprocess.run(["git", "-C", str(root), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(root), "commit", "-qm", "x"], check=True, env=env)
        (root / "untracked.py").write_text("new\n")


EXPECTED = [".gitignore", "keep.pt", "pkg/model.py", "pkg/out/x", "run.sh", "train.py"]


def test_file_list_honours_gitignore(tmp_path):
    make_tree(tmp_path)
    assert file_list(str(tmp_path)) == EXPECTED


def test_git_tree_and_plain_copy_hash_the_same(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_tree(a, git=True)
    make_tree(b)
    (b / "untracked.py").write_text("new\n")
    ni = load_nodeinfo()
    da, db = ni.digest(str(a)), ni.digest(str(b))
    assert da["kind"] == "git" and db["kind"] == "tree"
    assert da["digest"] == db["digest"] and da["dirty"] is True
    assert sorted(file_list(str(a))) == sorted(EXPECTED + ["untracked.py"])
    (b / "run.sh").chmod(0o644)  # the executable bit counts
    assert ni.digest(str(b))["digest"] != da["digest"]


@pytest.mark.parametrize("git", [False, True], ids=["tree", "git"])
def test_a_named_output_directory_is_neither_code_nor_pruned_and_nothing_marks_it(tmp_path, git):
    """A run's output dir inside the workdir differs per node: named as an output, it is not code,
    and neither the digest nor the prune writes anything into it. An older clusterctl's mark
    (.clusterctl-dir-id) is not code either, and no longer makes a directory an output."""
    root = tmp_path / "wd"
    make_tree(root, git=git)
    ni = load_nodeinfo()
    before = ni.digest(str(root))
    (root / "pkg" / "ckpts").mkdir()
    (root / "pkg" / "ckpts" / "state.json").write_text("weights")
    assert ni.digest(str(root))["digest"] != before["digest"]  # not named: it counts as code
    (root / "pkg" / "ckpts" / ".clusterctl-dir-id").write_text("id")
    (root / "pkg" / "ckpts" / "sub").mkdir()
    (root / "pkg" / "ckpts" / "sub" / "events").write_text("tb")
    assert ni.digest(str(root))["digest"] != before["digest"]  # the old mark alone: still code
    assert ni.digest(str(root), {"pkg/ckpts"}) == before
    (root / "pkg" / "ckpts" / ".clusterctl-dir-id").unlink()
    ni.prune(str(root), "\0".join(EXPECTED).encode(), {"pkg/ckpts"})
    assert (root / "pkg" / "ckpts" / "state.json").exists() and (root / "pkg" / "ckpts" / "sub" / "events").exists()
    assert not (root / "pkg" / "ckpts" / ".clusterctl-dir-id").exists()


@pytest.mark.parametrize("git", [False, True], ids=["tree", "git"])
def test_the_trainers_output_dir_in_the_workdir_is_not_code(tmp_path, git):
    """The bundled trainer writes out/ (checkpoints, logs) inside the workdir by default, and each
    node's differs: code_sync's digest, sync's file list and its prune leave it out."""
    root = tmp_path / "wd"
    make_tree(root, git=git)
    (root / ".gitignore").write_text("data/\n")  # nothing ignores out/ here
    inv = parse_inventory(yaml.safe_dump({"workdir": str(root), "nodes": [{"name": "a", "host": "h"}]}), "<t>")
    outs = run_outputs(inv, inv.nodes[0])
    assert outs == ["out"]
    ni = load_nodeinfo()
    (root / "out" / "log").unlink()
    before = ni.digest(str(root), set(outs))
    (root / "out" / "ckpt_00000010.pt").write_text("weights")
    (root / "out" / "logs").mkdir()
    (root / "out" / "logs" / "events").write_text("tb")
    assert ni.digest(str(root))["digest"] != before["digest"]  # named by nobody, it would count as code
    assert ni.digest(str(root), set(outs)) == before
    assert not any(f.startswith("out/") for f in select_files(str(root), outputs=outs))
    ni.prune(str(root), "\0".join(select_files(str(root))).encode(), set(outs))
    assert (root / "out" / "ckpt_00000010.pt").exists() and not (root / "out" / ".clusterctl-dir-id").exists()
    assert ni.digest(str(root), set(outs)) == before  # the probe is given the same outputs (--output)


def test_run_outputs_follow_the_inventory(tmp_path):
    def outs(**kw):
        inv = parse_inventory(yaml.safe_dump({"workdir": "~/w", "nodes": [{"name": "a", "host": "h"}], **kw}), "<t>")
        return run_outputs(inv, inv.nodes[0])

    assert outs(train={"args": ["--output-dir", "ckpt/run1"]}) == ["ckpt/run1"]
    assert outs(train={"args": ["--output-dir=o"], "output_dir": "/abs"}, output_dir="~/w/x") == ["o", "x"]
    assert outs(train={"script": "train.py"}) == []  # not the trainer: nothing assumed
    assert outs(output_dir="~/elsewhere", train={"module": "mypkg"}) == []


def test_rsync_command_line_carries_the_inventory_ssh_settings():
    inv = parse_inventory(yaml.safe_dump({
        "ssh": {"user": "u", "port": 2222, "identity_file": "/k/id", "known_hosts": "/k/kh",
                "proxy_jump": "jump@bastion:22"},
        "workdir": "~/gpt train", "nodes": [{"name": "a", "host": "10.0.0.1"}]}), "<t>")
    argv = rsync_argv("/src", inv.nodes[0])
    assert argv[-2:] == ["/src/", "u@10.0.0.1:gpt train/"] and "--files-from=-" in argv
    e = argv[argv.index("-e") + 1]
    for want in ('IdentityFile="/k/id"', "-p 2222", 'UserKnownHostsFile="/k/kh"', "StrictHostKeyChecking=yes",
                 "BatchMode=yes"):
        assert want in e
    assert "-J" not in e.split()  # -J would give the jump hop none of these options


def test_rsync_splits_the_ssh_command_into_exactly_our_words(tmp_path):
    """rsync, not a shell, splits -e: run the real rsync with a fake ssh that records its argv."""
    odd = tmp_path / "it's 100% a \"dir\"" / "known hosts"
    inv = parse_inventory(yaml.safe_dump({
        "ssh": {"user": "u", "port": 2222, "identity_file": str(odd.parent / "id key"),
                "known_hosts": str(odd), "proxy_jump": "j@bastion:2200,k@[fd00::1]:22"},
        "workdir": "~/w", "nodes": [{"name": "a", "host": "10.0.0.1"}]}), "<t>")
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\nsys.exit(1)\n")
    fake.chmod(0o755)
    (tmp_path / "src").mkdir()
    subprocess.run(rsync_argv(str(tmp_path / "src"), inv.nodes[0]), input=b"", capture_output=True,
                   env=dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}"), timeout=30)
    got = json.loads((tmp_path / "argv.json").read_text())
    want = ssh_argv(inv.nodes[0])[1:]
    assert got[:len(want)] == want and got[len(want):len(want) + 4] == ["-l", "u", "10.0.0.1", "rsync"], got
    assert f'UserKnownHostsFile="{str(odd).replace("%", "%%").replace(chr(34), chr(92) + chr(34))}"' in got
    proxy = next(a for a in got if a.startswith("ProxyCommand="))
    # the ProxyCommand is run by sh -c: its words are the second hop's ssh with the same options,
    # reached through the first hop by a nested ProxyCommand
    words = shlex.split(proxy[len("ProxyCommand="):])
    assert words[0] == "ssh" and words[-3:] == ["-W", "[%h]:%p", "fd00::1"]
    assert "-l" in words and words[words.index("-l") + 1] == "k"
    assert any(w.startswith("UserKnownHostsFile=") and "%%%%" in w for w in words)  # escaped twice
    inner = next(w for w in words if w.startswith("ProxyCommand="))
    assert "-p 2200" in inner and "-l j" in inner and inner.endswith("-W '[%%h]:%%p' bastion")


@pytest.fixture(scope="module")
def cl():
    from tests.cluster import TestCluster, require_root

    require_root()
    with TestCluster(n=3, gpus=0, name_prefix="ccsy") as cluster:
        yield cluster


@pytest.mark.cluster
@pytest.mark.parametrize("method", ["tar", "rsync"])
def test_sync_pushes_and_code_sync_passes(cl, tmp_path, method, capsys):
    src = tmp_path / "src"
    make_tree(src, git=True)
    # a stale file on one node is removed; its ignored data stays
    cl.nodes[1].run("mkdir -p ~/gpt_train/data && echo stale > ~/gpt_train/stale.py && "
                    "echo keep > ~/gpt_train/data/x")
    inv = parse_inventory(yaml.safe_dump(cl.inventory()), "<t>")
    with Cluster(inv) as c:
        before = run_preflight(c, inv, ["code_sync"], control_dir=str(src))
        res = sync(c, inv, str(src), method=method).results
        after = run_preflight(c, inv, ["code_sync"], control_dir=str(src))
        assert c.handshakes == 3
    assert not before.ok
    assert [r.method for r in res] == [method] * 3 and all(r.ok for r in res), res
    assert after.ok, after.to_json()
    out = cl.nodes[1].run("cd ~/gpt_train && ls -a && cat data/x && test -x run.sh && echo X").stdout
    assert "stale.py" not in out and "keep" in out and "X" in out and "w.pt" not in out
    cl.nodes[1].run("rm -rf ~/gpt_train")


@pytest.mark.cluster
def test_sync_command(cl, tmp_path, capsys):
    src = tmp_path / "src"
    make_tree(src)
    path = cl.write_inventory(tmp_path / "nodes.yaml")
    assert main(["sync", "-i", str(path), "--src", str(src)]) == 0
    assert "code_sync passes" in capsys.readouterr().err
    assert main(["sync", "-i", str(path), "--src", str(tmp_path / "missing")]) == 2


@pytest.mark.cluster
def test_rsync_through_a_jump_host_with_odd_known_hosts_and_identity_paths(cl, tmp_path):
    """The target drops the control machine's packets, so rsync must go through the jump host;
    root's own ~/.ssh knows neither host nor key: both hops need the inventory's files, whose
    paths hold a space, a quote and a %."""
    src = tmp_path / "src"
    make_tree(src)
    odd = tmp_path / "it's 100% a dir"
    odd.mkdir()
    shutil.copy(cl.known_hosts, odd / "known hosts")
    shutil.copy(cl.identity_file, odd / "id key")
    jump, target = cl.nodes[0], cl.nodes[2]
    ssh = {**cl.inventory()["ssh"], "known_hosts": str(odd / "known hosts"), "identity_file": str(odd / "id key")}
    inv = parse_inventory(yaml.safe_dump(cl.inventory(ssh=ssh, nodes=[
        {"name": "node3", "host": target.host, "ssh": {"proxy_jump": f"{cl.user}@{jump.host}"}}])), "<t>")
    target.iptables("-A", "INPUT", "-s", cl.host_ip, "-j", "DROP")
    try:
        with Cluster(inv) as c:
            res = sync(c, inv, str(src), method="rsync").results
        assert [(r.method, r.ok) for r in res] == [("rsync", True)], res
        assert target.run("cat ~/gpt_train/train.py").stdout == "print('train')\n"

        # the jump hop verifies its host key against the same file: without its line, refused
        (odd / "known hosts").write_text("".join(
            ln for ln in open(cl.known_hosts) if not ln.startswith(jump.host + " ")))
        p = subprocess.run(rsync_argv(str(src), inv.nodes[0]), input=b"train.py", capture_output=True,
                           timeout=60)
        assert p.returncode != 0 and b"Host key verification failed" in p.stderr, p.stderr
    finally:
        target.iptables("-D", "INPUT", "-s", cl.host_ip, "-j", "DROP")
        target.run("rm -rf ~/gpt_train")


def test_sync_refuses_to_mirror_into_the_directory_it_runs_in(tmp_path, monkeypatch, capsys):
    """The embedded default's local nodes have `workdir: .`: a sync from elsewhere would replace the
    directory the user stands in and prune everything the source lacks."""
    from orchestrator.cli import main

    src, here = tmp_path / "src", tmp_path / "here"
    src.mkdir()
    (src / "train.py").write_text("print('x')\n")
    here.mkdir()
    (here / "precious.txt").write_text("keep me\n")
    monkeypatch.chdir(here)
    rc = main(["sync", "--src", str(src)])
    err = capsys.readouterr().err
    assert rc == 2 and "holds the current directory" in err, err
    assert (here / "precious.txt").read_text() == "keep me\n" and not (here / "train.py").exists()


def test_a_push_waits_out_the_second_its_newest_file_was_written_in(tmp_path):
    from orchestrator.sync import wait_out_the_newest_second

    (tmp_path / "a.py").write_text("a")
    (tmp_path / "b.py").write_text("b")
    os.utime(tmp_path / "a.py", (1000.2, 1000.2))
    os.utime(tmp_path / "b.py", (1000.7, 1000.7))
    slept = []
    # written earlier in the current second: wait until it is over
    assert wait_out_the_newest_second(str(tmp_path), ["a.py", "b.py", "gone.py"], clock=lambda: 1000.75,
                                      sleep=slept.append) == pytest.approx(0.25)
    assert slept == [pytest.approx(0.25)]
    # written in an earlier second, or stamped in the future: nothing to wait for
    assert wait_out_the_newest_second(str(tmp_path), ["a.py", "b.py"], clock=lambda: 1001.0,
                                      sleep=slept.append) == 0.0
    assert wait_out_the_newest_second(str(tmp_path), ["a.py", "b.py"], clock=lambda: 999.9,
                                      sleep=slept.append) == 0.0
    assert wait_out_the_newest_second(str(tmp_path), [], clock=lambda: 1000.5, sleep=slept.append) == 0.0
    assert len(slept) == 1


@pytest.mark.slow
def test_a_same_size_edit_in_the_second_of_the_last_sync_is_pushed(tmp_path, monkeypatch):
    """CI's failure at 77c278d: write, sync, edit to the same size, all in one second. The copy
    carried that second's mtime, the second sync's quick check (size and whole-second mtime, like
    rsync's) saw nothing changed, and code_sync failed after a push that said ok. Starting just past
    a second boundary puts all three in one second unless the push waits the second out."""
    import time

    monkeypatch.setenv("HOME", str(tmp_path))
    src = tmp_path / "src"
    src.mkdir()
    inv = parse_inventory(f"nodes:\n  - {{name: n0, connection: local, gpus: 0, workdir: '{tmp_path}/w0'}}\n")
    time.sleep(1.02 - time.time() % 1)
    (src / "train.py").write_text("print('v1')\n")
    with Cluster(inv) as c:
        first = sync(c, inv, str(src))
        (src / "train.py").write_text("print('v2')\n")
        second = sync(c, inv, str(src))
        code = run_preflight(c, inv, ["code_sync"], control_dir=str(src))
    assert first.ok and second.ok, (first, second)
    assert (tmp_path / "w0" / "train.py").read_text() == "print('v2')\n"
    assert code.ok, code.to_json()


def test_preflights_probe_leaves_its_output_directory_out_of_the_digest(tmp_path):
    """code_sync's probe hands nodeinfo preflight's output directory (`output_dir:`): not code
    even before anything marked it."""
    from orchestrator.checks.preflight import probe_locally
    from orchestrator.checks.python import node_info

    root = tmp_path / "wd"
    make_tree(root)
    want = load_nodeinfo().digest(str(root), listing=True)
    (root / "ckpts").mkdir()
    (root / "ckpts" / "state.pt.json").write_text("weights")
    inv = parse_inventory(yaml.safe_dump({"workdir": str(root), "output_dir": "ckpts", "nodes": [
        {"name": "a", "connection": "local"}]}), "<t>")
    info, why = node_info(probe_locally(inv, inv.nodes[0], ["code_sync"]))
    assert info is not None, why
    assert info["code"] == want and load_nodeinfo().digest(str(root), listing=True) != want
    assert sorted(os.listdir(root / "ckpts")) == ["state.pt.json"]  # the probe only reads


# ------------------------------------------------------------------ which directory sync pushes


def test_the_source_is_src_then_sync_src_then_the_checkout_of_the_current_directory(tmp_path):
    from orchestrator.errors import UsageError
    from orchestrator.transfer.files import code_source, require_code_source

    proj = tmp_path / "proj"
    make_tree(proj, git=True)
    (proj / "pkg" / "deep").mkdir()
    plain = tmp_path / "plain"
    plain.mkdir()
    inv_path = tmp_path / "nodes.yaml"
    inv_path.write_text(yaml.safe_dump({"nodes": [{"name": "a", "host": "h"}]}))
    inv = parse_inventory(inv_path.read_text(), str(inv_path))
    assert code_source(inv, cwd=str(proj / "pkg" / "deep")) == str(proj)  # git rev-parse --show-toplevel
    assert code_source(inv, cwd=str(plain)) is None
    assert code_source(inv, src=str(plain), cwd=str(proj)) == str(plain)
    inv_path.write_text(yaml.safe_dump({"nodes": [{"name": "a", "host": "h"}], "sync": {"src": "plain"}}))
    with_src = parse_inventory(inv_path.read_text(), str(inv_path))
    assert code_source(with_src, cwd=str(proj)) == str(plain)  # relative to the inventory's directory
    with pytest.raises(UsageError) as e:
        require_code_source(inv, cwd=str(plain))
    assert "not inside a git checkout" in str(e.value) and "--src DIR" in str(e.value) and e.value.exit_code == 2


def test_without_git_here_the_error_says_so(tmp_path, monkeypatch):
    from orchestrator.errors import UsageError
    from orchestrator.transfer.files import require_code_source

    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    inv = parse_inventory(yaml.safe_dump({"nodes": [{"name": "a", "host": "h"}]}), "<t>")
    with pytest.raises(UsageError) as e:
        require_code_source(inv, cwd=str(tmp_path))
    assert "git is not installed on this machine" in str(e.value)


def test_sync_outside_a_checkout_is_one_paragraph(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump({"nodes": [{"name": "a", "host": "h"}]}))
    assert main(["sync", "-i", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not inside a git checkout" in err and "Traceback" not in err, err


def test_the_control_listing_is_syncs_selection(tmp_path):
    """code_sync's reference is exactly what sync ships: include in, exclude out, outputs out."""
    from orchestrator.transfer.files import control_code

    root = tmp_path / "wd"
    make_tree(root, git=True)
    inv = parse_inventory(yaml.safe_dump({"workdir": "~/w", "nodes": [{"name": "a", "host": "h"}],
                                          "sync": {"include": ["data"], "exclude": ["run.sh"]}}), "<t>")
    got = control_code(inv, str(root))
    want = select_files(str(root), ["data"], ["run.sh"], run_outputs(inv, inv.nodes[0]))
    assert sorted(got["hashes"]) == want and "data/big.bin" in want and "run.sh" not in want
    assert got["source"] == str(root) and got["files"] == len(want)

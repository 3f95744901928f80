"""Code is what `sync` ships; everything else in a workdir is output (orchestrator/remote/nodeinfo.py,
transfer/files.py). The control machine's selection leaves out what git does not track in the
folders tools write by default and the inventory's own files; a pushed node's code is the list its
last push recorded, so what a job writes there (on one rank or all) never counts, is never pruned,
and never reaches a spare."""

import os
import subprocess

import pytest
import yaml

from orchestrator.checks.preflight import run_preflight
from orchestrator.inventory import parse_inventory
from orchestrator.probe import load_nodeinfo
from orchestrator.transfer.files import control_code, private_files, select_files
from orchestrator.transport import Cluster

ni = load_nodeinfo()

TOOL_WRITES = ["lightning_logs/version_0/hparams.yaml", "lightning_logs/version_0/metrics.csv",
               "wandb/run-20261128_120000-abc/files/config.yaml", "runs/Nov28_12-00-00_n1/events.out.tfevents.1",
               "outputs/2026-11-28/12-00-00/.hydra/config.yaml", "multirun/2026-11-28/12-00-00/0/main.log",
               "pkg/__pycache__/model.cpython-311.pyc"]


def git(root, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", "-C", str(root), *args], check=True, env=env, capture_output=True)


def write(root, rel, text="x\n"):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def project(root, use_git):
    """train.py, pkg/model.py, a tracked runs/launch.py (a package that happens to be named runs)
    and a .gitignore that knows nothing of the tools' folders."""
    for rel in ("train.py", "pkg/model.py", "runs/launch.py"):
        write(root, rel, f"# {rel}\n")
    write(root, ".gitignore", "data/\n")
    if use_git:
        git(root.parent, "init", "-q", str(root))
        git(root, "add", "-A")
        git(root, "commit", "-qm", "code")


def test_in_a_checkout_what_git_does_not_track_in_the_tools_folders_is_output(tmp_path):
    root = tmp_path / "proj"
    project(root, use_git=True)
    before = ni.digest(str(root), listing=True)
    for rel in TOOL_WRITES:
        write(root, rel)
    write(root, "new_module.py")  # untracked, not ignored, outside those folders: code sync would ship
    got = ni.digest(str(root), listing=True)
    assert sorted(got["hashes"]) == sorted([*before["hashes"], "new_module.py"]), got["hashes"]
    assert "runs/launch.py" in got["hashes"]  # tracked there: code, whatever the folder's name
    assert select_files(str(root)) == sorted(got["hashes"])
    git(root, "add", "lightning_logs/version_0/hparams.yaml")  # tracked on purpose: code
    assert "lightning_logs/version_0/hparams.yaml" in select_files(str(root))
    # and `sync --include` ships a tool's folder when asked
    assert "wandb/run-20261128_120000-abc/files/config.yaml" in select_files(str(root), ["wandb"])


def test_a_plain_tree_tracks_nothing_so_the_tools_folders_are_output(tmp_path):
    root = tmp_path / "plain"
    project(root, use_git=False)
    for rel in TOOL_WRITES:
        write(root, rel)
    files = select_files(str(root))
    assert files == [".gitignore", "pkg/model.py", "train.py"], files
    assert ni.digest(str(root))["files"] == 3


def pushed(tmp_path, files):
    """A node's workdir after a push of `files` (copied from a checkout, pruned, list recorded)."""
    src, wd = tmp_path / "src", tmp_path / "node"
    project(src, use_git=True)
    for rel in files:
        if not (src / rel).exists():
            write(src, rel)
        write(wd, rel, (src / rel).read_text())
    ni.prune(str(wd), "\0".join(files).encode(), set())
    return src, wd


def test_a_pushed_workdirs_code_is_the_list_its_push_recorded(tmp_path, capsys):
    files = [".gitignore", "pkg/model.py", "runs/launch.py", "train.py"]
    src, wd = pushed(tmp_path, files)
    assert (wd / ".clusterctl-code").exists()
    want = ni.digest(str(src), listing=True)
    got = ni.digest(str(wd), listing=True, pushed=True)
    assert got["kind"] == "pushed" and got["hashes"] == want["hashes"] and got["digest"] == want["digest"]
    # rank 0's logs, a job's own files anywhere, data: none of it is code on a node
    for rel in [*TOOL_WRITES, "metrics.csv", "pkg/results/epoch1.json", "out/ckpt/last.ckpt"]:
        write(wd, rel)
    assert ni.digest(str(wd), listing=True, pushed=True) == got
    # an edit of pushed code is seen, and so is a pushed file gone
    write(wd, "train.py", "edited\n")
    assert ni.digest(str(wd), pushed=True)["digest"] != got["digest"]
    (wd / "train.py").unlink()
    assert "train.py" not in ni.digest(str(wd), listing=True, pushed=True)["hashes"]
    # what a donor node lists for a spare: the pushed files only
    write(wd, "train.py", "# train.py\n")
    capsys.readouterr()
    assert ni.main(["select", str(wd)]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"] == files and doc["code"]["digest"] == want["digest"]
    # the control machine never reads a push's list
    assert ni.digest(str(wd))["kind"] == "tree"


def test_a_push_prunes_only_what_the_previous_push_shipped(tmp_path):
    files = [".gitignore", "old.py", "pkg/model.py", "train.py"]
    src, wd = pushed(tmp_path, files + ["data/shakespeare.bin"])  # data shipped once with --include
    for rel in ["lightning_logs/version_0/metrics.csv", "metrics.csv", "pkg/results.json"]:
        write(wd, rel)  # a job's outputs, none ignored by .gitignore
    ni.prune(str(wd), "\0".join([".gitignore", "pkg/model.py", "train.py"]).encode(), set())
    left = sorted(str(p.relative_to(wd)) for p in wd.rglob("*") if p.is_file())
    assert left == [".clusterctl-code", ".gitignore", "data/shakespeare.bin", "lightning_logs/version_0/metrics.csv",
                    "metrics.csv", "pkg/model.py", "pkg/results.json", "train.py"], left
    assert ni.pushed_files(str(wd)) == [".gitignore", "pkg/model.py", "train.py"]


def test_a_workdir_no_push_recorded_loses_stale_code_but_not_the_tools_folders(tmp_path):
    wd = tmp_path / "node"
    for rel in ["train.py", "stale.py", "lightning_logs/version_0/metrics.csv", "wandb/latest-run/x",
                "pkg/__pycache__/m.pyc", "data/keep.bin"]:
        write(wd, rel)
    write(wd, ".gitignore", "data/\n")
    ni.prune(str(wd), b".gitignore\0train.py", set())
    left = sorted(str(p.relative_to(wd)) for p in wd.rglob("*") if p.is_file())
    assert left == [".clusterctl-code", ".gitignore", "data/keep.bin", "lightning_logs/version_0/metrics.csv",
                    "pkg/__pycache__/m.pyc", "train.py", "wandb/latest-run/x"], left


def inventory_in(root, **ssh):
    path = root / "nodes.yaml"
    path.write_text(yaml.safe_dump({"workdir": str(root), "ssh": ssh,
                                    "nodes": [{"name": "a", "connection": "local", "gpus": 0}]}))
    return parse_inventory(path.read_text(), str(path))


def test_the_inventory_and_the_files_it_names_are_never_code(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    project(root, use_git=True)
    write(root, "keys/id_ed25519", "PRIVATE\n")
    write(root, "keys/id_ed25519.pub", "ssh-ed25519 AAAA\n")
    write(root, "keys/known_hosts", "h ssh-ed25519 AAAA\n")
    monkeypatch.chdir(root)  # identity_file as written: relative to where clusterctl runs
    inv = inventory_in(root, identity_file="keys/id_ed25519", known_hosts=str(root / "keys" / "known_hosts"),
                       config_file="~/nowhere/config")
    git(root, "add", "nodes.yaml")  # tracked, even
    assert private_files(inv, str(root)) == {"nodes.yaml", "keys/id_ed25519", "keys/id_ed25519.pub",
                                             "keys/known_hosts"}
    assert private_files(inv, str(tmp_path / "elsewhere")) == set()
    code = control_code(inv, str(root))
    assert sorted(code["hashes"]) == [".gitignore", "pkg/model.py", "runs/launch.py", "train.py"], code["hashes"]
    (root / "nodes.yaml").write_text((root / "nodes.yaml").read_text() + "# edited\n")
    assert control_code(inv, str(root))["digest"] == code["digest"]


def test_a_local_node_working_in_the_checkout_itself_matches_it(tmp_path, monkeypatch):
    """The workdir is the source (no push, no list): its probe leaves out the tracked inventory
    (--never) and the untracked logs a run there wrote, as the control machine does."""
    root = tmp_path / "proj"
    project(root, use_git=True)
    monkeypatch.chdir(root)
    inv = inventory_in(root)
    git(root, "add", "nodes.yaml")
    git(root, "commit", "-qm", "inventory")
    for rel in TOOL_WRITES:
        write(root, rel)
    assert private_files(inv, str(root)) == {"nodes.yaml"}
    with Cluster(inv) as c:
        report = run_preflight(c, inv, ["code_sync"], control_dir=str(root))
    r = report.nodes[0].results["code_sync"]
    assert r.status == "ok", r.detail


@pytest.mark.parametrize("name", ["runs", "outputs"])
def test_only_the_top_level_folder_is_a_tools(tmp_path, name):
    """A package's own `runs/` or `outputs/` deeper down is code even untracked (a new module)."""
    root = tmp_path / "proj"
    project(root, use_git=True)
    write(root, f"pkg/{name}/new.py")
    assert f"pkg/{name}/new.py" in select_files(str(root))


def test_a_directory_a_job_made_where_a_pushed_file_was_is_left_alone(tmp_path):
    src, wd = pushed(tmp_path, [".gitignore", "report", "train.py"])
    (wd / "report").unlink()
    write(wd, "report/epoch1.txt")  # the job's own folder, named like a file the last push shipped
    ni.prune(str(wd), b".gitignore\0train.py", set())
    assert (wd / "report" / "epoch1.txt").exists()

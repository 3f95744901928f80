"""Private by default, on the real test cluster: once a short run has finished, another local user
can read none of its files, on the control machine nor on a node, while the run's user still can;
with the inventory's `share_with_group: true` a member of the user's group reads them (all but
spec.json, which holds the inventory's env), and still no one else."""

import grp
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import kill_supervisors
from tests.test_train_cluster import cli

pytestmark = pytest.mark.cluster

JOB = str(Path(__file__).parent / "scripts" / "stream_job.py")  # a log, checkpoints and TensorBoard bytes


def torchruns(path: Path) -> bool:
    """Inside the directory torchrun made for itself under the run's torchrun/ (--log-dir)."""
    parts = path.parts
    return "torchrun" in parts and parts.index("torchrun") < len(parts) - 1


def useradd(name: str, *groups: str) -> str:
    subprocess.run(["userdel", name], capture_output=True)  # left by a killed earlier run of this test
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", "--user-group",
                    *(["--groups", ",".join(groups)] if groups else []), name], check=True, capture_output=True)
    return name


@pytest.fixture
def users(make_cluster):
    """A 2-node cluster and two more local users: `outsider` (no group of the run's user) and
    `member` (in the group of the nodes' user); both removed after the test."""
    cluster = make_cluster(2, gpus=0)
    group = grp.getgrgid(cluster.pw.pw_gid).gr_name
    tag = str(os.getpid())[-6:]
    made = [useradd(f"ccpo{tag}"), useradd(f"ccpm{tag}", group)]
    yield cluster, made[0], made[1]
    for name in made:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def open_home(users, monkeypatch):
    """CLUSTERCTL_HOME in a directory every user may pass through (pytest's tmp_path is root's
    alone, which would make every check below pass for the wrong reason). It is set-group-ID with
    the nodes' user's group, as a team would set up a shared home: what is made in it is that
    group's, here as on the nodes."""
    cluster = users[0]
    base = Path(tempfile.mkdtemp(prefix="cc-private-", dir="/tmp"))
    base.chmod(0o755)
    home = base / "cchome"
    home.mkdir()
    os.chown(home, 0, cluster.pw.pw_gid)
    home.chmod(0o2755)
    monkeypatch.setenv("CLUSTERCTL_HOME", str(home))
    yield home
    kill_supervisors(home)
    shutil.rmtree(base, ignore_errors=True)


def read_as(user: str, paths: list[Path]) -> list[Path]:
    """The paths `user` can read: a file with cat, a directory with ls."""
    script = 'for p in "$@"; do if [ -d "$p" ]; then ls "$p"; else cat "$p"; fi >/dev/null 2>&1 && echo "$p"; done'
    r = subprocess.run(["runuser", "-u", user, "--", "sh", "-c", script, "sh", *map(str, paths)],
                       capture_output=True, text=True, timeout=120)
    return [Path(line) for line in r.stdout.splitlines()]


def tree(*roots: Path) -> list[Path]:
    return [p for root in roots for p in [root, *sorted(root.rglob("*"))]]


def run_once(cluster, tmp_path, home, share: bool):
    """A short run to its end; (its directory here, {node: [its run directories there]})."""
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
    inv = cluster.write_inventory(tmp_path / f"nodes-{share}.yaml", train={"checkpoint_replica": True},
                                  **({"share_with_group": True} if share else {}))
    before = set((home / "runs").iterdir()) if (home / "runs").exists() else set()
    r = cli("train", "-i", str(inv), "--skip-preflight", "--", JOB, "--steps", "20", "--sleep", "0.05")
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = set((home / "runs").iterdir()) - before
    on_nodes = {n.name: [n.home / ".clusterctl" / "artifacts" / run_dir.name,
                         n.home / ".clusterctl" / "node-runs" / f"{run_dir.name}@{n.name}"] for n in cluster.nodes}
    assert (run_dir / "checkpoints" / "ckpt_00000020.pt").exists() and (run_dir / "nodes" / "node1.log").exists()
    assert all(d.is_dir() for dirs in on_nodes.values() for d in dirs)
    return run_dir, on_nodes


def test_no_other_user_reads_a_run_and_the_group_does_only_when_shared(users, open_home, tmp_path):
    cluster, outsider, member = users
    user = cluster.user
    # the checks below can fail: both users reach the directories that hold clusterctl's own
    reachable = [open_home, *(n.home for n in cluster.nodes)]
    assert read_as(outsider, reachable) == reachable and read_as(member, reachable) == reachable

    private, private_nodes = run_once(cluster, tmp_path, open_home, share=False)
    here = tree(private)
    there = {name: tree(*dirs) for name, dirs in private_nodes.items()}
    assert len(here) > 10 and all(len(t) > 5 for t in there.values())
    assert read_as(outsider, here) == [] and read_as(member, here) == []
    for name, paths in there.items():
        assert read_as(outsider, paths) == [] and read_as(member, paths) == [], name
        assert read_as(user, paths) == paths, name  # the run's user still reads every one

    shared, shared_nodes = run_once(cluster, tmp_path, open_home, share=True)
    here = tree(shared)
    assert read_as(outsider, here) == []
    spec = shared / "spec.json"
    assert read_as(member, here) == [p for p in here if p != spec]  # the env it records is the user's alone
    for name, dirs in shared_nodes.items():
        paths = tree(*dirs)
        assert read_as(outsider, paths) == [], name
        # torchrun makes its own log directory under torchrun/ with tempfile.mkdtemp: 0700 whatever
        # the umask, and the job's files are the job's; clusterctl's are the member's to read
        ours = [p for p in paths if p.name != "spec.json" and not torchruns(p)]
        assert read_as(member, ours) == ours and ours, name
        assert read_as(user, paths) == paths, name
    # sharing the newer run opened nothing of the earlier one
    assert read_as(member, [private, *[d for dirs in private_nodes.values() for d in dirs]]) == []

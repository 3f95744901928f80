"""Private by default: what clusterctl writes is the user's alone (directories 0700, files 0600),
or with the inventory's `share_with_group: true` also the group's to read (0750, 0640). The
control machine's run directories through Run.create and the supervisor's umask; the nodes'
programs run here as they are shipped (`python - ARGS`, common.py in front)."""

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from orchestrator import probe
from orchestrator.cli import main
from orchestrator.home import USER_UMASK_ENV, runs_dir
from orchestrator.inventory import parse_inventory
from orchestrator.runs.spec import RunSpec
from orchestrator.runs.store import Run, run_umask, write_json
from tests.conftest import wait_for, write_record

COMMON = probe.common()
SHARE = {COMMON.GROUP_ENV: "1"}
INVENTORY = "nodes:\n  - {name: n1, connection: local}\n"
SHARED_INVENTORY = INVENTORY + "share_with_group: true\n"


def mode(path) -> int:
    return os.stat(path).st_mode & 0o7777


def modes(root: Path) -> dict[str, int]:
    """rel path -> mode of root and everything under it."""
    out = {".": mode(root)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = mode(p)
    return out


@pytest.fixture
def keep_umask():
    """This process's umask as the test found it, given back (a test sets clusterctl's)."""
    old = os.umask(0o022)
    yield
    os.umask(old)


# ------------------------------------------------------------------ the control machine


def test_a_run_directory_and_its_records_are_the_users_alone(home, keep_umask):
    runs_dir().mkdir(parents=True, mode=0o755)  # as an older clusterctl left it: tightened now
    runs_dir().chmod(0o755)
    run = Run.create("r-1", RunSpec(inventory_text=INVENTORY))
    assert os.umask(0o022) == 0o022  # the caller's umask is given back
    assert mode(runs_dir()) == 0o700
    assert modes(run.dir) == {".": 0o700, "nodes": 0o700, "spec.json": 0o600, "run.json": 0o600}
    # what the supervisor writes later takes its umask: the run's
    run_umask(run.spec)
    write_record(run, state="running")
    run.request_stop(1.0, "me")
    run.node_log("n1").write_bytes(b"x")
    (run.dir / "checkpoints" / "ckpt_00000010").mkdir(parents=True)
    assert set(modes(run.dir).values()) == {0o700, 0o600}, modes(run.dir)


def test_with_share_with_group_the_group_reads_the_run_but_not_its_spec(home, keep_umask):
    run = Run.create("r-2", RunSpec(inventory_text=SHARED_INVENTORY))
    assert mode(home) & 0o050 and mode(runs_dir()) == 0o750
    assert modes(run.dir) == {".": 0o750, "nodes": 0o750, "spec.json": 0o600, "run.json": 0o640}
    run_umask(run.spec)
    run.node_log("n1").write_bytes(b"x")
    assert mode(run.node_log("n1")) == 0o640
    # a later private run closes the shared top directory again: the newest run's setting decides
    Run.create("r-3", RunSpec(inventory_text=INVENTORY))
    assert mode(runs_dir()) == 0o700 and mode(runs_dir() / "r-3") == 0o700


def test_an_existing_home_only_gains_the_groups_search_bit(tmp_path, monkeypatch, keep_umask):
    own = tmp_path / "mine"
    own.mkdir(mode=0o700)
    own.chmod(0o700)
    monkeypatch.setenv("CLUSTERCTL_HOME", str(own))
    Run.create("r-4", RunSpec(inventory_text=INVENTORY))
    assert mode(own) == 0o700  # the user's directory: not opened, not tightened
    Run.create("r-5", RunSpec(inventory_text=SHARED_INVENTORY))
    assert mode(own) == 0o710 and mode(own / "runs") == 0o750


def test_a_set_group_id_runs_directory_keeps_its_bit(home, keep_umask):
    runs_dir().mkdir(parents=True)
    runs_dir().chmod(0o2755)
    Run.create("r-6", RunSpec(inventory_text=SHARED_INVENTORY))
    assert mode(runs_dir()) == 0o2750


def test_the_switch_is_read_from_the_recorded_inventory():
    assert parse_inventory(SHARED_INVENTORY).share_with_group is True
    inv = parse_inventory(INVENTORY)
    assert inv.share_with_group is False and inv.nodes[0].program_env == ""
    shared = parse_inventory(SHARED_INVENTORY).select(["n1"])
    assert shared.share_with_group and shared.nodes[0].program_env == f"{COMMON.GROUP_ENV}=1 "


def test_an_unreadable_recorded_inventory_leaves_the_run_private(keep_umask):
    run_umask(RunSpec(inventory_text="nodes: [}"))
    assert os.umask(0o022) == 0o077


def test_the_cli_writes_privately_and_gives_the_callers_umask_back(tmp_path, keep_umask):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=2\n")
    out = tmp_path / "nodes.yaml"
    assert main(["inventory", "import-hostfile", str(hostfile), "-o", str(out)]) == 0
    assert mode(out) == 0o600
    assert os.umask(0o022) == 0o022 and USER_UMASK_ENV not in os.environ


def test_records_keep_an_explicit_private_mode_whatever_the_umask(tmp_path, keep_umask):
    os.umask(0o027)
    write_json(tmp_path / "a.json", {}, mode=0o600)
    write_json(tmp_path / "b.json", {})
    assert mode(tmp_path / "a.json") == 0o600 and mode(tmp_path / "b.json") == 0o640


# ------------------------------------------------------------------ the nodes' programs, run here


def node_env(home: Path, share: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (COMMON.GROUP_ENV, USER_UMASK_ENV)}
    return dict(env, HOME=str(home), **(SHARE if share else {}))


def shipped(name, *args, home, share=False, stdin=b""):
    """The program as the nodes run it (the node code's zip, probe.local_argv), under a user's umask 022."""
    r = subprocess.run(probe.local_argv(name, *map(str, args)), input=stdin, env=node_env(home, share),
                       capture_output=True, timeout=60, umask=0o022)
    assert r.returncode == 0, r.stderr.decode()
    return r


@pytest.mark.parametrize("share", [False, True], ids=["private", "share_with_group"])
def test_artifacts_prepare_makes_and_tightens_the_run_directories(tmp_path, share):
    top = tmp_path / ".clusterctl"
    (top / "artifacts").mkdir(parents=True)  # an older clusterctl's, 0755
    for d in (top, top / "artifacts"):
        d.chmod(0o755)
    dirs = json.loads(shipped("artifacts", "prepare", "r1", home=tmp_path, share=share).stdout)
    want = 0o750 if share else 0o700
    assert {mode(p) for p in (top, top / "artifacts", top / "artifacts" / "r1", *dirs.values())} == {want}


def ckpt_tar() -> bytes:
    """A checkpoint directory and a file as a tar whose members ask for wide modes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, kind in (("ckpt_00000010", None, tarfile.DIRTYPE), ("ckpt_00000010/shard", b"w" * 10, None),
                                 ("ckpt_00000020.pt", b"x" * 10, None), ("ckpt_00000020.pt.sha256", b"y", None)):
            info = tarfile.TarInfo(name)
            info.mode = 0o777
            if kind:
                info.type = kind
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


@pytest.mark.parametrize("share", [False, True], ids=["private", "share_with_group"])
def test_a_restored_checkpoint_is_never_wider_than_the_umask(tmp_path, share):
    """`receive` (a restore) as checkpoints.restore ships it: the tar on stdin."""
    dest = tmp_path / "ck"
    r = subprocess.run(probe.local_argv("artifacts", "receive", str(dest)), input=ckpt_tar(), capture_output=True,
                       env=node_env(tmp_path, share), timeout=60, umask=0o022)
    assert r.returncode == 0, r.stderr.decode()
    d, f = (0o750, 0o640) if share else (0o700, 0o600)
    assert modes(dest) == {".": d, "ckpt_00000010": d, "ckpt_00000010/shard": f, "ckpt_00000020.pt": f,
                           "ckpt_00000020.pt.sha256": f}


@pytest.mark.parametrize("share", [False, True], ids=["private", "share_with_group"])
def test_node_agent_records_are_private_and_the_job_keeps_the_users_umask(tmp_path, share):
    job = "open('job-out.txt', 'w').write('mine')"  # the job's own output, in its cwd
    spec = {"argv": [sys.executable, "{rundir}/helper.py"], "cwd": str(tmp_path), "env": {},
            "files": {"helper.py": job}}
    shipped("node_agent", "start", "pf1@n1", json.dumps(spec).encode().hex(), home=tmp_path, share=share)
    d = tmp_path / ".clusterctl" / "node-runs" / "pf1@n1"
    wait_for(lambda: (d / "exit_code").exists(), 30, "the run's exit code")
    dm, fm = (0o750, 0o640) if share else (0o700, 0o600)
    assert mode(d.parent.parent) == dm and mode(d.parent) == dm and mode(d) == dm
    got = modes(d)
    assert got.pop("spec.json") == 0o600  # the inventory's env: the user's alone, always
    assert got == {".": dm, **{name: fm for name in ("helper.py", "log", "proc.json", "ended", "exit_code")}}
    assert (d / "exit_code").read_text() == "0"
    assert mode(tmp_path / "job-out.txt") == 0o644  # the job's: the user's umask, untouched


def test_a_local_node_runs_commands_under_the_users_umask_not_clusterctls(tmp_path, monkeypatch, keep_umask):
    """A `connection: local` node's command starts as an SSH session would, with the user's umask
    as the CLI found it (here 002), though the supervisor that runs it holds clusterctl's 077."""
    from orchestrator.transport.local import LocalConnection

    monkeypatch.setenv(USER_UMASK_ENV, "002")
    os.umask(0o077)
    node = parse_inventory(INVENTORY).nodes[0]
    proc = LocalConnection(node).exec(f"touch {tmp_path}/out.txt")
    wait_for(lambda: proc.p.poll() is not None, 30, "the command")
    assert mode(tmp_path / "out.txt") == 0o664


@pytest.mark.parametrize("share", [False, True], ids=["private", "share_with_group"])
def test_the_relay_installs_what_it_receives_no_wider_than_the_umask(tmp_path, share):
    """A replica (or code) arriving through relay.py `recv`: a member's 0755 lands 0700 (the owner
    keeps execute), 0644 lands 0600; under share_with_group 0750 and 0640."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, m in (("run.sh", 0o755), ("pkg/mod.py", 0o644)):
            info = tarfile.TarInfo(name)
            info.mode, info.size, info.mtime = m, 3, 1_600_000_000
            tar.addfile(info, io.BytesIO(b"abc"))
    data = buf.getvalue()
    wd = tmp_path / "wd"
    p = subprocess.Popen(probe.local_argv("relay", "recv", "x1", str(wd), "--idle", "20"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=node_env(tmp_path, share), umask=0o022)
    port = int(p.stdout.readline().split()[1])
    p.stdin.write(b"token tok\nlast\nsource tcp\n")
    p.stdin.flush()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"tok\n" + data)
    import hashlib

    p.stdin.write(f"sha256 {hashlib.sha256(data).hexdigest()}\n".encode())
    p.stdin.close()
    err = p.stderr.read()
    assert p.wait(30) == 0, err
    d, x, f = (0o750, 0o750, 0o640) if share else (0o700, 0o700, 0o600)
    assert modes(wd) == {".": d, "pkg": d, "run.sh": x, "pkg/mod.py": f}
    assert os.stat(wd / "run.sh").st_mtime == 1_600_000_000  # a code stream keeps its mtimes


def test_the_tar_member_rule_masks_the_members_mode(tmp_path, keep_umask):
    """common.py extract_member, in this process: whatever a member asks for, what lands is
    no wider than the umask; a link stream's file keeps its owner bits."""
    os.umask(0o077)
    data = ckpt_tar()
    for links, root in ((False, tmp_path / "data"), (True, tmp_path / "code")):
        root.mkdir()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
            for m in tar:
                assert COMMON.tar_member_ok(m, str(root), links)
                COMMON.extract_member(tar, m, str(root), links)
        f = 0o700 if links else 0o600  # a code file keeps its owner's execute bit (0777 asked)
        assert modes(root) == {".": 0o700, "ckpt_00000010": 0o700, "ckpt_00000010/shard": f,
                               "ckpt_00000020.pt": f, "ckpt_00000020.pt.sha256": f}

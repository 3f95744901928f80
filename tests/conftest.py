"""Shared pytest fixtures.

Test cluster (tests/cluster): `cluster4` is one session-wide 4-node cluster (2 fake GPUs per
node) for tests that only *use* nodes; don't break it (stop sshd, links, clocks...). Tests that
break nodes take `make_cluster` and build their own, always torn down after the test.
"""

import importlib
import json
import os
import random
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from orchestrator.runs.runrecord import RunRecord  # noqa: E402
from tests.cluster import TestCluster, require_root  # noqa: E402


FUZZ_SEED = "INVENTORY_FUZZ_SEED"


def pytest_configure(config):
    """The inventory fuzzer's seed is drawn once, here, before any xdist worker starts: every
    worker fuzzes with it and the header names it (a worker's own print would be captured). Not a
    CLUSTERCTL_ name: the runs the tests start pass those on (--notify's environment)."""
    if not hasattr(config, "workerinput") and not os.environ.get(FUZZ_SEED):
        os.environ[FUZZ_SEED] = str(random.SystemRandom().randrange(1 << 32))


def pytest_collection_modifyitems(session, config, items):
    """The test-cluster files first, the quick unit files last (a stable sort: each file's tests
    stay together and in order). With --dist loadfile --no-loadscope-reorder (scripts/test; by
    default xdist reorders files by their number of tests) xdist hands files out in this order, so the
    many short files fill the end of the run on both workers instead of one long cluster file
    running alone at the end while the other worker idles (a full run spent its last 14 minutes
    on its last 5 % of tests that way)."""
    items.sort(key=lambda item: 0 if item.path.name.endswith("_cluster.py") else 1)


def pytest_sessionstart(session):
    """The seed on the terminal, -q or not (the fuzz test also adds it to a failure's message)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):
        reporter.write_line(f"inventory fuzz seed: replay with {FUZZ_SEED}={os.environ.get(FUZZ_SEED)}")


@pytest.fixture(scope="session", autouse=True)
def _repo_importable():
    """Fail loudly if `orchestrator` comes from anywhere but this checkout."""
    mod = importlib.import_module("orchestrator")
    where = Path(mod.__file__).resolve()
    assert REPO_ROOT in where.parents, f"orchestrator imported from {where}, not {REPO_ROOT}"


@pytest.fixture(scope="session")
def cluster4():
    """4 nodes, 2 fake GPUs each, shared by the whole session (skips when not root)."""
    require_root()
    with TestCluster(n=4, gpus=2, name_prefix="cct") as cluster:
        yield cluster


@pytest.fixture
def make_cluster():
    """Factory: make_cluster(n, **TestCluster kwargs) -> started cluster, closed after the test."""
    require_root()
    made = []

    def make(n, **kw):
        kw.setdefault("name_prefix", "cctf")
        cluster = TestCluster(n=n, **kw).start()
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private CLUSTERCTL_HOME (run records, claims) for the test. Afterwards, supervisors the
    test left running (a failed test's detached runs) are killed, so none outlives its test and
    reaches the next test's nodes, which reuse the same names and addresses."""
    h = tmp_path / "cchome"
    monkeypatch.setenv("CLUSTERCTL_HOME", str(h))
    yield h
    kill_home_processes(h)
    kill_supervisors(h)


def kill_home_processes(h: Path, timeout: float = 5.0) -> None:
    """SIGKILL every process carrying CLUSTERCTL_HOME=h in its environment: a failed test's
    foreground `train` or `tail` left running would find its run's supervisor gone (killed below)
    and start one that adopts the run, which then reached the next test's nodes (the same names and
    addresses) and stopped what ran there. Again until none is left (one may start another
    meanwhile), `timeout` at most."""
    from orchestrator.remote.common import env_values

    want, deadline = str(h), time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and want in env_values(Path(f"/proc/{p.pid}/environ").read_bytes(),
                                                               "CLUSTERCTL_HOME"):
                    found.append(p)
            except (OSError, psutil.Error):
                continue
        if not found:
            return
        for p in found:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(found, timeout=1)


def kill_supervisors(h: Path) -> None:
    """SIGKILL each live supervisor named by a run record under `h` (its pid, checked by its
    command line so a reused pid is left alone)."""
    for rec_path in (h / "runs").glob("*/run.json") if (h / "runs").is_dir() else ():
        try:
            pid = RunRecord.from_json(json.loads(rec_path.read_text())).supervisor_pid
            proc = psutil.Process(pid) if pid else None
            if proc is not None and "orchestrator" in " ".join(proc.cmdline()):
                proc.kill()
        except (OSError, ValueError, psutil.Error):
            continue


def run_envs(cluster, run_id, every_attempt=False) -> dict:
    """{pid: environment} of every process on any test node whose run key is the run's first
    attempt's (RUN@NODE), or with every_attempt any attempt's too (RUN.aK@NODE): found by the key,
    never by name."""
    out = {}
    for p in cluster.processes():
        try:
            env = p.environ()
        except VANISHED:
            continue
        key = env.get("CLUSTERCTL_RUN_KEY", "").split("@")[0]
        if key == run_id or (every_attempt and key.startswith(run_id + ".")):
            out[p.pid] = env
    return out


def write_record(run, **changes) -> dict:
    """A test's hand on a run's record: run.json with `changes` merged in, written as is. The
    product writes the record only through runs/record.py's Book (named transitions)."""
    from orchestrator.runs.store import write_json

    doc = dict(run.record.to_json(), **changes)
    write_json(run.dir / "run.json", doc)
    return doc


def wait_for(pred, timeout=10.0, what="the condition", interval=0.1):
    """Poll pred() until it returns something truthy, and return that; fail the test naming
    `what` after `timeout` seconds. A wait on a condition, never a sleep that hopes."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# A process listed a moment ago may be gone (or a zombie) when it is read: psutil raises these.
VANISHED = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)


def cmdline(proc) -> str:
    return " ".join(proc.cmdline())


def scan(procs, read=cmdline) -> list:
    """[(process, read(process))] for the processes that are still there when read (their command
    line by default): one that ended between the listing and the read is left out, never raised."""
    found = []
    for p in procs:
        try:
            found.append((p, read(p)))
        except VANISHED:
            continue
    return found


def ended(proc) -> bool:
    """The process is gone or a zombie (asking it may itself find it gone)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except VANISHED:
        return True


def pid_ended(pid: int) -> bool:
    """ended() by pid: a pid that no longer names a process has ended too."""
    try:
        return ended(psutil.Process(pid))
    except VANISHED:
        return True

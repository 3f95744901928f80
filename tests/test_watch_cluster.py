"""`clusterctl watch` in a real terminal (tmux, 80 x 24) on the test cluster: every node's step
advances on screen, a rank's number and Enter shows its stack (and `--rank 1` off a terminal,
with a table of now, not of when it asked), a SIGSTOPped worker is flagged
(stall, then the hang watch's verdict names it), q leaves the view with the run still going.
tmux is installed by scripts/test (CI); without it, and without a way to install it, this skips."""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_for
from tests.test_hang_cluster import HANG, inventory
from tests.test_train_cluster import cli

pytestmark = pytest.mark.cluster

ROW = re.compile(r"^(node\d)\s+(\S+)\s+(\d+|-)\s+(\S+)\s+(\S+)\s+(\S+)\s*(.*)$")


def tmux_or_skip() -> str:
    found = shutil.which("tmux")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "tmux"], capture_output=True, timeout=300, env=env)
        found = shutil.which("tmux")
    if found is None:
        pytest.skip("tmux is not installed and could not be installed with apt-get (scripts/test installs it)")
    return found


class Term:
    """One tmux session of its own server, 80 x 24, running a command."""

    def __init__(self, tmux: str, command: list[str], env: dict):
        self.tmux, self.sock = tmux, f"cc-watch-{os.getpid()}"
        line = shlex.join(["env", *[f"{k}={v}" for k, v in env.items()], *command])
        self.run("new-session", "-d", "-x", "80", "-y", "24", "-s", "w", f"{line}; echo WATCH-EXIT $?; sleep 600")

    def run(self, *args):
        return subprocess.run([self.tmux, "-L", self.sock, *args], capture_output=True, text=True, timeout=30)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "w").stdout

    def rows(self) -> dict[str, tuple]:
        return {m[1]: m.groups()[1:] for ln in self.screen().splitlines() if (m := ROW.match(ln))}

    def keys(self, *keys):
        self.run("send-keys", "-t", "w", *keys)

    def close(self):
        self.run("kill-server")


def worker(cluster, node_index: int) -> psutil.Process:
    """The job's own process on that node: the innermost one running the script."""
    procs = [p for p in cluster.processes(cluster.nodes[node_index]) if any("hang_ddp.py" in a for a in p.cmdline())]
    leaves = [p for p in procs if not any(c.pid in {q.pid for q in procs} for c in p.children(recursive=True))]
    assert len(leaves) == 1, [p.cmdline() for p in procs]
    return leaves[0]


def stepped(term, want: dict | None = None):
    """Every node's step on screen, once each is a number (and past `want`'s)."""
    rows = term.rows()
    steps = {n: int(r[1]) for n, r in rows.items() if r[1].isdigit()}
    if len(steps) < 4 or (want and any(steps[n] <= s for n, s in want.items())):
        return None
    return steps


def test_watch_shows_every_nodes_step_advancing_a_stack_and_a_stopped_worker(cluster4, tmp_path, home):
    tmux = tmux_or_skip()
    inv = inventory(cluster4, tmp_path)
    r = cli("train", "-i", inv, "--skip-preflight", "--detach", "--nproc-per-node", "1", "--hang-timeout", "4",
            "--on-hang", "observe", "--", HANG, "--mode", "none", "--sleep", "0.3")
    assert r.returncode == 0, r.stderr
    run_id = r.stdout.strip()
    env = {"CLUSTERCTL_HOME": str(home), "PATH": os.environ["PATH"], "PYTHONPATH": str(Path(__file__).parent.parent)}
    term = Term(tmux, [sys.executable, "-m", "orchestrator.cli", "watch", run_id], env)
    stopped = None
    try:
        first = wait_for(lambda: stepped(term), 120, "every node's step on screen")
        later = wait_for(lambda: stepped(term, first), 60, f"every node's step past {first}")
        screen = term.screen()
        assert f"{run_id}: running, attempt 1 of at most 1" in screen, screen
        assert re.search(r"^node\s+state\s+step\s+s/step\s+tok/s\s+heard\s+flags", screen, re.M), screen
        assert all(term.rows()[n][0] == "running" for n in later)
        term.keys("0", "Enter")  # rank 0's stack, asked of node1 without stopping anything
        wait_for(lambda: "---- rank 0 (node1 r0 pid " in term.screen().split("stack:", 1)[-1]
                 if "stack:" in term.screen() else None, 60, "rank 0's stack on screen")
        assert "rank 0 on node1: last lines" in term.screen() and "rank 0 step" in term.screen()
        term.keys("Escape")
        once = cli("watch", run_id, "--rank", "1")  # off a terminal: the table once, rank 1's stack and lines
        assert once.returncode == 0, once.stderr
        assert re.search(r"^node2\s+running\s+\d+", once.stdout, re.M), once.stdout
        detail = once.stdout.split("rank 1 on node2: last lines", 1)[1]
        # what `clusterctl stack` says of rank 1: its frames, or why its hook did not answer
        assert "rank 1 step" in detail and "---- rank 1 (node2 r1 pid " in detail.split("stack:", 1)[1], once.stdout
        stopped = worker(cluster4, 2)  # node3's rank 2
        stopped.send_signal(signal.SIGSTOP)
        # named by the hang watch (within seconds: it can come before the 4 s of silence that make a
        # stall at --hang-timeout 4), and flagged stalled once silent past that
        want = ("HANG r2 stopped", "stall")
        rows = wait_for(lambda: (lambda rs: rs if all(w in rs.get("node3", ("",) * 6)[5] for w in want) else None)(
            term.rows()), 90, "node3 flagged as the hang's stopped rank, and stalled")
        assert not any("HANG" in rows[n][5] for n in ("node1", "node2", "node4")), rows
        term.keys("q")
        wait_for(lambda: "WATCH-EXIT 0" in term.screen(), 20, "watch to leave on q")
        assert "stopped watching" in term.screen() and "it keeps running" in term.screen()
        assert json_state(home, run_id) == "running"  # leaving the view leaves the run alone
    finally:
        if stopped is not None:
            stopped.send_signal(signal.SIGCONT)
        term.close()
        cli("stop", run_id)


def json_state(home, run_id):
    import json

    return json.loads((home / "runs" / run_id / "run.json").read_text())["state"]

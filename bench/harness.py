"""What several benches share: the clusterctl command line under its own home, waiting with a
deadline, a run's record, and a clock that timestamps each node log line as it arrives.

Benches import this module and `tests.cluster` (the test cluster), never another bench.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from orchestrator.remote.agent_base import listening

REPO = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^step (\d+) \| loss \S+ .*\| step (\d+) ms")  # the trainer's step line (trainer/train.py report)


def cli(home: Path, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """`clusterctl ARGS` to its end, with CLUSTERCTL_HOME=home."""
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def start(home: Path, *args) -> subprocess.Popen:
    """`clusterctl ARGS` in the background, with CLUSTERCTL_HOME=home (the caller waits or kills)."""
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)


def wait_for(pred, timeout: float, what: str):
    """pred()'s first true value, polled every 50 ms; the bench ends with a message after timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if v := pred():
            return v
        time.sleep(0.05)
    raise SystemExit(f"bench: timed out after {timeout}s waiting for {what}")


def record(run_dir: Path) -> dict:
    """The run's run.json, {} while it is not written yet."""
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def run_dir_of(home: Path) -> Path:
    """The one run directory under home (a bench's home holds one run)."""
    return wait_for(lambda: next((p for p in (home / "runs").glob("*") if (p / "run.json").exists()), None)
                    if (home / "runs").exists() else None, 120, "the run directory")


def training_process(cluster, node, key: str | None = None):
    """The process that trains on `node` (of attempt `key` when given), None if none does yet.

    Its environment carries RANK (torchrun's has none) and, with `key`, the attempt's run key; its
    hook listens (the node's own rule, remote/agent_base.listening, read through the process's
    root: a test node's home is its own mount). A rank forked from the warm interpreter has the
    process torchrun started beside it, with the same RANK, standing in: its hook does not listen,
    and a fault there would hit nothing that trains."""
    for p in cluster.processes(node):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if key is not None and env.get("CLUSTERCTL_RUN_KEY", "").split("@")[0] != key:
            continue
        if "RANK" in env and listening([p.pid], env.get("CLUSTERCTL_HOOK_DIR"), root=lambda pid: f"/proc/{pid}/root"):
            return p
    return None


def text_of(line: str) -> str:
    """A log line without its rank prefix (`[0]:`, `[default0]:` or `node/r0 | `)."""
    return re.sub(r"^(?:\[[A-Za-z_]*\d+\]:|\S+/r\d+ +\| )", "", line).strip()


class LogClock:
    """Timestamps each line of runs/RUN/nodes/*.log as it arrives (polled every 20 ms)."""

    def __init__(self, nodes_dir: Path):
        self.dir, self.lines = nodes_dir, {}  # node -> [(arrival, text)]
        self._pos, self._buf = {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.wait(0.02):
            self.poll()

    def poll(self):
        now = time.time()
        for path in self.dir.glob("*.log") if self.dir.is_dir() else ():
            node = path.stem
            with open(path, "rb") as f:
                f.seek(self._pos.get(node, 0))
                data = f.read()
            self._pos[node] = self._pos.get(node, 0) + len(data)
            buf = self._buf.get(node, b"") + data
            *done, self._buf[node] = buf.split(b"\n")
            self.lines.setdefault(node, []).extend((now, ln.decode(errors="replace")) for ln in done)

    def stop(self):
        self._stop.set()
        self._thread.join(5)
        self.poll()


class PipeClock:
    """Timestamps each line a process writes to its stdout pipe as it arrives (a reader thread)."""

    def __init__(self, stream):
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for raw in iter(stream.readline, b""):
            self.lines.append((time.time(), raw.decode(errors="replace").rstrip("\n")))

    def join(self, timeout: float = 5):
        self._thread.join(timeout)


def end_supervisor(rec: dict) -> None:
    """The supervisor waits (up to 5 min) for a cut node to answer, to stop the run there; the
    test cluster goes away with the benchmark, so that wait is ended here (the supervisor found
    by its pid and its run's mark, never by name)."""
    import psutil

    from orchestrator.runs.store import SUPERVISOR_MARK

    try:
        p = psutil.Process(rec["supervisor_pid"])
        if p.environ().get(SUPERVISOR_MARK) == rec["id"]:
            p.kill()
    except (psutil.Error, KeyError):
        pass


def start_nano(cluster, td: Path, steps: int, warm: bool) -> tuple[subprocess.Popen, Path]:
    """`train --max-restarts 1` of the trainer (preset nano, one rank a node, a step line a step, a
    checkpoint every 50 steps) on `cluster`, warm or `--no-warm`, its home and inventory in `td`,
    its output read on a thread as it comes (a step line a step fills the pipe in seconds, and a
    follower blocked on it would stop showing the run; the run itself goes on in its supervisor).
    -> (the foreground, node1's log) once step 100 is in that log and, warm, every node holds its
    warm interpreter."""
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    train = {"module": "trainer", "args": [
        "--preset", "nano", "--max-steps", str(steps), "--batch-size", "2", "--block-size", "32",
        "--log-every", "1", "--ckpt-every", "50", "--eval-steps", "1", "--sample-tokens", "0",
        "--output-dir", "out"]}
    inv = str(cluster.write_inventory(td / "nodes.yaml", checks={"disk_min_gb": 0.1}, output_dir="out",
                                      env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, train=train))
    proc = start(td / "home", "train", "-i", inv, "--max-restarts", "1", *([] if warm else ["--no-warm"]))
    threading.Thread(target=proc.communicate, daemon=True).start()
    try:
        log = run_dir_of(td / "home") / "nodes" / "node1.log"
        wait_for(lambda: log.exists() and b"step 100 |" in log.read_bytes(), 300, "steps")
        if warm:
            wait_for(lambda: all(n.warm_serving() for n in cluster.nodes), 120, "a warm interpreter on every node")
    except BaseException:
        stop_by_id(td / "home", proc)
        raise
    return proc, log


def stop_by_id(home: Path, proc: subprocess.Popen) -> None:
    """Every run in `home` stopped by its id (`clusterctl stop RUN`), then the foreground `proc`
    waited for (killed after 60 s). The run lives in its supervisor: a signal to the foreground is
    not heard where the bench runs as a background job (SIGINT ignored), and killing it leaves the
    supervisor training."""
    runs = home / "runs"
    for d in (runs.glob("*") if runs.exists() else ()):
        if (d / "run.json").exists():
            cli(home, "stop", d.name, timeout=180)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()

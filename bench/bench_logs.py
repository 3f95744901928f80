"""Log streaming throughput: 4 test-cluster nodes writing lines as fast as they can.

Runs `clusterctl train` of a writer script (one rank per node) on a fresh 4-node
namespace cluster and measures the lines per second that land, in order and
complete, in the control machine's run directory; then copies the same node logs
with a plain OpenSSH loop (`ssh node cat LOG`, all nodes in parallel) as the peer.
Prints the figures, the ratio, and the controller's CPU seconds per 100k lines.

    sudo .venv/bin/python bench/bench_logs.py [--lines-per-node 400000]

With --foreground, what the terminal gets instead: the same writer (4 nodes x 250k lines by
default; --same: every rank writes the same lines) run by `clusterctl train` with folding on and
with --no-fold, each timed from the command to its exit with its stdout going to a file; then
`clusterctl tail RUN --no-follow` of the finished runs, folding on and off, timed alone (the
foreground's printing without the cluster's share of the cores). With --baseline DIR (another
checkout, e.g. `git worktree add /tmp/base main`) the trains and tails are also timed with that
checkout's code, in the same invocation, so a change is measured against what it changes:

    sudo .venv/bin/python bench/bench_logs.py --foreground [--same] [--baseline /tmp/base] [--repeat 3]
"""

import argparse
import re
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.cluster import TestCluster  # noqa: E402

WRITER = """
import os, sys
n = int(sys.argv[1]); rank = os.environ["RANK"] if sys.argv[2:] != ["same"] else "*"
w = sys.stdout.write
for i in range(n):
    w(f"rank {rank} line {i:08d} " + "x" * 40 + "\\n")
sys.stdout.flush()
"""


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cli(argv: list[str], out: Path, checkout: Path | None = None, timeout: float = 1800) -> tuple[float, int, int, float]:
    """`clusterctl ARGV` (with `checkout`'s code) with stdout into `out`: (seconds, exit code,
    lines, its CPU seconds, which the machine's load disturbs less: the foreground's own for
    `tail`; for `train` it holds the supervisor's too whenever train reaped it, so it is not shown)."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    cpu0 = children_cpu()
    t0 = time.perf_counter()
    with open(out, "w") as f:
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], stdout=f, stderr=subprocess.DEVNULL,
                           env=env, cwd=checkout or Path(__file__).resolve().parent.parent, timeout=timeout)
    took, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    with open(out, "rb") as f:
        lines = sum(1 for _ in f)
    return took, r.returncode, lines, cpu


def foreground(a) -> None:
    """Lines/s into the foreground with folding on and off (see the module's docstring)."""
    home = Path(tempfile.mkdtemp(prefix="cc-bench-fg-"))
    os.environ["CLUSTERCTL_HOME"] = str(home)
    writer = home / "writer.py"
    writer.write_text(WRITER)
    os.chmod(home, 0o755)
    total = a.nodes * a.lines_per_node
    mode = ["same"] if a.same else []
    runs, rows = {}, []
    checkouts = [("this checkout", None)] + ([("baseline", Path(a.baseline).resolve())] if a.baseline else [])
    with TestCluster(n=a.nodes, gpus=0, name_prefix="ccbf") as cluster:
        for n in cluster.nodes:
            n.run("mkdir -p ~/gpt_train")
        inv = cluster.write_inventory(home / "nodes.yaml")
        for _ in range(a.repeat):  # folding on and off alternate: the machine's load drifts
            for name, checkout in checkouts:
                for fold in ("on", "off"):
                    before = {p.name for p in (home / "runs").iterdir()} if (home / "runs").exists() else set()
                    took, code, lines, cpu = cli(["train", "-i", str(inv), "--skip-preflight",
                                                  *(["--no-fold"] if fold == "off" else []), "--", str(writer),
                                                  str(a.lines_per_node), *mode], home / f"train-{fold}.out", checkout)
                    runs[fold] = next(p.name for p in (home / "runs").iterdir() if p.name not in before)
                    rows.append((f"train, {name}, folding {fold}", took, code, lines, cpu))
    for _ in range(a.repeat):
        for name, checkout in checkouts:
            for fold in ("on", "off"):
                took, code, lines, cpu = cli(["tail", runs[fold], "--no-follow",
                                              *(["--no-fold"] if fold == "off" else [])], home / f"tail-{fold}.out", checkout)
                rows.append((f"tail --no-follow, {name}, folding {fold}", took, code, lines, cpu))
    print(f"foreground, {a.nodes} nodes x {a.lines_per_node} {'identical' if a.same else 'distinct'} lines "
          f"({total} lines; stdout to a file)")
    for label, took, code, lines, cpu in rows:
        cpu_text = f"{cpu:6.1f} s" if label.startswith("tail") else "     -  "
        print(f"  {label:<48} {took:7.1f} s  {total / took:>10,.0f} lines/s  foreground CPU {cpu_text}  "
              f"({lines} lines printed, exit {code})")
    by: dict[str, list[tuple[float, float]]] = {}
    for label, took, _, _, cpu in rows:
        by.setdefault(label, []).append((took, cpu))
    for what in ("train", "tail --no-follow"):
        for name, _ in checkouts:
            (on, on_cpu), (off, off_cpu) = ((statistics.median(t for t, _ in by[f"{what}, {name}, folding {f}"]),
                                             statistics.median(c for _, c in by[f"{what}, {name}, folding {f}"]))
                                            for f in ("on", "off"))
            cpu_text = f", {on_cpu / off_cpu:.2f} in the foreground's CPU" if what.startswith("tail") else ""
            print(f"  folding on / off (medians of {a.repeat}): {what}, {name}: {on / off:.2f} in time{cpu_text}  "
                  f"(target <= 1.20)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--lines-per-node", type=int, default=None)
    ap.add_argument("--foreground", action="store_true", help="Time what reaches the terminal, folding on and off.")
    ap.add_argument("--same", action="store_true", help="With --foreground: every rank writes the same lines.")
    ap.add_argument("--baseline", help="With --foreground: another checkout whose train and tail are timed too.")
    ap.add_argument("--repeat", type=int, default=1, help="With --foreground: each measure this many times.")
    a = ap.parse_args()
    if a.foreground:
        a.lines_per_node = a.lines_per_node or 250_000
        return foreground(a)
    a.lines_per_node = a.lines_per_node or 400_000
    home = Path(tempfile.mkdtemp(prefix="cc-bench-logs-"))
    os.environ["CLUSTERCTL_HOME"] = str(home)
    writer = home / "writer.py"
    writer.write_text(WRITER)
    os.chmod(home, 0o755)
    total = a.nodes * a.lines_per_node
    with TestCluster(n=a.nodes, gpus=0, name_prefix="ccbl") as cluster:
        for n in cluster.nodes:
            n.run("mkdir -p ~/gpt_train")
        inv = cluster.write_inventory(home / "nodes.yaml")
        cpu0 = children_cpu()
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--skip-preflight",
                            "--", str(writer), str(a.lines_per_node)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, timeout=900)
        fg_cpu = children_cpu() - cpu0  # the foreground `clusterctl train`
        run_dir = max((home / "runs").iterdir(), key=lambda p: p.stat().st_ctime)
        rec = json.loads((run_dir / "run.json").read_text())
        logs = {n.name: run_dir / "nodes" / f"{n.name}.log" for n in cluster.nodes}
        # first and last byte on the controller: the copies' mtimes bracket the stream
        t_first = rec["started"]
        t_last = max(p.stat().st_mtime for p in logs.values())
        lost = torn = 0
        whole = re.compile(rb"^\[default0\]:rank \d+ line (\d{8}) x{40}$")
        for i, (name, p) in enumerate(logs.items()):
            got = [ln for ln in p.read_bytes().split(b"\n") if b" line " in ln]
            want = a.lines_per_node
            ok = [whole.match(ln) for ln in got]
            torn += sum(m is None for m in ok)  # a torn or merged line fails the exact pattern
            idx = [int(m.group(1)) for m in ok if m]
            if idx != list(range(want)):
                lost += want - len(set(idx))
        ours = total / (t_last - t_first)
        cpu = fg_cpu + rec.get("supervisor_cpu_s", 0.0)
        log = (run_dir / "supervisor.log").read_text()
        # the peer: plain OpenSSH copying the same node-side logs, all nodes at once
        t0 = time.time()
        procs = []
        for n in cluster.nodes:
            path = f".clusterctl/node-runs/{run_dir.name}@{n.name}/log"
            procs.append(subprocess.Popen(cluster.ssh_argv(n, "cat", path), stdout=subprocess.PIPE))
        peer_bytes = sum(len(p.communicate()[0]) for p in procs)
        t_peer = time.time() - t0
        peer = total / t_peer
    print(f"log streaming, {a.nodes} nodes x {a.lines_per_node} lines ({total} lines, run exit {r.returncode})")
    print(f"  clusterctl train -> control-side files: {ours:,.0f} lines/s end to end "
          f"(writer + the waiter's rank lines + node agent tail + SSH + supervisor), lost lines: {lost}, torn/merged lines: {torn}")
    print(f"  peer, plain `ssh node cat log` x{a.nodes} in parallel (copy only, {peer_bytes/1e6:.0f} MB): "
          f"{peer:,.0f} lines/s")
    print(f"  ratio clusterctl/peer: {ours / peer:.2f}  (target: >= 100k lines/s with zero loss: "
          f"{'met' if ours >= 100_000 and lost == torn == 0 else 'NOT met'})")
    sup = rec.get("supervisor_cpu_s", 0.0)
    print(f"  controller CPU (foreground+supervisor): {cpu:.2f} s = {cpu / total * 1e5:.3f} s per 100k lines "
          f"(supervisor copying {sup / total * 1e5:.3f}, foreground printing {fg_cpu / total * 1e5:.3f})")
    if "Traceback" in log:
        print(log)


if __name__ == "__main__":
    main()

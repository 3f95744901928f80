"""Fail fast: kill -9 one worker node's torchrun, time until no process of the run is left anywhere.

    sudo .venv/bin/python bench/bench_failfast.py [--nodes 2] [--repeat 5] [--old REV] [--new REV|.]

A test cluster of --nodes nodes trains the shipped trainer (preset nano, gloo on CPU) under
`clusterctl train --skip-preflight`. Once the master's step lines flow, the last node's torchrun
(its pid from the node's proc.json, checked to carry the run key in its environment) gets
SIGKILL. From then on /proc is scanned every few ms for any process whose environment carries
CLUSTERCTL_RUN_KEY=RUN_ID@... (the nodes are network namespaces sharing this machine's pid
namespace, so one scan covers every node; processes that vanish mid-scan are skipped). The
total is kill -> the last process of the run gone, on every node. Phases, by the nodes' own
records (~/.clusterctl/node-runs/KEY/) and the run's run.json:

  noticed     kill -> the victim's waiter recorded torchrun's end (`ended`)
  exit_code   -> the victim's exit_code written (its run cleaned up on the node)
  seen        -> the supervisor recorded the victim's end (run.json nodes[].ended)
  stop sent   -> the supervisor began the teardown (run.json teardown_at)
  stop there  -> the last other node received the stop (its `stop` file's "at"); "-" when
               every other node had already ended by itself
  clean       -> no process of the run left on any node (the total)
  foreground  kill -> `clusterctl train` returned

The new and the old way run alternately, --repeat times each, on the same cluster; medians are
printed with the ratio. Each way runs from its own `git worktree` of a commit (a checkout that
others are editing never enters the measurement): --new defaults to HEAD (`.` runs this working
tree), --old to OLD_REV, the last commit before the node agent's fail-fast changes.

The peer-failed stop (a teardown after a node failed sends the agents `stop KEY GRACE
peer-failed`, which kills at once unless a checkpoint is being written) is part of HEAD: the
--projected way that applied it as a patch to a worktree is gone with the code it patched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.cluster import TestCluster  # noqa: E402

OLD_REV = "52dec82"  # the last commit before the node agent's fail-fast changes
PHASES = ("noticed", "exit_code", "seen", "stop sent", "stop there", "clean", "foreground")


def worktree(rev: str, where: Path) -> Path:
    """A detached worktree of `rev` under `where`, readable by the test nodes' user."""
    if rev == ".":
        return REPO
    path = where / f"tree-{len(list(where.glob('tree-*')))}-{rev[:12]}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), rev],
                   check=True, capture_output=True, timeout=120)
    for p in (where, path):
        os.chmod(p, 0o755)
    return path


def drop_worktree(path: Path) -> None:
    if path != REPO:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       capture_output=True, timeout=60)


def run_pids(run_id: str, every_attempt: bool = False) -> dict[int, str]:
    """pid -> node of every live process whose environment carries CLUSTERCTL_RUN_KEY=RUN_ID@NODE
    (with every_attempt, RUN_ID.aK@NODE too: a restart's attempts)."""
    marker = f"\0CLUSTERCTL_RUN_KEY={run_id}".encode()
    attempt = re.compile(rb"(?:\.a\d+)?@" if every_attempt else rb"@")
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:  # gone mid-scan, or a kernel thread
            continue
        i = env.find(marker)
        if i >= 0 and (m := attempt.match(env, i + len(marker))):
            out[int(name)] = env[m.end():].split(b"\0", 1)[0].decode(errors="replace")
    return out


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v := pred():
            return v
        time.sleep(interval)
    raise SystemExit(f"bench: timed out after {timeout}s waiting for {what}")


def read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def inventory(cluster, path: Path, tree: Path) -> str:
    return str(cluster.write_inventory(
        path, env={"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"},
        train={"module": "trainer",
               "args": ["--preset", "nano", "--max-steps", "100000", "--batch-size", "2", "--block-size", "32",
                        "--log-every", "1", "--eval-steps", "1", "--sample-tokens", "0", "--output-dir", "out"]}))


class Trial:
    """One run: start, wait for steps, kill the victim's torchrun, watch every node until clean."""

    def __init__(self, cluster, tree: Path, td: Path, label: str):
        self.cluster, self.tree, self.label = cluster, tree, label
        self.home = td / f"home-{label}"
        self.inv = inventory(cluster, td / f"{label}.yaml", tree)
        self.victim = cluster.nodes[-1]

    def node_dir(self, node) -> Path:
        return node.home / ".clusterctl" / "node-runs" / f"{self.run_id}@{node.name}"

    def start(self) -> None:
        env = dict(os.environ, CLUSTERCTL_HOME=str(self.home), PYTHONPATH=str(self.tree))
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", self.inv,
                                      "--skip-preflight"], cwd=self.tree, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        runs = self.home / "runs"
        self.run_dir = wait_for(lambda: next((p for p in runs.glob("*") if (p / "run.json").exists()), None)
                                if runs.exists() else None, 120, "the run directory")
        self.run_id = self.run_dir.name
        master_log = self.run_dir / "nodes" / f"{self.cluster.nodes[0].name}.log"
        wait_for(lambda: (read(master_log) or "").count("| loss ") >= 3 or self.failed_early(), 300,
                 "three step lines from the master")

    def failed_early(self) -> bool:
        if self.proc.poll() is not None:
            raise SystemExit(f"bench: the run ended before the kill:\n{self.proc.stderr.read()[-3000:]}")
        return False

    def victim_torchrun(self) -> int:
        """torchrun's pid from the victim's proc.json, confirmed by the run key in its environment."""
        pid = json.loads(read(self.node_dir(self.victim) / "proc.json") or "{}")["pid"]
        if run_pids(self.run_id).get(pid) != self.victim.name:
            raise SystemExit(f"bench: pid {pid} does not carry CLUSTERCTL_RUN_KEY={self.run_id}@{self.victim.name}")
        return pid

    def kill_and_watch(self) -> dict:
        pid = self.victim_torchrun()
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        last_seen = {n.name: t0 for n in self.cluster.nodes}
        self.pid_seen: dict[int, tuple[str, float]] = {}
        t_clean = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now, found = time.time(), run_pids(self.run_id)
            for p, node in found.items():
                last_seen[node] = now
                self.pid_seen[p] = (node, now)
            if not found:
                t_clean = now
                break
            time.sleep(0.005)
        if t_clean is None:
            raise SystemExit(f"bench: {self.label}: processes of the run left after 120 s: {run_pids(self.run_id)}")
        try:
            self.proc.communicate(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.phases(t0, t_clean, time.time(), last_seen)

    def phases(self, t0: float, t_clean: float, t_fg: float, last_seen: dict) -> dict:
        rec = json.loads((self.run_dir / "run.json").read_text())
        vd = self.node_dir(self.victim)
        others = [n for n in self.cluster.nodes if n is not self.victim]
        stops = [json.loads(s)["at"] for n in others if (s := read(self.node_dir(n) / "stop"))]
        seen = next(st["ended"] for st in rec["nodes"] if st["name"] == self.victim.name)
        out = {"noticed": float(read(vd / "ended")) - t0, "exit_code": (vd / "exit_code").stat().st_mtime - t0,
               "seen": seen - t0, "stop sent": (rec["teardown_at"] - t0) if rec.get("teardown_at") else None,
               "stop there": (max(stops) - t0) if len(stops) == len(others) else None,
               "clean": t_clean - t0, "foreground": t_fg - t0}
        out["codes"] = {n.name: read(self.node_dir(n) / "exit_code") for n in self.cluster.nodes}
        out["node clean"] = {k: round(v - t0, 2) for k, v in last_seen.items()}
        out["detail"] = {}
        for n in others:  # when its workers went, its torchrun went, the waiter recorded it
            trun = json.loads(read(self.node_dir(n) / "proc.json") or "{}").get("pid")
            workers = [t for p, (nd, t) in self.pid_seen.items() if nd == n.name and p != trun]
            out["detail"][n.name] = {"workers gone": round(max(workers, default=t0) - t0, 2),
                                     "torchrun gone": round(self.pid_seen.get(trun, (0, t0))[1] - t0, 2),
                                     "ended": round(float(read(self.node_dir(n) / "ended") or t0) - t0, 2)}
        out["state"], out["exit"] = rec.get("state"), self.proc.returncode
        return out


def trial(cluster, tree: Path, td: Path, label: str) -> dict:
    t = Trial(cluster, tree, td, label)
    t.start()
    try:
        return t.kill_and_watch()
    finally:
        if t.proc.poll() is None:
            t.proc.kill()
        for pid in run_pids(t.run_id):  # never leave a run behind for the next trial
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def fmt(v) -> str:
    return "     -" if v is None else f"{v:6.2f}"


def median(rows: list[dict], k: str):
    vals = [r[k] for r in rows if r[k] is not None]
    return statistics.median(vals) if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5, help="runs each way, alternating")
    ap.add_argument("--old", default=OLD_REV, help="the old way's commit")
    ap.add_argument("--new", default="HEAD", help="the new way's commit ('.': this working tree)")
    ap.add_argument("--detail", action="store_true", help="the other nodes' workers, torchrun and waiter, per run")
    args = ap.parse_args(argv)
    td = Path(tempfile.mkdtemp(prefix="ccff-"))
    trees = {}
    try:
        trees = {"new": worktree(args.new, td), "old": worktree(args.old, td)}
        revs = {k: subprocess.run(["git", "-C", str(p), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip() + (" + working tree" if p == REPO else "")
                for k, p in trees.items()}
        print(f"fail fast: {args.nodes} nodes, preset nano, kill -9 of node{args.nodes}'s torchrun; "
              f"new = {revs['new']}, old = {revs['old']}"
              "; "
              f"{args.repeat} runs each way, alternating", flush=True)
        print(f"  {'run':<8}" + "".join(f"{p:>11}" for p in PHASES) + "  exit codes / node clean", flush=True)
        res = {way: [] for way in trees}
        with TestCluster(n=args.nodes, gpus=0, name_prefix="ccff") as cluster:
            for nd in cluster.nodes:
                nd.run("mkdir -p ~/gpt_train")
            for i in range(args.repeat):
                ways = list(trees)
                for way in ways[i % len(ways):] + ways[:i % len(ways)]:
                    r = trial(cluster, trees[way], td, f"{way}{i}")
                    res[way].append(r)
                    codes = ",".join(str(c) for c in r["codes"].values())
                    print(f"  {way + str(i):<8}" + "".join(f"{fmt(r[p]):>11}" for p in PHASES) +
                          f"  {codes} / {r['node clean']}", flush=True)
                    if args.detail:
                        print(f"    {r['detail']}", flush=True)
        for way in trees:
            print(f"  {'median ' + way:<8}" + "".join(f"{fmt(median(res[way], p)):>11}" for p in PHASES))
        new, old = median(res["new"], "clean"), median(res["old"], "clean")
        print(f"  kill -9 -> every node clean: new {new:.2f} s, old {old:.2f} s, new/old {new / old:.2f} "
              f"(target <= 2 s: {'met' if new <= 2 else 'MISSED'})")
    finally:
        for p in trees.values():
            drop_worktree(p)
        shutil.rmtree(td, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

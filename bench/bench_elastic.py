"""A link cut for good, carried by clusterctl and by torch elastic, the peer, in the same invocation.

    sudo .venv/bin/python bench/bench_elastic.py [--trials 2] [--steps 150] [--collective-timeout 10] [--warm]

Each trial runs the shipped trainer (preset nano, one rank per node, a checkpoint every 10 steps)
both ways, on fresh test clusters, and cuts one node's link (`ip link set down`) once a
checkpoint exists (with --warm, for clusterctl, also once every node holds the run's warm
interpreter, as it does from 20 s into any run with restarts: give it --steps to last that long):

  clusterctl   3 nodes + a spare, `clusterctl train` at its defaults plus `--max-restarts 1`;
               checkpoints copied off the nodes as the run goes (no shared filesystem). The run
               must end with exit 0 on the spare.
  torch elastic (its best case) `torchrun --nnodes 2:3 --max-restarts 3` on 3 nodes, c10d
               rendezvous on node1, checkpoints in one directory every node sees (the test nodes
               share this machine's filesystem: the shared storage torch elastic assumes),
               `last_call_timeout=1`, `keep_alive_interval=1`; the cut node's ranks are not
               replaced, the survivors go on as 2 nodes. The survivors learn of the cut only
               when their collective times out: the trainer's process group timeout is set to
               --collective-timeout seconds (the trainer's default is 1800 s), the shortest
               that does not fail a healthy run here.

Printed per trial and as medians: cold start (command → first step line), cut → the fault seen
(clusterctl: the node declared lost in run.json; torch elastic: a survivor's collective timing out, the
first sign of the cut in its output), cut → first step line of the next attempt, and that as a ratio of the cold start.
Issue 33's target: the cut → first step of the next attempt is at most the run's own cold start.
The nodes share this machine's two cores; no assertions, this prints figures.
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.harness import (STEP, LogClock, PipeClock, end_supervisor, record, run_dir_of, start, text_of,  # noqa: E402
                           wait_for)
from tests.cluster import TestCluster  # noqa: E402

SEEN = re.compile(r"Timed out waiting|failed \(exitcode")  # a survivor's collective timed out


def trainer_args(steps: int, out: str) -> list[str]:
    return ["--preset", "nano", "--max-steps", str(steps), "--batch-size", "2", "--block-size", "32",
            "--log-every", "1", "--ckpt-every", "10", "--eval-steps", "1", "--sample-tokens", "0",
            "--output-dir", out]


def first_step(lines, after: float) -> float | None:
    return next((t for t, s in lines if t > after and STEP.match(text_of(s))), None)


# ---------------------------------------------------------------- clusterctl
def ours(steps: int, warm: bool = False) -> dict:
    with TestCluster(n=4, gpus=0, name_prefix="ccbo") as cluster, tempfile.TemporaryDirectory() as td:
        for nd in cluster.nodes:
            nd.run("mkdir -p ~/gpt_train")
        nodes = cluster.inventory()["nodes"]
        nodes[-1]["spare"] = True
        inv = str(cluster.write_inventory(
            Path(td) / "nodes.yaml", nodes=nodes, checks={"disk_min_gb": 0.1}, output_dir="out",
            env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
            train={"module": "trainer", "max_restarts": 1, "args": trainer_args(steps, "out")}))
        home = Path(td) / "home"
        t_cmd = time.time()
        proc = start(home, "train", "-i", inv)
        try:
            run_dir = run_dir_of(home)
            clock = LogClock(run_dir / "nodes")
            wait_for(lambda: list((run_dir / "checkpoints").glob("ckpt_*.pt")), 300,
                     "a checkpoint on the control machine")
            if warm:
                wait_for(lambda: all(nd.warm_serving() for nd in cluster.nodes), 120,
                         "a warm interpreter on every node")
            t_cut = time.time()
            cluster.nodes[1].link_down()
            _, err = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
        clock.stop()
        rec = record(run_dir)
        end_supervisor(rec)
        attempts = rec.get("attempts", [])
        if proc.returncode != 0 or len(attempts) != 2:
            raise SystemExit(f"bench: clusterctl did not recover (exit {proc.returncode}):\n{err[-3000:]}\n"
                             f"{(run_dir / 'supervisor.log').read_text()[-3000:]}")
        a1, a2 = attempts
        every = sorted(x for node_lines in clock.lines.values() for x in node_lines)
        cold = first_step(every, t_cmd) - t_cmd
        again = first_step(every, a2["started"])
        return {"cold": cold, "seen": a1["failed_at"] - t_cut, "again": again - t_cut,
                "how": f"attempt 2 on {', '.join(a2['nodes'])} from {a2.get('checkpoint')}"}


# ---------------------------------------------------------------- torch elastic
def elastic_cmd(node, master, shared: Path, steps: int, timeout: float) -> str:
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "GLOO_SOCKET_IFNAME": node.iface, "CLUSTERCTL_DIST_TIMEOUT": str(timeout)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
            "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master.host}:29400",
            "--rdzv-id", "bench-elastic", "--local-addr", node.host,
            "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
            "-m", "trainer", *trainer_args(steps, str(shared))]
    return "exec env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)


def elastic(steps: int, timeout: float) -> dict:
    with TestCluster(n=3, gpus=0, name_prefix="ccbe") as cluster:
        shared = cluster.base_dir / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        master, victim = cluster.nodes[0], cluster.nodes[2]
        t_cmd = time.time()
        procs = [nd.popen(elastic_cmd(nd, master, shared, steps, timeout), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) for nd in cluster.nodes]
        clocks = [PipeClock(p.stdout) for p in procs]
        try:
            wait_for(lambda: list(shared.glob("ckpt_*.pt")), 300, "torch elastic's first checkpoint")
            t_cut = time.time()
            victim.link_down()
            for p in procs[:2]:
                p.wait(timeout=900)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for c in clocks[:2]:
            c.join()
        every = sorted(x for c in clocks[:2] for x in c.lines)
        if any(p.returncode != 0 for p in procs[:2]):
            tail = "\n".join(s for _, s in every[-40:])
            raise SystemExit(f"bench: torch elastic did not finish (exit {[p.returncode for p in procs[:2]]}):\n{tail}")
        t_seen = next((t for t, s in every if t > t_cut and SEEN.search(s)), None)
        if t_seen is None:
            tail = "\n".join(f"{t - t_cut:+7.2f} {s}" for t, s in every)
            raise SystemExit(f"bench: torch elastic finished without restarting its workers after the cut:\n{tail}")
        return {"cold": first_step(every, t_cmd) - t_cmd, "seen": t_seen - t_cut,
                "again": first_step(every, t_seen) - t_cut,
                "how": f"2 survivors, collective timeout {timeout:g} s, newest shared checkpoint"}


def show(name: str, r: dict) -> None:
    print(f"  {name:<13} cold start {r['cold']:5.1f} s | cut → seen {r['seen']:5.1f} s | cut → first step "
          f"{r['again']:5.1f} s = {r['again'] / r['cold']:.2f}x cold ({r['how']})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--collective-timeout", type=float, default=10.0,
                    help="torch elastic's process group timeout, s (how soon its survivors see the cut)")
    ap.add_argument("--only", choices=("clusterctl", "torch elastic"), help="run one side only (no ratio)")
    ap.add_argument("--warm", action="store_true",
                    help="cut clusterctl's run once every node holds its warm interpreter (20 s into the run)")
    args = ap.parse_args(argv)
    got: dict[str, list[dict]] = {"clusterctl": [], "torch elastic": []}
    print(f"a link cut for good: the trainer (nano), {args.steps} steps, a checkpoint every 10, {args.trials} "
          f"trial(s) each way{', clusterctl cut once its warm interpreters are up' if args.warm else ''}", flush=True)
    for i in range(args.trials):
        order = ("clusterctl", "torch elastic") if i % 2 == 0 else ("torch elastic", "clusterctl")
        for name in (n for n in order if args.only in (None, n)):
            r = ours(args.steps, args.warm) if name == "clusterctl" else elastic(args.steps, args.collective_timeout)
            got[name].append(r)
            show(f"{name} {i + 1}", r)
    if args.only:
        return 0
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("cold", "seen", "again")}
           for name, rs in got.items()}
    print("medians:")
    for name, m in med.items():
        print(f"  {name:<13} cold start {m['cold']:5.1f} s | cut → seen {m['seen']:5.1f} s | cut → first step "
              f"{m['again']:5.1f} s = {m['again'] / m['cold']:.2f}x cold", flush=True)
    o, e = med["clusterctl"], med["torch elastic"]
    print(f"  cut → first step: clusterctl {o['again']:.1f} s against torch elastic {e['again']:.1f} s: "
          f"{e['again'] / o['again']:.2f}x sooner; target (≤ its own cold start): "
          f"{'met' if o['again'] <= o['cold'] else 'MISSED'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hangs: how soon a stalled run is named and ended at default settings, against the old rule in the
same run; what a broken link between two workers is named, over repeated trials; and what the hook
and the Flight Recorder cost.

    sudo .venv/bin/python bench/bench_hang.py [--nodes 3] [--repeat 3] [--old-repeat 1]
        [--old-ref 5dc40d5] [--scenario stop|loader] [--heartbeat S] [--partition-trials 10]
        [--steps 400] [--cost-repeat 5] [--skip-latency] [--skip-partition] [--skip-cost]

Latency (a test cluster of --nodes nodes, gloo on CPU, no --hang-timeout: the defaults):
`clusterctl train` runs tests/scripts/hang_ddp.py, whose rank 1 stops at step 20 (--scenario stop:
SIGSTOP; loader: it blocks in slow_data_loader()) while the others wait in all_reduce. The
control copies of the node logs are watched every 20 ms: the stall is the moment the last step
line landed (a heartbeat thread's lines, --heartbeat, are not steps); then the verdict (the
attempt's `hang` in run.json) and the foreground's return are timed from it. The same runs are
made with the old rule: the clusterctl of --old-ref (the watch that counted log bytes and waited
300 s of silence), unpacked from this repository's history into a temporary directory and run
from there, the same nodes, script and settings; a run the old rule has not ended within
--old-limit seconds is stopped and reported as such (a heartbeat every 20 s kept it from ever
looking).

Partition (4 nodes, defaults): the same script with no hang of its own; at step 5 node2 and node3
drop each other's packets both ways (iptables in their namespaces), --partition-trials times.
Each verdict is printed with the time from the cut; the summary counts the verdicts that name
the link and those that name a rank that "never entered" a collective.

Cost (this machine, no cluster): torchrun --nproc-per-node 2 runs a loop of one all_reduce of
1 MB and a small matmul per step; each step's time is measured inside the ranks. Plain runs and
runs with what clusterctl adds to every rank (the snapshot hook on PYTHONPATH, its FIFO thread,
TORCH_FR_BUFFER_SIZE=2000) alternate --cost-repeat times; the ratio of the medians of the
per-run median step times is printed (target <= 1.01), and beside it the same for the ranks' CPU
per step (process CPU time, every thread: what the Flight Recorder's bookkeeping and the hook's
idle thread add), which other processes on a shared machine disturb less than wall time (gloo's
waits still count where they spin). Last, the Flight Recorder alone per collective: one process,
a world of 1 (no peer, no wait), the calling thread's CPU per all_reduce with and without it. The
hang watch itself runs on the control machine; on the ranks it costs the hook's answer to the
progress request every 10 s (the newest steps and pg_status: microseconds) and nothing per
collective.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
HANG = REPO / "tests" / "scripts" / "hang_ddp.py"
HOOK = REPO / "orchestrator" / "remote" / "hook" / "sitecustomize.py"

LOOP = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
steps = int(sys.argv[1]); x = torch.ones(262144); w = torch.randn(128, 128)
times = []
for i in range(steps + 20):
    if i == 20:
        c0 = time.process_time()  # every thread of the rank: the Flight Recorder's and the hook's too
    t0 = time.perf_counter()
    y = w @ w
    dist.all_reduce(x)
    if i >= 20:
        times.append(time.perf_counter() - t0)
cpu = torch.tensor([(time.process_time() - c0) / steps])
dist.all_reduce(cpu)
if dist.get_rank() == 0:
    times.sort()
    print("MEDIAN_MS", 1000 * times[len(times) // 2], flush=True)
    print("CPU_MS", 1000 * cpu.item() / dist.get_world_size(), flush=True)
dist.destroy_process_group()
"""


def cost_run(steps: int, hooked: bool, td: Path, port: int) -> tuple[float, float]:
    script = td / "loop.py"
    script.write_text(LOOP)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for var in ("TORCH_FR_BUFFER_SIZE", "CLUSTERCTL_HOOK_DIR"):
        env.pop(var, None)
    if hooked:
        (td / "py").mkdir(exist_ok=True)
        (td / "hook").mkdir(exist_ok=True)
        (td / "py" / "sitecustomize.py").write_text(HOOK.read_text())
        env.update(PYTHONPATH=str(td / "py"), CLUSTERCTL_HOOK_DIR=str(td / "hook"), TORCH_FR_BUFFER_SIZE="2000")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(port), str(script), str(steps)], env=env, capture_output=True, text=True, timeout=600)
    got = {ln.split()[0]: float(ln.split()[1]) for ln in out.stdout.splitlines() if ln.startswith(("MEDIAN_MS", "CPU_MS"))}
    if len(got) == 2:
        return got["MEDIAN_MS"], got["CPU_MS"]
    raise SystemExit(f"bench: the loop printed no time:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def cost(steps: int, repeat: int) -> None:
    plain, hooked = [], []
    with tempfile.TemporaryDirectory(prefix="cchang-") as d:
        td = Path(d)
        for i in range(repeat):
            plain.append(cost_run(steps, False, td, 29800 + 2 * i))
            hooked.append(cost_run(steps, True, td, 29801 + 2 * i))
    for i, what in ((0, "step time (wall, median of per-run medians)"),
                    (1, "CPU per step (the ranks' process CPU, every thread, mean over the ranks; median of runs)")):
        p, h = statistics.median(v[i] for v in plain), statistics.median(v[i] for v in hooked)
        print(f"\n{what}, {steps} steps x {repeat} runs each way:")
        print(f"  plain torchrun                         {p:8.3f} ms   runs: {', '.join(f'{v[i]:.3f}' for v in plain)}")
        print(f"  + hook on PYTHONPATH + Flight Recorder {h:8.3f} ms   runs: {', '.join(f'{v[i]:.3f}' for v in hooked)}")
        print(f"  ratio {h / p:.3f} (target <= 1.01)")


ONE = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
x = torch.ones(1024)
for _ in range(300):
    dist.all_reduce(x)
got = []
for _ in range(7):
    c0 = time.thread_time()
    for _ in range(2000):
        dist.all_reduce(x)
    got.append((time.thread_time() - c0) / 2000)
print("US", 1e6 * min(got), flush=True)
dist.destroy_process_group()
"""


def per_collective(repeat: int) -> None:
    """What the Flight Recorder adds to one collective, alone: one process, a world of 1 (no peer
    to wait for, so no wait is counted), 2000 all_reduces of 4 KB, the calling thread's CPU time,
    the best of 7 batches per run; runs with and without TORCH_FR_BUFFER_SIZE alternate."""
    got: dict[str, list[float]] = {"0": [], "2000": []}
    for i in range(repeat):
        for size in got:
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE=size)
            out = subprocess.run([sys.executable, "-c", ONE, str(29700 + 2 * i + (size != "0"))], env=env,
                                 capture_output=True, text=True, timeout=300)
            us = [float(ln.split()[1]) for ln in out.stdout.splitlines() if ln.startswith("US")]
            if not us:
                raise SystemExit(f"bench: the one-process loop printed nothing:\n{out.stderr[-2000:]}")
            got[size] += us
    off, on = statistics.median(got["0"]), statistics.median(got["2000"])
    print(f"\nthe Flight Recorder per collective (one process, world of 1, the calling thread's CPU, median of "
          f"{repeat} runs' best batch): {off:.2f} us without, {on:.2f} us with: {on - off:+.2f} us a collective")
    print(f"  runs without: {', '.join(f'{v:.2f}' for v in got['0'])}; with: {', '.join(f'{v:.2f}' for v in got['2000'])}")
    print(f"  a step of 100 ms making 100 collectives pays {100 * (on - off) / 1000:+.3f} ms of it: "
          f"{100 * (on - off) / 1000 / 100:+.3%} (target <= 1 %)")


OLD_REF = "5dc40d5"  # the last commit whose watch counted log bytes and waited 300 s of silence


def old_tree(ref: str, into: Path) -> Path:
    """clusterctl as it was at `ref`, unpacked from this repository's history into `into`."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    got = subprocess.run([sys.executable, "-c", "import orchestrator; print(orchestrator.__file__)"], cwd=into,
                         env=dict(os.environ, PYTHONPATH=str(into)), capture_output=True, text=True).stdout
    if not got.startswith(str(into)):
        raise SystemExit(f"bench: the old tree does not import from {into}: {got}")
    return into


def latency(args) -> None:
    from tests.cluster import TestCluster

    rows: dict[str, list[tuple[float | None, float, str]]] = {"this checkout": [], f"old rule ({args.old_ref})": []}
    with TestCluster(n=args.nodes, gpus=1, name_prefix="cchb") as cluster, \
            tempfile.TemporaryDirectory(prefix="cchl-") as d:
        for nd in cluster.nodes:
            nd.run("mkdir -p ~/gpt_train")
        os.chmod(d, 0o755)
        inv = cluster.write_inventory(Path(d) / "nodes.yaml", env={"OMP_NUM_THREADS": "1"})
        old = old_tree(args.old_ref, Path(tempfile.mkdtemp(prefix="cchold-", dir=d)))
        plan = [("this checkout", None)] * args.repeat + [(f"old rule ({args.old_ref})", old)] * args.old_repeat
        for i, (who, tree) in enumerate(plan):
            got = one_latency(inv, Path(d) / f"home{i}", args, tree)
            rows[who].append(got)
            v = "not named" if got[0] is None else f"{got[0]:6.1f} s"
            print(f"  {who}, run {len(rows[who])}: stall -> verdict {v}, stall -> train returned {got[1]:6.1f} s; "
                  f"{got[2]}", flush=True)
    print(f"\n{args.scenario}{f' with a heartbeat every {args.heartbeat:g} s' if args.heartbeat else ''}, "
          f"{args.nodes} nodes, default settings (no --hang-timeout):")
    for who, got in rows.items():
        named = [g[0] for g in got if g[0] is not None]
        if got:
            print(f"  {who:28s} median stall -> verdict "
                  f"{f'{statistics.median(named):.1f} s' if named else 'none'} ({len(named)}/{len(got)} named), "
                  f"stall -> ended {statistics.median(g[1] for g in got):.1f} s")
    new, old_ = ([g[1] for g in got] for got in rows.values())
    if new and old_:
        print(f"  ratio old/new, stall -> ended: {statistics.median(old_) / statistics.median(new):.1f}x "
              "(target: ended within 30 s of the stall)")


def watch_run(p: subprocess.Popen, home: Path, limit: float, cut=None) -> tuple[float | None, float | None, float, str]:
    """(the stall, the verdict, the end, the verdict's text) of a running `train`, timed here: the
    stall is when the last step line landed in the control copies; `cut(home)` may act and return
    the moment it did (then the stall is that moment)."""
    seen: dict[Path, int] = {}
    stall = verdict = None
    text, t0 = "", time.time()
    while p.poll() is None:
        now = time.time()
        for log in (home / "runs").glob("*/nodes/*.log"):
            size = log.stat().st_size
            if seen.get(log, 0) < size:
                with open(log, "rb") as f:
                    f.seek(seen.get(log, 0))
                    if b" step " in f.read():
                        stall = now
                seen[log] = size
        if cut is not None and (at := cut(home)):
            stall, cut = at, None
        if verdict is None:
            for rec in (home / "runs").glob("*/run.json"):
                doc = json.loads(rec.read_text() or "{}")
                if (doc.get("attempts") or [{}])[-1].get("hang"):
                    verdict, text = now, doc["attempts"][-1]["hang"]
        if now - t0 > limit:
            p.kill()
            break
        time.sleep(0.02)
    return stall, verdict, time.time(), text


def one_latency(inv: Path, home: Path, args, tree: Path | None) -> tuple[float | None, float, str]:
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--skip-preflight",
                          "--nproc-per-node", "1", "--", str(HANG), "--mode", args.scenario, "--rank", "1", "--at",
                          "20", "--sleep", "0.1", "--heartbeat", str(args.heartbeat)], env=env,
                         cwd=str(tree or REPO), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stall, verdict, ended, text = watch_run(p, home, args.old_limit)
    if stall is None:
        raise SystemExit(f"bench: no step was seen:\n{p.stderr.read()[-3000:]}")
    if verdict is None:  # the foreground was given up on: its run is stopped, nothing left on the nodes
        for run in (home / "runs").glob("*/run.json"):
            subprocess.run([sys.executable, "-m", "orchestrator.cli", "stop", run.parent.name], env=env,
                           cwd=str(tree or REPO), capture_output=True, timeout=300)
        text = f"not named within {args.old_limit:g} s"
    return (None if verdict is None else verdict - stall), ended - stall, text[:120]


def partition(args) -> None:
    """--partition-trials runs on 4 nodes at default settings, node2 and node3 cut from each other at step 5."""
    from tests.cluster import TestCluster

    found = []
    with TestCluster(n=4, gpus=1, name_prefix="cchp") as cluster, tempfile.TemporaryDirectory(prefix="cchp-") as d:
        for nd in cluster.nodes:
            nd.run("mkdir -p ~/gpt_train")
        os.chmod(d, 0o755)
        inv = cluster.write_inventory(Path(d) / "nodes.yaml", env={"OMP_NUM_THREADS": "1"})
        n2, n3 = cluster.nodes[1], cluster.nodes[2]
        rules = [(n2, ("INPUT", "-s", n3.host, "-j", "DROP")), (n2, ("OUTPUT", "-d", n3.host, "-j", "DROP")),
                 (n3, ("INPUT", "-s", n2.host, "-j", "DROP")), (n3, ("OUTPUT", "-d", n2.host, "-j", "DROP"))]
        for i in range(args.partition_trials):
            home = Path(d) / f"home{i}"

            def cut(h):
                if not any(b"rank 3 step 5" in log.read_bytes() for log in h.glob("runs/*/nodes/*.log")):
                    return None
                for node, rule in rules:
                    node.iptables("-A", *rule)
                return time.time()

            p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv),
                                  "--skip-preflight", "--nproc-per-node", "1", "--", str(HANG), "--mode", "none",
                                  "--sleep", "0.1"], env=dict(os.environ, CLUSTERCTL_HOME=str(home)), cwd=str(REPO),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                at, verdict, ended, text = watch_run(p, home, 600, cut)
            finally:
                for node, rule in rules:
                    node.iptables("-D", *rule, check=False)
            found.append(text)
            took = f"{verdict - at:5.1f} s" if verdict and at else "  none"
            print(f"  trial {i + 1}: cut -> verdict {took}, ended {ended - at:5.1f} s: {text}", flush=True)
    link = sum("node2 ↔ node3 cannot reach each other" in t for t in found)
    never = sum("never entered" in t for t in found)
    print(f"\nnode2 <-> node3 cut, {len(found)} trials at default settings: {link} named the link, {never} named a rank "
          "that never entered a collective")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--old-repeat", type=int, default=1)
    ap.add_argument("--old-ref", default=OLD_REF)
    ap.add_argument("--old-limit", type=float, default=600.0)
    ap.add_argument("--scenario", choices=("stop", "loader"), default="stop")
    ap.add_argument("--heartbeat", type=float, default=0.0)
    ap.add_argument("--partition-trials", type=int, default=10)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--cost-repeat", type=int, default=5)
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-partition", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_latency:
        print(f"hang latency: {args.nodes} test nodes, rank 1 ({args.scenario}) at step 20, default settings")
        latency(args)
    if not args.skip_partition and args.partition_trials:
        print(f"\npartition: 4 test nodes, node2 <-> node3 cut at step 5, {args.partition_trials} trials")
        partition(args)
    if not args.skip_cost:
        cost(args.steps, args.cost_repeat)
        per_collective(args.cost_repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())

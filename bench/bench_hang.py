"""Hangs: how soon a stalled run is named and ended, and what the hook and Flight Recorder cost.

    sudo .venv/bin/python bench/bench_hang.py [--nodes 3] [--hang-timeout 30] [--repeat 3]
                                              [--steps 400] [--cost-repeat 5]

Latency (a test cluster of --nodes nodes, gloo on CPU): `clusterctl train --hang-timeout T` runs
tests/scripts/hang_ddp.py, whose rank 1 blocks in slow_data_loader() at step 20 while the others
wait in all_reduce. The control copies of the node logs are watched every 20 ms: the stall is
the moment the last step line landed; then the verdict (the attempt's `hang` in run.json) and
the foreground's return are timed from it. The issue's target: ended within 90 s of the stall
at T = 30. Without the watch the same run waits for gloo's own timeout (30 min), or NCCL's
watchdog (10 min) on GPUs, and names nobody.

Cost (this machine, no cluster): torchrun --nproc-per-node 2 runs a loop of one all_reduce of
1 MB and a small matmul per step; each step's time is measured inside the ranks. Plain runs and
runs with what clusterctl adds to every rank (the snapshot hook on PYTHONPATH, its FIFO thread,
TORCH_FR_BUFFER_SIZE=2000) alternate --cost-repeat times; the ratio of the medians of the
per-run median step times is printed (target <= 1.01), and beside it the same for the ranks' CPU
per step (process CPU time, every thread: what the Flight Recorder's bookkeeping and the hook's
idle thread add), which other processes on a shared machine disturb less than wall time (gloo's
waits still count where they spin). Last, the Flight Recorder alone per collective: one process,
a world of 1 (no peer, no wait), the calling thread's CPU per all_reduce with and without it. The hang watch itself runs on the
control machine and costs the ranks nothing until it asks.
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


def latency(nodes: int, timeout: float, repeat: int) -> None:
    from tests.cluster import TestCluster

    rows = []
    with TestCluster(n=nodes, gpus=1, name_prefix="cchb") as cluster, tempfile.TemporaryDirectory(prefix="cchl-") as d:
        for nd in cluster.nodes:
            nd.run("mkdir -p ~/gpt_train")
        os.chmod(d, 0o755)
        inv = cluster.write_inventory(Path(d) / "nodes.yaml", env={"OMP_NUM_THREADS": "1"})
        for i in range(repeat):
            rows.append(one_latency(inv, Path(d) / f"home{i}", timeout))
            print(f"  run {i + 1}: stall -> verdict {rows[-1][0]:6.1f} s, stall -> train returned {rows[-1][1]:6.1f} s; "
                  f"{rows[-1][2]}")
    v, e = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    print(f"\nhang-timeout {timeout:g} s, {nodes} nodes: median stall -> verdict {v:.1f} s, stall -> ended {e:.1f} s "
          f"(target: ended within 90 s at 30 s); without the watch: gloo's 1800 s timeout, nobody named")


def one_latency(inv: Path, home: Path, timeout: float) -> tuple[float, float, str]:
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--skip-preflight",
                          "--nproc-per-node", "1", "--hang-timeout", str(timeout), "--", str(HANG), "--mode", "loader",
                          "--rank", "1", "--at", "20", "--sleep", "0.1"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    sizes: dict[Path, int] = {}
    stall = verdict = None
    while p.poll() is None:
        now = time.time()
        for log in (home / "runs").glob("*/nodes/*.log"):
            size = log.stat().st_size
            if sizes.get(log) != size:
                sizes[log], stall = size, now
        if verdict is None:
            for rec in (home / "runs").glob("*/run.json"):
                doc = json.loads(rec.read_text() or "{}")
                if (doc.get("attempts") or [{}])[-1].get("hang"):
                    verdict, text = now, doc["attempts"][-1]["hang"]
        time.sleep(0.02)
    ended = time.time()
    if verdict is None or stall is None:
        raise SystemExit(f"bench: no hang verdict:\n{p.stderr.read()[-3000:]}")
    return verdict - stall, ended - stall, text[:110]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--hang-timeout", type=float, default=30.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--cost-repeat", type=int, default=5)
    ap.add_argument("--skip-latency", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_latency:
        print(f"hang latency: {args.nodes} test nodes, rank 1 stuck in its data loader at step 20")
        latency(args.nodes, args.hang_timeout, args.repeat)
    cost(args.steps, args.cost_repeat)
    per_collective(args.cost_repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stragglers: what the straggler watch's periodic progress snapshots cost the ranks' step time.

    .venv/bin/python bench/bench_straggler.py [--steps 2000] [--repeat 3] [--periods 10,1]

This machine, no cluster: the node agent (as shipped, remote/common.py in front) starts
`torchrun --nproc-per-node 2 -m trainer --preset nano` with clusterctl's hook in every rank, as
`train` does. In one arm nothing asks the ranks anything; in the others the bench runs what the
watch runs on every node each period, `node_agent.py snapshot KEY N 5 progress` (a fresh Python
that finds the ranks in /proc, asks each hook over its FIFO and reads the answers), every P
seconds: P = 10 is the watch's own period (runs/straggler.py PERIOD_S), shorter ones magnify the
cost. Arms alternate --repeat times; each run's step time is the median of the trainer's own
`step N ms` figures (rank 0, every 10 steps); the ratio of the medians is printed (target <=
1.01 at the watch's period). Also printed: the CPU time one snapshot costs on the node (the agent
process's, children included), which over P is the share of a core it takes, and the trainer's
compute clock alone (in both arms above): nano's step with and without it in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.probe import program  # noqa: E402

AGENT = program("node_agent")
HOOK = (REPO / "orchestrator" / "remote" / "hook" / "sitecustomize.py").read_text()
STEP_MS = re.compile(rb"\| step (\d+) ms")


def agent(home: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-", *map(str, args)], input=AGENT, capture_output=True, timeout=120,
                          env=dict(os.environ, HOME=str(home)))


def one_run(home: Path, key: str, steps: int, period: float | None, port: int) -> tuple[float, list[float]]:
    """(median step ms, CPU seconds of each snapshot) for one trainer run."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            "-m", "trainer", "--preset", "nano", "--max-steps", str(steps), "--batch-size", "4", "--block-size", "64",
            "--log-every", "10", "--ckpt-every", "0", "--eval-every", "0", "--eval-steps", "1", "--sample-tokens", "0",
            "--output-dir", str(home / f"out-{key}"), "--resume", "none"]
    spec = {"argv": argv, "cwd": str(REPO), "hook": HOOK,
            "env": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}}
    r = agent(home, "start", key, json.dumps(spec).encode().hex())
    if r.returncode != 0:
        raise SystemExit(f"bench: the run did not start: {r.stderr.decode()[-2000:]}")
    log = home / ".clusterctl" / "node-runs" / key / "log"
    done, cpu = threading.Event(), []

    def ask() -> None:
        n = 0
        while not done.wait(period):
            n += 1
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            agent(home, "snapshot", key, n, 5, "progress")
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)

    asker = threading.Thread(target=ask, daemon=True) if period else None
    if asker:
        asker.start()
    try:
        while json.loads(agent(home, "status", key).stdout or b"{}").get("exit_code") is None:
            time.sleep(1)
    finally:
        done.set()
        if asker:
            asker.join(30)
        agent(home, "stop", key, 1)  # nothing is left running if the bench is interrupted
    ms = [int(m) for m in STEP_MS.findall(log.read_bytes())][2:]  # the first 20 steps warm up
    if not ms:
        raise SystemExit(f"bench: the trainer printed no step time:\n{log.read_bytes()[-3000:].decode()}")
    return statistics.median(ms), cpu


def clock_cost(steps: int = 300, rounds: int = 5) -> tuple[float, float]:
    """The trainer's compute clock alone (trainer/progress.py: a hook on every parameter's
    gradient, two clock reads per step), in this process: median CPU seconds per
    forward+backward+step of the nano model without and with it, alternating `rounds` times."""
    import torch

    from trainer.config import make_config
    from trainer.model import build_model
    from trainer.progress import StepClock

    torch.set_num_threads(1)
    cfg = make_config({"preset": "nano"})
    x = torch.randint(0, cfg.vocab_size, (4, 64))
    out: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for with_clock in (False, True):
            model = build_model(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            clock = StepClock(model, torch.device("cpu"), sink=lambda *_: None) if with_clock else None
            for _ in range(10):  # warm-up
                model(input_ids=x, labels=x).loss.backward()
                opt.zero_grad(set_to_none=True)
            t0 = time.process_time()  # this process's CPU time: other jobs on the machine do not count
            for step in range(steps):
                if clock:
                    clock.start()
                model(input_ids=x, labels=x).loss.backward()
                if clock:
                    clock.backward_done()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if clock:
                    clock.end(step)
            out[with_clock].append((time.process_time() - t0) / steps)
    return statistics.median(out[False]), statistics.median(out[True])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--periods", default="10,1", help="snapshot periods to measure, seconds, comma-separated")
    args = ap.parse_args(argv)
    arms: list[float | None] = [None, *(float(p) for p in args.periods.split(","))]
    got: dict[float | None, list[float]] = {a: [] for a in arms}
    cpu: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ccstrag-") as d:
        for i in range(args.repeat):
            for j, arm in enumerate(arms):
                ms, c = one_run(Path(d), f"bench{i}x{j}", args.steps, arm, 29700 + 10 * i + j)
                got[arm].append(ms)
                cpu += c
                print(f"  run {i + 1}, {'no snapshots' if arm is None else f'a snapshot every {arm:g} s'}: "
                      f"median step {ms:.0f} ms", flush=True)
    base = statistics.median(got[None])
    print(f"\nstep time, trainer nano on 2 CPU ranks, {args.steps} steps x {args.repeat} runs per arm "
          "(median of per-run medians):")
    print(f"  no snapshots                 {base:7.1f} ms   runs: {', '.join(f'{v:.0f}' for v in got[None])}")
    for arm in arms[1:]:
        m = statistics.median(got[arm])
        print(f"  a snapshot every {arm:4g} s      {m:7.1f} ms   runs: {', '.join(f'{v:.0f}' for v in got[arm])}   "
              f"ratio {m / base:.3f}{' (target <= 1.01)' if arm == 10 else ''}")
    plain, clocked = clock_cost()
    print(f"  the compute clock alone, nano in one process: {plain * 1e3:.2f} ms of CPU per step without, "
          f"{clocked * 1e3:.2f} ms with: ratio {clocked / plain:.3f}")
    if cpu:
        per = statistics.median(cpu)
        print(f"  one progress snapshot costs {per * 1e3:.0f} ms of CPU on the node (median of {len(cpu)}): "
              f"{per / 10:.2%} of one core at the watch's 10 s period")
    return 0


if __name__ == "__main__":
    sys.exit(main())

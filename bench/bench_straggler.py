"""Stragglers: what the straggler watch's progress requests cost the node, and the ranks' step time.

    .venv/bin/python bench/bench_straggler.py [--steps 2000] [--repeat 3] [--periods 10,1]
                                              [--cost-seconds 30]

This machine, no cluster, the node agent as shipped (remote/common.py in front; remote/artifacts.py
too for the stream). Two parts, in one invocation:

The CPU one progress request costs the node, both ways the watch has had of asking. Two ranks
with clusterctl's hook (the hook's full 512 steps reported, then asleep, so their CPU is their
answers alone) under the node's log stream, `tail KEY 0 stream - TBDIR - PROGRESS_S`, as a run
with artifact directories has it: over --cost-seconds with PROGRESS_S=1, then with PROGRESS_S=0,
the stream process's CPU time (utime+stime in /proc/PID/stat) and the ranks'; the difference
over the requests the stream sent is what one request costs there (what ships: the stream
process asks the hooks on a thread of its own). Beside it, on the same ranks, the old way (and
still the way of a run without a framed stream): `node_agent.py snapshot KEY N 5 progress`, a
fresh Python per request, its CPU (children included) plus the ranks' answers. Over the watch's
10 s period each is a share of one core (the target: at most 1 %).

The step time: torchrun --nproc-per-node 2 -m trainer --preset nano with the hook in every rank,
as `train` starts it, under the same stream. Arms, alternating --repeat times: nothing asked
(PROGRESS_S=0); the stream asking every P s (PROGRESS_S=P: what ships); a fresh `snapshot ...
progress` agent every P s (the old way). P = 10 is the watch's own period (runs/judge/straggler.py
PERIOD_S), shorter ones magnify the cost. Each run's figure is the median of the trainer's own
`step N ms` (rank 0, every 10 steps); the ratios of the medians are printed (target <= 1.01 at
the watch's period). Also printed: the trainer's compute clock alone, nano's step with and
without it in one process.
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

from orchestrator.probe import local_argv  # noqa: E402
from orchestrator.remote.common import env_values  # noqa: E402
from orchestrator.runs.judge.straggler import PERIOD_S  # noqa: E402
from orchestrator.runs.logs.copier import FRAME_PROGRESS, Frames  # noqa: E402

HOOK = (REPO / "orchestrator" / "remote" / "hook" / "sitecustomize.py").read_text()
STEP_MS = re.compile(rb"\| step (\d+) ms")
TICK = os.sysconf("SC_CLK_TCK")
# two ranks that report the hook's whole memory of steps (STEPS_KEPT) and then only answer
IDLE_RANK = """
import time
import sitecustomize
for step in range(512):
    sitecustomize.clusterctl_step(step, 0.05)
print("ready", flush=True)
time.sleep(3600)
"""
IDLE_LAUNCH = ("import os, subprocess, sys\n"
               "ps = [subprocess.Popen([sys.executable, '-c', os.environ['CHILD']], "
               "env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r))) for r in (0, 1)]\n"
               "[p.wait() for p in ps]")


def agent(home: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(local_argv("node_agent", *map(str, args)), stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=120,
                          env=dict(os.environ, HOME=str(home)))


def start(home: Path, key: str, spec: dict) -> Path:
    r = agent(home, "start", key, json.dumps(spec).encode().hex())
    if r.returncode != 0:
        raise SystemExit(f"bench: the run did not start: {r.stderr.decode()[-2000:]}")
    return home / ".clusterctl" / "node-runs" / key


def cpu_s(pid: int) -> float:
    """utime + stime of a process (/proc/PID/stat), in seconds; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


class Stream:
    """The node's log stream of run `key` (`tail KEY 0 stream - TBDIR - PROGRESS_S`), read on a
    thread: `progress` counts the progress records it sent."""

    def __init__(self, home: Path, key: str, progress_s: float):
        args = ["tail", key, "0", "stream", "-", str(home / "tb-none"), "-", f"{progress_s:g}"]
        self.proc = subprocess.Popen(local_argv("node_agent", *args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=dict(os.environ, HOME=str(home)))
        self.progress = 0
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self) -> None:
        frames = Frames()
        while chunk := os.read(self.proc.stdout.fileno(), 1 << 16):
            self.progress += sum(1 for head, _ in frames.feed(chunk) if head.get("t") == FRAME_PROGRESS)

    def close(self) -> None:
        self.thread.join(60)
        self.proc.wait(60)


def rank_pids(key: str) -> list[int]:
    """The run's ranks: its processes with RANK in their environment."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            env = (p / "environ").read_bytes() if p.name.isdigit() else b""
        except OSError:
            continue
        if key in env_values(env, "CLUSTERCTL_RUN_KEY") and env_values(env, "RANK"):
            out.append(int(p.name))
    return out


def cost_arm(home: Path, key: str, progress_s: float, seconds: float, snapshots: int) -> dict:
    """Over `seconds` of two idle hooked ranks under a stream asking every `progress_s` s: the
    stream's CPU, the ranks' CPU, the progress records sent; then (`snapshots` > 0) that many old-way
    agent snapshots, each's CPU and the ranks' CPU during them."""
    d = start(home, key, {"argv": [sys.executable, "-c", IDLE_LAUNCH], "cwd": str(home), "hook": HOOK,
                          "env": {"CHILD": IDLE_RANK}})
    s = Stream(home, key, progress_s)
    try:
        deadline = time.time() + 60
        while (d / "log").read_bytes().count(b"ready") < 2 and time.time() < deadline:
            time.sleep(0.1)
        ranks = rank_pids(key)
        time.sleep(1.0)  # the stream settled
        c0, r0, n0 = cpu_s(s.proc.pid), sum(map(cpu_s, ranks)), s.progress
        time.sleep(seconds)
        out = {"stream": cpu_s(s.proc.pid) - c0, "ranks": sum(map(cpu_s, ranks)) - r0, "requests": s.progress - n0,
               "agent": [], "agent_ranks": []}
        for n in range(snapshots):
            before, r0 = resource.getrusage(resource.RUSAGE_CHILDREN), sum(map(cpu_s, ranks))
            agent(home, "snapshot", key, 900 + n, 5, "progress")
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            out["agent"].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            out["agent_ranks"].append(sum(map(cpu_s, ranks)) - r0)
        return out
    finally:
        agent(home, "stop", key, 1)
        s.close()


def request_cost(home: Path, seconds: float, snapshots: int = 20) -> None:
    """Prints the CPU one progress request costs the node: the stream's way and the agent's."""
    on = cost_arm(home, "costp1", 1.0, seconds, 0)
    off = cost_arm(home, "costp0", 0.0, seconds, snapshots)
    if not on["requests"]:
        raise SystemExit("bench: the stream sent no progress record")
    stream = (on["stream"] - off["stream"]) / on["requests"]
    ranks = (on["ranks"] - off["ranks"]) / on["requests"]
    # the ranks' share by the sum: /proc counts whole clock ticks (10 ms), more than one answer takes
    old, old_ranks = statistics.median(off["agent"]), sum(off["agent_ranks"]) / len(off["agent_ranks"])
    print(f"\nCPU per progress request on the node (2 idle ranks answering 512 steps each), {seconds:g} s per arm:")
    print(f"  the log stream asks (what ships): stream process {on['stream']:.2f} s with PROGRESS_S=1 "
          f"({on['requests']} requests) vs {off['stream']:.2f} s with 0: {stream * 1e3:.1f} ms per request, "
          f"+ the ranks' answers {ranks * 1e3:.1f} ms = {(stream + ranks) * 1e3:.1f} ms: "
          f"{(stream + ranks) / PERIOD_S:.3%} of one core at the watch's {PERIOD_S:g} s period")
    print(f"  a fresh agent per request (the old way; {len(off['agent'])} of them): {old * 1e3:.0f} ms (median) "
          f"+ the ranks' answers {old_ranks * 1e3:.1f} ms (mean) = {(old + old_ranks) * 1e3:.0f} ms: "
          f"{(old + old_ranks) / PERIOD_S:.2%} of one core at the {PERIOD_S:g} s period")


def one_run(home: Path, key: str, steps: int, arm: tuple[str, float], port: int) -> tuple[float, list[float]]:
    """(median step ms, CPU seconds of each old-way snapshot) of one trainer run under its stream;
    arm: ("none", 0), ("stream", P) or ("agent", P)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            "-m", "trainer", "--preset", "nano", "--max-steps", str(steps), "--batch-size", "4", "--block-size", "64",
            "--log-every", "10", "--ckpt-every", "0", "--eval-every", "0", "--eval-steps", "1", "--sample-tokens", "0",
            "--output-dir", str(home / f"out-{key}"), "--resume", "none"]
    d = start(home, key, {"argv": argv, "cwd": str(REPO), "hook": HOOK,
                          "env": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}})
    kind, period = arm
    s = Stream(home, key, period if kind == "stream" else 0.0)
    done, cpu = threading.Event(), []

    def ask() -> None:
        n = 0
        while not done.wait(period):
            n += 1
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            agent(home, "snapshot", key, n, 5, "progress")
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)

    asker = threading.Thread(target=ask, daemon=True) if kind == "agent" else None
    if asker:
        asker.start()
    try:
        s.close()  # the stream ends once the run ended and every byte was sent
    finally:
        done.set()
        if asker:
            asker.join(30)
        agent(home, "stop", key, 1)  # nothing is left running if the bench is interrupted
    ms = [int(m) for m in STEP_MS.findall((d / "log").read_bytes())][2:]  # the first 20 steps warm up
    if not ms:
        raise SystemExit(f"bench: the trainer printed no step time:\n{(d / 'log').read_bytes()[-3000:].decode()}")
    if kind == "stream" and not s.progress:
        raise SystemExit("bench: the stream arm sent no progress record")
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
                torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
                opt.zero_grad(set_to_none=True)
            t0 = time.process_time()  # this process's CPU time: other jobs on the machine do not count
            for step in range(steps):
                if clock:
                    clock.start()
                torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
                if clock:
                    clock.backward_done()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if clock:
                    clock.end(step)
            out[with_clock].append((time.process_time() - t0) / steps)
    return statistics.median(out[False]), statistics.median(out[True])


def label(arm: tuple[str, float]) -> str:
    kind, p = arm
    return {"none": "nothing asked", "stream": f"the stream asks every {p:g} s",
            "agent": f"an agent every {p:g} s"}[kind]


def step_times(home: Path, steps: int, repeat: int, periods: list[float]) -> None:
    arms = [("none", 0.0), *((k, p) for p in periods for k in ("stream", "agent"))]
    got: dict[tuple[str, float], list[float]] = {a: [] for a in arms}
    cpu: list[float] = []
    for i in range(repeat):
        for j, arm in enumerate(arms):
            ms, c = one_run(home, f"bench{i}x{j}", steps, arm, 29700 + 10 * i + j)
            got[arm].append(ms)
            cpu += c
            print(f"  run {i + 1}, {label(arm)}: median step {ms:.0f} ms", flush=True)
    base = statistics.median(got[arms[0]])
    print(f"\nstep time, trainer nano on 2 CPU ranks under the node's stream, {steps} steps x {repeat} runs per arm "
          "(median of per-run medians):")
    for arm in arms:
        m = statistics.median(got[arm])
        ratio = "" if arm == arms[0] else f"   ratio {m / base:.3f}{' (target <= 1.01)' if arm[1] == 10 else ''}"
        print(f"  {label(arm):30s} {m:7.1f} ms   runs: {', '.join(f'{v:.0f}' for v in got[arm])}{ratio}")
    if cpu:
        print(f"  one old-way snapshot during training: {statistics.median(cpu) * 1e3:.0f} ms of CPU "
              f"(the agent process, median of {len(cpu)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--periods", default="10,1", help="request periods of the step-time arms, seconds, comma-separated")
    ap.add_argument("--cost-seconds", type=float, default=30.0,
                    help="how long each arm of the per-request CPU measure runs (0: left out)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ccstrag-") as d:
        if args.cost_seconds > 0:
            request_cost(Path(d), args.cost_seconds)
        if args.repeat > 0:
            step_times(Path(d), args.steps, args.repeat, [float(p) for p in args.periods.split(",")])
    plain, clocked = clock_cost()
    print(f"  the compute clock alone, nano in one process: {plain * 1e3:.2f} ms of CPU per step without, "
          f"{clocked * 1e3:.2f} ms with: ratio {clocked / plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

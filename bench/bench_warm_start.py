"""What a warm interpreter would save each restart: a rank forked from a process that has torch
imported, against a fresh interpreter (the way every rank starts today), in the same run.

Issue 33's hot recovery is not built. Every restart spends 8.9-12.5 s of its 10.4-14.7 s after
detection starting processes (docs/performance.md, "Recovery after a lost node"): torchrun and
each worker import torch again, and building the first optimizer imports torch._dynamo. This bench
measures the path a warm start would take before it is built:

- fresh: `python -c WORK` (import torch, a model, AdamW, one step), as torchrun starts a rank;
- warm: a zygote imported torch and torch._dynamo once and waits; each rank is a fork of it that
  runs the same WORK with the rank's own environment.

A fork would break the node side's contract that every process of a run is found by the marker in
its environment (/proc/PID/environ, remote/common.py marked_pids, RANK read by proc_environ): the
kernel shows a process's environment as it was at exec, and a fork has none of its own. The fork
here writes its environment over that block (the bytes between env_start and env_end of
/proc/self/stat, as setproctitle rewrites argv; the zygote starts with a pad variable to make
room), after moving libc's own environ off it (os.environ goes through setenv, which copies).
Each rank is checked while it waits: marked_pids finds it by its run key and proc_environ reads
its RANK, for both arms.

    .venv/bin/python bench/bench_warm_start.py --rounds 5 --ranks 4

Arms alternate per round; each round starts `--ranks` ranks at once (the test cluster's 4 nodes
on 2 cores) and times each from its request to its `ready` line. Not product code.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.remote.common import RUN_KEY, marked_pids, proc_environ  # noqa: E402

PAD = "CLUSTERCTL_ENV_PAD"
PAD_BYTES = 64 * 1024  # room for the rank's environment in the zygote's exec-time block

WORK = """
import os, signal, sys, torch
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(8, 256)).square().mean().backward()
opt.step()
print(f"ready {os.getpid()}", flush=True)
signal.sigwait([signal.SIGUSR1])  # the bench reads this process's environment, then lets it end
"""

ZYGOTE = r"""
import ctypes, json, os, signal, sys
import torch, torch._dynamo, torch.optim  # what every rank imports, once

def own_environ(env):
    # libc's environ moved to copies first (os.environ's setenv), then the exec-time block rewritten
    os.environ.clear()
    os.environ.update(env)
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51
    block = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())
    if len(block) > end - start:
        raise SystemExit(f"zygote: the environment ({len(block)} bytes) does not fit its block ({end - start})")
    ctypes.memmove(start, block.ljust(end - start, b"\0"), end - start)

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # a rank that ends is reaped by the kernel, no zombie waits
print("warm", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if os.fork() == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the rank waits for its own children as usual
        sys.stdin.close()
        own_environ(req["env"])
        exec(compile(req["work"], "<rank>", "exec"), {"__name__": "__main__"})
        os._exit(0)
"""


def rank_env(key: str, rank: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PAD}
    env.update({RUN_KEY: key, "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    return env


def read_ready(stream, n: int, timeout: float) -> dict[int, float]:
    """pid -> when its `ready` line arrived, for n lines (read from the file descriptor: a text
    stream's buffer would hide lines from select)."""
    got, buf, deadline = {}, b"", time.monotonic() + timeout
    fd = stream.fileno()
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SystemExit(f"bench: {len(got)} of {n} ranks ready after {timeout:g} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise SystemExit("bench: the ranks' output ended early")
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"ready "):
                got[int(line.split()[1])] = time.monotonic()
    return got


def check_and_end(pids, key: str) -> None:
    """Each rank is found by its run key and reads back its RANK; then let go."""
    found = set(marked_pids(RUN_KEY, lambda v: v == key))
    for pid in pids:
        if pid not in found:
            raise SystemExit(f"bench: rank process {pid} is not found by its marker {RUN_KEY}={key}")
        if "RANK" not in proc_environ(pid, ("RANK",)):
            raise SystemExit(f"bench: rank process {pid} shows no RANK in /proc/{pid}/environ")
        os.kill(pid, signal.SIGUSR1)


def fresh_round(key: str, ranks: int) -> list[float]:
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", WORK], env=rank_env(key, r), stdout=subprocess.PIPE, text=True)
             for r in range(ranks)]
    times = []
    for p in procs:
        ready = read_ready(p.stdout, 1, 120)
        times.append(next(iter(ready.values())) - t0)
    check_and_end([p.pid for p in procs], key)
    for p in procs:
        p.wait(30)
    return times


def warm_round(zygote: subprocess.Popen, key: str, ranks: int) -> list[float]:
    t0 = time.monotonic()
    for r in range(ranks):
        zygote.stdin.write(json.dumps({"env": rank_env(key, r), "work": WORK}) + "\n")
    zygote.stdin.flush()
    ready = read_ready(zygote.stdout, ranks, 120)
    check_and_end(list(ready), key)
    return [t - t0 for t in ready.values()]


def start_zygote() -> tuple[subprocess.Popen, float]:
    t0 = time.monotonic()
    z = subprocess.Popen([sys.executable, "-c", ZYGOTE], env=dict(os.environ, **{PAD: "x" * PAD_BYTES}),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if os.read(z.stdout.fileno(), 16).strip() != b"warm":
        raise SystemExit("bench: the zygote did not start")
    return z, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4, help="ranks started at once per round")
    args = ap.parse_args()
    zygote, warm_up = start_zygote()
    print(f"zygote warm in {warm_up:.2f} s (import torch and torch._dynamo, once)")
    fresh, warm = [], []
    try:
        for i in range(args.rounds):
            arms = [("fresh", fresh), ("warm", warm)]
            for name, into in (arms if i % 2 == 0 else arms[::-1]):
                key = f"bench-warm-{os.getpid()}-{i}-{name}"
                got = fresh_round(key, args.ranks) if name == "fresh" else warm_round(zygote, key, args.ranks)
                into.append(max(got))
                print(f"round {i + 1} {name}: every rank ready after {max(got):.2f} s "
                      f"(each: {', '.join(f'{t:.2f}' for t in sorted(got))})", flush=True)
    finally:
        zygote.stdin.close()
        zygote.wait(30)
        for pid in marked_pids(RUN_KEY, lambda v: v.startswith(f"bench-warm-{os.getpid()}-")):  # a round cut short
            os.kill(pid, signal.SIGKILL)
    f, w = statistics.median(fresh), statistics.median(warm)
    print(f"\n{args.ranks} ranks at once, median of {args.rounds} rounds: fresh {f:.2f} s, warm {w:.2f} s: "
          f"{f / w:.1f}x sooner, {f - w:.2f} s saved per start; every rank found by its marker with its RANK")


if __name__ == "__main__":
    main()

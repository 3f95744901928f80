"""What the warm interpreter saves each restarted rank (runs/warmpool.py, remote/warm.py): a rank
forked from it against a fresh interpreter (the way attempt 1's ranks start), in the same run.

Both arms start each rank the way torchrun does, `python -u -c WORK` (import torch, a model,
AdamW, one step), with the run's hook on PYTHONPATH as the node's waiter writes it (the hook and
clusterctl_warm.py). In the warm arm the rank's environment names the warm interpreter's socket
(CLUSTERCTL_WARM): the hook has it fork the rank, the process started stays as its stand-in. The
warm interpreter is the product's (`python -m orchestrator.remote.warm serve SOCK PRELOAD`, the
preload runs/warmpool.py asks for, the padded environment `warm RUN NODE` gives it). Each rank is
checked while it waits: marked_pids finds it by its run key and proc_environ reads its RANK.

    .venv/bin/python bench/bench_warm_start.py --rounds 5 --ranks 4

Arms alternate per round; each round starts `--ranks` ranks at once (the test cluster's 4 nodes
on 2 cores) and times each from its start to its `ready` line.

    .venv/bin/python bench/bench_warm_start.py --rounds 5 --ranks 4 --early 3

An early fault: each round starts a warm interpreter of its own and, `--early` seconds later (it
still imports), the ranks. "cold" is how such a restart started before the warm interpreter
listened from its start: every rank imports torch itself while the warm one goes on importing
beside it; "waits": every rank asks it, waits for its imports to end and is forked.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.node.warm import PRELOAD  # noqa: E402
from orchestrator.remote import warm as node_warm  # noqa: E402
from orchestrator.remote.common import RUN_KEY, marked_pids, proc_environ  # noqa: E402

REMOTE = Path(__file__).resolve().parent.parent / "orchestrator" / "remote"

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


def rank_env(key: str, rank: int, py: Path, sock: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({RUN_KEY: key, "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(py)})
    if sock is not None:
        env["CLUSTERCTL_WARM"] = str(sock)
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


def one_round(key: str, ranks: int, py: Path, sock: Path | None) -> list[float]:
    """Every rank started at once; each one's time from the start to its `ready` line."""
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-u", "-c", WORK], env=rank_env(key, r, py, sock),
                              stdout=subprocess.PIPE, text=True) for r in range(ranks)]
    times, pids = [], []
    for p in procs:
        ready = read_ready(p.stdout, 1, 120)
        pid, at = next(iter(ready.items()))
        if (pid != p.pid) != (sock is not None):
            raise SystemExit(f"bench: rank {p.pid} ran {'cold' if pid == p.pid else 'forked'} in the "
                             f"{'warm' if sock else 'fresh'} arm")
        times.append(at - t0)
        pids.append(pid)
    check_and_end(pids, key)
    for p in procs:
        p.wait(30)
    return times


def hook_dir(td: Path) -> Path:
    """The run directory's py/, as the waiter writes it: the hook and clusterctl_warm.py."""
    py = td / "py"
    py.mkdir()
    (py / "sitecustomize.py").write_text((REMOTE / "hook" / "sitecustomize.py").read_text())
    (py / "clusterctl_warm.py").write_text((REMOTE / "warm_client.py").read_text())
    return py


def start_zygote(sock: Path, ready: bool = True) -> tuple[subprocess.Popen, float]:
    """The product's warm interpreter on `sock`; with `ready`, once it said so (and how long that took)."""
    t0 = time.monotonic()
    pad = {f"{node_warm.PAD_ENV}{i}": "x" * node_warm.PAD_PART for i in range(2)}
    z = subprocess.Popen([sys.executable, "-m", "orchestrator.remote.warm", "serve", str(sock), ",".join(PRELOAD)],
                         cwd=REMOTE.parent.parent, env={**os.environ, **pad}, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, text=True)
    said = z.stdout.readline().strip()  # `listening` (its socket is there), then `ready` (imported)
    if said != "listening" or (ready and z.stdout.readline().strip() != "ready"):
        raise SystemExit("bench: the warm interpreter did not start")
    return z, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4, help="ranks started at once per round")
    ap.add_argument("--early", type=float, default=None, metavar="S",
                    help="an early fault: the ranks start S seconds after their warm interpreter, while it imports")
    args = ap.parse_args()
    if args.early is not None:
        return early(args)
    with tempfile.TemporaryDirectory() as td:
        py = hook_dir(Path(td))
        sock = Path(td) / "warm" / "sock"
        sock.parent.mkdir()
        zygote, warm_up = start_zygote(sock)
        print(f"warm interpreter ready in {warm_up:.2f} s (imports {', '.join(PRELOAD)}, once)")
        fresh, warm = [], []
        try:
            for i in range(args.rounds):
                arms = [("fresh", fresh), ("warm", warm)]
                for name, into in (arms if i % 2 == 0 else arms[::-1]):
                    key = f"bench-warm-{os.getpid()}-{i}-{name}"
                    got = one_round(key, args.ranks, py, sock if name == "warm" else None)
                    into.append(max(got))
                    print(f"round {i + 1} {name}: every rank ready after {max(got):.2f} s "
                          f"(each: {', '.join(f'{t:.2f}' for t in sorted(got))})", flush=True)
        finally:
            zygote.terminate()
            zygote.wait(30)
            for pid in marked_pids(RUN_KEY, lambda v: v.startswith(f"bench-warm-{os.getpid()}-")):  # cut short
                os.kill(pid, signal.SIGKILL)
    f, w = statistics.median(fresh), statistics.median(warm)
    print(f"\n{args.ranks} ranks at once, median of {args.rounds} rounds: fresh {f:.2f} s, warm {w:.2f} s: "
          f"{f / w:.1f}x sooner, {f - w:.2f} s saved per start; every rank found by its marker with its RANK")


def early(args) -> None:
    """Each round its own warm interpreter, the ranks started `args.early` s after it (see the
    module's doc): "cold" against "waits", alternated."""
    cold, waits = [], []
    with tempfile.TemporaryDirectory() as td:
        py = hook_dir(Path(td))
        try:
            for i in range(args.rounds):
                arms = [("cold", cold), ("waits", waits)]
                for name, into in (arms if i % 2 == 0 else arms[::-1]):
                    sock = Path(td) / f"warm-{i}-{name}" / "sock"
                    sock.parent.mkdir()
                    zygote, _ = start_zygote(sock, ready=False)
                    try:
                        time.sleep(args.early)
                        if zygote.poll() is not None or not sock.is_socket():
                            raise SystemExit(f"bench: the warm interpreter of round {i + 1} does not listen")
                        key = f"bench-warm-{os.getpid()}-{i}-{name}"
                        got = one_round(key, args.ranks, py, sock if name == "waits" else None)
                    finally:
                        zygote.terminate()
                        zygote.wait(60)
                    into.append(max(got))
                    print(f"round {i + 1} {name}: every rank ready {max(got):.2f} s after its start, "
                          f"{args.early:g} s after the warm interpreter's", flush=True)
        finally:
            for pid in marked_pids(RUN_KEY, lambda v: v.startswith(f"bench-warm-{os.getpid()}-")):
                os.kill(pid, signal.SIGKILL)
    c, w = statistics.median(cold), statistics.median(waits)
    print(f"\n{args.ranks} ranks {args.early:g} s after their warm interpreter's start, median of {args.rounds} "
          f"rounds: cold {c:.2f} s, waiting for it {w:.2f} s: {c / w:.2f}x sooner, {c - w:.2f} s saved")


if __name__ == "__main__":
    main()

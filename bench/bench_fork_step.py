"""Does a process forked from an interpreter that already imported torch step slower than a fresh one?

    .venv/bin/python bench/bench_fork_step.py [--rounds 8] [--steps 800]

One machine, no cluster, no clusterctl: the shipped trainer's model (preset nano, one thread) trains
on random tokens for `--steps` steps, timed after the first 100, in two kinds of process, in a
shuffled order each round: **fork**, a child this interpreter forks after importing torch (as the
warm interpreter forks a restarted rank, remote/warm.py, without the rest of a rank's set-up in
warm_fork.become), and **cold**, a fresh `python` started for it (as torchrun starts a rank). Printed per process: CPU ms per step (the process's own, time
.process_time) and minor page faults per step; then each kind's median and the fork's median
against the cold one, and the median of the per-round ratios. Where this machine's speed drifts
(a shared VM's does, by up to 20 % from one minute to the next), the rounds' ratios scatter: read
the median of them, not one round. No assertions: this prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 100


def steps(n: int) -> dict:
    """Train the nano model `n` steps in this process: CPU ms and minor faults per step after WARMUP."""
    import torch

    sys.path.insert(0, str(ROOT))
    from trainer.config import parse_args
    from trainer.model import build_model

    torch.set_num_threads(1)
    cfg = parse_args(["--preset", "nano"])
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    c0 = f0 = 0.0
    for i in range(n):
        if i == WARMUP:
            c0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    done = n - WARMUP
    return {"cpu_ms": (time.process_time() - c0) / done * 1e3,
            "minflt": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / done}


def cold(n: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(n)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def forked(n: int) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            os.write(w, json.dumps(steps(n)).encode())
            code = 0
        except BaseException:  # noqa: BLE001 - said, and the child's exit code tells the parent
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("bench: the forked child failed (its traceback above)")
    return json.loads(data)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(steps(args.child)))
        return 0
    if args.steps <= WARMUP:
        ap.error(f"--steps must be above {WARMUP} (the untimed warm-up)")
    os.environ["OMP_NUM_THREADS"] = "1"
    __import__("torch")  # what the warm interpreter holds before it forks

    got: dict[str, list[float]] = {"fork": [], "cold": []}
    ratios = []
    for i in range(args.rounds):
        order = ["fork", "cold"]
        random.shuffle(order)
        this = {}
        for kind in order:
            r = forked(args.steps) if kind == "fork" else cold(args.steps)
            this[kind] = r["cpu_ms"]
            got[kind].append(r["cpu_ms"])
            print(f"round {i + 1} {kind}: {r['cpu_ms']:.2f} ms CPU a step, {r['minflt']:.0f} minor faults a step", flush=True)
        ratios.append(this["fork"] / this["cold"])
    f, c = statistics.median(got["fork"]), statistics.median(got["cold"])
    print(f"fork {f:.2f} ms, cold {c:.2f} ms a step (medians of {args.rounds}): {f / c:.3f}x; per round "
          f"{min(ratios):.3f}-{max(ratios):.3f}x, median {statistics.median(ratios):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

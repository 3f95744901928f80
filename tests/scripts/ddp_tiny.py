"""A tiny DDP job for launch tests: all-reduces a few times and prints per rank.

--steps N      all-reduce N times
--restart-steps N  an attempt after the first (CLUSTERCTL_ATTEMPT > 1) all-reduces N times instead:
               the first attempt runs long enough to be cut, the restart's run to the end is short
--sleep S      sleep S seconds per step (so tests can break a node mid-run)
--lines K      print K extra numbered lines per rank at the end (log volume tests)
--fail-rank R  rank R exits with code 3 after the first step
--ignore-sigterm  workers ignore SIGTERM (a job that will not stop gracefully)
"""
import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--restart-steps", type=int, default=None)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--lines", type=int, default=0)
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--ignore-sigterm", action="store_true")
a = p.parse_args()
if a.restart_steps is not None and int(os.environ.get("CLUSTERCTL_ATTEMPT", "1")) > 1:
    a.steps = a.restart_steps
if a.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of {world} on {os.uname().nodename} run={os.environ.get('CLUSTERCTL_RUN_ID')}", flush=True)
for step in range(a.steps):
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    print(f"rank {rank} step {step} sum {int(t[0])}", flush=True)
    if rank == a.fail_rank:
        print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(a.sleep)
for i in range(a.lines):
    print(f"rank {rank} line {i}")
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()

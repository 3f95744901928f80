"""A gloo job whose rank --rank exits with --code at step --at in the run's first attempt
(CLUSTERCTL_ATTEMPT 1) and finishes in any other: the retry-by-exit-code tests' script."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--code", type=int, default=3)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--at", type=int, default=3)
p.add_argument("--steps", type=int, default=6)
a = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.ones(10)
for step in range(a.steps):
    if step == a.at and rank == a.rank and os.environ.get("CLUSTERCTL_ATTEMPT", "1") == "1":
        print(f"rank {rank} exits with {a.code} at step {step}", flush=True)
        sys.exit(a.code)
    dist.all_reduce(x)
    print(f"rank {rank} step {step}", flush=True)
dist.barrier()
dist.destroy_process_group()

"""A plain DDP job that knows nothing of clusterctl (no step reports): each step computes a few
matrix products on the CPU, then DDP all-reduces the gradients. For the straggler watch's Flight
Recorder path (tests/test_straggler_cluster.py).

--steps N   steps to run (default: until stopped)
--size K    the square matrices' side (the compute per step)
"""
import argparse
import os

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10**9)
p.add_argument("--size", type=int, default=192)
a = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(a.size, a.size))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(a.size, a.size)
print(f"rank {rank} on {os.uname().nodename}", flush=True)
for step in range(1, a.steps + 1):
    h = x
    for _ in range(6):
        h = torch.tanh(h @ x) / a.size
    model(h).sum().backward()
    opt.step()
    opt.zero_grad()
    if step % 50 == 0:
        print(f"rank {rank} step {step}", flush=True)
dist.destroy_process_group()

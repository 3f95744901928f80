"""A script that is not the shipped trainer, as a DCP or FSDP job logs: every rank all-reduces
each step, rank 0 alone prints `step=N loss=...`; at --stop-at it stops making progress (no
collective, no line) for --pause seconds, then goes on. With --busy a step computes (spins on the
CPU) for --step-s instead of sleeping: a rank stopped while it computes then falls behind, as a
straggler does (`clusterctl drill`'s straggler fault)."""
import argparse
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100)
p.add_argument("--step-s", type=float, default=0.3)
p.add_argument("--stop-at", type=int, default=-1)
p.add_argument("--pause", type=float, default=0.0)
p.add_argument("--busy", action="store_true")
a = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(a.steps):
    if step == a.stop_at:
        time.sleep(a.pause)
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 0:
        print(f"step={step} loss={4.0 / (step + 1):.3f}", flush=True)
    if a.busy:
        until = time.process_time() + a.step_s  # the rank's own CPU time: stopped, it does not advance
        while time.process_time() < until:
            pass
    else:
        time.sleep(a.step_s)
dist.destroy_process_group()

"""A DDP-shaped gloo job that hangs on purpose, for the hang watch's tests (runs/hang.py).

--mode loader    rank --rank blocks in slow_data_loader() at step --at; the others wait in all_reduce
--mode stop      rank --rank SIGSTOPs itself at step --at
--mode skip      rank --rank skips one all_reduce at step --at and goes on to the next collective
--mode deadlock  at step --at rank --rank calls barrier() while the others call all_reduce
--mode crossed   ranks 0 and 1 share two process groups and all-reduce in the first, then the
                 second, every step; at step --at rank 1 takes them the other way round: rank 0
                 waits in group 1 for rank 1, rank 1 in group 2 for rank 0 (a deadlock across
                 groups); the other ranks wait for both in the next all_reduce of every rank
--mode quiet     no hang: every rank prints nothing for --quiet S seconds while it keeps all-reducing
--mode none      no hang
--host NAME      only the rank(s) on the machine named NAME act (instead of --rank)
"""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--at", type=int, default=5)
p.add_argument("--steps", type=int, default=100000)
p.add_argument("--sleep", type=float, default=0.2)
p.add_argument("--quiet", type=float, default=0.0)
p.add_argument("--host", default=None)
a = p.parse_args()


def slow_data_loader():
    while True:  # a loader that never yields: the rank never reaches its next all_reduce
        time.sleep(1)


dist.init_process_group("gloo")
rank = dist.get_rank()
grad, loss = torch.ones(1000), torch.ones(1)
pair = [dist.new_group([0, 1]), dist.new_group([0, 1])] if a.mode == "crossed" else []  # every rank creates them
for step in range(a.steps):
    if pair and rank in (0, 1):
        first, second = pair[::-1] if rank == 1 and step == a.at else pair
        dist.all_reduce(loss, group=first)
        dist.all_reduce(loss, group=second)
    if step == a.at and (rank == a.rank if a.host is None else os.uname().nodename == a.host):
        if a.mode == "loader":
            slow_data_loader()
        elif a.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif a.mode == "skip":
            dist.broadcast(loss, 0)  # skipped the gradients' all_reduce: its next collective instead
            continue
        elif a.mode == "deadlock":
            dist.barrier()
    if a.mode == "quiet" and step == a.at:
        end = time.time() + a.quiet
        while time.time() < end:
            dist.all_reduce(loss)
            time.sleep(0.05)
    dist.all_reduce(grad)
    dist.broadcast(loss, 0)
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(a.sleep)
dist.barrier()
dist.destroy_process_group()

"""A DDP-shaped gloo job that hangs on purpose, for the hang watch's tests (runs/judge/hang.py).

--mode loader    rank --rank blocks in slow_data_loader() at step --at; the others wait in all_reduce
--mode stop      rank --rank SIGSTOPs itself at step --at
--mode skip      rank --rank skips one all_reduce at step --at and goes on to the next collective
--mode deadlock  at step --at rank --rank calls barrier() while the others call all_reduce
--mode crossed   ranks 0 and 1 share two process groups and all-reduce in the first, then the
                 second, every step; at step --at rank 1 takes them the other way round: rank 0
                 waits in group 1 for rank 1, rank 1 in group 2 for rank 0 (a deadlock across
                 groups); the other ranks wait for both in the next all_reduce of every rank
--mode quiet     no hang: every rank prints nothing for --quiet S seconds while it keeps all-reducing
--mode spin      rank --rank computes in its own code at step --at for --spin S seconds (0: for ever)
                 while the others wait in the next all_reduce
--mode early     rank --rank blocks in slow_data_loader() before the first collective, a barrier the
                 others wait in
--mode none      no hang
--host NAME      only the rank(s) on the machine named NAME act (instead of --rank)
--silent-at K    at step K every rank sleeps --silent S seconds, no collective (nobody waits on anybody)
--heartbeat S    every rank has a thread that prints a line every S seconds, whatever the rank does
"""
import argparse
import os
import signal
import threading
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
p.add_argument("--spin", type=float, default=0.0)
p.add_argument("--silent-at", type=int, default=-1)
p.add_argument("--silent", type=float, default=0.0)
p.add_argument("--heartbeat", type=float, default=0.0)
a = p.parse_args()


def slow_data_loader():
    while True:  # a loader that never yields: the rank never reaches its next all_reduce
        time.sleep(1)


def spin(seconds):
    end, x = time.time() + (seconds or float("inf")), 0
    while time.time() < end:  # computing: no collective, no line
        x = (x * 31 + 7) % 1000003


def heartbeat():
    while True:
        time.sleep(a.heartbeat)
        print(f"rank {rank} heartbeat", flush=True)


dist.init_process_group("gloo")
rank = dist.get_rank()
if a.heartbeat:
    threading.Thread(target=heartbeat, daemon=True).start()
if a.mode == "early":
    if rank == a.rank:
        slow_data_loader()
    dist.barrier()
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
        elif a.mode == "spin":
            spin(a.spin)
    if step == a.silent_at:
        time.sleep(a.silent)
    if a.mode == "quiet" and step == a.at:
        # a count, not a clock: every rank must enter the same number of all_reduces, or one rank's
        # last small all_reduce meets another's gradient all_reduce (gloo aborts on the size)
        for _ in range(max(1, round(a.quiet / 0.05))):
            dist.all_reduce(loss)
            time.sleep(0.05)
    dist.all_reduce(grad)
    dist.broadcast(loss, 0)
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(a.sleep)
dist.barrier()
dist.destroy_process_group()

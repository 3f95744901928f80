"""A gloo job that, asked to stop (SIGTERM), finishes its step, "saves" for --save seconds and
exits 0, as a trainer that checkpoints on SIGTERM does: the graceful-stop tests' script."""
import argparse
import signal
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--save", type=float, default=5.0)
a = p.parse_args()
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(time.time()))

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.ones(4)
step = 0
while not stop:
    dist.all_reduce(x)
    print(f"rank {rank} step {step}", flush=True)
    step += 1
    time.sleep(0.1)
print(f"rank {rank}: SIGTERM, saving", flush=True)
time.sleep(a.save)
print(f"rank {rank}: saved at step {step}, exiting", flush=True)
sys.exit(0)

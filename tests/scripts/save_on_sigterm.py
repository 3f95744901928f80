"""A gloo job that, asked to stop (SIGTERM), finishes its step, "saves" for --save seconds and
exits 0, as a trainer that checkpoints on SIGTERM does: the graceful-stop tests' script.

The ranks agree on the step they stop at (an all-reduce of "asked to stop" before each step), as
a trainer that saves collectively must: the nodes' SIGTERMs arrive milliseconds apart, and a rank
that left the loop alone would leave its peer waiting in the next all-reduce until the first one
exited and broke the connection (that peer then failed, exit 1: a race of this script, seen once
in a full run)."""
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
asked = torch.zeros(1)
step = 0
while True:
    asked[0] = 1.0 if stop else 0.0
    dist.all_reduce(asked)  # a rank signalled a moment later learns it here, at the same step
    if asked.item() > 0:
        break
    dist.all_reduce(x)
    print(f"rank {rank} step {step}", flush=True)
    step += 1
    time.sleep(0.1)
print(f"rank {rank}: SIGTERM, saving", flush=True)
time.sleep(a.save)
print(f"rank {rank}: saved at step {step}, exiting", flush=True)
sys.exit(0)

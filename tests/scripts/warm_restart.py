"""A DDP job for warm restarts: every rank says whether it started in a warm interpreter (torch
imported before the script ran: a fork of the node's warm interpreter, remote/warm.py) and how
long importing torch took it, then all-reduces --steps times, --sleep s apart.

--steps N   all-reduce N times (each attempt)
--sleep S   seconds between steps
"""
import sys
import time

warm = "torch" in sys.modules  # a cold rank's hook imports nothing of torch
t0 = time.monotonic()
import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

imported = time.monotonic() - t0
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.0)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} attempt {os.environ.get('CLUSTERCTL_ATTEMPT')} on {os.uname().nodename} warm={warm} "
      f"import={imported:.2f}s pid={os.getpid()}", flush=True)
for step in range(a.steps):
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(a.sleep)
dist.barrier()
dist.destroy_process_group()

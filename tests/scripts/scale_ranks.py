"""A rank of the largest real-torchrun test (tests/test_scale_real_cluster.py): no torch import
(the launch chain is the subject). Each rank says it is up, then for --steps steps, each at the
next --tick boundary of the wall clock (the test nodes share this machine's clock, so every rank
prints a step within milliseconds of the others): one line the same on every rank, then its own.
"""
import argparse
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--tick", type=float, default=0.5)
args = ap.parse_args()
rank = int(os.environ["RANK"])
print(f"rank {rank} up", flush=True)
for step in range(args.steps):
    time.sleep(args.tick - time.time() % args.tick)
    print("every rank says the same", flush=True)
    print(f"rank {rank} step {step}", flush=True)

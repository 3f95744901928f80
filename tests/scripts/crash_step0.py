"""A script that fails at step 0 on every rank with the same error, as a shape bug does: one
all-reduce (so every rank is up), then RuntimeError from train_step on each rank."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} starting", flush=True)


def train_step(step):
    t = torch.ones(2)
    dist.all_reduce(t)
    raise RuntimeError(f"shapes do not match at step {step}: (4, 8) vs (8, 4)")


for step in range(3):
    train_step(step)

"""A tiny DeepSpeed job, written the way a DeepSpeed user writes one.

It reads its rank and world size from torchrun's environment (through deepspeed.initialize) and
takes the DeepSpeed flags (--deepspeed_config ds.json) from deepspeed.add_config_arguments. Each
rank fits y = x @ w on its own fixed batch; rank 0 prints the loss averaged over the ranks per step,
and every rank prints how much of the optimizer's fp32 state ZeRO gave it (its partition).

--steps N   optimizer steps (default 8)
"""
import argparse
import gc

import deepspeed
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it; torchrun sets LOCAL_RANK
p = deepspeed.add_config_arguments(p)
args = p.parse_args()

torch.manual_seed(0)  # the same model and target on every rank
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
target_w = torch.randn(16, 1)

engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
rank, world = dist.get_rank(), dist.get_world_size()

g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
x = torch.randn(engine.train_micro_batch_size_per_gpu(), 16, generator=g).to(engine.device)
y = x @ target_w.to(engine.device)

for step in range(args.steps):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        print(f"ds step {step} loss {mean.item() / world:.6f}", flush=True)

# ZeRO stages 1-2 keep the fp32 master weights and the optimizer state partitioned over the ranks
held = sum(t.numel() for t in getattr(optimizer, "single_partition_of_fp32_groups", []))
total = sum(t.numel() for t in model.parameters())
print(f"ds rank {rank} holds {held} of {total} optimizer parameters", flush=True)
if rank == 0:
    print(f"ds done: zero stage {engine.zero_optimization_stage()}, world {world}, "
          f"backend {dist.get_backend()}, device {engine.device}", flush=True)
# what clusterctl's SIGABRT hint asks of any script: let go of the engine (its process-group work
# and DeepSpeed's comm threads) before the process group, not at interpreter exit
del engine, optimizer
gc.collect()
dist.barrier()
dist.destroy_process_group()

"""Bytes and time per gradient sync for each DDP comm hook, `tiny` GPT-2, 2 gloo processes.

Bytes are counted by wrapping torch.distributed.all_reduce while the hook runs (every hook,
including "none" = torch's allreduce_hook, sends its gradients through it). Time per sync is
the syncing backward minus a no_sync backward on the same batch. Prints figures; asserts nothing.

    python bench/bench_comm_hooks.py [--iters 3] [--rank 4]
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.config import parse_args  # noqa: E402
from trainer.model import build_model, count_params  # noqa: E402
from trainer.parallel import register_comm_hook  # noqa: E402


def worker(rank, world, port, iters, prank, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counted = {"bytes": 0, "calls": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):
        counted["bytes"] += tensor.numel() * tensor.element_size()
        counted["calls"] += 1
        return real_all_reduce(tensor, *a, **k)

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    x = torch.randint(0, 50257, (1, 256), generator=torch.Generator().manual_seed(rank))
    for hook in ["none", "fp16", "bf16", "powersgd"]:
        cfg = parse_args(["--preset", "tiny", "--block-size", "256", "--comm-hook", hook,
                          "--powersgd-rank", str(prank), "--powersgd-start-iter", "2"])
        torch.manual_seed(0)
        model = DDP(build_model(cfg), gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_cap_mb)
        if hook == "none":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        else:
            register_comm_hook(model, cfg)

        def backward(sync):
            model.require_backward_grad_sync = sync
            t0 = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            dt = time.perf_counter() - t0
            model.zero_grad(set_to_none=False)
            return dt

        for _ in range(3):  # PowerSGD: two plain iterations, then its own
            backward(True)
        dist.all_reduce = counting_all_reduce
        counted.update(bytes=0, calls=0)
        t_sync = sum(backward(True) for _ in range(iters)) / iters
        dist.all_reduce = real_all_reduce
        t_local = sum(backward(False) for _ in range(iters)) / iters
        if rank == 0:
            results[hook] = (counted["bytes"] / iters, counted["calls"] / iters, t_sync - t_local, t_sync,
                             count_params(model.module))
        del model
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rank", type=int, default=4)
    a = ap.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, port, a.iters, a.rank, results), nprocs=2, join=True)
    n = next(iter(results.values()))[4]
    print(f"tiny GPT-2 ({n:,} params, ctx 256), 2 gloo processes, 1 thread each, {a.iters} syncs per hook")
    print(f"{'hook':<10}{'MB/sync':>10}{'allreduces':>12}{'sync s':>10}{'backward s':>12}")
    for hook in ["none", "fp16", "bf16", "powersgd"]:
        b, c, ts, tb, _ = results[hook]
        print(f"{hook:<10}{b / 1e6:>10.3f}{c:>12.0f}{ts:>10.3f}{tb:>12.3f}")
    cut = results["fp16"][0] / results["powersgd"][0]
    print(f"PowerSGD rank {a.rank} sends {cut:.0f}x fewer bytes than fp16 "
          f"({results['none'][0] / results['powersgd'][0]:.0f}x fewer than fp32; target >= 50x vs fp16)")


if __name__ == "__main__":
    main()

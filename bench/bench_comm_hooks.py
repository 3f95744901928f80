"""Bytes and time per gradient sync for each DDP comm hook, `tiny` GPT-2, 2 gloo processes.

The model is the real `tiny` (6/384/6, ctx 512, vocab 50,257: 30,142,848 parameters); inputs
are 256 tokens to keep the backward short on a CPU. Bytes are what the hook actually sends:
torch.distributed.all_reduce is wrapped while the hook runs and the sizes of the tensors passed
to it are summed (every hook, "none" = torch's allreduce_hook included, sends through it; bytes
per rank per sync, before the ring's 2(N-1)/N factor). Time per sync is the syncing backward
minus a no_sync backward of the same batch (median of --iters), i.e. the time the sync adds.
Prints figures; asserts nothing.

    python bench/bench_comm_hooks.py [--iters 3] [--rank 4]
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.config import parse_args  # noqa: E402
from trainer.model import build_model, count_params  # noqa: E402
from trainer.parallel import register_comm_hook  # noqa: E402

# (label, --comm-hook, --powersgd-dtype)
VARIANTS = [("none (fp32)", "none", "fp32"), ("fp16", "fp16", "fp32"), ("bf16", "bf16", "fp32"),
            ("powersgd", "powersgd", "fp32"), ("powersgd+fp16", "powersgd", "fp16"),
            ("powersgd+bf16", "powersgd", "bf16")]


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

    from torch.nn.parallel import DistributedDataParallel as DDP
    x = torch.randint(0, 50257, (1, 256), generator=torch.Generator().manual_seed(rank))
    for label, hook, dtype in VARIANTS:
        cfg = parse_args(["--preset", "tiny", "--comm-hook", hook, "--powersgd-rank", str(prank),
                          "--powersgd-start-iter", "2", "--powersgd-dtype", dtype])
        torch.manual_seed(0)
        model = DDP(build_model(cfg), gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_cap_mb)
        register_comm_hook(model, cfg)  # "none" registers torch's allreduce_hook, so it is counted too

        def backward(sync):
            model.require_backward_grad_sync = sync
            t0 = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            dt = time.perf_counter() - t0
            model.zero_grad(set_to_none=False)
            return dt

        for _ in range(3):  # PowerSGD: two plain iterations (start iter 2), then its own
            backward(True)
        dist.all_reduce = counting_all_reduce
        counted.update(bytes=0, calls=0)
        t_sync = [backward(True) for _ in range(iters)]
        dist.all_reduce = real_all_reduce
        t_local = [backward(False) for _ in range(iters)]
        if rank == 0:
            results[label] = (counted["bytes"] / iters, counted["calls"] / iters,
                              statistics.median(t_sync) - statistics.median(t_local),
                              statistics.median(t_sync), count_params(model.module))
        del model
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD matrix approximation rank")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, port, a.iters, a.rank, results), nprocs=2, join=True)
    n = next(iter(results.values()))[4]
    print(f"tiny GPT-2 ({n:,} params), 256-token batch, 2 gloo processes on loopback, 1 thread each, "
          f"median of {a.iters} syncs, PowerSGD rank {a.rank}, torch {torch.__version__}")
    print(f"{'hook':<15}{'bytes/sync':>14}{'MB/sync':>10}{'allreduces':>12}{'sync s':>9}{'backward s':>12}"
          f"{'vs fp16':>9}")
    fp16 = results["fp16"][0]
    for label, *_ in VARIANTS:
        b, c, ts, tb, _ = results[label]
        print(f"{label:<15}{b:>14,.0f}{b / 1e6:>10.3f}{c:>12.0f}{ts:>9.3f}{tb:>12.3f}{fp16 / b:>8.1f}x")
    for label in ("powersgd", "powersgd+fp16", "powersgd+bf16"):
        cut = fp16 / results[label][0]
        print(f"{label} rank {a.rank}: {cut:.1f}x fewer bytes than fp16 -> target >= 50x "
              f"{'MET' if cut >= 50 else 'NOT met'}")


if __name__ == "__main__":
    main()

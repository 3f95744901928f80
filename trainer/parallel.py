"""Process group, model wrapping (DDP / FSDP2), DDP comm hooks, device peaks for MFU."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import TrainConfig

# Dense peak FLOP/s per device, (bf16/fp16, tf32) by a substring of torch.cuda.get_device_name(),
# from the vendors' datasheets (without sparsity). First match wins, so longer names come first.
PEAK_FLOPS = [
    ("H200", (989e12, 494e12)), ("H100 PCIe", (756e12, 378e12)), ("H100", (989e12, 494e12)),
    ("GH200", (989e12, 494e12)), ("B200", (2250e12, 1100e12)),
    ("A100", (312e12, 156e12)), ("A10G", (70e12, 35e12)), ("A10", (125e12, 62.5e12)),
    ("L40S", (362e12, 183e12)), ("L4", (121e12, 60e12)), ("A6000", (155e12, 77e12)),
    ("MI300X", (1307e12, 654e12)), ("MI325X", (1307e12, 654e12)), ("MI250", (362e12, 181e12)),
    ("R9700", (191e12, 48e12)), ("RX 9070", (195e12, 49e12)),
    ("4090", (165e12, 83e12)), ("3090", (71e12, 36e12)), ("V100", (125e12, 16e12)),
]


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak, or None where unknown (CPU, unlisted GPU): MFU is then 'n/a'.

    CLUSTERCTL_PEAK_TFLOPS overrides the table for a device it does not know.
    """
    if os.environ.get("CLUSTERCTL_PEAK_TFLOPS"):
        return float(os.environ["CLUSTERCTL_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32) in PEAK_FLOPS:
        if key in name:
            return half if precision in ("bf16", "fp16") else tf32
    return None


def setup_distributed():
    """torchrun env -> process group (nccl on GPU, gloo on CPU); plain process otherwise.

    Returns (rank, local_rank, world, device, control_group). The control group is a gloo group
    for the few CPU scalars ranks agree on (the SIGTERM flag every step, logged means): NCCL
    only takes GPU tensors, and a GPU round-trip per step would stall the launch queue.
    """
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        timeout = timedelta(seconds=float(os.environ.get("CLUSTERCTL_DIST_TIMEOUT", 1800)))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                                device_id=device if cuda else None)
        control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
        return rank, local_rank, world, device, control
    return rank, local_rank, world, device, None


def wrap_model(raw, cfg: TrainConfig, world: int, device: torch.device):
    """-> (model to call, module whose gradient sync is toggled or None).

    torch.compile goes *inside* DDP (nanoGPT's order), so DDP's graph-splitting optimizer sees
    the bucket boundaries and the DDP wrapper stays the object whose sync flag we flip.
    """
    maybe_compiled = torch.compile(raw) if cfg.compile else raw
    if world == 1:
        return maybe_compiled, None
    if cfg.strategy == "fsdp":
        shard_model(raw, cfg, device)
        return (torch.compile(raw) if cfg.compile else raw), raw
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(maybe_compiled, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True)
    if cfg.comm_hook != "none":
        register_comm_hook(ddp, cfg)
    return ddp, ddp


def shard_model(raw, cfg: TrainConfig, device: torch.device) -> None:
    """FSDP2: fully_shard each transformer block, then the root (for the embeddings and final LN).

    --zero 3 frees a block's gathered parameters after its forward and gathers them again in
    backward; --zero 2 (reshard_after_forward=False) keeps them gathered from forward to backward:
    one all-gather fewer per block per step for the memory of the unsharded parameters, while
    gradients and optimizer state stay sharded, as in ZeRO-2. --cpu-offload keeps the shards,
    their gradients and the optimizer state in CPU memory and runs the optimizer step there.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {"reshard_after_forward": cfg.zero == 3}
    if cfg.precision in ("bf16", "fp16"):  # compute in half, reduce-scatter in fp32
        half = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    if cfg.cpu_offload:  # pinned host memory lets copies overlap compute; it needs an accelerator
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in raw.transformer.h:
        fully_shard(block, **kw)
    fully_shard(raw, **kw)


def register_comm_hook(ddp, cfg: TrainConfig, wrap=None):
    """fp16/bf16 compression or PowerSGD; `wrap` lets a benchmark count bytes through the hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if cfg.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                            start_powerSGD_iter=cfg.powersgd_start_iter)
        hook = powerSGD_hook.powerSGD_hook
        if cfg.powersgd_dtype == "fp16":  # torch's documented recipe: P and Q computed and sent in half
            hook = default_hooks.fp16_compress_wrapper(hook)
        elif cfg.powersgd_dtype == "bf16":
            hook = (default_hooks.bf16_compress_wrapper(hook) if dist.get_backend() == "nccl"
                    else _bf16_wrapper_any_backend(hook))
    elif cfg.comm_hook == "none":
        state, hook = None, default_hooks.allreduce_hook
    else:
        state = None
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[cfg.comm_hook]
        if cfg.comm_hook == "bf16" and dist.get_backend() != "nccl":
            hook = _bf16_compress_hook_any_backend
    ddp.register_comm_hook(state, wrap(hook) if wrap else hook)
    return state


def _bf16_compress_hook_any_backend(process_group, bucket):
    """What torch's bf16_compress_hook does, for any backend: DDP refuses that hook (by its name)
    off NCCL/XCCL, while gloo all-reduces bf16 fine. The bucket is cast to bf16, pre-divided by
    the world size, all-reduced, and copied back into the fp32 bucket."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        buffer.copy_(f.value()[0])
        return buffer
    return fut.then(decompress)


def _bf16_wrapper_any_backend(hook):
    """torch's bf16_compress_wrapper, under a name DDP does not refuse off NCCL."""
    def bf16_wrapped_hook(state, bucket):
        bucket.set_buffer(bucket.buffer().to(torch.bfloat16))
        fut = hook(state, bucket)

        def decompress(f):
            buf = bucket.buffer()
            buf.copy_(f.value())
            return buf
        return fut.then(decompress)
    return bf16_wrapped_hook


def ddp_comm_stats(ddp) -> dict | None:
    """DDP's own sampled timers (its reducer times iterations 1-10, then every 100th): the last
    sampled backward's all-reduce span, compute span and their overlap, in seconds. None when
    nothing is sampled yet or this torch does not offer the figures.

    torch exposes them only through DDP's private, prototype `_get_ddp_logging_data`. It raises
    AssertionError when the DDP module has no logger; a torch release without the method (or
    with other key names) leaves the progress line without the figures instead of failing it.
    """
    getter = getattr(ddp, "_get_ddp_logging_data", None)
    if getter is None:
        return None
    try:
        d = getter()
    except AssertionError:
        return None
    keys = ("backward_comm_time", "forward_compute_time", "backward_compute_time",
            "backward_compute_comm_overlap_time")
    if not all(isinstance(d.get(k), int) for k in keys):
        return None
    return {"iteration": d.get("iteration"), "comm": d["backward_comm_time"] / 1e9,
            "compute": (d["forward_compute_time"] + d["backward_compute_time"]) / 1e9,
            "overlap": d["backward_compute_comm_overlap_time"] / 1e9}

"""The training loop, nanoGPT style: one process per device, DDP switched on by torchrun's env.

Single process:   python -m trainer --preset nano --max-steps 50
Several on one:   torchrun --standalone --nproc-per-node 2 -m trainer ...
Only rank 0 logs, writes TensorBoard and writes checkpoints (FSDP checkpoints are collective).
"""
from __future__ import annotations

import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint
from .config import TrainConfig, UsageError
from .data import TokenData
from .model import build_model, count_params, flops_per_token
from .tokenizer import load_tokenizer

# Dense peak FLOP/s per device, (bf16/fp16, tf32) by a substring of torch.cuda.get_device_name().
PEAK_FLOPS = [
    ("H200", (989e12, 494e12)), ("H100 PCIe", (756e12, 378e12)), ("H100", (989e12, 494e12)),
    ("A100", (312e12, 156e12)), ("A10G", (70e12, 35e12)), ("L40S", (362e12, 183e12)),
    ("L4", (121e12, 60e12)), ("MI300X", (1307e12, 654e12)), ("MI325X", (1307e12, 654e12)),
    ("MI250", (362e12, 181e12)), ("R9700", (191e12, 48e12)), ("RX 9070", (195e12, 49e12)),
    ("4090", (165e12, 83e12)), ("3090", (71e12, 36e12)), ("V100", (125e12, 16e12)),
]


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak, or None where unknown (CPU): MFU is then printed as n/a."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32) in PEAK_FLOPS:
        if key in name:
            return half if precision in ("bf16", "fp16") else tf32
    return None


def get_lr(step: int, cfg: TrainConfig, scale: float) -> float:
    """Linear warm-up, then cosine decay to min_lr over decay_steps (nanoGPT's get_lr)."""
    lr, min_lr = cfg.lr * scale, cfg.min_lr_value * scale
    if step < cfg.warmup_steps:
        return lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= cfg.decay_steps:
        return min_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def setup_distributed():
    """torchrun env -> process group (nccl on GPU, gloo on CPU); plain process otherwise."""
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
    return rank, local_rank, world, device


def wrap_model(model, cfg: TrainConfig, world: int, device: torch.device):
    if world == 1:
        return model
    if cfg.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True)
    if cfg.comm_hook != "none":
        register_comm_hook(ddp, cfg)
    return ddp


def register_comm_hook(ddp, cfg: TrainConfig, wrap=None):
    """fp16/bf16 compression or PowerSGD; `wrap` lets a benchmark count bytes through the hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if cfg.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                            start_powerSGD_iter=cfg.powersgd_start_iter)
        hook = powerSGD_hook.powerSGD_hook
    else:
        state = None
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[cfg.comm_hook]
        if cfg.comm_hook == "bf16" and dist.get_backend() != "nccl":
            hook = _bf16_compress_hook_any_backend
    ddp.register_comm_hook(state, wrap(hook) if wrap else hook)
    return state


def _bf16_compress_hook_any_backend(process_group, bucket):
    """torch's bf16_compress_hook body; DDP refuses the public one off NCCL/XCCL, gloo handles bf16."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def configure_optimizer(model, cfg: TrainConfig, device: torch.device):
    """AdamW; weight decay on 2-D weights (matmuls, embeddings) only, fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


class Trainer:
    """Holds what the step needs; `step()` is the whole optimizer step (also used by bench/)."""

    def __init__(self, model, raw_model, optimizer, scaler, autocast, cfg, world, device):
        self.model, self.raw, self.opt, self.scaler = model, raw_model, optimizer, scaler
        self.autocast, self.cfg, self.world, self.device = autocast, cfg, world, device
        self.ddp = world > 1 and cfg.strategy == "ddp"
        self.fsdp = world > 1 and cfg.strategy == "fsdp"
        self.last_comm = None  # fraction of the step spent in the syncing backward's extra time

    def loss(self, x, y):
        with self.autocast:
            logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def step(self, batches, lr: float, timed: bool = False) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr
        accum, total, bwd = len(batches), 0.0, []
        for micro, (x, y) in enumerate(batches):
            last = micro == accum - 1
            # Gradients only need averaging across ranks once per optimizer step: skipping the
            # all-reduce on the other micro-steps saves (accum-1)/accum of the traffic, which is
            # what makes accumulation worth it over a 1 Gbps link.
            if self.ddp:
                self.model.require_backward_grad_sync = last
            elif self.fsdp:
                self.model.set_requires_gradient_sync(last)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = self.loss(x, y) / accum  # the mean over micro-steps, as one big batch would give
            t0 = time.perf_counter()
            self.scaler.scale(loss).backward()
            if timed:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                bwd.append(time.perf_counter() - t0)
            total += loss.item()
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        # Honest comm share: the syncing backward's time beyond a non-syncing one's. Only
        # measurable with accumulation (accum > 1) and more than one rank; otherwise unknown.
        self.last_comm = (bwd[-1] - sum(bwd[:-1]) / (accum - 1)) if timed and accum > 1 and self.ddp else None
        return total


def _make_autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    try:
        ctx = torch.autocast(device_type=device.type, dtype=dtype)
        with ctx:
            pass
    except Exception as e:  # pragma: no cover - depends on the torch build
        raise UsageError(f"--precision {precision} is not supported on {device.type} by this torch build ({e}).")
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(trainer: Trainer, data: TokenData, cfg: TrainConfig, rank: int, step: int) -> float:
    trainer.model.eval()
    losses = [trainer.loss(*(t.to(trainer.device) for t in data.batch("val", cfg.batch_size, cfg.seed, rank, step, i))).item()
              for i in range(cfg.eval_steps)]
    trainer.model.train()
    val = torch.tensor(sum(losses) / len(losses))
    if trainer.world > 1:
        dist.all_reduce(val)
        val /= trainer.world
    return val.item()


@torch.no_grad()
def sample(trainer: Trainer, tok, cfg: TrainConfig, prompt: str = "\n") -> str:
    """Top-k (k=40) sampling from a seeded generator: same tokens on every rank (FSDP needs all)."""
    trainer.model.eval()
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.tensor([tok.encode(prompt) or [tok.eot]], dtype=torch.long)
    for _ in range(cfg.sample_tokens):
        with trainer.autocast:
            logits = trainer.model(input_ids=ids[:, -cfg.block_size:].to(trainer.device)).logits[0, -1].float().cpu()
        logits[tok.vocab_size:] = -float("inf")  # never sample a padding id
        v, i = torch.topk(logits, min(40, tok.vocab_size))
        nxt = i[torch.multinomial(F.softmax(v, -1), 1, generator=g)]
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    trainer.model.train()
    return tok.decode(ids[0].tolist())


def train(cfg: TrainConfig) -> int:
    rank, local_rank, world, device = setup_distributed()
    master = rank == 0
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(cfg.output_dir, exist_ok=True)

    tok = load_tokenizer(cfg.tokenizer)
    if tok.vocab_size > cfg.vocab_size:
        raise UsageError(f"the {tok.name} tokenizer has {tok.vocab_size} tokens but --vocab-size is {cfg.vocab_size}.")
    data = TokenData(cfg.data, tok, os.path.join(cfg.output_dir, "cache"), cfg.block_size, local_rank)

    raw = build_model(cfg).to(device)
    n_params = count_params(raw)
    model = wrap_model(raw, cfg, world, device)
    optimizer = configure_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    trainer = Trainer(model, raw, optimizer, scaler, _make_autocast(cfg.precision, device), cfg, world, device)
    fsdp = world > 1 and cfg.strategy == "fsdp"
    state_model = model if fsdp else raw
    start = checkpoint.load(cfg.resume, cfg.output_dir, state_model, optimizer, scaler,
                            rank=rank, fsdp=fsdp, distributed=world > 1) or 0
    if cfg.compile:
        trainer.model = torch.compile(model)

    lr_scale = world * cfg.grad_accum if cfg.scale_lr else 1
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * world
    fpt, peak = flops_per_token(cfg, n_params), peak_flops(device, cfg.precision)
    writer = None
    if master:
        run_id = os.environ.get("CLUSTERCTL_RUN_ID")
        if run_id:
            print(f"run id {run_id}")
        print(f"world size {world} | strategy {cfg.strategy} | device {device} | params {n_params:,} | "
              f"effective batch {cfg.batch_size} x {world} x {cfg.grad_accum} = "
              f"{cfg.batch_size * world * cfg.grad_accum} seqs ({tokens_per_step:,} tokens) | "
              f"data {data.n_tokens:,} tokens ({tok.name}) | start step {start}", flush=True)
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(cfg.output_dir, "logs"), purge_step=start)

    def save(step):
        return checkpoint.save(cfg.output_dir, step, state_model, optimizer, scaler, asdict(cfg),
                               rank=rank, fsdp=fsdp, keep=cfg.keep_ckpts)

    step, t_last, terminated = start, time.perf_counter(), False
    while step < cfg.max_steps:
        # Every rank must stop at the same step: agree on the SIGTERM flag before stepping.
        flag = torch.tensor([1.0 if stop["flag"] else 0.0])
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            path = save(step)
            if master:
                print(f"SIGTERM received: saved checkpoint {path} at step {step}, exiting", flush=True)
            terminated = True
            break
        lr = get_lr(step, cfg, lr_scale)
        log_now = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps
        batches = [data.batch("train", cfg.batch_size, cfg.seed, rank, step, m) for m in range(cfg.grad_accum)]
        loss = trainer.step(batches, lr, timed=log_now)
        step += 1
        if log_now:
            lt = torch.tensor(loss)
            if world > 1:
                dist.all_reduce(lt)
                lt /= world
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            steps_done = cfg.log_every if step - start >= cfg.log_every else step - start
            dt = (now - t_last) / max(1, steps_done)
            t_last = now
            tps = tokens_per_step / dt
            if master:
                mfu = f"{fpt * tps / (peak * world):.1%}" if peak else "n/a"
                comm = f"{trainer.last_comm / dt:.0%}" if trainer.last_comm is not None else "n/a"
                print(f"step {step} | loss {lt.item():.6f} | lr {lr:.3e} | tok/s {tps:,.0f} | mfu {mfu} | comm {comm}", flush=True)
                writer.add_scalar("train/loss", lt.item(), step)
                writer.add_scalar("train/lr", lr, step)
                writer.add_scalar("perf/tokens_per_s", tps, step)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
            val = evaluate(trainer, data, cfg, rank, step)
            if master:
                print(f"step {step} | val loss {val:.6f}", flush=True)
                writer.add_scalar("val/loss", val, step)
        if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < cfg.max_steps:
            save(step)

    if not terminated:
        if step > start:
            save(step)
        val = evaluate(trainer, data, cfg, rank, step)
        text = sample(trainer, tok, cfg) if cfg.sample_tokens else ""
        if master:
            print(f"step {step} | val loss {val:.6f}", flush=True)
            writer.add_scalar("val/loss", val, step)
            if text:
                print("sample:\n" + text, flush=True)
    if writer:
        writer.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0

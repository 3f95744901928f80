"""The training loop, nanoGPT style: one process per device, DDP switched on by torchrun's env.

Single process:   python -m trainer --preset nano --max-steps 50
Several on one:   torchrun --standalone --nproc-per-node 2 -m trainer ...
Only rank 0 logs, writes TensorBoard and writes checkpoints (FSDP checkpoints are collective).
"""
from __future__ import annotations

import gc
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import STARTED, checkpoint
from .config import TrainConfig, UsageError, check_precision
from .data import TokenData
from .model import build_model, count_params, flops_per_token
from .parallel import ddp_comm_stats, peak_flops, setup_distributed, wrap_model
from .progress import StepClock
from .saver import Saver, write_error_everywhere
from .tokenizer import load_tokenizer


def get_lr(step: int, cfg: TrainConfig, scale: float) -> float:
    """Linear warm-up, then cosine decay to min_lr over decay_steps (nanoGPT's get_lr)."""
    lr, min_lr = cfg.lr * scale, cfg.min_lr_value * scale
    if step < cfg.warmup_steps:
        return lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= cfg.decay_steps:
        return min_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def configure_optimizer(model, cfg: TrainConfig, device: torch.device, fused: bool = True):
    """AdamW; weight decay on 2-D weights (matmuls, embeddings) only; the fused kernel where
    this torch has it for the device (CUDA, and CPU since torch 2.4: ~4x faster step there)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)
        except (RuntimeError, ValueError):  # no fused kernel for this device/dtype
            pass
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


class Trainer:
    """Holds what the step needs; `step()` is the whole optimizer step (also used by bench/)."""

    def __init__(self, model, sync_module, optimizer, scaler, autocast, cfg, device, clock: StepClock | None = None):
        self.model, self.sync_module, self.opt, self.scaler = model, sync_module, optimizer, scaler
        self.autocast, self.cfg, self.device = autocast, cfg, device
        self.clock = clock  # each step's compute time, for clusterctl's straggler watch

    def loss(self, x, y):
        with self.autocast:
            logits = self.model(input_ids=x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def _sync_gradients(self, on: bool) -> None:
        # Gradients only need averaging across ranks once per optimizer step: skipping the
        # all-reduce (DDP) / reduce-scatter (FSDP) on the other micro-steps saves
        # (accum-1)/accum of the traffic, which is what makes accumulation pay over 1 Gbps.
        # DDP's no_sync() context does the same; the flag fits a loop better than a `with`.
        if self.sync_module is None:
            return
        if hasattr(self.sync_module, "require_backward_grad_sync"):
            self.sync_module.require_backward_grad_sync = on
        else:
            self.sync_module.set_requires_gradient_sync(on)

    def step(self, batches, lr: float, step: int | None = None) -> torch.Tensor:
        """One optimizer step over len(batches) micro-steps; returns the mean micro-step loss
        as a tensor (no .item() here: on a GPU that would stall the queue every step)."""
        clock = self.clock if step is not None else None
        if clock is not None:
            clock.start()
        for g in self.opt.param_groups:
            g["lr"] = lr
        accum, total = len(batches), torch.zeros((), device=self.device)
        for micro, (x, y) in enumerate(batches):
            self._sync_gradients(micro == accum - 1)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = self.loss(x, y) / accum  # the mean over micro-steps, as one big batch would give
            self.scaler.scale(loss).backward()
            total += loss.detach().float()
        if clock is not None:
            clock.backward_done()
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        if clock is not None:
            clock.end(step)
        return total


def _make_autocast(precision: str, device: torch.device):
    """The autocast context for --precision (a no-op for fp32), checked with torch's public
    predicates first so an unsupported combination is a UsageError, not a RuntimeError."""
    if precision == "fp32":
        return nullcontext()
    if not torch.amp.is_autocast_available(device.type):
        raise UsageError(f"--precision {precision}: this torch build has no autocast for {device.type}.")
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise UsageError("--precision bf16: this GPU does not support bfloat16; use fp16 or fp32.")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


@torch.no_grad()
def evaluate(trainer: Trainer, data: TokenData, cfg: TrainConfig, rank: int, step: int, group=None) -> float:
    trainer.model.eval()
    losses = [trainer.loss(*(t.to(trainer.device) for t in data.batch("val", cfg.batch_size, cfg.seed, rank, step, i))).item()
              for i in range(cfg.eval_steps)]
    trainer.model.train()
    val = torch.tensor(sum(losses) / len(losses))
    return _mean_over_ranks(val.item(), group)


def _mean_over_ranks(x: float, group=None) -> float:
    """Mean of a Python float over ranks, on the CPU control group (None: single process)."""
    if group is None:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def sample(trainer: Trainer, tok, cfg: TrainConfig, prompt: str = "\n") -> str:
    """Top-k (k=40) sampling from a seeded generator: same tokens on every rank (FSDP needs all)."""
    trainer.model.eval()
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.tensor([tok.encode(prompt) or [tok.eot]], dtype=torch.long)
    for _ in range(cfg.sample_tokens):
        with trainer.autocast:
            logits = trainer.model(input_ids=ids[:, -cfg.block_size:].to(trainer.device))[0, -1].float().cpu()
        logits[tok.vocab_size:] = -float("inf")  # never sample a padding id
        v, i = torch.topk(logits, min(40, tok.vocab_size))
        nxt = i[torch.multinomial(F.softmax(v, -1), 1, generator=g)]
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    trainer.model.train()
    return tok.decode(ids[0].tolist())


class Run:
    """Everything one training process holds: process group, data, model, trainer, writer."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.phases = {"imports": time.monotonic() - STARTED}  # startup, in seconds (rank 0 prints it)
        t = time.monotonic()
        self.rank, self.local_rank, self.world, self.device, self.control = setup_distributed()
        self.phases["process group"], t = time.monotonic() - t, time.monotonic()
        self.master = self.rank == 0
        self.fsdp = self.world > 1 and cfg.strategy == "fsdp"
        torch.manual_seed(cfg.seed)
        if self.device.type == "cuda":  # TF32 matmuls/convs: ~free speed on Ampere+, fp32 accumulate
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            torch.backends.cudnn.conv.fp32_precision = "tf32"
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.tok = load_tokenizer(cfg.tokenizer)
        if self.tok.vocab_size > cfg.vocab_size:
            raise UsageError(f"the {self.tok.name} tokenizer has {self.tok.vocab_size} tokens but --vocab-size "
                             f"is {cfg.vocab_size}.")
        self.data = TokenData(cfg.data, self.tok, os.path.join(cfg.output_dir, "cache"), cfg.block_size,
                              self.local_rank)
        self.raw = build_model(cfg).to(self.device)
        self.n_params = count_params(self.raw)
        self.trainer = self._build_trainer()
        # under clusterctl, checkpoints and TensorBoard go where it copies them off the node from
        self.ckpt_dir = os.environ.get("CLUSTERCTL_CHECKPOINT_DIR") or cfg.output_dir
        self.tb_dir = os.environ.get("CLUSTERCTL_TENSORBOARD_DIR") or os.path.join(cfg.output_dir, "logs")
        os.makedirs(self.ckpt_dir, exist_ok=True)
        self.saver = Saver(self.ckpt_dir, rank=self.rank, fsdp=self.fsdp, keep=cfg.keep_ckpts, blocking=cfg.sync_ckpt)
        self.reported = 0  # finished saves said so far
        self.phases["data and model"], t = time.monotonic() - t, time.monotonic()
        self.start = checkpoint.load(cfg.resume, self.ckpt_dir, self.raw, self.trainer.opt, self.trainer.scaler,
                                     rank=self.rank, fsdp=self.fsdp, distributed=self.world > 1) or 0
        self.phases["checkpoint"] = time.monotonic() - t
        self.lr_scale = self.world * cfg.grad_accum if cfg.scale_lr else 1
        self.tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * self.world
        self.fpt, self.peak = flops_per_token(cfg, self.n_params), peak_flops(self.device, cfg.precision)
        self.writer = None
        if self.master:
            from torch.utils.tensorboard import SummaryWriter
            # the step a checkpoint was saved at was logged before it: drop only what comes after
            self.writer = SummaryWriter(self.tb_dir, purge_step=self.start + 1)

    def _build_trainer(self) -> Trainer:
        cfg, device = self.cfg, self.device
        model, sync_module = wrap_model(self.raw, cfg, self.world, device)
        # ShardedGradScaler (FSDP + fp16) hands fused AdamW a found_inf it cannot broadcast: unfused there
        sharded_fp16 = self.fsdp and cfg.precision == "fp16"
        optimizer = configure_optimizer(self.raw, cfg, device, fused=not sharded_fp16)
        if sharded_fp16:  # each rank sees only its shard's grads: all ranks must agree on inf/NaN
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
            scaler = ShardedGradScaler(device.type)
        else:
            scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
        return Trainer(model, sync_module, optimizer, scaler, _make_autocast(cfg.precision, device), cfg, device,
                       StepClock(self.raw, device))

    def strategy(self) -> str:
        if self.world == 1:
            return "single"
        if self.fsdp:
            return f"fsdp zero-{self.cfg.zero}" + (" cpu-offload" if self.cfg.cpu_offload else "")
        return "ddp"

    def banner(self) -> None:
        cfg, world = self.cfg, self.world
        if os.environ.get("CLUSTERCTL_RUN_ID"):
            print(f"run id {os.environ['CLUSTERCTL_RUN_ID']}")
        seqs = cfg.batch_size * world * cfg.grad_accum
        print(f"world size {world} | strategy {self.strategy()} | device {self.device} | "
              f"precision {cfg.precision} | params {self.n_params:,} | effective batch {cfg.batch_size} x {world} x "
              f"{cfg.grad_accum} = {seqs} seqs ({self.tokens_per_step:,} tokens) | "
              f"lr {cfg.lr * self.lr_scale:.3e}{' (scaled)' if cfg.scale_lr else ''} | "
              f"data {self.data.n_tokens:,} tokens ({self.tok.name}) | start step {self.start}", flush=True)
        print(f"startup {time.monotonic() - STARTED:.2f} s: " +
              ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items()), flush=True)

    def save(self, step: int, final: bool = False) -> str:
        """A checkpoint of this step: written in the background (saver.py), or, `final`, before
        this returns."""
        t = self.trainer
        self.saver.settle()  # the write in flight has ended: whether it failed is known on every rank
        if _any_rank(self.saver.failed(), self.control):
            write_error_everywhere(self.saver)
        return self.saver.save(step, self.raw, t.opt, t.scaler, asdict(self.cfg), final=final)

    def saved(self) -> None:
        """Rank 0 says which background writes have finished well since (a failed one is for
        _stop_agreed, which every rank reaches)."""
        self.saver.poll()
        for done in self.saver.saved[self.reported:]:
            if self.master:
                print(f"checkpoint {done.path} written: training waited {done.stall_s * 1e3:.0f} ms, "
                      f"the write took {done.total_s:.2f} s", flush=True)
        self.reported = len(self.saver.saved)

    def report(self, step: int, lr: float, loss: float, dt: float) -> None:
        """Rank 0: the progress line and its TensorBoard scalars."""
        tps = self.tokens_per_step / dt
        mfu = self.fpt * tps / (self.peak * self.world) if self.peak else None
        line = (f"step {step} | loss {loss:.6f} | lr {lr:.3e} | tok/s {tps:,.0f} | "
                f"mfu {'n/a' if mfu is None else f'{mfu:.1%}'} | step {dt * 1e3:.0f} ms")
        sync = self.trainer.sync_module
        comm = ddp_comm_stats(sync) if sync is not None and not self.fsdp else None
        if comm and comm.get("iteration") == getattr(self, "_ddp_sampled", None):
            comm = None  # the reducer samples iterations 1-10, then every 100th: a figure once, when new
        if comm:  # DDP's own timers of the iteration its reducer sampled last (its forward to its backward's end)
            self._ddp_sampled = comm.get("iteration")
            line += (f" | DDP iteration {comm.get('iteration')}: allreduce {comm['comm'] * 1e3:.0f} ms vs "
                     f"compute {comm['compute'] * 1e3:.0f} ms (overlap {comm['overlap'] * 1e3:.0f} ms)")
        print(line, flush=True)
        scalars = {"train/loss": loss, "train/lr": lr, "perf/tokens_per_s": tps, "perf/mfu": mfu}
        if comm:
            scalars.update({"perf/allreduce_s": comm["comm"], "perf/compute_s": comm["compute"]})
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)

    def validate(self, step: int) -> None:
        val = evaluate(self.trainer, self.data, self.cfg, self.rank, step, self.control)
        if self.master:
            print(f"step {step} | val loss {val:.6f}", flush=True)
            self.writer.add_scalar("val/loss", val, step)


def _any_rank(flag: bool, control) -> bool:
    """Whether `flag` holds on any rank (a collective on the CPU control group)."""
    t = torch.tensor([1.0 if flag else 0.0])
    if control is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
    return bool(t.item())


def _stop_agreed(run: Run, stop) -> bool:
    """Every rank must stop at the same step: agree on the SIGTERM flag before stepping, and on
    whether a rank's checkpoint write failed (then every rank raises CheckpointError here)."""
    flag = torch.tensor([2.0 if run.saver.failed() else 1.0 if stop.requested else 0.0])
    if run.control is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=run.control)
    if flag.item() == 2.0:
        write_error_everywhere(run.saver)
    return bool(flag.item())


def _loop(run: Run, stop) -> tuple[int, bool]:
    """Optimizer steps from run.start to max_steps -> (last step, stopped by SIGTERM)."""
    cfg = run.cfg
    step, t_last, steps_since = run.start, time.perf_counter(), 0
    while step < cfg.max_steps:
        if _stop_agreed(run, stop):
            path = run.save(step, final=True) if step > run.start else "(none: no step since the last one)"
            if run.master:
                print(f"SIGTERM received: saved checkpoint {path} at step {step}, exiting", flush=True)
            return step, True
        lr = get_lr(step, cfg, run.lr_scale)
        batches = [run.data.batch("train", cfg.batch_size, cfg.seed, run.rank, step, m) for m in range(cfg.grad_accum)]
        loss = run.trainer.step(batches, lr, step)
        step += 1
        steps_since += 1
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            loss = _mean_over_ranks(loss.item(), run.control)
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t_last) / steps_since
            t_last, steps_since = time.perf_counter(), 0
            if run.master:
                run.report(step, lr, loss, dt)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
            run.validate(step)
        run.saved()
        if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < cfg.max_steps:
            run.save(step)
    return step, False


def train(cfg: TrainConfig) -> int:
    check_precision(cfg, "cuda" if torch.cuda.is_available() else "cpu")  # before any process group
    stop = SimpleNamespace(requested=False)  # SIGTERM (clusterctl stop): finish the step, checkpoint, exit 0
    signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "requested", True))
    run = Run(cfg)
    if run.master:
        run.banner()
    step, terminated = _loop(run, stop)
    if not terminated:
        if step > run.start:
            run.save(step, final=True)
        run.validate(step)
        text = sample(run.trainer, run.tok, cfg) if cfg.sample_tokens else ""
        if run.master and text:
            print("sample:\n" + text, flush=True)
    run.saver.close()  # a write still in flight is on disk before the process ends
    if run.writer:
        run.writer.close()
    if run.world > 1:
        dist.barrier()
        # DDP/FSDP (and the control group) keep references to the process groups. Drop them so
        # destroy_process_group frees the gloo group now, joining its worker threads, instead
        # of at interpreter exit: a worker still releasing a finished all_reduce's tensors
        # needs the GIL then, and torch 2.13 aborts the rank ("terminate called without an
        # active exception", SIGABRT), failing a finished run (seen in ~1 of 4 cross-host runs).
        del run
        gc.collect()
        dist.destroy_process_group()
    return 0

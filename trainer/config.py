"""Training configuration: one dataclass, filled from presets and command-line flags.

Validation happens here, at the edge (nanoGPT's configurator spirit): a bad flag or a missing
data path is one clear sentence on stderr and exit status 2; the rest of the trainer trusts
the `TrainConfig` it is handed.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, fields

# name -> (n_layer, n_embd, n_head, block_size, vocab_size, tokenizer)
PRESETS = {
    "nano": (2, 64, 2, 64, 256, "byte"),        # CPU-sized, for demos and tests
    "tiny": (6, 384, 6, 512, 50257, "gpt2"),    # seed 000/001's "GPT-2 Tiny": 30,142,848 params
    "small": (12, 768, 12, 1024, 50257, "gpt2"),  # GPT-2 124M
    "medium": (24, 1024, 16, 1024, 50257, "gpt2"),  # GPT-2 350M
}


@dataclass
class TrainConfig:
    # model
    preset: str = "nano"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    block_size: int = 64
    vocab_size: int = 256
    pad_vocab: bool = False
    dropout: float = 0.0
    # data
    data: str | None = None
    tokenizer: str = "byte"
    # optimisation
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 100
    lr: float = 1e-3
    min_lr: float | None = None
    warmup_steps: int = 10
    lr_decay_steps: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    scale_lr: bool = False
    # systems
    precision: str = "fp32"
    strategy: str = "ddp"
    comm_hook: str = "none"
    powersgd_rank: int = 4
    powersgd_start_iter: int = 10
    powersgd_dtype: str = "fp32"
    bucket_cap_mb: float = 25.0
    grad_checkpointing: bool = False
    compile: bool = False
    # output, checkpoints, logging
    output_dir: str = "out"
    ckpt_every: int = 0
    keep_ckpts: int = 3
    resume: str = "auto"
    eval_every: int = 0
    eval_steps: int = 5
    log_every: int = 10
    sample_tokens: int = 32
    seed: int = 1337

    @property
    def min_lr_value(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def decay_steps(self) -> int:
        return self.max_steps if self.lr_decay_steps is None else self.lr_decay_steps


class UsageError(Exception):
    """A user mistake in flags or paths: reported as one sentence, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear sentence instead of usage + traceback
        raise UsageError(message[0].upper() + message[1:] + " (see python -m trainer --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainer",
                description="Train a GPT-2 (transformers GPT2LMHeadModel) with DDP or FSDP. "
                "Run directly for one process, or under torchrun / clusterctl train for many.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=list(PRESETS), default="nano",
                   help="model size: nano (2/64/2, ctx 64, byte vocab 256), tiny (6/384/6, ctx 512), "
                   "small (12/768/12, 124M), medium (24/1024/16, 350M)")
    for name, what in [("n-layer", "transformer blocks"), ("n-embd", "embedding width"),
                       ("n-head", "attention heads"), ("block-size", "context length in tokens"),
                       ("vocab-size", "vocabulary size (must cover the tokenizer)")]:
        m.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {what}")
    m.add_argument("--pad-vocab", action="store_true",
                   help="round the vocabulary up to a multiple of 64 (faster output layer)")
    m.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    m.add_argument("--grad-checkpointing", action="store_true",
                   help="recompute activations in backward to save memory")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, metavar="DIR",
                   help="directory (or file) of .txt/.jsonl text, or hf:NAME[:CONFIG] for a Hugging Face "
                   "dataset (online only); default: the text of the stdlib module pydoc_data.topics, "
                   "which ships with Python")
    d.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="'gpt2' (offline GPT-2 BPE), 'byte' (256 byte values), or a local Hugging Face "
                   "tokenizer directory; default: byte for nano, gpt2 otherwise")
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch-size", type=int, default=8, help="sequences per process per micro-step")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    o.add_argument("--max-steps", type=int, default=100, help="optimizer steps to train for")
    o.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    o.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    o.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps")
    o.add_argument("--lr-decay-steps", type=int, default=None,
                   help="steps of the cosine decay (default: --max-steps)")
    o.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (2-D weights only)")
    o.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0 disables)")
    o.add_argument("--scale-lr", action="store_true",
                   help="treat --lr/--min-lr as the rates for one process without accumulation and "
                   "scale them linearly with world size x grad-accum")
    s = p.add_argument_group("systems")
    s.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="autocast dtype; fp16 adds a GradScaler")
    s.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp",
                   help="DistributedDataParallel, or FSDP2 fully_shard per block (ZeRO-3)")
    s.add_argument("--comm-hook", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                   help="DDP gradient compression hook")
    s.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix approximation rank")
    s.add_argument("--powersgd-start-iter", type=int, default=10,
                   help="PowerSGD: plain all-reduce before this iteration (>= 2)")
    s.add_argument("--powersgd-dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="PowerSGD: dtype its low-rank factors are computed and sent in; fp16/bf16 halve "
                   "the bytes again (torch's fp16/bf16_compress_wrapper around powerSGD_hook)")
    s.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP gradient bucket size in MB")
    s.add_argument("--compile", action="store_true", help="torch.compile the model")
    lg = p.add_argument_group("output")
    lg.add_argument("--output-dir", default="out", help="checkpoints, TensorBoard logs (logs/), token cache (cache/)")
    lg.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    lg.add_argument("--keep-ckpts", type=int, default=3, help="checkpoints kept on disk")
    lg.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                    help="auto: newest loadable checkpoint in --output-dir; none: start fresh; or a path")
    lg.add_argument("--eval-every", type=int, default=0, help="validation loss every N steps (0: only at the end)")
    lg.add_argument("--eval-steps", type=int, default=5, help="validation batches per evaluation")
    lg.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    lg.add_argument("--sample-tokens", type=int, default=32, help="tokens of text sampled at the end (0: none)")
    lg.add_argument("--seed", type=int, default=1337, help="seed for init and data windows")
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Flags -> TrainConfig. Raises UsageError on anything wrong."""
    args = build_parser().parse_args(argv)
    n_layer, n_embd, n_head, block, vocab, tok = PRESETS[args.preset]
    values = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block, vocab_size=vocab)
    for k in values:
        if getattr(args, k) is not None:
            values[k] = getattr(args, k)
    known = {f.name for f in fields(TrainConfig)}
    rest = {k: v for k, v in vars(args).items() if k in known and k not in values}
    rest["tokenizer"] = args.tokenizer or tok
    cfg = TrainConfig(**values, **rest)
    if cfg.pad_vocab:
        cfg.vocab_size = (cfg.vocab_size + 63) // 64 * 64
    _validate(cfg)
    return cfg


def _validate(cfg: TrainConfig) -> None:
    positive = ["n_layer", "n_embd", "n_head", "block_size", "vocab_size", "batch_size",
                "grad_accum", "max_steps", "eval_steps", "log_every", "keep_ckpts", "powersgd_rank"]
    for k in positive:
        if getattr(cfg, k) <= 0:
            raise UsageError(f"--{k.replace('_', '-')} must be a positive integer, got {getattr(cfg, k)}.")
    for k in ("warmup_steps", "ckpt_every", "eval_every", "sample_tokens", "grad_clip", "weight_decay"):
        if getattr(cfg, k) < 0:
            raise UsageError(f"--{k.replace('_', '-')} must not be negative, got {getattr(cfg, k)}.")
    if cfg.lr <= 0 or (cfg.min_lr is not None and not 0 <= cfg.min_lr <= cfg.lr):
        raise UsageError(f"--lr must be positive and --min-lr between 0 and --lr (got {cfg.lr}, {cfg.min_lr}).")
    if not 0 <= cfg.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {cfg.dropout}.")
    if cfg.bucket_cap_mb <= 0:
        raise UsageError(f"--bucket-cap-mb must be positive, got {cfg.bucket_cap_mb}.")
    if cfg.n_embd % cfg.n_head:
        raise UsageError(f"--n-embd ({cfg.n_embd}) must be divisible by --n-head ({cfg.n_head}).")
    if cfg.data is not None and not cfg.data.startswith("hf:"):
        if not os.path.exists(cfg.data):
            raise UsageError(f"--data path {cfg.data!r} does not exist "
                             "(prefix a Hugging Face dataset name with hf:).")
        if os.path.isfile(cfg.data) and not cfg.data.endswith((".txt", ".jsonl")):
            raise UsageError(f"--data file {cfg.data!r} is neither .txt nor .jsonl.")
        if os.path.isdir(cfg.data) and not any(
                f.endswith((".txt", ".jsonl")) for _, _, fs in os.walk(cfg.data) for f in fs):
            raise UsageError(f"--data directory {cfg.data!r} holds no .txt or .jsonl files.")
    if cfg.tokenizer not in ("byte", "gpt2") and not os.path.isdir(cfg.tokenizer):
        raise UsageError(f"--tokenizer {cfg.tokenizer!r} is neither 'byte', 'gpt2' nor a local directory.")
    if cfg.comm_hook == "powersgd" and cfg.powersgd_start_iter < 2:
        raise UsageError("--powersgd-start-iter must be at least 2: DDP needs two plain iterations first.")
    if cfg.strategy == "fsdp" and cfg.comm_hook != "none":
        raise UsageError("--comm-hook applies to DDP only; FSDP shards gradients with reduce-scatter.")
    if cfg.resume not in ("auto", "none") and not os.path.exists(cfg.resume):
        raise UsageError(f"--resume checkpoint {cfg.resume!r} does not exist.")


def main_usage_error(err: UsageError) -> int:
    print(f"trainer: error: {err}", file=sys.stderr)
    return 2

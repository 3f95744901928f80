"""Training configuration: one frozen dataclass, filled from a named preset and flags.

Every setting is stated once, as a `TrainConfig` field: its default, its type (from the
annotation), its help text, choices and bounds (from the field's metadata). The argparse parser
is built from those fields, so a flag cannot drift from its field. `make_config(dict)` is the one
constructor: unknown keys are an error naming them (nanoGPT's configurator rule), the preset
supplies the model shape, explicit keys override it, and every value is checked here, at the
edge -- a bad flag or a missing data path is one sentence on stderr and exit status 2; the rest
of the trainer trusts the `TrainConfig` it is handed.

This module imports neither torch nor transformers: planners import `PRESETS` cheaply.
"""
from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace


@dataclass(frozen=True)
class Preset:
    """A model size: the fields of `TrainConfig` it sets, and a line for --help."""
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    vocab_size: int
    tokenizer: str
    about: str


PRESETS: dict[str, Preset] = {
    "nano": Preset(n_layer=2, n_embd=64, n_head=2, block_size=64, vocab_size=256, tokenizer="byte",
                   about="CPU-sized, for demos and tests: 120,576 params"),
    # "tiny" counts its tied output head once: 30,142,848 params, not the 50.3M of counting it twice
    "tiny": Preset(n_layer=6, n_embd=384, n_head=6, block_size=512, vocab_size=50257, tokenizer="gpt2",
                   about="30,142,848 params"),
    "small": Preset(n_layer=12, n_embd=768, n_head=12, block_size=1024, vocab_size=50257, tokenizer="gpt2",
                    about="GPT-2 124M"),
    "medium": Preset(n_layer=24, n_embd=1024, n_head=16, block_size=1024, vocab_size=50257, tokenizer="gpt2",
                     about="GPT-2 350M"),
}
DEFAULT_PRESET = "nano"
PRESET_FIELDS = tuple(f.name for f in fields(Preset) if f.name != "about")
_BASE = PRESETS[DEFAULT_PRESET]


# fp16 autocast on a CPU without fp16 matmul kernels, torch 2.13.0+cpu on 2 AMD EPYC cores: one
# layer of tiny at ctx 128, 1 thread, 4.3-4.9 CPU-s per step against 0.35 s in fp32 (bf16 0.24-0.31 s);
# the full tiny preset 10-20 s per step against 0.5 s.
CPU_FP16_SLOWDOWN = "14-40x"


def _opt(default, help: str, *, group: str, choices=None, metavar=None, bound=None, from_preset=False):
    """A TrainConfig field with what its flag needs. bound: ">0" or ">=0", checked in make_config."""
    return field(default=default, metadata=dict(help=help, group=group, choices=choices, metavar=metavar,
                                                bound=bound, from_preset=from_preset))


@dataclass(frozen=True)
class TrainConfig:
    preset: str = _opt(DEFAULT_PRESET, "model size: " + "; ".join(
        f"{k} ({p.n_layer}/{p.n_embd}/{p.n_head}, ctx {p.block_size}, vocab {p.vocab_size}: {p.about})"
        for k, p in PRESETS.items()), group="model", choices=list(PRESETS))
    n_layer: int = _opt(_BASE.n_layer, "transformer blocks", group="model", bound=">0", from_preset=True)
    n_embd: int = _opt(_BASE.n_embd, "embedding width", group="model", bound=">0", from_preset=True)
    n_head: int = _opt(_BASE.n_head, "attention heads", group="model", bound=">0", from_preset=True)
    block_size: int = _opt(_BASE.block_size, "context length in tokens", group="model", bound=">0",
                           from_preset=True)
    vocab_size: int = _opt(_BASE.vocab_size, "vocabulary size (must cover the tokenizer)", group="model",
                           bound=">0", from_preset=True)
    pad_vocab: bool = _opt(False, "round the vocabulary up to a multiple of 64 (faster output layer)",
                           group="model")
    dropout: float = _opt(0.0, "dropout probability", group="model")
    grad_checkpointing: bool = _opt(False, "recompute activations in backward to save memory", group="model")
    data: str | None = _opt(None, "directory (or file) of .txt/.jsonl text, or hf:NAME[:CONFIG] for a Hugging "
                            "Face dataset (online only); default: the text of the stdlib module "
                            "pydoc_data.topics, which ships with Python", group="data", metavar="DIR")
    tokenizer: str = _opt(_BASE.tokenizer, "'gpt2' (offline GPT-2 BPE), 'byte' (256 byte values), or a local "
                          "Hugging Face tokenizer directory", group="data", metavar="PATH", from_preset=True)
    batch_size: int = _opt(8, "sequences per process per micro-step", group="optimisation", bound=">0")
    grad_accum: int = _opt(1, "micro-steps per optimizer step", group="optimisation", bound=">0")
    max_steps: int = _opt(100, "optimizer steps to train for", group="optimisation", bound=">0")
    lr: float = _opt(1e-3, "peak learning rate", group="optimisation", bound=">0")
    min_lr: float | None = _opt(None, "final learning rate (default: lr/10)", group="optimisation", bound=">=0")
    warmup_steps: int = _opt(10, "linear warm-up steps", group="optimisation", bound=">=0")
    lr_decay_steps: int | None = _opt(None, "steps of the cosine decay (default: --max-steps)",
                                      group="optimisation", bound=">0")
    weight_decay: float = _opt(0.1, "AdamW weight decay (2-D weights only)", group="optimisation", bound=">=0")
    grad_clip: float = _opt(1.0, "max gradient norm (0 disables)", group="optimisation", bound=">=0")
    scale_lr: bool = _opt(False, "treat --lr/--min-lr as the rates for one process without accumulation and "
                          "scale them linearly with world size x grad-accum", group="optimisation")
    precision: str = _opt("fp32", "autocast dtype; fp16 adds a GradScaler (on a CPU-only run fp16 needs "
                          "--allow-slow-fp16)", group="systems", choices=["fp32", "fp16", "bf16"])
    allow_slow_fp16: bool = _opt(False, "accept --precision fp16 on a CPU-only run, where fp16 autocast "
                                 f"measured {CPU_FP16_SLOWDOWN} slower than fp32", group="systems")
    strategy: str = _opt("ddp", "DistributedDataParallel, or FSDP2 fully_shard per block", group="systems",
                         choices=["ddp", "fsdp"])
    zero: int = _opt(3, "with --strategy fsdp: 3 frees gathered parameters after forward and gathers them "
                     "again for backward (ZeRO-3, least memory); 2 keeps them until backward (ZeRO-2-like: "
                     "one all-gather fewer per step, more memory)", group="systems", choices=[2, 3])
    cpu_offload: bool = _opt(False, "with --strategy fsdp: keep sharded parameters, gradients and optimizer "
                             "state in CPU memory, optimizer step on the CPU (FSDP2 CPUOffloadPolicy)",
                             group="systems")
    comm_hook: str = _opt("none", "DDP gradient compression hook", group="systems",
                          choices=["none", "fp16", "bf16", "powersgd"])
    powersgd_rank: int = _opt(4, "PowerSGD matrix approximation rank", group="systems", bound=">0")
    powersgd_start_iter: int = _opt(10, "PowerSGD: plain all-reduce before this iteration (>= 2)",
                                    group="systems")
    powersgd_dtype: str = _opt("fp32", "PowerSGD: dtype its low-rank factors are computed and sent in; "
                               "fp16/bf16 halve the bytes again (torch's fp16/bf16_compress_wrapper around "
                               "powerSGD_hook)", group="systems", choices=["fp32", "fp16", "bf16"])
    bucket_cap_mb: float = _opt(25.0, "DDP gradient bucket size in MB", group="systems", bound=">0")
    compile: bool = _opt(False, "torch.compile the model", group="systems")
    output_dir: str = _opt("out", "checkpoints, TensorBoard logs (logs/), token cache (cache/)", group="output")
    ckpt_every: int = _opt(0, "checkpoint every N steps (0: only at the end)", group="output", bound=">=0")
    keep_ckpts: int = _opt(3, "checkpoints kept on disk", group="output", bound=">0")
    sync_ckpt: bool = _opt(False, "write each checkpoint on the training thread from the live tensors (the default "
                           "copies them to host memory, a pause of milliseconds, and writes that copy in the "
                           "background): for a host without the memory for one more copy of the model and "
                           "optimizer state", group="output")
    resume: str = _opt("auto", "auto: newest loadable checkpoint in --output-dir; none: start fresh; or a path",
                       group="output", metavar="auto|none|PATH")
    eval_every: int = _opt(0, "validation loss every N steps (0: only at the end)", group="output", bound=">=0")
    eval_steps: int = _opt(5, "validation batches per evaluation", group="output", bound=">0")
    log_every: int = _opt(10, "progress line every N steps", group="output", bound=">0")
    sample_tokens: int = _opt(32, "tokens of text sampled at the end (0: none)", group="output", bound=">=0")
    seed: int = _opt(1337, "seed for init and data windows", group="output")

    @property
    def min_lr_value(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def decay_steps(self) -> int:
        return self.max_steps if self.lr_decay_steps is None else self.lr_decay_steps


FIELDS = {f.name: f for f in fields(TrainConfig)}


def _base_type(hint) -> type:
    """An annotation without its `| None`: int, float, str or bool."""
    if isinstance(hint, types.UnionType):
        (hint,) = [t for t in typing.get_args(hint) if t is not type(None)]
    return hint


TYPES: dict[str, type] = {k: _base_type(h) for k, h in typing.get_type_hints(TrainConfig).items()}


def _type_ok(name: str, value) -> bool:
    want = TYPES[name]
    if value is None:
        return FIELDS[name].default is None
    if isinstance(value, bool):  # bool is an int to isinstance: a flag is not a count
        return want is bool
    return isinstance(value, want) or (want is float and isinstance(value, int))


class UsageError(Exception):
    """A user mistake in flags or paths: reported as one sentence, exit status 2."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (saver.py): reported as one sentence, exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear sentence instead of usage + traceback
        raise UsageError(message[0].upper() + message[1:] + " (see python -m trainer --help)")


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, from its metadata. Flags not given stay out of the
    namespace (SUPPRESS), so make_config can tell "not given" from "given the default"."""
    p = _Parser(prog="python -m trainer", argument_default=argparse.SUPPRESS,
                description="Train a GPT-2 with DDP or FSDP. "
                "Run directly for one process, or under torchrun / clusterctl train for many.")
    groups = {}
    for f in FIELDS.values():
        meta, kind = f.metadata, TYPES[f.name]
        group = groups.setdefault(meta["group"], p.add_argument_group(meta["group"]))
        flag = "--" + f.name.replace("_", "-")
        if meta["from_preset"]:
            default = " (default: from --preset)"
        else:
            default = "" if f.default is None or f.default is False else f" (default: {f.default})"
        if kind is bool:
            assert f.default is False, f"{f.name}: a flag switches a False default on"
            group.add_argument(flag, action="store_true", help=meta["help"])
            continue
        metavar = meta["metavar"] or (None if meta["choices"] else {int: "N", float: "X"}.get(kind))
        group.add_argument(flag, type=kind, choices=meta["choices"], metavar=metavar, help=meta["help"] + default)
    return p


def make_config(values: Mapping[str, object]) -> TrainConfig:
    """{field: value} -> TrainConfig: the preset's model shape, overridden by `values`, checked.
    Raises UsageError naming any unknown key, mistyped value or bad combination."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise UsageError(f"unknown config key{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                         "(see python -m trainer --help).")
    for k, v in values.items():
        if not _type_ok(k, v):
            raise UsageError(f"config key {k} must be {TYPES[k].__name__}, got {v!r}.")
    values = {k: float(v) if TYPES[k] is float and v is not None else v for k, v in values.items()}
    preset = values.get("preset", DEFAULT_PRESET)
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)}).")
    shape = {k: getattr(PRESETS[preset], k) for k in PRESET_FIELDS}
    cfg = TrainConfig(**{**shape, **values})
    if cfg.pad_vocab:
        cfg = replace(cfg, vocab_size=(cfg.vocab_size + 63) // 64 * 64)
    _validate(cfg)
    return cfg


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Flags -> TrainConfig. Raises UsageError on anything wrong."""
    return make_config(vars(build_parser().parse_args(argv)))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _validate(cfg: TrainConfig) -> None:
    for f in FIELDS.values():
        v, bound = getattr(cfg, f.name), f.metadata["bound"]
        if v is None or bound is None:
            continue
        if bound == ">0" and v <= 0:
            raise UsageError(f"{_flag(f.name)} must be positive, got {v}.")
        if bound == ">=0" and v < 0:
            raise UsageError(f"{_flag(f.name)} must not be negative, got {v}.")
    if cfg.min_lr is not None and cfg.min_lr > cfg.lr:
        raise UsageError(f"--min-lr ({cfg.min_lr}) must not exceed --lr ({cfg.lr}).")
    if not 0 <= cfg.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {cfg.dropout}.")
    if cfg.n_embd % cfg.n_head:
        raise UsageError(f"--n-embd ({cfg.n_embd}) must be divisible by --n-head ({cfg.n_head}).")
    if cfg.data is not None and not cfg.data.startswith("hf:"):
        _validate_data_path(cfg.data)
    if cfg.tokenizer not in ("byte", "gpt2") and not os.path.isdir(cfg.tokenizer):
        raise UsageError(f"--tokenizer {cfg.tokenizer!r} is neither 'byte', 'gpt2' nor a local directory.")
    if cfg.comm_hook == "powersgd" and cfg.powersgd_start_iter < 2:
        raise UsageError("--powersgd-start-iter must be at least 2: DDP needs two plain iterations first.")
    if cfg.strategy == "fsdp" and cfg.comm_hook != "none":
        raise UsageError("--comm-hook applies to DDP only; FSDP shards gradients with reduce-scatter.")
    if cfg.strategy != "fsdp" and (cfg.zero != 3 or cfg.cpu_offload):
        raise UsageError("--zero 2 and --cpu-offload apply to --strategy fsdp only "
                         "(DDP keeps a full replica on every rank).")
    if cfg.resume not in ("auto", "none") and not os.path.exists(cfg.resume):
        raise UsageError(f"--resume checkpoint {cfg.resume!r} does not exist.")


def _validate_data_path(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"--data path {path!r} does not exist (prefix a Hugging Face dataset name with hf:).")
    if os.path.isfile(path) and not path.endswith((".txt", ".jsonl")):
        raise UsageError(f"--data file {path!r} is neither .txt nor .jsonl.")
    if os.path.isdir(path) and not any(f.endswith((".txt", ".jsonl")) for _, _, fs in os.walk(path) for f in fs):
        raise UsageError(f"--data directory {path!r} holds no .txt or .jsonl files.")


def check_precision(cfg: TrainConfig, device_type: str) -> None:
    """fp16 autocast on a CPU is accepted by torch but crawls; refuse it unless asked for."""
    if device_type == "cpu" and cfg.precision == "fp16" and not cfg.allow_slow_fp16:
        raise UsageError(f"--precision fp16 on a CPU-only run measured {CPU_FP16_SLOWDOWN} slower than fp32 "
                         "(tiny: 10-20 s per step against 0.5 s); use --precision bf16 (not slower than fp32 "
                         "on a CPU) or fp32, or pass --allow-slow-fp16 to run it anyway.")


def main_usage_error(err: UsageError) -> int:
    print(f"trainer: error: {err}", file=sys.stderr)
    return 2

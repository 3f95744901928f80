"""The I/O half of `clusterctl plan`: read a model from a file, time a micro-step here.

The rest of orchestrator/plan/ stays pure; this module opens files and runs torch.  torch and
transformers are imported inside the functions, so `clusterctl plan` without
--config/--measure-step stays fast.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from orchestrator import plan as P


def spec_from_state_dict(sd: dict, n_head: int | None = None) -> P.ModelSpec:
    """GPT-2 dimensions from a state dict's tensor shapes (GPT2LMHeadModel or GPT2Model keys, any
    prefix such as `module.` or `_orig_mod.`).  Shapes do not tell the head count; it changes
    neither parameters nor bytes nor FLOPs, so it is 1 unless given."""
    shapes = {k: tuple(v.shape) for k, v in sd.items() if hasattr(v, "shape")}

    def one(suffix):
        hits = [k for k in shapes if k.endswith(suffix)]
        return hits[0] if hits else None

    wte, wpe, fc = one("wte.weight"), one("wpe.weight"), one("h.0.mlp.c_fc.weight")
    if not (wte and wpe):
        raise ValueError("no wte.weight/wpe.weight tensors: not a GPT-2 state dict")
    vocab, d = shapes[wte]
    layers = {k.split(".h.", 1)[-1].split(".", 1)[0] for k in shapes if ".h." in f".{k}"}
    layers = {x for x in layers if x.isdigit()}
    head = one("lm_head.weight")
    tied = head is None or _same_storage(sd[head], sd[wte])
    return P.ModelSpec(n_layer=len(layers), n_embd=d, n_head=n_head or 1, n_positions=shapes[wpe][0],
                       vocab_size=vocab, n_inner=shapes[fc][1] if fc else None, tied=tied).validate()


def _same_storage(a, b) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - not tensors, or no storage: judge by shape
        return tuple(a.shape) == tuple(b.shape)


def _torch_load(path: Path):
    import torch

    try:  # tensors, dicts and plain types only: no code from the file runs
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - trainer checkpoints carry RNG states weights_only refuses
        # the user named this file as their own checkpoint (the trainer loads it the same way)
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def load_model_file(path: str | Path) -> P.ModelSpec:
    """A model from a file: a config.json (GPT2Config), a Hugging Face save directory (its
    config.json), a trainer checkpoint (`ckpt_*.pt`, or an FSDP `ckpt_*/` with extra.pt: the saved
    config), or a bare state dict (.pt/.bin, dimensions from tensor shapes).  ValueError on
    anything else, with one sentence saying why."""
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():
            p = p / "config.json"
        elif (p / "extra.pt").is_file():
            p = p / "extra.pt"
        else:
            raise ValueError(f"{path}: a directory without config.json or extra.pt")
    if p.suffix == ".json":
        try:
            return P.spec_from_config(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a JSON model config ({e})") from None
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(p), "pt") as f:
            return spec_from_state_dict({k: _Shape(f.get_slice(k).get_shape()) for k in f.keys()})
    try:
        obj = _torch_load(p)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one user error
        raise ValueError(f"{path}: not a JSON config or a torch checkpoint ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a checkpoint dict")
    cfg = obj.get("config")
    if isinstance(cfg, dict):
        return P.spec_from_config(cfg)
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj.get(key), dict):
            return spec_from_state_dict(obj[key])
    return spec_from_state_dict(obj)


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def measure_step_seconds(m: P.ModelSpec, micro_batch: int, seq_len: int | None = None, *,
                         precision: str = "fp32", steps: int = 3, device: str | None = None) -> tuple[float, str]:
    """Median seconds of one forward+backward micro-step of the model on this machine (random
    tokens, after one warm-up step), and the device it ran on (cuda if present, else cpu).
    The optimizer step, once per sync, is left out: it is small next to accum x (fwd + bwd)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seq = seq_len or m.n_positions
    if seq > m.n_positions:
        raise ValueError(f"sequence length {seq} exceeds the model's context {m.n_positions}")
    cfg = GPT2Config(n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head, n_positions=m.n_positions,
                     vocab_size=m.vocab, n_inner=m.n_inner, tie_word_embeddings=m.tied, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    with torch.device(dev):
        model = GPT2LMHeadModel(cfg)
    model.train()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    if dev.type == "cpu" and dtype is torch.float16:
        dtype = None  # fp16 autocast on CPU is not what a GPU node runs; time fp32 instead
    x = torch.randint(0, m.vocab, (micro_batch, seq), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its loss_type notice is noise on plan's output
    try:
        step()  # warm-up: allocator, kernels
        times = []
        for _ in range(max(1, steps)):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    finally:
        hf_logging.set_verbosity(level)
    return statistics.median(times), dev.type

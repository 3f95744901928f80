"""The model: GPT-2 with SDPA attention and tied input/output embeddings (gpt2.py: our own, the
same parameters, initialisation and numerics as transformers' GPT2LMHeadModel, without the seconds
its import costs every launch).

Parameter counts are of *unique* tensors: the tied lm_head is the token embedding, counted once.
That is why `tiny` (6/384/6, ctx 512, vocab 50,257) is 30,142,848 parameters and not the 50.3M
that counting the head a second time gives.

`count_params(cfg)` and `flops_per_token(cfg)` are closed forms that need no torch (torch is
imported only by `build_model`), so planners may import them cheaply.
"""
from __future__ import annotations

from .config import TrainConfig


def build_model(cfg: TrainConfig, device="cpu"):
    """A freshly initialised GPT-2 on `device` ("meta" builds it without allocating)."""
    import torch

    from .gpt2 import GPT2
    with torch.device(device):
        return GPT2(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size, cfg.dropout,
                    cfg.grad_checkpointing)


def count_params(cfg_or_model) -> int:
    """Unique parameters (the tied head once) of a TrainConfig (closed form) or of a module.

    Closed form, d = n_embd, V = vocab, T = context, L = layers (MLP width 4d):
    V·d + T·d (embeddings) + L·(12d² + 13d) (attention, MLP, two LayerNorms) + 2d (final LN).
    """
    if isinstance(cfg_or_model, TrainConfig):
        c = cfg_or_model
        d = c.n_embd
        return c.vocab_size * d + c.block_size * d + c.n_layer * (12 * d * d + 13 * d) + 2 * d
    seen, total = set(), 0
    for p in cfg_or_model.parameters():  # parameters() already de-duplicates shared tensors
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def flops_per_token(cfg: TrainConfig, n_params: int | None = None) -> float:
    """Training FLOPs per token, PaLM appendix B / nanoGPT's estimate_mfu: 6N + 12·L·H·Q·T.

    N is *all* unique parameters (embeddings included: the tied embedding is also the output
    projection, whose matmul is real work), L layers, H heads, Q head dim, T context length.
    """
    n = count_params(cfg) if n_params is None else n_params
    L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
    return 6 * n + 12 * L * H * Q * T

"""The model: transformers' GPT2LMHeadModel (SDPA attention, tied input/output embeddings).

Parameter counts are of *unique* tensors: the tied lm_head is the token embedding, counted once.
That is why `tiny` (6/384/6, ctx 512, vocab 50,257) is 30,142,848 parameters and not the 50.3M
that counting the head a second time gives.
"""
from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from .config import TrainConfig


def gpt2_config(cfg: TrainConfig) -> GPT2Config:
    return GPT2Config(
        n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_positions=cfg.block_size,
        vocab_size=cfg.vocab_size, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout, tie_word_embeddings=True, use_cache=False,
        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
    )


def build_model(cfg: TrainConfig, device: str | torch.device = "cpu") -> GPT2LMHeadModel:
    """A freshly initialised GPT-2 on `device` ("meta" builds it without allocating)."""
    with torch.device(device):
        model = GPT2LMHeadModel(gpt2_config(cfg))
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied weights once); works on meta tensors too."""
    seen, total = set(), 0
    for p in model.parameters():  # parameters() already de-duplicates shared tensors
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def flops_per_token(cfg: TrainConfig, n_params: int) -> float:
    """Training FLOPs per token, PaLM appendix B / nanoGPT's estimate_mfu: 6N + 12·L·H·Q·T.

    N is *all* unique parameters (embeddings included: the tied embedding is also the output
    projection, whose matmul is real work), L layers, H heads, Q head dim, T context length.
    """
    L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
    return 6 * n_params + 12 * L * H * Q * T

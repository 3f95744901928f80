"""GPT-2 in plain torch (nanoGPT-sized), a drop-in for transformers' GPT2LMHeadModel.

Importing transformers costs seconds at every launch and restart (its import alone was 2.7-3.2 s
of a 4.4 s start here, 15 s of 19 s on the test cluster's nodes); this module costs nothing
beyond torch. It keeps what the trainer relied on in GPT2LMHeadModel, so checkpoints written
with either load in the other and a seed gives the same run:

- the module tree and parameter names (`transformer.wte`, `transformer.h.N.attn.c_attn`, ...,
  `lm_head` tied to `transformer.wte`), shapes (Conv1D weights stored (in, out)) and order;
- the numerics of its SDPA attention path: the same ops in the same order (addmm for Conv1D,
  `scaled_dot_product_attention(is_causal=True)` with the 1/sqrt(head dim) scale, the tanh
  GELU written out as transformers writes it, LayerNorm eps 1e-5);
- its initialisation, draw for draw from the global generator (see `GPT2`).

tests/test_trainer_model.py holds it to transformers' model: same weights, same logits and
loss, same gradients; same seed, same initial weights.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

INIT_STD = 0.02  # GPT2Config.initializer_range
LN_EPS = 1e-5  # GPT2Config.layer_norm_epsilon


class Conv1D(nn.Module):
    """A linear layer with its weight stored (in, out), computed with addmm as transformers does."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.n_out = n_out
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        nn.init.normal_(self.weight, std=INIT_STD)

    def forward(self, x):
        y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return y.view(*x.shape[:-1], self.n_out)


def gelu_new(x):
    """GPT-2's tanh GELU, written as transformers' NewGELUActivation (F.gelu(approximate="tanh")
    is close but not bit-identical)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float):
        super().__init__()
        self.c_attn = Conv1D(d, 3 * d)
        self.c_proj = Conv1D(d, d)
        self.resid_dropout = nn.Dropout(dropout)
        self.d, self.n_head, self.dropout = d, n_head, dropout

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.d, dim=2)
        hd = self.d // self.n_head
        q, k, v = (t.view(*t.shape[:-1], -1, hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           scale=hd ** -0.5, is_causal=q.size(2) > 1)
        y = y.transpose(1, 2).contiguous()
        y = y.reshape(*y.shape[:-2], -1).contiguous()
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d: int, dropout: float):
        super().__init__()
        self.c_fc = Conv1D(d, 4 * d)
        self.c_proj = Conv1D(4 * d, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(gelu_new(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=LN_EPS)
        self.attn = Attention(d, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d, eps=LN_EPS)
        self.mlp = MLP(d, dropout)

    def forward(self, x):
        x = self.attn(self.ln_1(x)) + x
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """model(input_ids) -> logits (B, T, vocab). `grad_checkpointing` recomputes each block's
    activations in backward (non-reentrant torch.utils.checkpoint) while training.

    Initialised as GPT2LMHeadModel(config) is, draw for draw from the global generator, so a seed
    gives the same weights with either model: the body's constructors (nn.Embedding N(0, 1),
    Conv1D N(0, 0.02)), the body's init pass (`_init_body`), then the output head's constructor
    (kaiming-uniform) and its init (N(0, 0.02)), both thrown away when it is tied to the token
    embedding. (Building on the meta device and drawing once would skip those draws, but meta
    tensors' normal_ imports torch._dynamo: 1.5 s of start-up.)"""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int,
                 dropout: float = 0.0, grad_checkpointing: bool = False):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab_size, n_embd)
        self.transformer.wpe = nn.Embedding(block_size, n_embd)
        self.transformer.drop = nn.Dropout(dropout)
        self.transformer.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.transformer.ln_f = nn.LayerNorm(n_embd, eps=LN_EPS)
        _init_body(self.transformer)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.normal_(0.0, INIT_STD)
        self.tie_weights()
        self.grad_checkpointing = grad_checkpointing

    def tie_weights(self) -> None:
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids):
        t = self.transformer
        pos = torch.arange(input_ids.size(-1), device=input_ids.device).unsqueeze(0)
        x = t.drop(t.wte(input_ids) + t.wpe(pos))
        for block in t.h:
            if self.grad_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(t.ln_f(x))


@torch.no_grad()
def _init_body(t: nn.Module) -> None:
    """GPT2Model's init pass, module by module as it visits them: embeddings and Conv1D weights
    N(0, 0.02), each residual projection drawn again with std 0.02/sqrt(2 * n_layer) (GPT-2's
    scaled init); biases stay 0 and LayerNorms 1 and 0, as constructed."""
    scaled = INIT_STD / math.sqrt(2 * len(t.h))
    t.wte.weight.normal_(0.0, INIT_STD)
    t.wpe.weight.normal_(0.0, INIT_STD)
    for b in t.h:
        for layer, proj in ((b.attn.c_attn, b.attn.c_proj), (b.mlp.c_fc, b.mlp.c_proj)):
            layer.weight.normal_(0.0, INIT_STD)
            proj.weight.normal_(0.0, INIT_STD)
            proj.weight.normal_(0.0, scaled)


# Causal-mask constants that transformers' GPT2LMHeadModel kept in its state dict before it made
# them non-persistent: not weights, and the same in every checkpoint of a given block size.
LEGACY_BUFFERS = (".attn.bias", ".attn.masked_bias")


def fit_state_dict(model: nn.Module, sd: dict) -> dict:
    """`sd` (ours, or transformers' GPT2LMHeadModel's of any version) as `model.load_state_dict`
    takes it strictly: the legacy mask buffers dropped. ValueError saying what does not fit when
    the weights are of another model (other layers, widths or vocabulary)."""
    own = model.state_dict()
    sd = {k: v for k, v in sd.items() if k in own or not k.endswith(LEGACY_BUFFERS)}
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} is {list(sd[k].shape)} there, {list(v.shape)} here"
              for k, v in own.items() if k in sd and tuple(sd[k].shape) != tuple(v.shape)]
    why = [f"{len(missing)} of this model's tensors are missing (first {missing[0]})"] if missing else []
    why += [f"{len(unexpected)} are not this model's (first {unexpected[0]})"] if unexpected else []
    why += [f"{len(shapes)} differ in shape ({shapes[0]})"] if shapes else []
    if why:
        raise ValueError("; ".join(why))
    return sd

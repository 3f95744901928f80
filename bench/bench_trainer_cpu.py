"""Tokens/s of the trainer's optimizer step vs a plain Hugging Face GPT-2 loop, same run.

Same model config, same initial weights, same batch, same number of threads, same token
memmap; both sides fetch their batches every step. The trainer side is `trainer.train.Trainer`
on the trainer's own GPT-2, trainer/gpt2.py (the loop body `python -m trainer` runs: AdamW with
decay groups, clipping, GradScaler pass-through, explicit cross-entropy); the plain side is the textbook
`model(input_ids, labels).loss.backward(); clip; opt.step()` on transformers' GPT2LMHeadModel
with a nanoGPT-style get_batch.
Rounds alternate A/B so drift on a shared machine hits both. Each round is timed twice: wall
clock and process CPU time (tokens per CPU-second; with --threads 1 this barely moves when other
jobs share the box, which wall clock does by up to 5x here). Ratios use each side's best
round, the one least disturbed; medians are printed too. Prints figures, asserts nothing.

    python bench/bench_trainer_cpu.py [--threads 1] [--rounds 10] [--steps 3] [trainer flags ...]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.config import parse_args  # noqa: E402
from trainer.data import TokenData  # noqa: E402
from trainer.model import build_model, count_params  # noqa: E402
from trainer.tokenizer import load_tokenizer  # noqa: E402
from trainer.train import Trainer, configure_optimizer  # noqa: E402


def hf_model(cfg):
    """transformers' GPT2LMHeadModel of the same shape (the trainer's own GPT-2 keeps its names)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(
        n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_positions=cfg.block_size,
        vocab_size=cfg.vocab_size, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        tie_word_embeddings=True, use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10, help="alternating A/B rounds")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per round")
    ap.add_argument("--warmup", type=int, default=3)
    a, trainer_flags = ap.parse_known_args()
    # default model: 4 layers, 256 wide, ctx 256, byte vocab -- big enough that the step, not
    # Python overhead, dominates on 2 cores; pass trainer flags (e.g. --preset tiny) to change
    cfg = parse_args(trainer_flags or ["--n-layer", "4", "--n-embd", "256", "--n-head", "4",
                                       "--block-size", "256", "--batch-size", "8"])
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(cfg.tokenizer)
    data = TokenData(cfg.data, tok, os.path.join(tempfile.gettempdir(), "clusterctl-bench-cache"), cfg.block_size)
    train_arr, T, B = data.views["train"][0], cfg.block_size, cfg.batch_size

    torch.manual_seed(0)
    m_trainer = build_model(cfg)
    m_plain = hf_model(cfg)
    m_plain.load_state_dict(m_trainer.state_dict())
    trainer = Trainer(m_trainer, None, configure_optimizer(m_trainer, cfg, torch.device("cpu")),
                      torch.amp.GradScaler("cpu", enabled=False), nullcontext(), cfg, torch.device("cpu"))
    opt_plain = torch.optim.AdamW(m_plain.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(0)
    state = {"step": 0}

    def trainer_step():
        s = state["step"] = state["step"] + 1
        trainer.step([data.batch("train", B, cfg.seed, 0, s, m) for m in range(cfg.grad_accum)], cfg.lr)

    def plain_step():
        for _ in range(cfg.grad_accum):
            ix = rng.integers(0, len(train_arr) - T - 1, B)
            x = torch.from_numpy(np.stack([train_arr[i:i + T].astype(np.int64) for i in ix]))
            loss = m_plain(input_ids=x, labels=x).loss / cfg.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(m_plain.parameters(), cfg.grad_clip)
        opt_plain.step()
        opt_plain.zero_grad(set_to_none=True)

    def tps(fn, steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            fn()
        tokens = steps * B * T * cfg.grad_accum
        return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)

    tps(trainer_step, a.warmup)
    tps(plain_step, a.warmup)
    res = {"trainer": [], "plain": []}
    for r in range(a.rounds):
        order = [("trainer", trainer_step), ("plain", plain_step)]
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            res[name].append(tps(fn, a.steps))
    print(f"model {cfg.n_layer}L/{cfg.n_embd}d/{cfg.n_head}h ctx {T} vocab {cfg.vocab_size} "
          f"({count_params(cfg):,} params), batch {B} x accum {cfg.grad_accum}, fp32, {a.threads} threads, "
          f"torch {torch.__version__}, {a.rounds} rounds x {a.steps} steps")
    ratios = {}
    for i, clock in enumerate(("wall", "cpu")):
        best = {k: max(v[i] for v in res[k]) for k in res}
        med = {k: statistics.median(v[i] for v in res[k]) for k in res}
        for k in ("trainer", "plain"):
            print(f"{clock:<4} {k:<8} tokens/s best {best[k]:>8,.0f}  median {med[k]:>8,.0f}   rounds: "
                  + ", ".join(f"{v[i]:,.0f}" for v in res[k]))
        ratios[clock] = best["trainer"] / best["plain"]
    r = ratios["cpu"]
    print(f"ratio trainer/plain, best rounds: wall {ratios['wall']:.3f}, per CPU-second {r:.3f} -> "
          f"{'at least as fast' if r >= 0.98 else 'slower'} (within 2 % counts as equal)")

if __name__ == "__main__":
    main()

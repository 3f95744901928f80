"""CPU tokens/s: the trainer's step (trainer.train.Trainer.step) vs a plain HF GPT-2 loop.

Same model config, batch, context, thread count and optimizer, in the same run, interleaved
rounds so machine noise hits both. Prints figures and the ratio; asserts nothing.

    python bench/bench_trainer_cpu.py [--preset nano] [--steps 20] [--threads 2]
"""
import argparse
import os
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.config import parse_args  # noqa: E402
from trainer.model import build_model, count_params  # noqa: E402
from trainer.train import Trainer, configure_optimizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="nano")
    ap.add_argument("--block-size", default="128")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = parse_args(["--preset", a.preset, "--block-size", a.block_size, "--batch-size", str(a.batch_size),
                      "--n-layer", "4", "--n-embd", "128", "--n-head", "4"])
    dev = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    batches = [(lambda t: (t[:, :-1].contiguous(), t[:, 1:].contiguous()))(
        torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size + 1), generator=g)) for _ in range(4)]

    torch.manual_seed(0)
    m1 = build_model(cfg)
    opt1 = configure_optimizer(m1, cfg, dev)
    tr = Trainer(m1, m1, opt1, torch.amp.GradScaler("cpu", enabled=False), nullcontext(), cfg, 1, dev)

    torch.manual_seed(0)
    m2 = build_model(cfg)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=cfg.lr)

    def run_trainer(n):
        for i in range(n):
            tr.step([batches[i % 4]], cfg.lr)

    def run_plain(n):  # the loop from the HF docs: labels=, loss.backward(), step, zero_grad
        for i in range(n):
            x, _ = batches[i % 4]
            m2(input_ids=x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(m2.parameters(), 1.0)
            opt2.step()
            opt2.zero_grad(set_to_none=True)

    run_trainer(2), run_plain(2)  # warm-up
    tokens = a.steps * cfg.batch_size * cfg.block_size
    best = {"trainer": 0.0, "plain HF": 0.0}
    for _ in range(a.rounds):
        for name, fn in (("trainer", run_trainer), ("plain HF", run_plain)):
            t0 = time.perf_counter()
            fn(a.steps)
            best[name] = max(best[name], tokens / (time.perf_counter() - t0))
    print(f"model {cfg.n_layer}/{cfg.n_embd}/{cfg.n_head} ctx {cfg.block_size} vocab {cfg.vocab_size} "
          f"({count_params(m1):,} params), batch {cfg.batch_size}, {a.threads} threads, "
          f"best of {a.rounds} x {a.steps} steps")
    for name, v in best.items():
        print(f"{name:<10} {v:>10,.0f} tok/s")
    print(f"ratio trainer / plain HF = {best['trainer'] / best['plain HF']:.2f}")


if __name__ == "__main__":
    main()

"""nanoGPT's checkpoint habits on gloo/CPU, unedited for clusterctl: every eval_interval iterations
rank 0 evaluates and, when the val loss improved or --always_save_checkpoint=True (nanoGPT's
default), torch.save()s {out_dir}/ckpt.pt in place; with --init_from=resume every rank loads it and
goes on from its iter_num. Arguments as nanoGPT's configurator takes them (--key=value). No
CLUSTERCTL_ variable is read. --n_embd sets the model's width (the checkpoint is ~12 * n_embd^2
bytes: weights and AdamW's two moments); --eval_interval=10 --iter_s=0.1 rewrites it every ~1 s.

--resumed_iter_s=S: each iteration sleeps S instead of iter_s with --init_from=resume (a test's
relaunch runs to its end quickly; -1: iter_s).

--slow_save_at=N: the save at iteration N writes half of ckpt.pt, waits --slow_save_s with the file
open, then writes the rest (a checkpoint caught mid-write when its node dies)."""

import os
import sys
import time

import torch
import torch.distributed as dist

config = {"out_dir": "out", "max_iters": 120, "eval_interval": 30, "init_from": "scratch", "iter_s": 0.25,
          "always_save_checkpoint": True, "n_embd": 16, "slow_save_at": -1, "slow_save_s": 60.0,
          "resumed_iter_s": -1.0}
for arg in sys.argv[1:]:
    key, _, val = arg[2:].partition("=")
    assert key in config, f"unknown config key {key}"
    config[key] = val == "True" if isinstance(config[key], bool) else type(config[key])(val)

if config["init_from"] == "resume" and config["resumed_iter_s"] >= 0:
    config["iter_s"] = config["resumed_iter_s"]

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(1337)
n = config["n_embd"]
model = torch.nn.Linear(n, n)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
iter_num, best_val_loss = 0, 1e9
ckpt_path = os.path.join(config["out_dir"], "ckpt.pt")
if config["init_from"] == "resume":
    checkpoint = torch.load(ckpt_path, map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
print(f"rank {rank} init_from {config['init_from']} at iter {iter_num}", flush=True)


def save(it):
    os.makedirs(config["out_dir"], exist_ok=True)
    blob = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it,
            "best_val_loss": best_val_loss, "config": config}
    if it != config["slow_save_at"] or config["init_from"] == "resume":  # slow only the first time
        torch.save(blob, ckpt_path)
        print(f"saving checkpoint to {config['out_dir']} at iter {it}", flush=True)
        return
    import io

    buf = io.BytesIO()
    torch.save(blob, buf)
    data = buf.getvalue()
    with open(ckpt_path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        open("slow-save-started", "w").close()  # in the workdir, for the test to see at once
        print(f"writing checkpoint at iter {it} slowly", flush=True)
        time.sleep(config["slow_save_s"])
        f.write(data[len(data) // 2:])


x, x_val = torch.randn(8, n), torch.randn(8, n)
while iter_num < config["max_iters"]:
    if iter_num > 0 and iter_num % config["eval_interval"] == 0 and rank == 0:
        with torch.no_grad():
            val_loss = model(x_val).pow(2).mean().item()
        if val_loss < best_val_loss or config["always_save_checkpoint"]:
            best_val_loss = min(best_val_loss, val_loss)
            save(iter_num)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    optimizer.step()
    if rank == 0:
        print(f"iter {iter_num}: loss {loss.item():.4f}", flush=True)
    iter_num += 1
    time.sleep(config["iter_s"])
print(f"rank {rank} done at iter {iter_num}", flush=True)
dist.barrier()
del model, optimizer
dist.destroy_process_group()

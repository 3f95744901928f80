"""The trainer's checkpoint stall and its start-up, each against the old way in the same run.

    python bench/bench_trainer_ckpt_start.py [all] [--rounds 3]     # both, one after the other
    python bench/bench_trainer_ckpt_start.py stall [--steps 100] [--every 20] [--rounds 3] [trainer flags ...]
    python bench/bench_trainer_ckpt_start.py start [--rounds 5] [--old REV] [--tiny]

stall  One process, one thread (so all compute is on the training thread), the trainer's own
       optimizer step (train.Trainer) for --steps steps, a checkpoint every --every steps, three
       ways in alternating rounds: none (no checkpoint), sync (checkpoint.save, what every save
       was before: written on the training thread from the live tensors; --sync-ckpt today) and
       async (saver.Saver: copied to host memory, written by a background thread). The stall is
       measured as the training thread's CPU time (time.thread_time) per step, and directly as its
       CPU time inside the save calls; wall time is printed beside it but is noise on a shared box.
       The writer's CPU (the process's CPU not on the training thread) is printed too: it moved
       off the training thread, it did not vanish.
start  `python -m trainer` from process start to its first step line ("step 1 |"), nano preset,
       the token cache built beforehand, no checkpoint to resume: this checkout's trainer against
       the one at --old (default: the commit before the fast start, which imported transformers),
       extracted with git archive, in alternating rounds. Wall time (the target: <= 3 s) and the
       child's CPU time read from /proc when the line arrives. --tiny adds the tiny preset (one
       sequence of 64 tokens per step, so the step is not what is measured), also both ways.

Prints figures and ratios; asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

OLD_REV = "1692cd0"  # main before the trainer stopped importing transformers and saved in the background


def med(xs):
    return statistics.median(xs)


# ---------------------------------------------------------------- stall


def _stall_setup(flags):
    import torch

    from trainer.config import parse_args
    from trainer.data import TokenData
    from trainer.model import build_model, count_params
    from trainer.tokenizer import load_tokenizer
    from trainer.train import Trainer, configure_optimizer
    cfg = parse_args(flags)
    torch.set_num_threads(1)
    data = TokenData(cfg.data, load_tokenizer(cfg.tokenizer), os.path.join(tempfile.gettempdir(), "clusterctl-bench-cache"),
                     cfg.block_size)
    torch.manual_seed(0)
    model = build_model(cfg)
    cpu = torch.device("cpu")
    trainer = Trainer(model, None, configure_optimizer(model, cfg, cpu), torch.amp.GradScaler("cpu", enabled=False),
                      nullcontext(), cfg, cpu)
    return cfg, data, model, trainer, count_params(cfg)


def _one_round(way, cfg, data, model, trainer, steps, every, out):
    from trainer import checkpoint
    from trainer.saver import Saver
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    saver = Saver(out, rank=0, fsdp=False, keep=2) if way == "async" else None
    config, step_cpu, save_cpu, save_wall = asdict(cfg), [], [], []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    w0, t0 = time.perf_counter(), time.thread_time()
    for step in range(1, steps + 1):
        c = time.thread_time()
        trainer.step([data.batch("train", cfg.batch_size, cfg.seed, 0, step, m) for m in range(cfg.grad_accum)], cfg.lr)
        if saver is not None:
            saver.poll()
        if step % every == 0 and way != "none":
            s, sw = time.thread_time(), time.perf_counter()
            if saver is not None:
                saver.save(step, model, trainer.opt, trainer.scaler, config)
            else:
                checkpoint.save(out, step, model, trainer.opt, trainer.scaler, config, rank=0, fsdp=False, keep=2)
            save_cpu.append(time.thread_time() - s)
            save_wall.append(time.perf_counter() - sw)
        step_cpu.append(time.thread_time() - c)
    main_cpu, wall = time.thread_time() - t0, time.perf_counter() - w0
    if saver is not None:
        saver.close()  # the last write is counted in the process's CPU below
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    proc_cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return {"cpu_step": main_cpu / steps, "wall_step": wall / steps, "save_cpu": save_cpu, "save_wall": save_wall,
            "off_thread": max(0.0, proc_cpu - main_cpu) / steps}


def bench_stall(a, flags):
    cfg, data, model, trainer, n = _stall_setup(flags)
    out = tempfile.mkdtemp(prefix="bench-ckpt-")
    ways = ("none", "sync", "async")
    for way in ways:  # warm-up: allocator, staging buffers, page cache
        _one_round(way, cfg, data, model, trainer, a.every, a.every, out)
    res = {w: [] for w in ways}
    for r in range(a.rounds):
        for way in ways if r % 2 == 0 else ways[::-1]:
            res[way].append(_one_round(way, cfg, data, model, trainer, a.steps, a.every, out))
    shutil.rmtree(out, ignore_errors=True)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + AdamW's two moments
    print(f"model {cfg.n_layer}L/{cfg.n_embd}d/{cfg.n_head}h ctx {cfg.block_size} vocab {cfg.vocab_size} ({n:,} params, "
          f"checkpoint ~{size / 1e6:.0f} MB), batch {cfg.batch_size}, 1 thread, {a.rounds} rounds x {a.steps} steps, "
          f"a checkpoint every {a.every} steps")
    base = med(x["cpu_step"] for x in res["none"])
    for way in ways:
        xs = res[way]
        cpu, wall, off = (med(x[k] for x in xs) for k in ("cpu_step", "wall_step", "off_thread"))
        line = f"  {way:5s} training-thread CPU/step {cpu * 1e3:8.2f} ms ({(cpu / base - 1) * 100:+5.1f} % vs none)"
        if way != "none":
            saves = [c for x in xs for c in x["save_cpu"]]
            per = med(saves)
            line += (f" | in save(): {per * 1e3:7.2f} ms CPU per checkpoint = {per / (a.every * base) * 100:5.2f} % "
                     f"of {a.every} steps, wall {med(w for x in xs for w in x['save_wall']) * 1e3:.0f} ms")
        print(line + f" | wall/step {wall * 1e3:.1f} ms | CPU off the training thread {off * 1e3:.2f} ms/step")
    s = med(c for x in res["sync"] for c in x["save_cpu"])
    q = med(c for x in res["async"] for c in x["save_cpu"])
    print(f"stall per checkpoint (training-thread CPU in save()), sync/async: {s / q:.1f}x; async stall "
          f"{q / (a.every * base) * 100:.2f} % of step time at one checkpoint every {a.every} steps (target <= 1 %)")


# ---------------------------------------------------------------- start


def _cpu_of(pid) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _first_step(root, out, flags):
    """(wall s, CPU s) from process start to the first step line."""
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "trainer", "--output-dir", out, "--resume", "none", "--max-steps", "1",
           "--log-every", "1", "--sample-tokens", "0", "--eval-steps", "1", *flags]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    wall = cpu = None
    for line in p.stdout:
        if line.startswith("step 1 |"):
            wall, cpu = time.perf_counter() - t0, _cpu_of(p.pid)
            break
    p.stdout.close()
    p.wait(600)
    if wall is None:
        raise SystemExit(f"{root}: no first step line ({' '.join(cmd)})")
    return wall, cpu


def bench_start(a):
    tmp = tempfile.mkdtemp(prefix="bench-start-")
    old = os.path.join(tmp, "old")
    os.makedirs(old)
    tar = subprocess.run(["git", "-C", REPO, "archive", a.old, "trainer"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", old], input=tar, check=True)
    presets = {"nano": ["--preset", "nano"]}
    if a.tiny:
        presets["tiny"] = ["--preset", "tiny", "--batch-size", "1", "--block-size", "64"]
    for name, flags in presets.items():
        out = os.path.join(tmp, name)
        _first_step(REPO, out, flags)  # the token cache (both trainers key it alike), the page cache
        _first_step(old, out, flags)
        got = {"old": [], "new": []}
        for r in range(a.rounds):
            for way in ("old", "new") if r % 2 == 0 else ("new", "old"):
                got[way].append(_first_step(old if way == "old" else REPO, out, flags))
        print(f"{name}: process start -> first step, {a.rounds} alternating rounds (old = trainer at {a.old})")
        for way in ("old", "new"):
            w, c = [x[0] for x in got[way]], [x[1] for x in got[way]]
            print(f"  {way}: wall median {med(w):.2f} s (best {min(w):.2f}), CPU median {med(c):.2f} s "
                  f"(best {min(c):.2f})   rounds: " + ", ".join(f"{x:.2f}" for x in w))
        ow, nw = med(x[0] for x in got["old"]), med(x[0] for x in got["new"])
        oc, nc = med(x[1] for x in got["old"]), med(x[1] for x in got["new"])
        print(f"  old/new: wall {ow / nw:.2f}x, CPU {oc / nc:.2f}x; new median {nw:.2f} s "
              f"({'within' if nw <= 3 else 'over'} the 3 s target; best {min(x[0] for x in got['new']):.2f} s)")
    shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["all", "stall", "start"], nargs="?", default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="stall: optimizer steps per round")
    ap.add_argument("--every", type=int, default=20, help="stall: a checkpoint every N steps")
    ap.add_argument("--old", default=OLD_REV, help="start: the git revision whose trainer/ is the old way")
    ap.add_argument("--tiny", action="store_true", help="start: the tiny preset too")
    a, flags = ap.parse_known_args()
    if a.what in ("all", "stall"):
        bench_stall(a, flags or ["--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--block-size", "256",
                                 "--batch-size", "8"])
    if a.what in ("all", "start"):
        bench_start(a)


if __name__ == "__main__":
    main()

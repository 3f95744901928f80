"""A small gloo job with what a run is watched by (tests/test_observe_cluster.py): rank 0 prints the
trainer's progress line (step, loss, tok/s, step time), writes TensorBoard scalars, a checkpoint
every --ckpt-every steps (ckpt_NNNNNNNN.pt with its .sha256, as trainer/checkpoint.py does), and
with --trackers logs to W&B (wandb.init(project=...) with no id) and MLflow (mlflow.start_run()
with no id). It resumes from the newest checkpoint clusterctl restored into its checkpoint directory.

--steps N  --sleep S (per step)  --ckpt-every K  --trackers
"""
import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--sleep", type=float, default=0.25)
p.add_argument("--ckpt-every", type=int, default=5)
p.add_argument("--trackers", action="store_true")
a = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
ckpt_dir, tb_dir = os.environ["CLUSTERCTL_CHECKPOINT_DIR"], os.environ["CLUSTERCTL_TENSORBOARD_DIR"]
attempt = os.environ.get("CLUSTERCTL_ATTEMPT")


def newest() -> tuple[int, str | None]:
    done = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("ckpt_") and f.endswith(".pt")
                  and os.path.exists(os.path.join(ckpt_dir, f + ".sha256")))
    return (int(done[-1][5:13]), os.path.join(ckpt_dir, done[-1])) if done else (0, None)


# rank 0 holds the checkpoint clusterctl restored (a restart's other nodes may hold none): it says
# where the job resumes, and the others take its state
state = torch.zeros(5)
if rank == 0:
    start, path = newest()
    if path:
        state[0], state[1:] = start, torch.load(path)["w"]
dist.broadcast(state, 0)
start, w = int(state[0]), state[1:].clone()
print(f"rank {rank} attempt {attempt} start step {start}", flush=True)
if rank == 0:
    writer = SummaryWriter(tb_dir, purge_step=start + 1 if start else None)
    if a.trackers:
        import mlflow
        import wandb

        wrun = wandb.init(project="cc-observe")
        mrun = mlflow.start_run()
        print(f"trackers: attempt {attempt} wandb {wrun.id} mlflow {mrun.info.run_id}", flush=True)
for step in range(start + 1, a.steps + 1):
    t0 = time.perf_counter()
    x = torch.ones(4) * (rank + 1)
    dist.all_reduce(x)
    w += x / 100
    time.sleep(a.sleep)
    dt = time.perf_counter() - t0
    loss = 4.0 / step + float(w.sum()) * 1e-3
    if rank == 0:
        print(f"step {step} | loss {loss:.6f} | tok/s {256 / dt:,.0f} | step {dt * 1e3:.0f} ms", flush=True)
        writer.add_scalar("train/loss", loss, step)
        writer.flush()
        if a.trackers:
            wandb.log({"loss": loss, "step": step})
            mlflow.log_metric("loss", loss, step=step)
        if step % a.ckpt_every == 0:
            out = os.path.join(ckpt_dir, f"ckpt_{step:08d}.pt")
            torch.save({"w": w, "step": step}, out + ".tmp")
            os.replace(out + ".tmp", out)
            with open(out, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            with open(out + ".sha256", "w") as f:
                f.write(digest + "\n")
dist.barrier()
if rank == 0:
    writer.close()
    if a.trackers:
        wandb.finish()
        mlflow.end_run()
dist.destroy_process_group()

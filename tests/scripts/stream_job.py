"""A job whose log, checkpoints and TensorBoard bytes interleave (the node stream's tests).

Each rank prints every step (every 7th a 70 KB line: a record split over many SSH packets) and
appends to its TensorBoard file; rank 0 writes a checkpoint every --every steps as the trainer
does (its .sha256 first, then the file renamed into place).

--steps N  --sleep S  --every K
"""
import argparse
import hashlib
import os
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--sleep", type=float, default=0.1)
p.add_argument("--every", type=int, default=10)
a = p.parse_args()
rank = int(os.environ["RANK"])
ck, tb = os.environ["CLUSTERCTL_CHECKPOINT_DIR"], os.environ["CLUSTERCTL_TENSORBOARD_DIR"]
os.makedirs(os.path.join(tb, "run"), exist_ok=True)
for step in range(a.steps):
    print(f"rank {rank} step {step} " + ("x" * 70_000 if step % 7 == 6 else "."), flush=True)
    with open(os.path.join(tb, "run", f"events.{rank}"), "a") as f:
        f.write(f"rank {rank} step {step}\n")
    if rank == 0 and step % a.every == a.every - 1:
        name = os.path.join(ck, "ckpt_%08d.pt" % (step + 1))
        data = os.urandom(200_000)
        with open(name + ".sha256", "w") as f:
            f.write(hashlib.sha256(data).hexdigest() + "  " + os.path.basename(name) + "\n")
        with open(name + ".tmp.%d" % os.getpid(), "wb") as f:
            f.write(data)
        os.replace(name + ".tmp.%d" % os.getpid(), name)
    time.sleep(a.sleep)
print(f"rank {rank} done", flush=True)

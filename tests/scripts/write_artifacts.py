"""Each rank writes seeded bytes into the run's checkpoint and TensorBoard directories (fetch tests).

--size N   bytes of each checkpoint file (more than a pipe buffer, so the copy streams in pieces)
"""
import argparse
import os
import random

p = argparse.ArgumentParser()
p.add_argument("--size", type=int, default=3 << 20)
a = p.parse_args()
rank = int(os.environ["RANK"])
data = random.Random(f"{rank}-{os.uname().nodename}").randbytes(a.size)
with open(os.path.join(os.environ["CLUSTERCTL_CHECKPOINT_DIR"], f"blob-{rank}.bin"), "wb") as f:
    f.write(data)
tb = os.path.join(os.environ["CLUSTERCTL_TENSORBOARD_DIR"], "sub")
os.makedirs(tb, exist_ok=True)
with open(os.path.join(tb, f"events.{rank}"), "w") as f:
    f.write(f"rank {rank} events\n")
print(f"rank {rank} wrote {a.size} bytes", flush=True)

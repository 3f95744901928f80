"""A stock PyTorch Lightning script, unedited for clusterctl: a `Trainer` with its default logger
(lightning_logs/version_N/ in the working directory, written by rank 0 only) and
`ModelCheckpoint(dirpath=out/ckpt, save_last=True)`, resumed with `--ckpt_path out/ckpt/last.ckpt`
the way Lightning's docs show. DDP over gloo on CPU; the node and process counts come from
torchrun's environment as Lightning reads them. No CLUSTERCTL_ variable is read.

--step_s: seconds each step sleeps (so a test can cut a node mid-run); --resumed_step_s: instead,
once resumed (--ckpt_path given), so a test's relaunch runs to its end quickly.
--hang_at=N --hang_rank=R --hang_once=FILE: at global step N rank R stops answering (the other
ranks wait in DDP's all-reduce) unless FILE exists; FILE is created first, so a relaunch in the
same directory does not hang again.
"""

import argparse
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

p = argparse.ArgumentParser()
p.add_argument("--max_steps", type=int, default=60)
p.add_argument("--every_n_steps", type=int, default=10)
p.add_argument("--step_s", type=float, default=0.2)
p.add_argument("--resumed_step_s", type=float, default=None)
p.add_argument("--dirpath", default="out/ckpt")
p.add_argument("--ckpt_path", default=None)
p.add_argument("--hang_at", type=int, default=-1)
p.add_argument("--hang_rank", type=int, default=1)
p.add_argument("--hang_once", default="")
args = p.parse_args()
if args.ckpt_path and args.resumed_step_s is not None:
    args.step_s = args.resumed_step_s


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        if self.global_step == args.hang_at and self.global_rank == args.hang_rank and args.hang_once \
                and not os.path.exists(args.hang_once):
            open(args.hang_once, "w").close()
            print(f"rank {self.global_rank} hanging at global_step {self.global_step}", flush=True)
            while True:
                time.sleep(3600)
        time.sleep(args.step_s)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_start(self):
        print(f"rank {self.global_rank} starts at global_step {self.global_step}", flush=True)

    def on_train_end(self):
        print(f"rank {self.global_rank} ends at global_step {self.global_step}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // local
    trainer = L.Trainer(accelerator="cpu", devices=local, num_nodes=nodes,
                        strategy=DDPStrategy(process_group_backend="gloo"), max_steps=args.max_steps,
                        callbacks=[ModelCheckpoint(dirpath=args.dirpath, save_last=True, save_top_k=-1,
                                                   every_n_train_steps=args.every_n_steps)],
                        enable_model_summary=False, log_every_n_steps=5)
    trainer.fit(Tiny(), loader, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()

"""A Hugging Face Trainer script as people write one, unedited for clusterctl: a tiny GPT-2 trained
with transformers.Trainer (DDP over gloo on CPU), checkpoint-N/ directories in --output_dir every
--save_steps (rank 0 writes the model, optimizer, scheduler and trainer state; every rank writes its
own rng_state_R.pth on its own node; rank 0 alone rotates old ones), and `--resume` to go on with
trainer.train(resume_from_checkpoint=True), which loads the newest checkpoint-N/ on every rank.
Nothing is downloaded: the model is built from a config and trained on generated tokens.
--step_s: seconds each step sleeps; --resumed_step_s: instead, with --resume (a test's relaunch runs
to its end quickly)."""

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--output_dir", default="out")
p.add_argument("--max_steps", type=int, default=120)
p.add_argument("--save_steps", type=int, default=30)
p.add_argument("--step_s", type=float, default=0.2)
p.add_argument("--resumed_step_s", type=float, default=None)
p.add_argument("--resume", action="store_true")
args = p.parse_args()
if args.resume and args.resumed_step_s is not None:
    args.step_s = args.resumed_step_s
rank = int(os.environ.get("RANK", "0"))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=4096, block=16):
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 128, (n, block), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Pace(TrainerCallback):
    def on_train_begin(self, a, state, control, **kw):
        print(f"rank {rank} starts at step {state.global_step}", flush=True)

    def on_step_end(self, a, state, control, **kw):
        time.sleep(args.step_s)
        if rank == 0:
            print(f"step {state.global_step}", flush=True)


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=16))
targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                          save_steps=args.save_steps, save_total_limit=2, logging_steps=10, report_to=[],
                          use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
                          learning_rate=1e-3)
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[Pace()])
trainer.train(resume_from_checkpoint=True if args.resume else None)
print(f"rank {rank} finished at step {trainer.state.global_step}", flush=True)

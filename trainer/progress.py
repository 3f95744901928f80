"""Each rank's compute time per step, on its own clock, told to clusterctl's straggler watch.

A step's wall time is the same on every rank of a synchronous job: the fast ranks wait in the
gradients' all-reduce (and in the next step's stop flag) for the slow one. Its compute is not:
here it is the time from the step's start to the moment the last gradient of the last micro-step
was accumulated (DDP launches that bucket's all-reduce then, and waits for it after), plus the
optimizer's update. Both ends are the rank's own: no clock is compared across nodes.

On a GPU the two spans are CUDA events (read a step later, when they have completed: no sync is
added); on a CPU, perf_counter. A model whose parameters fire no post-accumulate-grad hook
(FSDP's flat parameters) reports nothing rather than a time that includes the waits.

Under clusterctl the figure goes to its hook in this process (remote/hook/sitecustomize.py
`clusterctl_step`), which hands the newest steps to the watch when asked; elsewhere it is dropped.
"""
from __future__ import annotations

import sys
import time

import torch


def _hook_sink():
    return getattr(sys.modules.get("sitecustomize"), "clusterctl_step", None)


class StepClock:
    """start() before a step's first forward, backward_done() after its last backward, end(step)
    after the optimizer's update. `last` is the newest step's compute in seconds (None: unknown)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, sink=None):
        self.sink = sink if sink is not None else _hook_sink()
        self.cuda = device.type == "cuda"
        self.grad_at: float | None = None
        self.last: float | None = None
        self.pending = None  # the step whose CUDA events are read once they completed
        self.hooked = False  # a gradient hook fired: the figure excludes the waits
        if self.cuda:
            self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        for p in model.parameters():
            if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, _p) -> None:
        if self.cuda:
            self.ev[1].record()  # re-recorded by every gradient: the last one stands
        else:
            self.grad_at = time.perf_counter()
        self.hooked = True

    def start(self) -> None:
        self.grad_at = None
        if self.cuda:
            self._read_pending()
            self.ev[0].record()
        else:
            self.t0 = time.perf_counter()

    def backward_done(self) -> None:
        if self.cuda:
            self.ev[2].record()
        else:
            self.t_bw = time.perf_counter()

    def end(self, step: int) -> None:
        if not self.hooked:
            return
        if self.cuda:
            self.ev[3].record()
            self.pending = step
            return
        if self.grad_at is not None:
            self._tell(step, (self.grad_at - self.t0) + (time.perf_counter() - self.t_bw))

    def _read_pending(self) -> None:
        if self.pending is None or not self.ev[3].query():
            return
        e = self.ev
        self._tell(self.pending, (e[0].elapsed_time(e[1]) + e[2].elapsed_time(e[3])) / 1e3)
        self.pending = None

    def _tell(self, step: int, seconds: float) -> None:
        self.last = seconds
        if self.sink is not None:
            self.sink(step, seconds)

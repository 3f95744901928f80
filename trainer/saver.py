"""Checkpoints written while training goes on.

A save copies the state to host memory on the training thread -- the only time the step waits
-- and one background thread writes that copy (torch.distributed.checkpoint's async_save does
the same for FSDP shards). The copy is a snapshot: the next optimizer step may change the live
tensors at once. The write is checkpoint.py's, unchanged: temp name, checksum, rename; so a
write still in flight, or cut by SIGKILL, leaves nothing that looks complete (to `--resume auto`
or to clusterctl, which takes a file once its .sha256 sits beside it and a directory once it is
renamed with its manifest in it).

- At most one write is in flight: a save first waits for the one before it, whose host-memory
  buffers it then reuses (pinned on GPUs, so the copy from the device is fast and queued).
- A final save (SIGTERM, end of training) or --sync-ckpt is written before save() returns,
  from the live tensors; it waits for the write in flight first.
- A write that fails raises CheckpointError on the training thread, on every rank at once:
  `failed` says so without blocking (train.py folds it into the flag every rank agrees on each
  step), and before each save train.py settles the write in flight and agrees again, so no rank
  raises alone while the others wait for it at a collective. `poll` never raises.
- FSDP: DCP's async_save and the manifest step after it talk over a gloo group of the writer's
  own, so they never interleave with the training thread's collectives.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import checkpoint
from .config import CheckpointError


@dataclass
class Saved:
    """One finished save: its path, how long training waited for it, how long it took in all."""
    path: str
    step: int
    stall_s: float
    total_s: float


class HostCopy:
    """A copy of a checkpoint's state in host memory, into buffers kept from one save to the next
    (the write of the previous copy has finished by then). Tensors shared within the state stay
    shared in the copy (the tied embedding is written once). DCP's DefaultStager does this too,
    and is what FSDP's sharded tensors go through; for plain tensors it costs ~75 us a tensor
    in Python bookkeeping here against ~5 (7 ms against 0.5 for the nano preset's state)."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self._next = 0
        self._from_device = False

    def take(self, state):
        self._next, self._from_device = 0, False
        out = self._copy(state, {})
        if self._from_device:  # the copies were queued without blocking: the snapshot is whole only now
            torch.cuda.synchronize()
        return out

    def _copy(self, obj, memo: dict):
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                buf = self._buffer(obj)
                on_device = obj.device.type != "cpu"
                buf.copy_(obj.detach(), non_blocking=on_device and buf.is_pinned())
                self._from_device |= on_device
                memo[id(obj)] = buf
            return memo[id(obj)]
        if isinstance(obj, dict):
            return {k: self._copy(v, memo) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, memo) for v in obj)
        return obj  # numbers, strings, None: nothing training changes in place

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        if i < len(self.buffers) and self.buffers[i].shape == t.shape and self.buffers[i].dtype == t.dtype:
            return self.buffers[i]
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")  # pinned: fast, async copies
        self.buffers[i:i + 1] = [buf]
        return buf


class Saver:
    def __init__(self, out_dir: str, *, rank: int, fsdp: bool, keep: int, blocking: bool = False):
        self.out_dir, self.rank, self.fsdp, self.keep, self.blocking = out_dir, rank, fsdp, keep, blocking
        self._pending: Future | None = None
        self._pending_info: tuple[str, int, float, float] | None = None  # path, step, stall, start
        self._error: CheckpointError | None = None  # a write that failed, kept until `wait` raises it (once)
        self._pool: ThreadPoolExecutor | None = None
        self._stager = None  # FSDP: DCP's, for sharded tensors
        self._copy = HostCopy()
        self._group = None
        self.saved: list[Saved] = []  # every finished save, oldest first
        if not blocking:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        if fsdp and not blocking:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            cuda = torch.cuda.is_available()
            # pinned buffers make the device-to-host copy fast and let it run without blocking
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
            self._group = dist.new_group(backend="gloo")  # a collective: every rank builds its Saver here

    def save(self, step: int, model, optimizer, scaler, config: dict, *, final: bool = False) -> str:
        """Collective (RNG states are gathered; FSDP shards are planned together). Waits for the
        write in flight first. Returns the checkpoint's path (written once `wait` returns)."""
        self.wait()
        if self.saved and self.saved[-1].step == step:  # nothing trained since (a stop right after a save)
            return self.saved[-1].path
        t0 = time.monotonic()
        if final or self.blocking:
            path = checkpoint.save(self.out_dir, step, model, optimizer, scaler, config, rank=self.rank,
                                   fsdp=self.fsdp, keep=self.keep)
            self._record(path, step, time.monotonic() - t0, t0)
            return path
        extra = checkpoint.extra_state(step, scaler, config)
        path, job = (self._fsdp_job if self.fsdp else self._file_job)(step, model, optimizer, extra)
        if job is not None:
            stall = time.monotonic() - t0
            self._pending_info = (path, step, stall, t0)
            self._pending = self._pool.submit(self._timed, job, t0)
        return path

    def _file_job(self, step, model, optimizer, extra):
        path = checkpoint.file_path(self.out_dir, step)
        if self.rank != 0:
            return path, None
        state = self._copy.take({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra})
        return path, lambda: checkpoint.write_file(self.out_dir, path, state, self.keep)

    def _fsdp_job(self, step, model, optimizer, extra):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        final, tmp = checkpoint.fsdp_paths(self.out_dir, step)
        checkpoint.fsdp_prepare(tmp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        shards = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp,
                                process_group=self._group, async_stager=self._stager)

        def job():
            shards.result()
            checkpoint.fsdp_finish(tmp, final, self.out_dir, extra, self.rank, self.keep, self._group)
        return final, job

    def _timed(self, job, t0: float) -> float:
        job()
        total = time.monotonic() - t0
        if self.rank == 0:
            checkpoint.record_save_seconds(total)
        return total

    def _record(self, path: str, step: int, stall: float, t0: float) -> None:
        self.saved.append(Saved(path, step, stall, time.monotonic() - t0))

    def failed(self) -> bool:
        """A write has failed (`wait` raises its error). Does not block."""
        return self._error is not None or (self._pending is not None and self._pending.done()
                                           and self._pending.exception() is not None)

    def poll(self) -> Saved | None:
        """The write in flight, if it has finished well since the last call: its figures. Does
        not block, never raises: a failed write is kept for `failed` and `wait`."""
        if self._pending is None or not self._pending.done() or self._pending.exception() is not None:
            return None
        return self.settle()

    def settle(self) -> Saved | None:
        """Block until the write in flight has ended -> its figures, or None (none, or it failed:
        then `failed` holds and `wait` raises)."""
        if self._pending is None:
            return None
        fut, (path, step, stall, _) = self._pending, self._pending_info
        self._pending = self._pending_info = None
        try:
            total = fut.result()
        except Exception as e:  # any failure of the write: disk full, permissions, a rank lost mid-manifest
            if self._error is None:
                self._error = CheckpointError(f"could not write checkpoint {path} (step {step}): "
                                              f"{type(e).__name__}: {e}. The checkpoints before it are intact.")
                self._error.__cause__ = e
            return None
        self.saved.append(Saved(path, step, stall, total))
        return self.saved[-1]

    def wait(self) -> Saved | None:
        """Block until the write in flight is on disk -> its figures; CheckpointError if a write failed."""
        done = self.settle()
        if self._error is not None:
            err, self._error = self._error, None  # raised once
            raise err
        return done

    def close(self) -> None:
        """Wait for the write in flight (raising its error), then let the writer thread go."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()


def write_error_everywhere(saver: Saver) -> None:
    """Raise the CheckpointError of a write that failed on this rank, or say which rank's did:
    called on every rank once they agreed that one failed."""
    saver.wait()
    raise CheckpointError("a checkpoint write failed on another rank (its log says why); "
                          f"stopping rank {dist.get_rank() if dist.is_initialized() else 0} too.")

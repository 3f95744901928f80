"""Checkpoints written while training goes on.

A save copies the state to host memory on the training thread -- the only time the step waits
-- and one background thread writes that copy (torch.distributed.checkpoint's async_save does
the same for FSDP shards). The copy is a snapshot: the next optimizer step may change the live
tensors at once. The write is checkpoint.py's, unchanged: temp name, checksum, rename; so a
write still in flight, or cut by SIGKILL, leaves nothing that looks complete (to `--resume auto`
or to clusterctl, which takes a file once its .sha256 sits beside it and a directory once it is
renamed with its manifest in it).

- At most one write is in flight: a save first waits for the one before it (whose host-memory
  buffers it then reuses: DCP's stager keeps them, keyed by the tensors they copy).
- A final save (SIGTERM, end of training) or --sync-ckpt is written before save() returns,
  from the live tensors; it waits for the write in flight first.
- A write that fails raises CheckpointError on the training thread: at the next step (`failed`,
  which train.py folds into the flag every rank agrees on each step) or the next save.
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


class Saver:
    def __init__(self, out_dir: str, *, rank: int, fsdp: bool, keep: int, blocking: bool = False):
        self.out_dir, self.rank, self.fsdp, self.keep, self.blocking = out_dir, rank, fsdp, keep, blocking
        self._pending: Future | None = None
        self._pending_info: tuple[str, int, float, float] | None = None  # path, step, stall, start
        self._pool: ThreadPoolExecutor | None = None
        self._stager = None
        self._group = None
        self.saved: list[Saved] = []  # every finished save, oldest first
        if not blocking:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            cuda = torch.cuda.is_available()
            # pinned buffers make the device-to-host copy fast and let it run without blocking
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
            if fsdp:  # a collective: every rank builds its Saver at the same point
                self._group = dist.new_group(backend="gloo")

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
        state = self._stager.stage({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra})
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
        """The write in flight has finished with an error (`wait` raises it). Does not block."""
        return self._pending is not None and self._pending.done() and self._pending.exception() is not None

    def poll(self) -> Saved | None:
        """The write in flight, if it has finished since the last call: its figures (raises
        CheckpointError if it failed). Does not block."""
        if self._pending is None or not self._pending.done():
            return None
        return self.wait()

    def wait(self) -> Saved | None:
        """Block until the write in flight is on disk -> its figures; CheckpointError if it failed."""
        if self._pending is None:
            return None
        fut, (path, step, stall, t0) = self._pending, self._pending_info
        self._pending = self._pending_info = None
        try:
            total = fut.result()
        except Exception as e:  # any failure of the write: disk full, permissions, a rank lost mid-manifest
            raise CheckpointError(f"could not write checkpoint {path} (step {step}): {type(e).__name__}: {e}. "
                                  "The checkpoints before it are intact.") from e
        self.saved.append(Saved(path, step, stall, total))
        return self.saved[-1]

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

"""Checkpoints: atomic, newest-valid-wins, last N kept.

DDP / single process: rank 0 writes `ckpt_{step:08d}.pt` (model, optimizer, scaler, step = data
position, RNG states, config) to a temp file, fsyncs it and os.replace()s it into place, so a
crash leaves either the old set or the new file, never half of one under the real name. A file
torn some other way (disk full, copied half-way) fails to load and is skipped with a warning.

FSDP: torch.distributed.checkpoint writes every rank's shards into `ckpt_{step:08d}.tmp/`;
after a barrier rank 0 renames it to `ckpt_{step:08d}/`. Needs a filesystem all ranks share.
"""
from __future__ import annotations

import glob
import os
import random
import re
import shutil
import sys

import torch
import torch.distributed as dist

_NAME = re.compile(r"ckpt_(\d{8})(\.pt)?$")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(out_dir: str) -> list[str]:
    """Finished checkpoints, newest first (temp files/dirs are not listed)."""
    found = [p for p in glob.glob(os.path.join(out_dir, "ckpt_*")) if _NAME.search(os.path.basename(p))]
    return sorted(found, key=lambda p: int(_NAME.search(os.path.basename(p)).group(1)), reverse=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(out_dir: str, keep: int) -> None:
    for old in list_checkpoints(out_dir)[keep:]:
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)


def save(out_dir: str, step: int, model, optimizer, scaler, config: dict, *, rank: int,
         fsdp: bool, keep: int = 3) -> str:
    extra = {"step": step, "scaler": scaler.state_dict() if scaler is not None else None,
             "rng": _rng_state(), "config": config}
    if fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        final = os.path.join(out_dir, f"ckpt_{step:08d}")
        tmp = final + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        dist.barrier()
        if rank == 0:
            torch.save(extra, os.path.join(tmp, "extra.pt"))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(out_dir)
            _prune(out_dir, keep)
        dist.barrier()
        return final
    path = os.path.join(out_dir, f"ckpt_{step:08d}.pt")
    if rank == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(out_dir)
        _prune(out_dir, keep)
    return path


def _load_file(path: str) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise ValueError("not a trainer checkpoint")
    return state


def load(spec: str, out_dir: str, model, optimizer, scaler, *, rank: int, fsdp: bool,
         distributed: bool) -> int | None:
    """Restore the checkpoint `spec` names (auto|none|PATH); returns its step, or None.

    With `auto`, candidates are tried newest first and one that fails to load is skipped with a
    warning. For DDP rank 0 loads and broadcasts the state, so other nodes need no copy of it.
    """
    if spec == "none":
        return None
    candidates = list_checkpoints(out_dir) if spec == "auto" else [spec]
    if fsdp:
        return _load_fsdp(candidates, model, optimizer, scaler)
    state = None
    if rank == 0:
        for path in candidates:
            try:
                state = _load_file(path)
                print(f"resuming from {path} (step {state['step']})", flush=True)
                break
            except Exception as e:  # torn or foreign file: never half-load it
                print(f"warning: skipping checkpoint {path}: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
    if distributed:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    if state is None:
        return None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    _set_rng_state(state["rng"])
    return int(state["step"])


def _load_fsdp(candidates, model, optimizer, scaler) -> int | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    for path in candidates:
        try:
            extra = torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=False)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            sd = {"model": model_sd, "optim": optim_sd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        except Exception as e:
            print(f"warning: skipping checkpoint {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        if scaler is not None and extra.get("scaler"):
            scaler.load_state_dict(extra["scaler"])
        _set_rng_state(extra["rng"])
        if dist.get_rank() == 0:
            print(f"resuming from {path} (step {extra['step']})", flush=True)
        return int(extra["step"])
    return None

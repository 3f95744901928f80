"""Checkpoints: atomic, checksummed, newest-valid-wins, last N kept.

DDP / single process: rank 0 writes `ckpt_{step:08d}.pt` (model, optimizer, GradScaler, step,
data position, every rank's RNG states, config). The bytes go to a temp file while being hashed;
the file is fsynced, its SHA-256 written to `ckpt_{step:08d}.pt.sha256`, and only then is the
temp file os.replace()d into place. A crash therefore leaves the old set or the new file, never
half of one under the real name; a file damaged later (disk full, copied half-way, bit rot) no
longer matches its checksum and is skipped with a warning -- torch.load alone would happily
load a zip whose tensor bytes were overwritten.

FSDP: torch.distributed.checkpoint writes every rank's shards into `ckpt_{step:08d}.tmp/`;
then rank 0 adds `extra.pt`, every rank hashes the files it wrote, and the `MANIFEST.sha256`
lists every rank's files; then the directory is renamed to `ckpt_{step:08d}/`.
Without a shared filesystem each node finalizes its own directory (its shards, the full
manifest): no node alone holds a complete checkpoint, and `verify` says so. clusterctl gathers
the pieces into one complete checkpoint and puts it back on every node before a restart.

`save` writes on the calling thread; saver.py's Saver runs the same writes (`write_file`,
`fsdp_finish`) on a background thread from a copy in host memory, so training goes on meanwhile.

The data position is the step: batches are a pure function of (seed, rank, step, micro-step),
see data.py, so restoring the step restores where in the data the run was.
"""
from __future__ import annotations

import glob
import hashlib
import os
import pickle
import random
import re
import shutil
import sys
import zipfile
import time

import torch
import torch.distributed as dist

from .config import UsageError
from .gpt2 import fit_state_dict

_NAME = re.compile(r"ckpt_(\d{8})(\.pt)?$")
MANIFEST = "MANIFEST.sha256"
# What a checkpoint that cannot be used raises while being verified or read: ValueError from
# verify() (no or wrong checksum, malformed manifest) and from _load_file (not a trainer dict);
# OSError for unreadable files; and from torch.load on bytes that passed a checksum but are not
# a torch file: a zip error, an unpickling error, EOFError, or RuntimeError (torch's zip reader).
UNUSABLE = (ValueError, OSError, EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile)


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


def _all_rng_states() -> list[dict]:
    """Every rank's RNG state (a collective when distributed): dropout masks differ per rank."""
    mine = _rng_state()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _restore_rng(states: list[dict]) -> None:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    _set_rng_state(states[rank] if rank < len(states) else states[0])  # world size changed: best effort


def list_checkpoints(out_dir: str) -> list[str]:
    """Finished checkpoints, newest first (temp files/dirs and checksum files are not listed)."""
    found = [p for p in glob.glob(os.path.join(out_dir, "ckpt_*")) if _NAME.search(os.path.basename(p))]
    return sorted(found, key=lambda p: int(_NAME.search(os.path.basename(p)).group(1)), reverse=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        for p in (path, path + ".sha256"):
            if os.path.exists(p):
                os.remove(p)


def _prune(out_dir: str, keep: int) -> None:
    for old in list_checkpoints(out_dir)[keep:]:
        _remove(old)


class _HashingWriter:
    """A write-only file object that hashes what passes through (torch.save needs write/flush)."""

    def __init__(self, fh):
        self.fh, self.h = fh, hashlib.sha256()

    def write(self, b) -> int:
        self.h.update(b)
        return self.fh.write(b)

    def flush(self) -> None:
        self.fh.flush()


def extra_state(step: int, scaler, config: dict) -> dict:
    """What a checkpoint holds besides model and optimizer (a collective: RNG states are gathered)."""
    return {"step": step, "data_position": {"step": step, "seed": config.get("seed")},
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": _all_rng_states(), "config": config}


def save(out_dir: str, step: int, model, optimizer, scaler, config: dict, *, rank: int,
         fsdp: bool, keep: int = 3) -> str:
    """Collective: every rank calls it (RNG states are gathered); rank 0 writes (DDP), from the
    live tensors, before it returns. saver.py's Saver writes in the background instead."""
    t0 = time.monotonic()
    extra = extra_state(step, scaler, config)
    if fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        final, tmp = fsdp_paths(out_dir, step)
        fsdp_prepare(tmp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        fsdp_finish(tmp, final, out_dir, extra, rank, keep)
        path = final
    else:
        path = file_path(out_dir, step)
        if rank == 0:
            write_file(out_dir, path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}, keep)
    if rank == 0:
        record_save_seconds(time.monotonic() - t0)
    return path


def record_save_seconds(seconds: float) -> None:
    """Under clusterctl, how long the last save took goes to $CLUSTERCTL_NODE_DIR/save_seconds:
    `clusterctl stop` gives the job at least twice that before SIGKILL (a stop may find one write
    in flight and then the final save to do)."""
    node_dir = os.environ.get("CLUSTERCTL_NODE_DIR")
    if node_dir and os.path.isdir(node_dir):
        _write_small(os.path.join(node_dir, "save_seconds"), f"{seconds:.3f}\n")


def file_path(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, f"ckpt_{step:08d}.pt")


def write_file(out_dir: str, path: str, state: dict, keep: int) -> None:
    """The bytes go to a temp file while being hashed, are fsynced, the checksum goes beside it,
    and only then is the file renamed into place: the old set or the new file, never half of one
    under the real name. A failed write takes its temp file with it."""
    tmp, side = f"{path}.tmp.{os.getpid()}", path + ".sha256"
    try:
        with open(tmp, "wb") as fh:
            w = _HashingWriter(fh)
            torch.save(state, w)
            fh.flush()
            os.fsync(fh.fileno())
        _write_small(side, w.h.hexdigest() + "\n")
        os.replace(tmp, path)
    except BaseException:
        for p in (tmp, side):  # no temp file left behind, and no checksum of a file that never landed
            if os.path.exists(p):
                os.remove(p)
        raise
    _fsync_dir(out_dir)
    _prune(out_dir, keep)


def _write_small(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def _own_files(tmp: str, rank: int) -> list[str]:
    """The files this rank wrote into a DCP directory: its `__RANK_*.distcp` shards (rank 0 also
    .metadata and extra.pt)."""
    mine = [f for f in os.listdir(tmp) if f.startswith(f"__{rank}_")]
    if rank == 0:
        mine += [f for f in (".metadata", "extra.pt") if os.path.exists(os.path.join(tmp, f))]
    return mine


def fsdp_paths(out_dir: str, step: int) -> tuple[str, str]:
    """(the checkpoint directory, the temp directory its shards are written into)."""
    final = os.path.join(out_dir, f"ckpt_{step:08d}")
    return final, final + ".tmp"


def fsdp_prepare(tmp: str) -> None:
    """Collective: an empty temp directory on every node (a shared one or one of its own)."""
    if _local_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()


def _agree(error: Exception | None, group) -> None:
    """Collective: raise on every rank if any rank failed, so no rank waits at the next
    collective for one that gave up."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if failed:
        raise OSError(f"rank {failed[0][0]} could not write its part: {failed[0][1]}")


def _attempt(fn, *args) -> Exception | None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - handed to every rank by _agree, then raised
        return e
    return None


def fsdp_finish(tmp, final, out_dir, extra, rank, keep, group=None) -> None:
    """Collective, after every rank's shards are in `tmp`: rank 0 adds `extra.pt`, every rank
    hashes the files it wrote, the `MANIFEST.sha256` lists every rank's files, and the directory
    is renamed to `final`. Without a shared filesystem each node finalizes its own directory (its
    shards, the full manifest). `group`: the process group to agree over (the writer thread's own)."""
    err = _attempt(torch.save, extra, os.path.join(tmp, "extra.pt")) if rank == 0 else None
    entries = []
    if err is None:
        try:
            entries = [(f, _sha256(os.path.join(tmp, f))) for f in _own_files(tmp, rank)]
        except OSError as e:
            err = e
    _agree(err, group)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, entries, group=group)  # the manifest names every rank's files
    lines = sorted(f"{digest}  {name}\n" for part in gathered for name, digest in part)
    _agree(_attempt(_finalize, tmp, final, out_dir, lines, keep) if rank == 0 else None, group)
    local = _local_rank() == 0 and rank != 0 and os.path.isdir(tmp) and not os.path.isdir(final)
    _agree(_attempt(_finalize, tmp, final, out_dir, lines, keep) if local else None, group)  # this node's own part


def _finalize(tmp, final, out_dir, lines, keep) -> None:
    _write_small(os.path.join(tmp, MANIFEST), "".join(lines))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(out_dir)
    _prune(out_dir, keep)


def verify(path: str) -> None:
    """Raise ValueError unless `path` is a complete checkpoint whose bytes match its checksums."""
    if os.path.isdir(path):
        man = os.path.join(path, MANIFEST)
        if not os.path.exists(man):
            raise ValueError(f"no {MANIFEST} (unfinished or foreign directory)")
        with open(man) as fh:
            for line in fh:
                digest, name = line.rstrip("\n").split("  ", 1)
                if not os.path.exists(os.path.join(path, name)) or _sha256(os.path.join(path, name)) != digest:
                    raise ValueError(f"{name} is missing or does not match its checksum")
        return
    side = path + ".sha256"
    if not os.path.exists(side):
        raise ValueError("no .sha256 next to it (unfinished or foreign file)")
    with open(side) as fh:
        want = (fh.read().split() or [""])[0]
    if _sha256(path) != want:
        raise ValueError("contents do not match the checksum written with it (torn or corrupt)")


def _load_file(path: str) -> dict:
    verify(path)
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise ValueError("not a trainer checkpoint")
    return state


def _warn_skip(path: str, e: Exception) -> None:
    print(f"warning: skipping checkpoint {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def load(spec: str, out_dir: str, model, optimizer, scaler, *, rank: int, fsdp: bool,
         distributed: bool) -> int | None:
    """Restore the checkpoint `spec` names (auto|none|PATH); returns its step, or None.

    With `auto`, candidates are tried newest first and one that fails verification or loading
    is skipped with a warning. For DDP rank 0 loads and broadcasts the state, so other nodes
    need no copy of it.
    """
    if spec == "none":
        return None
    candidates = list_checkpoints(out_dir) if spec == "auto" else [spec]
    if fsdp:
        return _load_fsdp(candidates, model, optimizer, scaler, rank)
    state = chosen = None
    if rank == 0:
        for chosen in candidates:
            try:
                state = _load_file(chosen)
                print(f"resuming from {chosen} (step {state['step']})", flush=True)
                break
            except UNUSABLE as e:  # torn or foreign file: never half-load it
                _warn_skip(chosen, e)
    if distributed:
        box = [state, chosen]
        dist.broadcast_object_list(box, src=0)
        state, chosen = box
    if state is None:
        return None
    _load_model(model, state, chosen)
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    _restore_rng(state["rng"])
    return int(state["step"])


def _load_model(model, state: dict, path: str) -> None:
    """Weights of this model or of transformers' GPT2LMHeadModel (what the trainer used before)
    load; those of another model are a usage error, one sentence, on every rank."""
    try:
        model.load_state_dict(fit_state_dict(model, state["model"]))
    except ValueError as e:
        arch = {k: state.get("config", {}).get(k) for k in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size")}
        raise UsageError(f"checkpoint {path} holds another model's weights ({e}); it was written with "
                         + ", ".join(f"{k}={v}" for k, v in arch.items()) + ". Give the same model flags, "
                         "--resume none to start fresh, or another --output-dir.") from None


def _load_fsdp(candidates, model, optimizer, scaler, rank) -> int | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    # one rank per node checks the bytes (nodes need not share a filesystem); the newest
    # checkpoint complete on every node wins
    ok = None
    if _local_rank() == 0:
        ok = []
        for path in candidates:
            try:
                verify(path)
                ok.append(os.path.basename(path))
            except (ValueError, OSError) as e:  # see UNUSABLE: what verify() raises
                _warn_skip(path, e)
    votes: list = [None] * dist.get_world_size()
    dist.all_gather_object(votes, ok)
    sets = [set(v) for v in votes if v is not None]
    good = [p for p in candidates if all(os.path.basename(p) in s for s in sets)]
    if not good:
        return None
    path = good[0]
    extra = torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=False)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if scaler is not None and extra.get("scaler"):
        scaler.load_state_dict(extra["scaler"])
    _restore_rng(extra["rng"])
    if rank == 0:
        print(f"resuming from {path} (step {extra['step']})", flush=True)
    return int(extra["step"])

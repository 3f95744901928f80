"""Data: text -> tokens once, cached as a memmap; random windows per rank.

Default corpus when --data is absent: the text of the stdlib module `pydoc_data.topics` (the
help() topics, ~700 KB of English prose and code that ships with every Python), so the demo
needs no download and no data from the user.

The token stream is written once per node (LOCAL_RANK 0) to `<output-dir>/cache/<key>/`, key =
hash of the data and the tokenizer, as uint16 (uint32 if the vocabulary exceeds 65,535). Other
local ranks wait for the `done` marker with a timeout, so a crashed writer is an error, not a
hang. 90 % of the stream is train, 10 % validation.

Batches are windows at random offsets drawn from a torch.Generator seeded by (seed, rank, step,
micro-step): ranks see different data, and a run resumed at step S draws what it would have.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time

import numpy as np
import torch

from .tokenizer import tokenizer_fingerprint


def _source_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs
                  if f.endswith((".txt", ".jsonl")))


def _documents(path: str | None):
    """Yield text documents: pydoc topics by default, else .txt files and .jsonl 'text' fields."""
    if path is None:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            yield topics[key]
        return
    for f in _source_files(path):
        with open(f, encoding="utf-8", errors="replace") as fh:
            if f.endswith(".txt"):
                yield fh.read()
            else:
                for line in fh:
                    if line.strip():
                        rec = json.loads(line)
                        yield rec["text"] if isinstance(rec, dict) else str(rec)


def _data_hash(path: str | None) -> str:
    h = hashlib.sha256()
    if path is None:
        import sys
        h.update(f"pydoc_data.topics {sys.version}".encode())
    else:
        for f in _source_files(path):
            h.update(os.path.relpath(f, path if os.path.isdir(path) else os.path.dirname(f)).encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def _tokenize_to(dirpath: str, path: str | None, tok) -> None:
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    ids: list[int] = []
    for doc in _documents(path):
        ids.extend(tok.encode(doc))
        ids.append(tok.eot)
    arr = np.array(ids, dtype=dtype)
    n_train = int(len(arr) * 0.9)
    tmp = f"{dirpath}.tmp.{socket.gethostname()}.{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for split, part in (("train", arr[:n_train]), ("val", arr[n_train:])):
        part.tofile(os.path.join(tmp, f"{split}.bin"))
    with open(os.path.join(tmp, "meta.json"), "w") as fh:
        json.dump({"dtype": np.dtype(dtype).name, "tokens": len(arr), "tokenizer": tok.name}, fh)
    with open(os.path.join(tmp, "done"), "w") as fh:
        fh.write("ok\n")
    try:
        os.replace(tmp, dirpath)
    except OSError:  # another node's writer got there first on a shared filesystem
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


class TokenData:
    def __init__(self, path: str | None, tok, cache_root: str, block_size: int,
                 local_rank: int = 0, timeout_s: float | None = None):
        key = f"{_data_hash(path)}-{tokenizer_fingerprint(tok)}"
        self.dir = os.path.join(cache_root, key)
        marker = os.path.join(self.dir, "done")
        os.makedirs(cache_root, exist_ok=True)
        if not os.path.exists(marker):
            if local_rank == 0:
                _tokenize_to(self.dir, path, tok)
            else:
                timeout_s = timeout_s or float(os.environ.get("CLUSTERCTL_DATA_TIMEOUT", 1800))
                deadline = time.monotonic() + timeout_s
                while not os.path.exists(marker):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"local rank 0 did not finish tokenizing into {self.dir} "
                                           f"within {timeout_s:.0f}s")
                    time.sleep(0.2)
        with open(os.path.join(self.dir, "meta.json")) as fh:
            meta = json.load(fh)
        self.block_size = block_size
        self.splits = {s: np.memmap(os.path.join(self.dir, f"{s}.bin"), dtype=meta["dtype"], mode="r")
                       for s in ("train", "val")}
        for s, arr in self.splits.items():
            if len(arr) <= block_size + 1:
                raise ValueError(f"the {s} split has {len(arr)} tokens, fewer than one window of "
                                 f"{block_size + 1}; give more data or a smaller --block-size")
        self.n_tokens = meta["tokens"]

    def batch(self, split: str, batch_size: int, seed: int, rank: int, step: int, micro: int = 0):
        """(x, y) int64 tensors of shape (batch_size, block_size), y shifted by one."""
        data, T = self.splits[split], self.block_size
        g = torch.Generator()
        salt = 0 if split == "train" else 1
        g.manual_seed(hash((seed, rank, step, micro, salt)) & 0x7FFF_FFFF_FFFF_FFFF)
        ix = torch.randint(len(data) - T - 1, (batch_size,), generator=g).tolist()
        x = torch.from_numpy(np.stack([data[i:i + T] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[i + 1:i + 1 + T] for i in ix]).astype(np.int64))
        return x, y

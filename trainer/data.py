"""Data: text -> tokens once, cached as memmapped shards; random windows per rank.

Sources (--data):
- absent: the text of the stdlib module `pydoc_data.topics` (the help() topics, ~700 KB of
  English prose and code that ships with every CPython), so the demo needs no download and no
  data from the user;
- a directory (or file) of .txt files (one document each) and .jsonl files (a "text" field per
  line);
- `hf:NAME[:CONFIG]`, a Hugging Face dataset's train split ("text" column). Needs the optional
  `datasets` package and a network connection; offline it fails with one clear sentence.

The token stream is written once per node (LOCAL_RANK 0) to `<output-dir>/cache/<key>/`, key =
hash of the data and the tokenizer, as shards of at most 2**28 tokens in uint16 (uint32 if the
vocabulary exceeds 65,535), streamed to disk so memory stays flat. The writer builds everything
in a private temp directory, writes a `done` marker last and renames the directory into place,
so a reader sees all of it or none. Other local ranks poll for the marker with a timeout
(CLUSTERCTL_DATA_TIMEOUT, default 1800 s): a crashed writer is an error, not a hang. The last
10 % of every shard is validation.

Batches are windows at random offsets drawn from a generator seeded by (seed, rank, step,
micro-step): ranks see different windows, and a run resumed at step S draws exactly what the
uninterrupted run would have -- the step *is* the data position stored in checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time

import numpy as np
import torch

from .config import UsageError
from .tokenizer import tokenizer_fingerprint

SHARD_TOKENS = 1 << 28
VAL_FRACTION = 0.1


def _source_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs
                  if f.endswith((".txt", ".jsonl")))


def _hf_dataset(spec: str):
    name, _, config = spec[3:].partition(":")
    try:
        import datasets
    except ImportError:
        raise UsageError(f"--data {spec} is a Hugging Face dataset, which needs the 'datasets' package "
                         "(pip install datasets) and a network connection; or give a local directory of .txt/.jsonl files.") from None
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UsageError(f"--data {spec} is a Hugging Face dataset but HF offline mode is set; "
                         "give a local directory of .txt/.jsonl files instead.")
    try:
        return datasets.load_dataset(name, config or None, split="train")
    except Exception as e:  # offline, unknown name, gated...: one sentence, not a traceback
        raise UsageError(f"could not load Hugging Face dataset {name!r} (offline or unknown?): "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _documents(path: str | None):
    """Yield text documents from the default corpus, local files, or a HF dataset."""
    if path is None:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            yield topics[key]
        return
    if path.startswith("hf:"):
        for row in _hf_dataset(path):
            yield row["text"]
        return
    for f in _source_files(path):
        with open(f, encoding="utf-8", errors="replace") as fh:
            if f.endswith(".txt"):
                yield fh.read()
                continue
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"{f}:{n} is not valid JSON ({e.msg}).") from None
                if isinstance(rec, dict) and not isinstance(rec.get("text"), str):
                    raise UsageError(f"{f}:{n} has no string \"text\" field.")
                yield rec["text"] if isinstance(rec, dict) else str(rec)


def _data_hash(path: str | None) -> str:
    h = hashlib.sha256()
    if path is None:
        import sys
        h.update(f"pydoc_data.topics {sys.version}".encode())
    elif path.startswith("hf:"):
        h.update(path.encode())
        h.update(getattr(_hf_dataset(path), "_fingerprint", "").encode())
    else:
        for f in _source_files(path):
            h.update(os.path.relpath(f, path if os.path.isdir(path) else os.path.dirname(f)).encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def _tokenize_to(dirpath: str, path: str | None, tok) -> None:
    """Stream documents -> tokens -> shard files in a temp dir, then rename it into place."""
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    tmp = f"{dirpath}.tmp.{socket.gethostname()}.{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    shards, buf, fh, in_shard = [], [], None, 0

    def flush():
        nonlocal buf
        if buf:
            fh.write(np.asarray(buf, dtype=dtype).tobytes())
            buf = []

    for doc in _documents(path):
        ids = tok.encode(doc) + [tok.eot]
        while ids:
            if fh is None:
                fh = open(os.path.join(tmp, f"shard_{len(shards):05d}.bin"), "wb")
                shards.append(0)
            take = ids[:SHARD_TOKENS - in_shard]
            ids = ids[len(take):]
            buf.extend(take)
            in_shard += len(take)
            shards[-1] = in_shard
            if len(buf) >= 1 << 20:
                flush()
            if in_shard == SHARD_TOKENS:
                flush()
                fh.close()
                fh, in_shard = None, 0
    if fh is not None:
        flush()
        fh.close()
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"dtype": np.dtype(dtype).name, "shards": shards, "tokenizer": tok.name}, f)
    with open(os.path.join(tmp, "done"), "w") as f:
        f.write("ok\n")
    try:
        os.replace(tmp, dirpath)
    except OSError:  # another node's writer got there first on a shared filesystem
        shutil.rmtree(tmp, ignore_errors=True)


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


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
        self.n_tokens = sum(meta["shards"])
        # per split: list of 1-D memmap views, and the cumulative count of window starts
        self.views: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        for i, n in enumerate(meta["shards"]):
            arr = np.memmap(os.path.join(self.dir, f"shard_{i:05d}.bin"), dtype=meta["dtype"], mode="r")
            cut = int(n * (1 - VAL_FRACTION))
            for split, view in (("train", arr[:cut]), ("val", arr[cut:])):
                if len(view) > block_size + 1:
                    self.views[split].append(view)
        self.starts = {}
        for split, views in self.views.items():
            if not views:
                raise UsageError(f"the data has too few tokens ({self.n_tokens:,}) for one {split} window of "
                                 f"{block_size + 1}; give more data or a smaller --block-size.")
            self.starts[split] = np.cumsum([len(v) - block_size - 1 for v in views])

    def batch(self, split: str, batch_size: int, seed: int, rank: int, step: int, micro: int = 0):
        """(x, y) int64 tensors of shape (batch_size, block_size), y shifted by one."""
        T, views, cum = self.block_size, self.views[split], self.starts[split]
        g = torch.Generator().manual_seed(_seed(seed, rank, step, micro, split == "val"))
        flat = torch.randint(int(cum[-1]), (batch_size,), generator=g).numpy()
        shard = np.searchsorted(cum, flat, side="right")
        rows = []
        for s, i in zip(shard, flat - np.concatenate([[0], cum])[shard]):
            rows.append(views[s][i:i + T + 1].astype(np.int64))
        xy = torch.from_numpy(np.stack(rows))
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()

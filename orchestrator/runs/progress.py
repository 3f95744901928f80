"""How far a rank has come, read from what any script prints, and from its Flight Recorder.

`parse(line)` is pure: the step in a log line in the forms training scripts use,
- `step 45`, `step=45`, `step: 45`, `Step 45/1000`, `global_step=45`, `it 45`, `iter 45`,
  `iteration 45` (a figure in ms or s after `step` is a step time, not a step);
- a tqdm bar, `45/100 [00:10<00:12, 4.50it/s]` (the HF Trainer's and any loop's), `45it [00:10, ...]`
  when the total is unknown, and Lightning's `Epoch 3: 45%|████ | 45/100 [...]`: epoch 3 of
  100 batches each is global step 345 (the bars of validation, testing, prediction and the
  sanity check are not training progress);
- Lightning's Rich bar, `Epoch 1/1  ━━━━━━━━ 30/30 0:00:00 • ...` (off a terminal it prints once,
  at the end);
- the HF Trainer's log dicts, `{'loss': '4.55', 'grad_norm': '1.2', 'learning_rate': ..., 'epoch':
  '0.05'}` (transformers 5 quotes the values), and JSON log lines: their `step`/`global_step`,
  else their epoch.
The fixtures it is tested on were recorded from Lightning 2.6 and transformers 5 on CPU
(tests/fixtures/progress/record.py).

`collectives(entered)`: a rank's Flight Recorder entries (the hook's progress answer, `entered`:
[[process group, collective seq, ns]]) as the highest collective seq per process group, the
progress every rank of a distributed job has, whether it prints or not.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Iterable

# `step 45`, `step=45`, `Step: 45/1000`, `global_step 45`, `iter 45`, `it 45`; not a step time (`step 977 ms`)
KEYWORD = re.compile(r"\b(?:global[_ ]step|step|iter(?:ation)?|it)\b\s*[:=#]?\s*(\d+)(?![\d.])(?!\s*m?s\b)",
                     re.IGNORECASE)
# tqdm: `Epoch 3:  45%|████▌     | 45/100 [00:10<00:12, ...]`, ` 17%|█▋        | 5/30 [00:00<...]`,
# `Epoch 3: 45/100 [00:10<...]` (no bar), `45it [00:10, 4.50it/s]` (no total)
TQDM = re.compile(r"^(?P<desc>[^|]*?)(?:\d+%)?(?:\|[^|]*\|)?\s*(?P<n>\d+)/(?P<total>\d+|\?)\s*\[\d+:\d\d")
TQDM_NO_TOTAL = re.compile(r"^(?P<desc>[^|]*?)(?P<n>\d+)it \[\d+:\d\d")
# Lightning's Rich bar: `Epoch 1/1  ━━━━━━━━━━━━ 30/30 0:00:00 • 0:00:00 85.07it/s v_num: 1.000`
RICH = re.compile(r"^Epoch (?P<epoch>\d+)/\d+\s+[━╸╺╾╼─\-\s]*?\s(?P<n>\d+)/(?P<total>\d+)\s")
EPOCH = re.compile(r"\bEpoch (\d+)\b")
NOT_TRAINING = re.compile(r"valid|sanity|test|predict|eval", re.IGNORECASE)


@dataclass(frozen=True)
class Progress:
    """A step (or a progress bar's position), or only an epoch (a fraction, as the HF Trainer's
    log dicts give it)."""

    step: int | None = None
    epoch: float | None = None

    @property
    def text(self) -> str:
        if self.step is not None:
            return str(self.step)
        return f"ep {self.epoch:g}" if self.epoch is not None else "-"


def _bar(m: re.Match) -> Progress | None:
    desc = m.group("desc")
    if NOT_TRAINING.search(desc):
        return None
    n, total = int(m.group("n")), m.groupdict().get("total")
    epoch = EPOCH.search(desc)
    if epoch is not None and total and total.isdigit():
        return Progress(int(epoch.group(1)) * int(total) + n)
    return Progress(n)


def _record(line: str) -> Progress | None:
    """A log dict or JSON object with a step, or an epoch."""
    try:
        doc = json.loads(line)
    except ValueError:
        try:
            doc = ast.literal_eval(line)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    if not isinstance(doc, dict):
        return None
    for key in ("global_step", "step"):
        try:
            return Progress(int(doc[key]))
        except (KeyError, TypeError, ValueError):
            pass
    try:
        return Progress(epoch=float(doc["epoch"]))
    except (KeyError, TypeError, ValueError):
        return None


def parse(line: str) -> Progress | None:
    """The progress a line says, or None. A line with `\\r` is a progress bar's updates (and
    what was printed between them): the newest step among them, else the newest epoch."""
    if "\r" in line:
        epoch = None
        for part in reversed(line.split("\r")):
            found = parse(part)
            if found is not None and found.step is not None:
                return found
            epoch = epoch or found
        return epoch
    if "/" in line and "[" in line and (m := TQDM.match(line)):
        return _bar(m)
    if "it [" in line and (m := TQDM_NO_TOTAL.match(line)):
        return _bar(m)
    if line.startswith("Epoch ") and (m := RICH.match(line)):
        return Progress(int(m.group("epoch")) * int(m.group("total")) + int(m.group("n")))
    stripped = line.strip()
    if stripped[:1] == "{" and stripped[-1:] == "}" and ("step" in stripped or "epoch" in stripped):
        return _record(stripped)
    m = KEYWORD.search(line)
    return Progress(int(m.group(1))) if m else None


def collectives(entered: Iterable) -> dict[str, int]:
    """A rank's Flight Recorder entries ([[process group, collective seq, time ns], ...]) ->
    {process group: the highest collective seq entered}."""
    out: dict[str, int] = {}
    for pg, seq, *_ in entered or ():
        try:
            seq = int(seq)
        except (TypeError, ValueError):
            continue
        if seq > out.get(str(pg), -1):
            out[str(pg)] = seq
    return out

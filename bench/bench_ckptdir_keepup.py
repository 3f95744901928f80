"""A job that rewrites its checkpoint every ~1 s (train --checkpoint-dir): the completeness rule as
it was against the one that ships, in the same run.

    sudo .venv/bin/python bench/bench_ckptdir_keepup.py [--seconds 60] [--repeat 2] [--mb 8] [--period 1]

On one test node (a network namespace with its own sshd) a job steps (20 matrix products on one
thread) and torch.save()s a --mb MB checkpoint in place every --period s, as nanoGPT does with
always_save_checkpoint. This process copies the node's DIR home over SSH with runs/ckpt/jobdir_home.py's
DirCopier under each rule, in turn, --seconds each, --repeat times:

  none    no copier: the job's own step time
  before  an entry is complete once unchanged for 5 s and open for writing nowhere, looked at every
          3 s: remote/ckptdir.py `state` and `send` as they were (git show BEFORE), run as shipped
  now     complete when its writer closed it, captured on the node at once (remote/ckptdir.py
          `look`), at most one look per 3 s (train.checkpoint_interval's default), with the guard
          on the job's processes as a run has it

Printed per rule: snapshots taken per minute; the lag from a save to its copy home (the time
from the job's save of the version a snapshot holds to that snapshot being complete here), median
and max over the snapshots; the newest snapshot's age at 500 random cuts (the
time since the job saved the version that snapshot holds, or since the job started when no
snapshot is home: a restart from nothing), median and 90th percentile; and the job's step time
and CPU per step against `none` (medians over the repeats); and how many snapshots that came
home do not load with torch.load (each such store kept under --keep-bad). No assertions: this prints figures.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import yaml  # noqa: E402

from orchestrator.inventory import parse_inventory  # noqa: E402
from orchestrator import shell  # noqa: E402
from orchestrator.runs.ckpt.jobdir_home import DirCopier, DirStore  # noqa: E402
from orchestrator.transfer.unpack import Unpacker  # noqa: E402
from orchestrator.transport import Cluster  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402

BEFORE = "cb95001"  # main when the rule changed: remote/ckptdir.py's `state` (quiet 5 s) and `send`
KEY = "bench-keepup"  # the job's CLUSTERCTL_RUN_KEY is KEY@NODE, as a run's are

JOB = """
import os, sys, time, torch
path, period, mb, log = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
side = int((mb * 2**20 / 4) ** 0.5)
weights, a = torch.randn(side, side), torch.randn(256, 256)
os.makedirs(os.path.dirname(path), exist_ok=True)
out = open(log, "w", buffering=1)
step, last = 0, 0.0
print(time.time(), "start", file=out)
while True:
    t0, c0 = time.time(), time.process_time()
    for _ in range(20):
        a = torch.tanh(a @ a.T / 256)
    if t0 - last >= period:
        weights[0, 0] = step
        torch.save({"step": step, "weights": weights}, path)
        last = t0
        print(time.time(), "save", step, file=out)
    print(time.time(), "step", step, time.time() - t0, time.process_time() - c0, file=out)
    step += 1
"""


def old_program() -> bytes:
    """The node program of the rule before (remote/common.py, then remote/ckptdir.py, at BEFORE)."""
    def show(path):
        return subprocess.run(["git", "-C", str(REPO), "show", f"{BEFORE}:{path}"], capture_output=True,
                              check=True).stdout
    return show("orchestrator/remote/common.py") + b"\n# ---- orchestrator/remote/ckptdir.py\n" + \
        show("orchestrator/remote/ckptdir.py")


# The rule before ran its program as `PYTHON -c LOADER VERB ARGS`, the program length-prefixed on
# stdin in front of the verb's data (the node code was text then, not a zip)
LOADER = "import sys;exec(sys.stdin.buffer.read(int(sys.stdin.buffer.readline())))"


def old_line(node, *words) -> str:
    return f"{shell.path(node.python)} -c {shell.quote(LOADER)} " + " ".join(shell.quote(w) for w in words)


class QuietRule(DirCopier):
    """The rule before: `state PATH 5` every 3 s, copies read from DIR itself by `send`."""

    QUIET_S = 5.0

    def __init__(self, *a, program: bytes, **kw):
        super().__init__(*a, interval=3.0, **kw)
        self.program = program

    def _then(self, data=b""):
        yield str(len(self.program)).encode() + b"\n" + self.program
        if data:
            yield data

    def look(self, nodes, final=False):
        res = self.cluster.run(lambda n: old_line(n, "state", self.paths[n.name], 0 if final else self.QUIET_S),
                               stdin=lambda n: b"".join(self._then()), nodes=nodes, timeout=60)
        self.looks += 1
        out = {}
        for name, r in res.items():
            if not r.ok:
                return None
            doc = json.loads(r.stdout.strip().splitlines()[-1])
            for e in doc["entries"].values():
                e["complete"] = e["quiet"]
            out[name] = doc
        return out

    def _fetch(self, node, mine, stage, files):
        line = json.dumps([[rel, m["size"], m["mtime_ns"]] for rel, m in sorted(mine.items())]).encode() + b"\n"
        into = Unpacker(stage, checksums=True, name="unpack-before")
        try:
            r = self.cluster.run(lambda n: old_line(n, "send", self.paths[node]), stdin=lambda n: self._then(line),
                                 nodes=[node], timeout=600, capture=False,
                                 on_bytes=lambda _n, stream, data: into.feed(data) if stream == "stdout" else None)[node]
        finally:
            error = into.close(600)
        if not r.ok or error is not None:
            return False
        for rel in mine:
            files[rel]["sha256"] = into.digests[stage / rel]
        return True


def phase(cl, inv, rule: str, a, tmp: Path, home: str) -> dict:
    """One rule for a.seconds against a fresh job. -> its figures."""
    node = cl.nodes[0]
    d, log = f"{home}/gpt_train/out", f"{home}/job-{rule}.log"
    node.run(f"rm -rf {d} {home}/.clusterctl/artifacts/keepup && mkdir -p {d}")
    job = node.popen(f"exec env CLUSTERCTL_RUN_KEY={KEY}@{node.name} {cl.python} -c '{JOB}' {d}/ckpt.pt "
                     f"{a.period} {a.mb} {log}")
    taken: list[tuple[float, int]] = []  # (when a snapshot was home, the job's step in it)
    bad = 0  # snapshots home that do not load
    try:
        time.sleep(2.0)  # the job imports torch and starts stepping
        with Cluster(inv) as c:
            c.connect()
            store = DirStore(tmp / rule / str(time.time_ns()))
            copier = None if rule == "none" else QuietRule(c, store, say=lambda _s: None, program=OLD) \
                if rule == "before" else DirCopier(c, store, say=lambda _s: None)
            if copier is not None:
                copier.for_attempt({node.name: d}, {node.name: {"replicas": f"{home}/.clusterctl/artifacts/keepup/r"}})
                copier.key = KEY
            stop = time.monotonic() + a.seconds
            while time.monotonic() < stop:
                name = copier.tick([node.name]) if copier is not None else None
                if name is not None:
                    try:
                        blob = torch.load(io.BytesIO((store.dir / name / "ckpt.pt").read_bytes()), map_location="cpu")
                    except Exception as e:  # a torn snapshot home: counted, and kept for a look
                        keep = Path(a.keep_bad) / f"{rule}-{time.time_ns()}"
                        shutil.copytree(store.dir, keep)
                        print(f"{rule}: snapshot {name} does not load ({e!r}); the store is kept in {keep}",
                              file=sys.stderr)
                        bad += 1
                        continue
                    taken.append((time.time(), blob["step"]))
                time.sleep(min(0.2, copier.due_in() if copier is not None else 0.2))
            ended = time.time()
    finally:
        job.kill()
        job.wait()
    return figures(node.run(f"cat {log}").stdout, taken, ended, copier) | {"bad": bad}


def figures(log: str, taken, ended: float, copier) -> dict:
    started, saved, steps, cpu = None, {}, [], []
    for line in log.splitlines():
        f = line.split()
        if f[1] == "start":
            started = float(f[0])
        elif f[1] == "save":
            saved[int(f[2])] = float(f[0])
        elif f[1] == "step" and float(f[0]) <= ended:
            steps.append(float(f[3]))
            cpu.append(float(f[4]))
    ages = []
    rnd = random.Random(0)
    for _ in range(500):
        cut = rnd.uniform(started + 5.0, ended)
        home = [s for t, s in taken if t <= cut]
        ages.append(cut - (saved[home[-1]] if home else started))
    lags = [t - saved[s] for t, s in taken] or [float("nan")]
    return {"per_min": len(taken) / (ended - started) * 60, "age_p50": statistics.median(ages),
            "lag_p50": statistics.median(lags), "lag_max": max(lags),
            "age_p90": statistics.quantiles(ages, n=10)[-1], "step_ms": statistics.mean(steps) * 1000,
            "cpu_ms": statistics.mean(cpu) * 1000, "torn": copier.torn if copier else 0,
            "looks": copier.looks if copier else 0}


def median(xs: list[float]) -> float:
    """The median of those that are numbers (a run without a snapshot has no lag): nan when none."""
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    global OLD
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="each rule's run against the job")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--mb", type=float, default=8.0, help="the checkpoint's size")
    ap.add_argument("--period", type=float, default=1.0, help="seconds between the job's saves")
    ap.add_argument("--keep-bad", default="/tmp/bench-keepup-bad", help="where a snapshot that does not load is kept")
    a = ap.parse_args()
    OLD = old_program()
    rules = ("none", "before", "now")
    got: dict[str, list[dict]] = {r: [] for r in rules}
    with TestCluster(n=1, gpus=0, name_prefix="ckup") as cl, tempfile.TemporaryDirectory(dir="/root") as td:
        home = cl.nodes[0].run("echo ~").stdout.strip()
        inv = parse_inventory(yaml.safe_dump(cl.inventory()), "<bench>")
        for k in range(a.repeat):
            for rule in rules if k % 2 == 0 else rules[::-1]:  # alternate the order: drift hits both
                got[rule].append(phase(cl, inv, rule, a, Path(td), home))
    med = {r: {k: median([x[k] for x in got[r]]) for k in got[r][0]} for r in rules}
    print(f"a job saving a {a.mb:g} MB checkpoint in place every {a.period:g} s, {a.seconds:g} s per rule, "
          f"medians of {a.repeat}:")
    for rule in rules[1:]:
        m = med[rule]
        lag = "no snapshot while it ran" if m["lag_p50"] != m["lag_p50"] else \
            f"median {m['lag_p50']:4.1f} s, max {m['lag_max']:5.1f} s"
        print(f"  {rule:7s} {m['per_min']:5.1f} snapshots/min; a save to its copy home: {lag}; "
              f"newest snapshot's age at a random cut: "
              f"median {m['age_p50']:5.1f} s, p90 {m['age_p90']:5.1f} s; {m['looks']:.0f} looks, "
              f"{m['torn']:.0f} copies voided by a rewrite, {sum(x['bad'] for x in got[rule])} snapshots home that do not load (all repeats)")
    for rule in rules:
        m = med[rule]
        rel = "" if rule == "none" else f" ({m['step_ms'] / med['none']['step_ms'] - 1:+.1%} step, " \
                                        f"{m['cpu_ms'] / med['none']['cpu_ms'] - 1:+.1%} CPU)"
        print(f"  job under {rule:7s} step {m['step_ms']:6.1f} ms, CPU {m['cpu_ms']:6.1f} ms per step{rel}")


OLD = b""

if __name__ == "__main__":
    main()

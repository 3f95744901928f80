"""Where this machine's CPU goes while a bench runs: every process's CPU time, read from /proc every
`--every` seconds, summed by test node (the named network namespace it runs in, /run/netns) and by
role (the supervisor, a node's log stream, its warm interpreter, torchrun, a rank, sshd, other).
Run beside a bench (as root, to read every process); one JSON line per interval to `--json`, and the
busiest groups printed:

    sudo .venv/bin/python bench/cpu_by_node.py --every 15 --json /tmp/cpu.jsonl &
    .venv/bin/python bench/bench_goodput.py --minutes 2 --seed 1 --spares 3

It found why restarts stepped slower (docs/performance.md, goodput under faults): every node's
stream scanning forked ranks' padded environments. Figures are shares of one core over the
interval; the test nodes share this machine's cores, so a group's share is also what it takes from
the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.remote.common import env_values  # noqa: E402
from tests.cluster.host import NETNS_RUN  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def namespaces() -> dict[int, str]:
    """netns inode -> its name (the test node's namespace)."""
    out = {}
    for p in NETNS_RUN.glob("*") if NETNS_RUN.is_dir() else ():
        try:
            out[p.stat().st_ino] = p.name
        except OSError:
            pass
    return out


def role(cmd: list[str], env: bytes) -> str:
    """What a process is, from its argv and environment."""
    line = " ".join(cmd)
    if "orchestrator.runs.supervisor" in line:
        return "supervisor"
    if "sshd" in (cmd[:1] or [""])[0]:
        return "sshd"
    if env_values(env, "RANK") and env_values(env, "LOCAL_RANK"):
        return "rank"
    if "torchrun" in line or "torch.distributed.run" in line:
        return "torchrun"
    for word in ("stream", "warm"):
        if word in cmd:
            return word
    return "other"


def sample(names: dict[int, str]) -> dict[int, tuple[str, str, int]]:
    """pid -> (node, role, CPU ticks so far) for every process readable now."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            ticks = int(fields[11]) + int(fields[12])
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{entry.name}/environ").read_bytes()
            node = names.get(os.stat(f"/proc/{entry.name}/ns/net").st_ino, "host")
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry.name)] = (node, role([c.decode(errors="replace") for c in cmd if c], env), ticks)
    return out


def shares(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """'node/role' -> share of one core used between two samples (a process new since `before`
    counts from 0)."""
    out: dict[str, float] = {}
    for pid, (node, what, ticks) in after.items():
        was = before.get(pid)
        used = ticks - (was[2] if was and was[:2] == (node, what) else 0)
        key = f"{node}/{what}"
        out[key] = out.get(key, 0.0) + used / TICK / seconds
    return {k: round(v, 4) for k, v in sorted(out.items()) if v > 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--for", dest="total", type=float, default=0.0, help="stop after this many seconds (0: never)")
    ap.add_argument("--json", type=Path, help="append one JSON line per interval here")
    ap.add_argument("--top", type=int, default=8, help="groups printed per interval")
    args = ap.parse_args(argv)
    start = last_t = time.time()
    last = sample(namespaces())
    while not args.total or time.time() - start < args.total:
        time.sleep(args.every)
        now_t, now = time.time(), sample(namespaces())
        got = shares(last, now, now_t - last_t)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps({"t": round(now_t, 1), "shares": got}) + "\n")
        busiest = sorted(got.items(), key=lambda kv: -kv[1])[:args.top]
        print(f"{now_t - start:7.0f} s  all {sum(got.values()):.2f}  "
              + "  ".join(f"{k} {v:.2f}" for k, v in busiest), flush=True)
        last_t, last = now_t, now
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the straggler watch asks of the nodes (runs/judge/straggler.py holds the rule and the
watch): every rank's newest steps through each node's agent, for a run without log streams
(`progress`), and each node's clock offset from this machine's, for judging from the Flight
Recorder's entry times (`clock_offsets`)."""

from __future__ import annotations

import time
from typing import Callable, Mapping

from orchestrator.node import agent

ANSWER_S = 5.0  # how long a node's agent waits for its ranks' progress answers


CLOCK_S = 2.0  # how long a clock request on the open log streams is waited for


def clock_offsets(cluster, names: list[str], tries: int = 3, asks=None) -> dict[str, tuple[float, float]]:
    """Every node's clock minus this machine's, in seconds, and the measure's uncertainty
    (checks/system.py `skew`, the round trip with the smallest uncertainty of `tries`); a node that
    does not answer is left out. Asked on the nodes' open log streams first (`asks`,
    runs/logs/streamask.py StreamAsks: a line each way, where `date` over SSH is a session and a
    shell on every node, three times: at 64 nodes that round was most of the supervisor's CPU in
    the seconds after every rank was up), then by `date` on every node whose stream did not answer."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.checks.system import skew

    best_of: dict[str, tuple[float, float]] = {}
    if asks is not None and names:
        for k in range(tries):
            t0 = time.time()
            for name, (node_t, t1) in asks.clock(names, time.time_ns() // 1_000_000 + k, CLOCK_S).items():
                found = skew(node_t, t0, t1)
                if name not in best_of or found[1] < best_of[name][1]:
                    best_of[name] = found
        names = [n for n in names if n not in best_of]

    def one(name: str) -> tuple[str, float | None]:
        best = None
        for _ in range(tries):
            t0 = time.time()
            r = cluster.run(lambda n: "date +%s.%N", nodes=[name], timeout=10)[name]
            t1 = time.time()
            try:
                found = skew(float(r.stdout.split()[0]), t0, t1) if r.ok else None
            except (ValueError, IndexError):
                found = None
            if found is not None and (best is None or found[1] < best[1]):
                best = found
        return name, best

    if not names:
        return best_of
    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        return best_of | {n: off for n, off in pool.map(one, names) if off is not None}


def progress(cluster, key: str, names: list[str], say: Callable[[str], None]) -> list[Mapping]:
    """Every rank's newest steps on the nodes `names` (node agent `snapshot ... progress`)."""
    ask = time.time_ns() // 1_000_000  # unique on the node, like the hang watch's requests
    got = agent.run(cluster, lambda nd: agent.snapshot(nd, key, ask, ANSWER_S, progress=True), names)
    out: list[Mapping] = []
    for name, sn in sorted(got.items()):
        if sn.error is not None:
            say(f"{name}: no progress snapshot: {sn.error}")
        out.extend(sn.ranks)
    return out

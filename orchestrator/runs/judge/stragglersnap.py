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
    the seconds after every rank was up; a stream that did not answer is not asked again), then by
    `date` on every node whose stream did not answer."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.checks.system import skew

    best: dict[str, tuple[float, float]] = {}
    ask = list(names) if asks is not None else []
    for k in range(tries if ask else 0):
        t0 = time.time()
        got = asks.clock(ask, time.time_ns() // 1_000_000 + k, CLOCK_S)
        for name, (node_t, t1) in got.items():
            keep_best(best, name, skew(node_t, t0, t1))
        if not (ask := [n for n in ask if n in got]):
            break

    def by_date(name: str) -> dict[str, tuple[float, float]]:
        found: dict[str, tuple[float, float]] = {}
        for _ in range(tries):
            t0 = time.time()
            r = cluster.run(lambda n: "date +%s.%N", nodes=[name], timeout=10)[name]
            t1 = time.time()
            try:
                keep_best(found, name, skew(float(r.stdout.split()[0]), t0, t1) if r.ok else None)
            except (ValueError, IndexError):
                pass
        return found

    if rest := [n for n in names if n not in best]:
        with ThreadPoolExecutor(max_workers=min(16, len(rest))) as pool:
            for found in pool.map(by_date, rest):
                best |= found
    return best


def keep_best(best: dict[str, tuple[float, float]], name: str, found: tuple[float, float] | None) -> None:
    """`found` (offset, uncertainty) kept for `name` when it is more certain than what `best` holds."""
    if found is not None and (name not in best or found[1] < best[name][1]):
        best[name] = found


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

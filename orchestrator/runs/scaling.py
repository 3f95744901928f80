"""The settings that grow with the cluster, derived from its node and rank counts by one rule.

A cluster of 8 nodes and one of 256 cannot share every timeout: the larger one's control machine
pings, streams and snapshots 32 times as many nodes, and its nodes take longer to agree. The
design documents tuned these by hand for 8, 16 and 64 GPUs (the NCCL timeout 1 h, 2 h, 4 h by node
count); this module is that tuning as a rule, so `train` needs no flags to run at 256 nodes:

  setting             up to 64 nodes      above 64 nodes, per doubling    what it is
  collective timeout  1 h / 2 h / 4 h     4 h (8 nodes and up)            NCCL_TIMEOUT, the trainer's
                      (1, 2-7, 8+ nodes)                                  init_process_group (torchrun.py)
  fan-out             the node count,     the node count, at most 256     commands in flight at once
                      at least 64
  lost timeout        30 s                +30 s                           silence that loses a node
  suspect after       2 s                 +1 s                            an unanswered ping makes a
                                                                          suspect (transport/liveness.py)
  probe timeout       1 s                 +0.5 s                          the suspect's TCP handshake
  snapshot wait       10 s                +5 s                            each node's wait for its
                                                                          ranks' hooks (hang snapshots);
                                                                          x ranks per node / 8 above 8
  hang timeout        300 s               +60 s                           the hang watch's backstop
  rendezvous timeout  900 s               +300 s                          torchrun's static rendezvous:
                                                                          how long node 0's store waits
                                                                          for every node's torchrun, and
                                                                          a node's torchrun tries to join
                                                                          (--rdzv-conf timeout=N)
  stream stall        30 s                +30 s                           a node's log stream silent this
                                                                          long while its node answers is
                                                                          started again (runs/logs/streams.py)
  progress period     ranks / 25.6 s, at least 2 s, at most 10 s          how often every rank's progress is
                      (2 s up to 51 ranks, 5 s at 128, 10 s from 256)     asked for on the log streams: what
                                                                          the hang and straggler watches see

The rendezvous timeout is torchrun's own default (900 s) up to 64 nodes, so nothing changes there.
It runs from node 0's torchrun opening its store until the last node's torchrun joined: the
launcher starting every other node (one agent call each, under the fan-out; the launch grew
linearly, about 0.3 s per node, to 38 s at 128 nodes with the test cluster's torchrun stand-in) and
each node's interpreter and torch import, which all nodes do at once from what may be one shared
filesystem (a real torchrun's first line took 51-58 s at 32 nodes on the test machine:
docs/performance.md). +300 s per doubling keeps the margin while both grow with the nodes; a node
that cannot reach node 0 still fails the run within the timeout. A static rendezvous has no
separate join timeout: the same `timeout` bounds each joining node's connect and node 0's wait.
The stream stall grows like the lost timeout: both are silences that a loaded control machine
reading N streams lengthens (at 128 nodes the test machine's streams sat silent 48 s while their
nodes answered), and a needless restart costs the node a session while it is busiest.

The progress period follows the ranks, not the nodes: the supervisor reads one answer per rank
per period (at 64 x 8 ranks every 10 s that is 4.5 % of one core on the test machine:
docs/performance.md), so the period keeps those answers to at most 25.6 a second (128 ranks every
5 s, the period's value there since 2026-11-30) and a smaller cluster gets its hang and straggler
verdicts sooner: a stall is seen at the next request. Not below 2 s: a hang is named once the
others waited 3 s inside the collective (runs/judge/hangrule.py WAIT_S), which a shorter period
does not shorten, while every rank's hook answers each request (a Flight Recorder read, ~3 ms,
where the script tells no steps).

Doublings count from 64 nodes (log2(nodes / 64), so 128 nodes is one, 256 two, fractions between).
A setting the user gave (a flag, or the inventory's train: value) is kept as given: `derive`
returns the rule's values and `resolve` lays the given ones over them, naming where each came from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from orchestrator.runs.judge.straggler import PERIOD_S
from orchestrator.torchrun import RDZV_TIMEOUT_S, dist_timeout_s

BASE_NODES = 64  # the largest cluster the hand-tuned values were written for (8 x 8 GPUs and beyond)
STREAM_STALL_S = 30.0  # a log stream's stall up to BASE_NODES (runs/logs/streams.py)
ANSWERS_PER_S = 128 / (PERIOD_S / 2)  # the rank answers a second the progress period allows (128 ranks every 5 s)
PROGRESS_MIN_S = 2.0  # the shortest progress period (PERIOD_S the longest)


@dataclass(frozen=True)
class Scaled:
    """The derived values for one cluster (seconds, except fanout)."""

    collective_timeout: int
    fanout: int
    lost_timeout: float
    suspect_s: float
    probe_s: float
    snapshot_wait: float
    hang_timeout: float
    rendezvous_timeout: int
    stream_stall: float
    progress_s: float


WHAT = {  # the words `train --dry-run` prints for each setting, and the flag or inventory key that sets it
    "collective_timeout": ("collective timeout", "inventory env NCCL_TIMEOUT"),
    "fanout": ("fan-out", "--fanout"),
    "lost_timeout": ("lost timeout", "--lost-timeout"),
    "suspect_s": ("suspect after", "-"),
    "probe_s": ("probe timeout", "-"),
    "snapshot_wait": ("snapshot wait", "-"),
    "hang_timeout": ("hang timeout", "--hang-timeout, train.hang_timeout"),
    "rendezvous_timeout": ("rendezvous timeout", "--rendezvous-timeout, inventory env PET_RDZV_CONF"),
    "stream_stall": ("stream stall", "-"),
    "progress_s": ("progress period", "-"),
}


def doublings(nodes: int) -> float:
    """How many times the cluster doubled past BASE_NODES (0 at or below it)."""
    return max(0.0, math.log2(max(nodes, 1) / BASE_NODES))


def derive(nodes: int, ranks: int) -> Scaled:
    """The rule's values for `nodes` nodes running `ranks` ranks in all."""
    d = doublings(nodes)
    per_node = ranks / max(nodes, 1)
    return Scaled(
        collective_timeout=dist_timeout_s(nodes),
        fanout=min(max(nodes, 64), 256),
        lost_timeout=round(30.0 + 30.0 * d, 1),
        suspect_s=round(2.0 + 1.0 * d, 1),
        probe_s=round(1.0 + 0.5 * d, 1),
        snapshot_wait=round((10.0 + 5.0 * d) * max(1.0, per_node / 8), 1),
        hang_timeout=round(300.0 + 60.0 * d, 1),
        rendezvous_timeout=round(RDZV_TIMEOUT_S + 300 * d),
        stream_stall=round(STREAM_STALL_S + 30.0 * d, 1),
        progress_s=round(min(PERIOD_S, max(PROGRESS_MIN_S, ranks / ANSWERS_PER_S)), 1),
    )


def resolve(nodes: int, ranks: int, given: dict[str, float | int]) -> tuple[Scaled, dict[str, str]]:
    """The rule's values with the user's given ones laid over them (`given`: setting -> value, for
    the settings a flag or the inventory set), and where each came from: "derived" or "given"."""
    known = {f.name for f in dataclasses.fields(Scaled)}
    unknown = set(given) - known
    if unknown:
        raise ValueError(f"not a scaled setting: {', '.join(sorted(unknown))}")
    values = dataclasses.replace(derive(nodes, ranks), **given)
    return values, {k: "given" if k in given else "derived" for k in sorted(known)}


def lines(values: Scaled, source: dict[str, str]) -> list[str]:
    """`train --dry-run`'s lines for the settings, one each: name, value, where it came from."""
    out = []
    for key, (name, how) in WHAT.items():
        v = getattr(values, key)
        shown = f"{v}" if key == "fanout" else f"{v:g} s"
        came = "given" if source.get(key) == "given" else f"derived{f' (set with {how})' if how != '-' else ''}"
        out.append(f"  {name:<19}{shown:>10}  {came}")
    return out


def record_doc(spec) -> dict:
    """The run record's `scaling` (runs/record.py Book.scaled): the node and rank counts train
    derived from, where each setting came from, and the values the run uses (its RunSpec's; the
    collective timeout as train resolved it, since the nodes' environment carries it)."""
    doc = dict(spec.scaling)
    doc["values"] = {**doc.get("values", {}), "fanout": spec.fanout, "lost_timeout": spec.lost_timeout,
                     "suspect_s": spec.suspect_s, "probe_s": spec.probe_s, "snapshot_wait": spec.snapshot_wait,
                     "hang_timeout": spec.hang_timeout, "rendezvous_timeout": spec.rendezvous_timeout,
                     "stream_stall": spec.stream_stall, "progress_s": spec.progress_s}
    return doc

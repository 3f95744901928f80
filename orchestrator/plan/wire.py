"""Bytes on the wire: what one gradient sync sends per rank, and how long a link takes for it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.plan.model import ModelSpec, param_count, param_shapes

HOOKS = ("none", "fp16", "bf16", "powersgd")


def _powersgd_compressed(n: int, mm: int, rank: int, min_rate: float = 2.0) -> bool:
    # torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook._should_compress
    return n * mm >= (n + mm) * rank * min_rate


def sync_bytes(m: ModelSpec, hook: str = "none", powersgd_rank: int = 4) -> int:
    """Bytes of gradient one all-reduce carries (S) for one optimizer step."""
    if hook not in HOOKS:
        raise ValueError(f"unknown comm hook {hook!r} (one of {', '.join(HOOKS)})")
    if hook == "none":
        return 4 * param_count(m)
    if hook in ("fp16", "bf16"):
        return 2 * param_count(m)
    if powersgd_rank < 1:
        raise ValueError(f"powersgd rank must be >= 1, got {powersgd_rank}")
    values = 0
    for _, shape in param_shapes(m):
        if len(shape) == 2 and _powersgd_compressed(*shape, powersgd_rank):
            values += (shape[0] + shape[1]) * powersgd_rank
        else:
            values += math.prod(shape)
    return 4 * values


@dataclass(frozen=True)
class Link:
    bandwidth_bps: float  # bits per second
    latency_s: float = 50e-6  # one way, per message step
    efficiency: float = 1.0  # goodput / bandwidth_bps

    @property
    def goodput_bps(self) -> float:
        return self.bandwidth_bps * self.efficiency


# TCP payload per Ethernet frame at MTU 1500: 1448 B (1500 - 20 IP - 32 TCP with timestamps) of 1538 B
# on the wire (+14 header, 4 FCS, 8 preamble, 12 gap) = 0.94 -> 941 Mbit/s on 1 Gbit/s.  Checked: a tc
# 1gbit link between namespaces, gloo all-reduce of tiny's 60.3 MB fp16 gradient over 2 nodes took 0.58 s
# in one run and 0.517 s in bench/bench_plan_wire.py; this predicts 0.513 s (-12 %, -1 %), line rate 0.482.
NOMINAL_EFFICIENCY = 0.94
MEASURED_EFFICIENCY = 1.0  # netbench measures goodput already


def wire_seconds(nbytes: float, link: Link, steps: int) -> float:
    """alpha-beta: `steps` message latencies plus `nbytes` at the link's goodput."""
    return steps * link.latency_s + nbytes * 8 / link.goodput_bps


def predict_sync_seconds(tensor_bytes: float, link: Link, algorithm: str = "ring", nodes: int = 2,
                         gpus_per_node: int = 1, intra: Link | None = None) -> float:
    """Seconds to all-reduce a `tensor_bytes` tensor across `nodes` x `gpus_per_node` ranks over
    `link` -- the function a measured (bandwidth, latency) pair feeds straight into, e.g.
    `predict_sync_seconds(60_285_696, Link(946e6, 25e-6, 1.0), "ring", 2)` -> 0.510 s."""
    return sync_seconds(traffic(tensor_bytes, nodes, gpus_per_node, algorithm), link, intra, gpus_per_node)


@dataclass(frozen=True)
class Traffic:
    algo: str
    inter_bytes: float  # bytes each GPU sends over the inter-node link per sync
    inter_steps: int
    intra_bytes: float = 0.0
    intra_steps: int = 0


def ring_bytes(S: float, n: int) -> float:
    return 2 * (n - 1) / n * S if n > 1 else 0.0


def traffic(S: float, nodes: int, gpus_per_node: int = 1, algo: str = "auto") -> Traffic:
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("nodes and GPUs per node must be >= 1")
    g, world = gpus_per_node, nodes * gpus_per_node
    if algo == "auto":
        algo = "hierarchical" if g > 1 and nodes > 1 else "ring"
    if algo == "ring":
        return Traffic("ring", ring_bytes(S, world), 2 * (world - 1))
    if algo == "tree":
        return Traffic("tree", 2.0 * S if world > 1 else 0.0, 2 * math.ceil(math.log2(world)) if world > 1 else 0)
    if algo == "hierarchical":
        return Traffic("hierarchical", ring_bytes(S / g, nodes), 2 * (nodes - 1),
                       ring_bytes(S, g), 2 * (g - 1))
    raise ValueError(f"unknown algorithm {algo!r} (ring, tree, hierarchical, auto)")


def sync_seconds(t: Traffic, link: Link, intra: Link | None = None, gpus_per_node: int = 1) -> float:
    """Seconds of one sync.  Flat ring/tree with G GPUs per node: the G GPUs of a node share its NIC
    (the ring crosses each node boundary once, so the node's NIC carries one GPU's share)."""
    s = wire_seconds(t.inter_bytes, link, t.inter_steps)
    if t.algo == "hierarchical":
        # all G GPUs' shards cross the node's NIC together
        s = wire_seconds(t.inter_bytes * gpus_per_node, link, t.inter_steps)
        if t.intra_bytes:
            s += wire_seconds(t.intra_bytes, intra or Link(300e9 * 8, 5e-6), t.intra_steps)
    return s



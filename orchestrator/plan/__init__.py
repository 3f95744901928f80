"""The bandwidth planner behind `clusterctl plan`: pure arithmetic, no torch, no I/O.

Model: GPT-2 (tied LM head).  Parameters are counted in closed form and checked against
`GPT2LMHeadModel` in tests/test_plan.py.  Per optimizer step a data-parallel job does `accum`
micro-steps of compute and one gradient sync; the planner predicts the sync's seconds from the
bytes each rank sends and a link (bandwidth, latency, efficiency), then the share of time spent
communicating and the speed-up over one GPU.  Conventions (see docs/plan.md):

* bytes per sync ("S") by what is sent: `none` -> fp32 grads, 4 B/param (DDP all-reduces
  grads in the parameter dtype, fp32, even under fp16/bf16 autocast); `fp16`/`bf16` comm hook ->
  2 B/param; `powersgd` rank r -> per 2-D matrix n x m, (n+m)*r fp32 values (P and Q), matrices
  too small to gain `min_compression_rate` (2, torch's default) and 1-D tensors uncompressed fp32.
* bytes each rank sends: ring 2(N-1)/N * S (N ranks), tree 2 * S (reduce up + broadcast down,
  pipelined), hierarchical (GPUs per node G > 1): intra-node reduce-scatter + all-gather,
  2(G-1)/G * S over the intra-node link, and an inter-node ring over the N nodes on each GPU's
  1/G shard: 2(N-1)/N * S/G per GPU (G GPUs of a node share its NIC, so the node sends
  2(N-1)/N * S).
* seconds = steps * latency + bytes * 8 / (bandwidth * efficiency); ring steps = 2(N-1), tree
  2*ceil(log2 N), hierarchical 2(G-1) + 2(N-1).  Efficiency 0.94 for a nominal line rate
  (TCP goodput is about 941 Mbit/s of 1 Gbit/s), 1.0 for a link measured by `clusterctl netbench`
  (already goodput).
* comm share = sync / (accum * step + sync): no overlap, the seed's (conservative) convention;
  with overlap=True the last micro-step's backward (2/3 of a step) hides part of the sync,
  as DDP's bucketed all-reduce does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from orchestrator.plan.model import (  # noqa: F401 - the planner's public names
    OVERRIDE_FIELDS,
    PRESETS,
    ModelSpec,
    flops_per_token,
    model_spec,
    override,
    param_count,
    param_shapes,
    spec_from_config,
)
from orchestrator.plan.units import fmt_bps, parse_bandwidth, parse_latency  # noqa: F401 - the planner's public names
from orchestrator.plan.wire import (  # noqa: F401 - the planner's public names
    HOOKS,
    MEASURED_EFFICIENCY,
    NOMINAL_EFFICIENCY,
    Link,
    Traffic,
    predict_sync_seconds,
    ring_bytes,
    sync_bytes,
    sync_seconds,
    traffic,
    wire_seconds,
)

# --------------------------------------------------------------------------- time

OVERLAP_FRACTION = 2 / 3  # backward share of a micro-step, which DDP overlaps with the all-reduce
SEED_STEP_TIME_S = 1.0  # the design documents' compute time per micro-step, the default when none is measured


def compute_seconds(m: ModelSpec, *, step_time: float | None = None, peak_tflops: float | None = None,
                    mfu: float | None = None, tokens_per_micro_step: int | None = None,
                    seq_len: int | None = None) -> float:
    """Compute seconds per micro-step per GPU: given, or FLOPs / (peak * MFU)."""
    if step_time is not None:
        if step_time <= 0:
            raise ValueError("step time must be > 0")
        return step_time
    if peak_tflops is not None:
        mfu = 0.4 if mfu is None else mfu
        if peak_tflops <= 0 or not 0 < mfu <= 1:
            raise ValueError("peak TFLOP/s must be > 0 and MFU in (0, 1]")
        tokens = tokens_per_micro_step or m.n_positions
        return flops_per_token(m, seq_len) * tokens / (peak_tflops * 1e12 * mfu)
    return SEED_STEP_TIME_S


def comm_share(sync_s: float, step_s: float, accum: int, overlap: bool = False) -> float:
    exposed = exposed_sync(sync_s, step_s, overlap)
    return exposed / (accum * step_s + exposed)


def exposed_sync(sync_s: float, step_s: float, overlap: bool = False) -> float:
    return max(0.0, sync_s - OVERLAP_FRACTION * step_s) if overlap else sync_s


def speedup(sync_s: float, step_s: float, accum: int, world: int, overlap: bool = False) -> float:
    """Throughput vs one GPU doing the same micro-steps: world * accum*step / (accum*step + sync)."""
    return world * accum * step_s / (accum * step_s + exposed_sync(sync_s, step_s, overlap))


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    model: dict
    params: int
    nodes: int
    gpus_per_node: int
    hook: str
    powersgd_rank: int
    sync_bytes: int
    algo: str
    bytes_per_rank: float
    step_s: float
    overlap: bool
    target_share: float
    accums: list[int]
    links: list[dict]  # {"label","bandwidth_bps","latency_s","efficiency","sync_s","rows":[...]}
    recommendation: dict

    def to_json(self) -> dict:
        return asdict(self)


def _rows(sync_s, step_s, accums, world, overlap):
    return [{"accum": a, "sync_s": sync_s, "comm_share": comm_share(sync_s, step_s, a, overlap),
             "speedup": speedup(sync_s, step_s, a, world, overlap)} for a in accums]


def make_plan(m: ModelSpec, *, nodes: int, gpus_per_node: int = 1, hook: str = "none",
              powersgd_rank: int = 4, accums=(1, 2, 4, 8, 16, 32), links: list[tuple[str, Link]],
              step_s: float = SEED_STEP_TIME_S, intra: Link | None = None, algo: str = "auto",
              overlap: bool = False, target_share: float = 0.2) -> Plan:
    world = nodes * gpus_per_node
    S = sync_bytes(m, hook, powersgd_rank)
    t = traffic(S, nodes, gpus_per_node, algo)
    out_links = []
    for label, link in links:
        s = sync_seconds(t, link, intra, gpus_per_node)
        out_links.append({"label": label, "bandwidth_bps": link.bandwidth_bps, "latency_s": link.latency_s,
                          "efficiency": link.efficiency, "sync_s": s,
                          "rows": _rows(s, step_s, accums, world, overlap)})
    rec = recommend(m, nodes=nodes, gpus_per_node=gpus_per_node, hook=hook, powersgd_rank=powersgd_rank,
                    accums=accums, links=links, step_s=step_s, intra=intra, algo=algo, overlap=overlap,
                    target_share=target_share)
    return Plan(asdict(m), param_count(m), nodes, gpus_per_node, hook, powersgd_rank, S, t.algo,
                t.inter_bytes, step_s, overlap, target_share, list(accums), out_links, rec)


def recommend(m: ModelSpec, *, nodes, gpus_per_node, hook, powersgd_rank, accums, links, step_s,
              intra=None, algo="auto", overlap=False, target_share=0.2) -> dict:
    """Per link: the smallest accumulation whose comm share is under the target; where none is,
    the first comm hook (fp16, then PowerSGD rank 4) that gets there at some listed accumulation."""
    per_link = []
    for label, link in links:
        entry = {"label": label, "accum": None, "hook": hook, "comm_share": None}
        order = [hook] + [h for h in ("fp16", "powersgd") if h != hook and HOOKS.index(h) > HOOKS.index(hook)]
        for h in order:
            r = powersgd_rank if h == hook else 4
            S = sync_bytes(m, h, r)
            t = traffic(S, nodes, gpus_per_node, algo)
            s = sync_seconds(t, link, intra, gpus_per_node)
            hit = next((a for a in sorted(accums) if comm_share(s, step_s, a, overlap) <= target_share), None)
            if hit is not None:
                entry.update(accum=hit, hook=h, powersgd_rank=r if h == "powersgd" else None,
                             comm_share=comm_share(s, step_s, hit, overlap))
                break
        if entry["accum"] is None:
            entry["text"] = (f"{label}: no listed accumulation keeps comm under {target_share:.0%}, "
                             f"even with a compressing hook; more accumulation or a faster link")
        else:
            how = "" if entry["hook"] == hook else (
                f" with --comm-hook {entry['hook']}" + (f" (rank {entry['powersgd_rank']})"
                                                        if entry["hook"] == "powersgd" else ""))
            entry["text"] = (f"{label}: accumulate {entry['accum']} step(s){how} "
                             f"-> comm {entry['comm_share']:.1%} (target {target_share:.0%})")
        per_link.append(entry)
    return {"target_share": target_share, "per_link": per_link}


# --------------------------------------------------------------------------- the seed's numbers

SEED = {
    "params": 50_300_000,  # tied head counted twice
    "bytes_fp32": 201.2e6,
    "bytes_fp16": 100.6e6,
    "allreduce_factor": 2.0,  # "2 x gradient size" for two nodes (ring is 2(N-1)/N = 1)
    "goodput_Bps": 100e6,  # 1 Gbps taken as 100 MB/s
    "sync_s_fp16": {"1gbit": 2.0, "10gbit": 0.2, "100gbit": 0.02},  # its bandwidth table
    "comm_share_fp16_1gbit": {1: 0.67, 2: 0.50, 4: 0.33, 8: 0.20, 16: 0.11},
    "comm_share_accum8": {"1gbit": 0.20, "10gbit": 0.024, "100gbit": 0.0025},
    "step_time_s": 1.0,
}

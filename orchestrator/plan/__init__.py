"""The bandwidth planner behind `clusterctl plan` (issue 6): pure arithmetic, no torch, no I/O.

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

import math
from dataclasses import asdict, dataclass, fields, replace

# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    vocab_size: int
    n_inner: int | None = None  # MLP width; None = 4 * n_embd (GPT2Config's default)
    tied: bool = True  # LM head shares the token embedding (GPT-2)
    pad_vocab_to: int = 1  # round vocab up to a multiple of this (e.g. 64 -> 50304)

    @property
    def vocab(self) -> int:
        m = max(1, self.pad_vocab_to)
        return -(-self.vocab_size // m) * m

    @property
    def inner(self) -> int:
        return self.n_inner or 4 * self.n_embd

    def validate(self) -> "ModelSpec":
        for f in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.n_inner is not None and self.n_inner < 1:
            raise ValueError(f"n_inner must be >= 1, got {self.n_inner}")
        return self


def _presets() -> dict[str, ModelSpec]:
    out = {
        "nano": ModelSpec(2, 64, 2, 64, 256),
        "tiny": ModelSpec(6, 384, 6, 512, 50257),
        "small": ModelSpec(12, 768, 12, 1024, 50257),
        "medium": ModelSpec(24, 1024, 16, 1024, 50257),
    }
    try:  # the trainer's presets win (trainer/config.py: name -> Preset(n_layer, n_embd, ...));
        # config.py is torch-free, so this keeps `clusterctl plan` fast
        from trainer.config import PRESETS as _trainer_presets  # type: ignore

        for name, p in _trainer_presets.items():
            out[name] = ModelSpec(p.n_layer, p.n_embd, p.n_head, p.block_size, p.vocab_size)
    except Exception:  # noqa: BLE001 - no trainer in this checkout, or another shape: use ours
        pass
    return out


PRESETS = _presets()
OVERRIDE_FIELDS = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "n_inner", "pad_vocab_to")


def model_spec(preset: str = "tiny", **overrides) -> ModelSpec:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    return override(PRESETS[preset], **overrides)


def override(m: ModelSpec, **overrides) -> ModelSpec:
    """`m` with the given fields replaced (None = keep), validated."""
    over = {k: v for k, v in overrides.items() if v is not None}
    bad = set(over) - {f.name for f in fields(ModelSpec)}
    if bad:
        raise ValueError(f"unknown model field(s): {', '.join(sorted(bad))}")
    return replace(m, **over).validate()


# config.json / trainer-config spellings of each ModelSpec field (GPT2Config, generic HF, trainer.config)
_CONFIG_KEYS = {
    "n_layer": ("n_layer", "num_hidden_layers"),
    "n_embd": ("n_embd", "hidden_size", "d_model"),
    "n_head": ("n_head", "num_attention_heads"),
    "n_positions": ("n_positions", "max_position_embeddings", "block_size", "n_ctx"),
    "vocab_size": ("vocab_size",),
    "n_inner": ("n_inner", "intermediate_size"),
}


def spec_from_config(doc: dict, base: str = "tiny") -> ModelSpec:
    """A GPT-2 config.json (GPT2Config.to_dict), or the trainer's saved config, -> ModelSpec.
    Fields it lacks come from preset `base`; a non-GPT-2 model_type is refused (the count would lie)."""
    if not isinstance(doc, dict):
        raise ValueError("a model config must be a JSON object")
    kind = doc.get("model_type")
    if kind not in (None, "gpt2"):
        raise ValueError(f"model_type {kind!r} is not GPT-2; plan counts GPT-2 parameters only")
    over: dict = {}
    for field, keys in _CONFIG_KEYS.items():
        for k in keys:
            if doc.get(k) is not None:
                try:
                    over[field] = int(doc[k])
                except (TypeError, ValueError):
                    raise ValueError(f"config field {k} = {doc[k]!r} is not an integer") from None
                break
    if "tie_word_embeddings" in doc:
        over["tied"] = bool(doc["tie_word_embeddings"])
    if doc.get("pad_vocab") is True:  # trainer: vocab rounded up to a multiple of 64
        over["pad_vocab_to"] = 64
    if not {"n_layer", "n_embd"} <= set(over):
        raise ValueError("the config names neither n_layer/num_hidden_layers nor n_embd/hidden_size")
    return model_spec(base, **over)


def param_shapes(m: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of GPT2LMHeadModel, in module order (Conv1D weights are (in, out))."""
    d, h = m.n_embd, m.inner
    shapes = [("wte", (m.vocab, d)), ("wpe", (m.n_positions, d))]
    for i in range(m.n_layer):
        p = f"h.{i}."
        shapes += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (d, h)), (p + "mlp.c_fc.bias", (h,)),
                   (p + "mlp.c_proj.weight", (h, d)), (p + "mlp.c_proj.bias", (d,))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    if not m.tied:
        shapes.append(("lm_head", (m.vocab, d)))
    return shapes


def param_count(m: ModelSpec) -> int:
    """Closed form: V*d + T*d + L*(4*d*h + 2*h... ) -- i.e. L*(12 d^2 + 13 d) when h = 4d."""
    d, h, L = m.n_embd, m.inner, m.n_layer
    per_layer = (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d) + 4 * d
    n = m.vocab * d + m.n_positions * d + L * per_layer + 2 * d
    return n + (m.vocab * d if not m.tied else 0)


def flops_per_token(m: ModelSpec, seq: int | None = None) -> float:
    """Training FLOPs per token: 6N + 12*L*H*Q*T (Q = head dim, H*Q = n_embd, T = sequence)."""
    return 6 * param_count(m) + 12 * m.n_layer * m.n_embd * (seq or m.n_positions)


# --------------------------------------------------------------------------- bytes

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
# (issue 6) and 0.517 s (bench/bench_plan_wire.py); this predicts 0.513 s (-12 %, -1 %), line rate 0.482.
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


# --------------------------------------------------------------------------- time

OVERLAP_FRACTION = 2 / 3  # backward share of a micro-step, which DDP overlaps with the all-reduce
SEED_STEP_TIME_S = 1.0  # seed 001's compute time per micro-step ("计算时间: 1秒/步")


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


# --------------------------------------------------------------------------- units

_SI = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_bandwidth(text: str) -> float:
    """A rate -> bits per second.  Bits: 1gbit, 100mbit, 25Gbps, 10Gb/s, 955Mbit/s, 1e9 (bare = bit/s).
    Bytes: 1.2GB/s, 125MB/s, 100MBps, 1GiB/s (capital B, or 'byte').  Note: tc reads 'gbps' as
    bytes; here 'bps' is bits, the networking convention."""
    import re

    raw = text.strip()
    mt = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?\s*"
                      r"(bits?|bit/s|bps|b/s|b|B|B/s|Bps|bytes?|bytes?/s)?", raw)
    if not mt or (mt.group(2) and not mt.group(3)):
        raise ValueError(f"{text!r} is not a bandwidth like 1gbit, 25Gbps, 100mbit or 1.2GB/s")
    value = float(mt.group(1))
    prefix = (mt.group(2) or "").lower()
    unit = mt.group(3) or "bit"
    byte = unit.startswith("B") or unit.startswith("byte")
    bps = value * _SI[prefix] * (8 if byte else 1)
    if bps <= 0:
        raise ValueError(f"{text!r}: bandwidth must be > 0")
    return bps


def parse_latency(text: str) -> float:
    import re

    mt = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)?", text.strip())
    if not mt:
        raise ValueError(f"{text!r} is not a latency like 50us, 0.2ms or 0.001s")
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[mt.group(2)]
    return float(mt.group(1)) * scale


def fmt_bps(bps: float) -> str:
    for div, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= div:
            v = bps / div
            return f"{v:.3g} {unit}"
    return f"{bps:.0f} bit/s"


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

"""Print the markdown tables of docs/plan.md: seed 001's numbers beside the corrected model's,
and the wire check (predicted vs measured all-reduce on the shaped test cluster).

    .venv/bin/python bench/plan_seed_table.py [--wire plan_wire.json]

--wire reads bench/bench_plan_wire.py --out; without it, the figures recorded below (the run
that docs/plan.md quotes) are printed.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator import plan as P  # noqa: E402

ISSUE_MEASURED_S = 0.58  # issue 6 / seeds README: 2 namespaces, tc tbf 1gbit, gloo, 60.3 MB fp16
RATES = [("1 Gbps", 1e9, "1gbit"), ("10 Gbps", 10e9, "10gbit"), ("100 Gbps", 100e9, "100gbit")]
ACCUMS = [1, 4, 8, 16]

# bench/bench_plan_wire.py, 4-namespace test cluster, tc tbf on every node's link, gloo, median of 3 (1gbit)
# or 2 (100mbit) timed all-reduces after a warm-up.
# (nodes, rate, grads, MB, netbench Mbit/s, predicted s, measured s)
RECORDED_WIRE = [
    (2, "1gbit", "fp16", 60.3, 946, 0.510, 0.517),
    (2, "1gbit", "fp32", 120.6, 946, 1.020, 1.017),
    (4, "1gbit", "fp16", 60.3, 945, 0.765, 0.771),
    (4, "1gbit", "fp32", 120.6, 945, 1.531, 1.563),
    (2, "100mbit", "fp16", 60.3, 97, 4.978, 5.055),
    (2, "100mbit", "fp32", 120.6, 97, 9.957, 10.158),
    (4, "100mbit", "fp16", 60.3, 97, 7.469, 7.855),
    (4, "100mbit", "fp32", 120.6, 97, 14.938, 15.795),
]


def seed_table() -> list[str]:
    m = P.model_spec("tiny")
    S16 = P.sync_bytes(m, "fp16")
    S32 = P.sync_bytes(m, "none")
    step = P.SEED["step_time_s"]
    out = ["### Seed 001 vs the corrected model (GPT-2 tiny, 2 nodes x 1 GPU, ring all-reduce)", "",
           f"Compute per micro-step: {step:g} s (the seed's assumption). Corrected seconds use the nominal "
           f"rate x {P.NOMINAL_EFFICIENCY} (TCP goodput) and 2(N-1) = 2 latency steps of 50 µs.", "",
           "| quantity | seed 001 | corrected |", "|---|---:|---:|",
           f"| parameters | 50.3 M (tied head counted twice) | {P.param_count(m):,} |",
           f"| fp32 gradient S | 201.2 MB | {S32 / 1e6:.1f} MB |",
           f"| fp16 gradient S | 100.6 MB | {S16 / 1e6:.1f} MB |",
           f"| bytes sent per rank per all-reduce, fp16 (ring 2(N-1)/N x S) | 201.2 MB (2 x S) | "
           f"{P.ring_bytes(S16, 2) / 1e6:.1f} MB (1 x S) |",
           f"| bytes sent per rank per all-reduce, fp32 | 402.4 MB | {P.ring_bytes(S32, 2) / 1e6:.1f} MB |"]
    link_s = {}
    for label, bps, key in RATES:
        lk = P.Link(bps, 50e-6, P.NOMINAL_EFFICIENCY)
        for name, S in (("fp16", S16), ("fp32", S32)):
            link_s[(key, name)] = P.sync_seconds(P.traffic(S, 2), lk)
    seed_s = P.SEED["sync_s_fp16"]
    for label, bps, key in RATES:
        out.append(f"| seconds per sync, fp16, {label} | {seed_s[key]:g} s | {link_s[(key, 'fp16')]:.3g} s |")
    out.append(f"| measured: gloo all-reduce of the fp16 gradient, 2 namespaces, tc 1gbit (issue 6) | "
               f"0.58 s (seed predicts {seed_s['1gbit']:g} s, +{seed_s['1gbit'] / ISSUE_MEASURED_S - 1:.0%}) | "
               f"0.58 s (predicted {link_s[('1gbit', 'fp16')]:.3g} s, "
               f"{link_s[('1gbit', 'fp16')] / ISSUE_MEASURED_S - 1:+.0%}) |")
    for label, bps, key in RATES:
        seed32 = 2 * seed_s[key]
        note = "" if key == "1gbit" else " (its formula)"
        out.append(f"| seconds per sync, fp32, {label} | {seed32:g} s{note} | {link_s[(key, 'fp32')]:.3g} s |")
    out += ["", "Comm share (sync / (accum x step + sync), no overlap) and speed-up vs one GPU, fp16 hook:", "",
            "| accumulation | seed, 1 Gbps | 1 Gbps | 10 Gbps | 100 Gbps |", "|---:|---:|---:|---:|---:|"]
    seed_share = P.SEED["comm_share_fp16_1gbit"]
    for a in ACCUMS:
        cells = []
        for label, bps, key in RATES:
            s = link_s[(key, "fp16")]
            cells.append(f"{P.comm_share(s, step, a):.1%} (x{P.speedup(s, step, a, 2):.2f})")
        out.append(f"| {a} | {seed_share[a]:.0%} | " + " | ".join(cells) + " |")
    out += ["", "Seed's bandwidth table at 8-step accumulation: "
            + ", ".join(f"{label} {P.SEED['comm_share_accum8'][key]:.2%}" for label, _, key in RATES)
            + "; corrected: "
            + ", ".join(f"{label} {P.comm_share(link_s[(key, 'fp16')], step, 8):.2%}" for label, _, key in RATES)
            + ".", "",
            "fp32 gradients (DDP without a comm hook sends fp32 even under fp16 autocast), comm share:", "",
            "| accumulation | 1 Gbps | 10 Gbps | 100 Gbps |", "|---:|---:|---:|---:|"]
    for a in ACCUMS:
        out.append(f"| {a} | " + " | ".join(f"{P.comm_share(link_s[(k, 'fp32')], step, a):.1%}"
                                           for _, _, k in RATES) + " |")
    lk = P.Link(1e9, 50e-6, P.NOMINAL_EFFICIENCY)
    out += ["", "What each `--comm-hook` sends for tiny (S per sync; 2 nodes, 1 Gbps, 1 s micro-step):", "",
            "| comm hook | S | fp32 S / S | seconds per sync | comm share, accum 1 | accum 8 |",
            "|---|---:|---:|---:|---:|---:|"]
    for hook, r in (("none (fp32 grads)", None), ("fp16 / bf16", None), ("powersgd rank 4", 4),
                    ("powersgd rank 1", 1)):
        h = hook.split()[0]
        S = P.sync_bytes(m, h, r or 4)
        sec = P.predict_sync_seconds(S, lk, "ring", 2)
        out.append(f"| {hook} | {S / 1e6:.2f} MB | {S32 / S:.0f} | {sec:.3g} s | "
                   f"{P.comm_share(sec, step, 1):.1%} | {P.comm_share(sec, step, 8):.2%} |")
    return out


def seed_claim(dtype, rate):
    nbytes = P.SEED["bytes_fp16" if dtype == "fp16" else "bytes_fp32"] * P.SEED["allreduce_factor"]
    return nbytes / (P.SEED["goodput_Bps"] * {"1gbit": 1e9, "100mbit": 1e8}[rate] / 1e9)


def wire_table(path: str | None) -> list[str]:
    if path:
        rows = [(r["nodes"], r["rate"], r["dtype"], r["bytes"] / 1e6, r["link_bps"] / 1e6, r["predicted_s"],
                 r["measured_s"]) for r in json.loads(Path(path).read_text())["rows"]]
    else:
        rows = RECORDED_WIRE
    out = ["### Checked against a real wire", "",
           "`plan --link` (the netbench-measured link, efficiency 1.0) vs a measured gloo all-reduce "
           "(bench/bench_plan_wire.py):", "",
           "| nodes | tc rate | grads | MB | netbench link | predicted s | measured s | error | seed's claim s |",
           "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for n, rate, dt, mb, mbit, pred, meas in rows:
        out.append(f"| {n} | {rate} | {dt} | {mb:.1f} | {mbit:.0f} Mbit/s | {pred:.3f} | {meas:.3f} | "
                   f"{(pred - meas) / meas:+.1%} | {seed_claim(dt, rate):.2f} |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wire", help="bench/bench_plan_wire.py --out JSON")
    args = ap.parse_args(argv)
    print("\n".join(seed_table() + [""] + wire_table(args.wire)))


if __name__ == "__main__":
    main()

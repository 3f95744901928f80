"""`clusterctl plan` against a real wire: predicted vs measured all-reduce seconds (issue 6).

    sudo .venv/bin/python bench/bench_plan_wire.py [--out plan_wire.json] [--full]

A 4-node test cluster (network namespaces + sshd), every node's link shaped with `tc tbf` to
1gbit, then 100mbit.  For 2 and 4 nodes at each rate: `netbench`'s measure_links gives the link
(slowest direction of the slowest master<->worker link, half the median RTT); that link is saved
exactly as `clusterctl netbench --save` does and fed to `clusterctl plan --link FILE --json`, whose
seconds per sync is the prediction; measure_allreduce times a real gloo all-reduce of GPT-2 tiny's
gradient (fp16 hook: 60.3 MB; fp32: 120.6 MB) across the nodes.  Agreement: within +-20 %.
The seed's claim is its own formula: 2 x (its 50.3 M params x bytes) / (100 MB/s per Gbit/s).

All eight cases take about 3.5 minutes; --quick skips the slowest (100mbit, fp32, 4 nodes: ~15 s
per all-reduce, ~1 minute) for a ~2 minute run.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from click.testing import CliRunner  # noqa: E402

from orchestrator import plan as P  # noqa: E402
from orchestrator.inventory import load_inventory  # noqa: E402
from orchestrator.netbench import NetReport, measure_allreduce, measure_links  # noqa: E402
from orchestrator.cli.plan import plan_command  # noqa: E402
from orchestrator.transport import Cluster  # noqa: E402
from tests.cluster import TestCluster, require_root  # noqa: E402

TINY = P.model_spec("tiny")
HOOK = {"fp16": "fp16", "fp32": "none"}  # what plan calls the bytes the all-reduce carries
RATE_BPS = {"1gbit": 1e9, "100mbit": 1e8}


def seed_claim(dtype: str, rate: str) -> float:
    nbytes = P.SEED["bytes_fp16" if dtype == "fp16" else "bytes_fp32"] * P.SEED["allreduce_factor"]
    return nbytes / (P.SEED["goodput_Bps"] * RATE_BPS[rate] / 1e9)


def predict(link_json: dict, nodes: int, dtype: str, workdir: Path) -> dict:
    f = workdir / f"link_{nodes}.json"
    f.write_text(json.dumps(link_json))
    r = CliRunner().invoke(plan_command, ["--json", "--preset", "tiny", "--nodes", str(nodes),
                                          "--gpus-per-node", "1", "--comm-hook", HOOK[dtype], "--accum", "1",
                                          "--link", str(f)])
    if r.exit_code != 0:
        raise RuntimeError(f"plan failed: {r.output}")
    return json.loads(r.output)


def run_case(inv, nodes, rate, dtypes, iters, workdir):
    rows = []
    with Cluster(inv) as c:
        if c.unreachable:
            raise RuntimeError(f"unreachable: {list(c.unreachable)}")
        report = NetReport(inv.master.name, measure_links(c, inv, seconds=1.5))
        link = report.to_json()
        for dtype in dtypes:
            plan = predict(link, nodes, dtype, workdir)
            S = plan["sync_bytes"]
            ar = measure_allreduce(c, inv, nbytes=S, iters=iters, dtype=dtype)
            pred, meas = plan["links"][0]["sync_s"], ar.seconds
            assert plan["links"][0]["bandwidth_bps"] == link["bandwidth_bps"]  # plan used the measured link
            rows.append({"nodes": nodes, "rate": rate, "dtype": dtype, "bytes": S,
                         "link_bps": link["bandwidth_bps"], "latency_s": link["latency_s"],
                         "predicted_s": pred, "measured_s": meas, "times": ar.times,
                         "error": (pred - meas) / meas, "seed_s": seed_claim(dtype, rate)})
            r = rows[-1]
            print(f"  {nodes} nodes {rate:>7} {dtype}: link {link['bandwidth_bps'] / 1e6:.0f} Mbit/s, "
                  f"predicted {pred:.3f} s, measured {meas:.3f} s ({r['error']:+.1%}), seed {r['seed_s']:.2f} s",
                  flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="Write the rows as JSON here (bench/plan_seed_table.py --wire reads it).")
    ap.add_argument("--quick", action="store_true", help="Skip 100mbit fp32 at 4 nodes (~1 min less).")
    ap.add_argument("--tolerance", type=float, default=0.2)
    args = ap.parse_args(argv)
    require_root()
    t0 = time.monotonic()
    rows, skipped = [], []
    with TestCluster(4, gpus=0, name_prefix="ccw") as cluster, tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inv_path = cluster.write_inventory(tmp / "nodes.yaml")
        inv4 = load_inventory(str(inv_path))
        for rate in ("1gbit", "100mbit"):
            for node in cluster.nodes:
                node.shape(rate=rate)
            for n in (2, 4):
                inv = inv4.select([x.name for x in inv4.nodes[:n]]) if n < 4 else inv4
                dtypes = ["fp16", "fp32"]
                if rate == "100mbit" and n == 4 and args.quick:
                    dtypes = ["fp16"]
                    skipped.append("4 nodes 100mbit fp32 (--quick)")
                rows += run_case(inv, n, rate, dtypes, 3 if rate == "1gbit" else 2, tmp)
    ok = all(abs(r["error"]) <= args.tolerance for r in rows)
    print()
    print("| nodes | rate | grads | MB | netbench link | predicted s | measured s | error | seed's claim s |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['nodes']} | {r['rate']} | {r['dtype']} | {r['bytes'] / 1e6:.1f} | "
              f"{r['link_bps'] / 1e6:.0f} Mbit/s | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
              f"{r['error']:+.1%} | {r['seed_s']:.2f} |")
    for s in skipped:
        print(f"skipped: {s}")
    print(f"all within ±{args.tolerance:.0%}: {'yes' if ok else 'NO'}   ({time.monotonic() - t0:.0f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "skipped": skipped, "all_ok": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

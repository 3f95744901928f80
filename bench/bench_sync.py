"""`clusterctl sync` (the relay) vs parallel rsync from the control machine, over a slow control link.

    sudo .venv/bin/python bench/bench_sync.py [--nodes 8] [--mb 200] [--mbit 100]

One test cluster of --nodes nodes. The control machine's side of the bridge (the bridge device's
own egress: what this machine sends onto it) is shaped to --mbit with tc tbf; node<->node traffic
is forwarded port to port and stays unshaped, like nodes on a fast switch and a laptop on Wi-Fi.
The tree: a train.py and --mb MB of incompressible data in a gitignored data/ that the
inventory's `sync.include` ships (nanoGPT's layout). In one run, each to a fresh workdir:
  clusterctl   `clusterctl sync --json` (relay), including its probe, prune and code_sync check
  rsync        one `rsync -a -e ssh` per node, all at once (what pdcp or a shell loop does)
Prints both wall times, their ratio, the ideal (size / link rate), clusterctl's time / ideal,
and the bytes that left this machine (tx_bytes of the bridge, before/after).
Targets: >= 4x faster than parallel rsync, within 1.3x of the ideal, bytes out <= 1.1x the tree.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.cluster import TestCluster  # noqa: E402
from tests.cluster import host  # noqa: E402


def tx_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def make_tree(root: Path, mb: int) -> int:
    (root / "data").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / ".gitignore").write_text("data/\n")
    left, i = mb * 1_000_000, 0
    while left > 0:
        n = min(10_000_000, left)
        (root / "data" / f"shard{i:03d}.bin").write_bytes(os.urandom(n))
        left, i = left - n, i + 1
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def measured(dev, fn):
    b0, t0 = tx_bytes(dev), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, tx_bytes(dev) - b0, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--mbit", type=int, default=100)
    args = ap.parse_args(argv)
    with TestCluster(n=args.nodes, gpus=0, name_prefix="ccbs") as cl, tempfile.TemporaryDirectory() as td:
        src = Path(td) / "src"
        tree = make_tree(src, args.mb)
        src.chmod(0o755)
        inv = cl.write_inventory(Path(td) / "nodes.yaml", sync={"include": ["data"]})
        host.run(["tc", "qdisc", "replace", "dev", cl.bridge, "root", "tbf", "rate", f"{args.mbit}mbit",
                  "burst", "256kb", "latency", "200ms"])
        ideal = tree * 8 / (args.mbit * 1e6)

        def clusterctl():
            p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sync", "-i", str(inv), "--src",
                                str(src), "--json"], capture_output=True, text=True)
            doc = json.loads(p.stdout)
            assert p.returncode == 0, (doc, p.stderr[-2000:])
            return doc

        ssh = " ".join(cl.ssh_argv(cl.nodes[0])[:-1])  # without the user@host

        def rsync_all():
            procs = [subprocess.Popen(["rsync", "-a", "-e", ssh, f"{src}/",
                                       f"{cl.user}@{nd.host}:rsync_copy/"], stderr=subprocess.PIPE)
                     for nd in cl.nodes]
            errs = [(p.wait(), p.stderr.read().decode()[-300:]) for p in procs]
            assert all(rc == 0 for rc, _ in errs), errs

        ct, cbytes, doc = measured(cl.bridge, clusterctl)
        rt, rbytes, _ = measured(cl.bridge, rsync_all)
        methods = sorted({n["method"] for n in doc["nodes"]})
        print(f"{args.nodes} nodes, {tree / 1e6:.1f} MB of incompressible files, control link {args.mbit} Mbit/s "
              f"(tbf on {cl.bridge}), node<->node unshaped, {os.cpu_count()} CPUs for everything")
        print(f"  clusterctl sync ({'/'.join(methods)}): {ct:6.1f}s   bytes out {cbytes / 1e6:8.1f} MB "
              f"({cbytes / tree:.2f} x the tree; the tool itself counted {doc['bytes_sent'] / 1e6:.1f} MB)")
        print(f"  parallel rsync:        {rt:6.1f}s   bytes out {rbytes / 1e6:8.1f} MB ({rbytes / tree:.2f} x the tree)")
        print(f"  rsync / clusterctl: {rt / ct:.2f}x (target >= 4)   ideal {tree / 1e6:.0f} MB / {args.mbit} Mbit/s "
              f"= {ideal:.1f}s   clusterctl / ideal: {ct / ideal:.2f} (target <= 1.3)   "
              f"bytes out / tree: {cbytes / tree:.2f} (target <= 1.1)")
        for n in doc["nodes"]:
            print(f"    {n['name']}: {n['method']} {n['bytes'] / 1e6:.1f} MB in {n['seconds']:.1f}s ok={n['ok']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

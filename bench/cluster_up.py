"""Start an N-node test cluster, report start time and memory per node, tear it down.

    sudo .venv/bin/python bench/cluster_up.py 64 [--gpus 8] [--ssh]

Quick sanity for the 64-256-node benchmarks: memory is the processes' PSS (sshd + the
namespace anchor) and the host's MemAvailable drop (which also counts kernel memory for
namespaces, veths and bridge ports).
"""

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.cluster import TestCluster  # noqa: E402


def mem_available():
    return psutil.virtual_memory().available


def pss(pids):
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.Error:
            pass
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=64)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--ssh", action="store_true", help="also time one `hostname` over ssh per node")
    args = ap.parse_args(argv)
    before = mem_available()
    t0 = time.monotonic()
    cluster = TestCluster(n=args.n, gpus=args.gpus, name_prefix="ccb")
    with cluster:
        started = time.monotonic() - t0
        used = before - mem_available()
        procs = pss([p.pid for nd in cluster.nodes for p in (nd.sshd, nd.anchor)])
        print(f"{args.n} nodes up in {started:.2f}s; per node: "
              f"{procs / args.n / 2**20:.1f} MiB PSS (sshd + anchor), "
              f"{used / args.n / 2**20:.1f} MiB of MemAvailable")
        if args.ssh:
            t1 = time.monotonic()
            with ThreadPoolExecutor(64) as pool:
                outs = list(pool.map(lambda nd: subprocess.run(
                    cluster.ssh_argv(nd, "hostname"), capture_output=True, text=True), cluster.nodes))
            bad = [nd.name for nd, out in zip(cluster.nodes, outs) if out.stdout.strip() != nd.name]
            print(f"ssh hostname on all {args.n} nodes (fan-out 64): {time.monotonic() - t1:.2f}s, "
                  f"{len(bad)} wrong: {bad[:5]}")
        t2 = time.monotonic()
    print(f"teardown in {time.monotonic() - t2:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What an open, idle SSH connection costs the control machine, and what each part of it is.

    .venv/bin/python bench/bench_idle_connections.py [--nodes 32] [--window 20] [--repeat 3]

N test nodes (network namespaces with sshd), one `Cluster` connected to all of them the way the
supervisor holds them through a run; this process's CPU (user+sys) is sampled over --window
seconds with nothing running on the connections, per connection and second, in three settings:

  default        as shipped: a ping a second per connection (transport/liveness.py), paramiko's
                 reader polling its socket every IDLE_READ_S (transport/ssh.py)
  paramiko poll  the reader polling every 0.1 s, paramiko's own default (the product before
                 IDLE_READ_S)
  no pings       the pings off (a lost timeout of days): what the connections cost without them

Each setting runs in a fresh process, in turn, --repeat times; medians printed, with the ratio
to the default. The nodes share this machine's cores, so their sshd's answers cost CPU here too,
but not this process's: the figure is the control side's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETTINGS = ("default", "paramiko poll", "no pings")


def one(setting: str, window: float, cluster_json: str) -> float:
    """In this process: connect to the nodes of `cluster_json` and measure; ms of CPU per connection-second."""
    import yaml

    from orchestrator.inventory import parse_inventory
    from orchestrator.transport import Cluster
    from orchestrator.transport import ssh

    inv_doc = json.loads(cluster_json)
    lost = 60.0
    if setting == "paramiko poll":
        ssh.IDLE_READ_S = 0.1
    elif setting == "no pings":
        lost = 1e7  # a ping every lost_timeout / 4 at the soonest: none in the window
        ssh.PING_S = 1e6
    inv = parse_inventory(yaml.safe_dump(inv_doc), "bench")
    with Cluster(inv, lost_timeout=lost) as c:
        assert all(r.ok for r in c.run("true").values())
        time.sleep(2.0)  # the connect's own threads settle
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(window)
        r1, dt = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return 1000 * cpu / dt / len(inv.nodes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--one", nargs=2, metavar=("SETTING", "INVENTORY_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps({"ms": one(args.one[0], args.window, args.one[1])}))
        return
    from tests.cluster import TestCluster

    got: dict[str, list[float]] = {s: [] for s in SETTINGS}
    with TestCluster(n=args.nodes, gpus=1, name_prefix="ccic") as cluster:
        doc = json.dumps(cluster.inventory())
        for _ in range(args.repeat):
            for s in SETTINGS:
                out = subprocess.run([sys.executable, __file__, "--window", str(args.window), "--one", s, doc],
                                     capture_output=True, text=True, timeout=args.window + 120, cwd=REPO)
                if out.returncode != 0:
                    raise SystemExit(f"bench: {s}: {out.stderr[-2000:]}")
                got[s].append(json.loads(out.stdout.splitlines()[-1])["ms"])
                print(f"{s:14} {got[s][-1]:.3f} ms of CPU per connection-second", flush=True)
    base = statistics.median(got["default"])
    print(f"\n{args.nodes} idle connections, {args.window:g} s windows, medians of {args.repeat}:")
    for s in SETTINGS:
        m = statistics.median(got[s])
        print(f"  {s:14} {m:.3f} ms/s per connection ({min(got[s]):.3f}-{max(got[s]):.3f}), "
              f"{m / base:.2f}x the default; at 64 nodes {64 * m / 10:.2f} % of a core")


if __name__ == "__main__":
    main()

"""What a node's scan for a run's processes costs where warm forks run, against reading each
environment whole (the old way), in the same run.

    .venv/bin/python bench/bench_env_scan.py [--procs 15] [--scans 50]

`--procs` sleeping processes marked as a run's, first plain (their own small environment), then
as warm forks show themselves (remote/warm_fork.own_environ over a padded block of ~200 KB: a
few KB of variables, then NULs); each set is scanned `--scans` times by remote/common.marked_pids
(reading each block up to its first two NULs) and by the same scan reading every block whole.
Printed: CPU ms per scan each way, and the ratio. No assertions: this prints figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from orchestrator.remote import common  # noqa: E402

MINE = {"BENCH_ENV_SCAN": "k", "RANK": "2", "PATH": "/usr/bin", "SOME_TOKEN": "y" * 6000}  # ~6 KB, as a rank's
PAD = {f"CLUSTERCTL_WARM_PAD{i}": "x" * 100_000 for i in range(2)}  # the zygote's room (remote/warm.py)
CHILD = ("import sys, time\n"
         f"sys.path.insert(0, {str(REPO)!r})\n"
         "from orchestrator.remote.warm_fork import own_environ\n"
         f"if sys.argv[1:] == ['fork']: own_environ({MINE!r})\n"
         "print('ok', flush=True)\n"
         "time.sleep(600)\n")


def read_whole(f):
    return f.read()


def cpu_per_scan(n: int, scans: int, read) -> float:
    """CPU ms of one marked_pids scan, each environment read by `read`."""
    common.environ_of, real = read, common.environ_of
    try:
        t = time.process_time()
        for _ in range(scans):
            found = common.marked_pids("BENCH_ENV_SCAN", lambda v: v == "k")
            assert len(found) == n, found
        return (time.process_time() - t) / scans * 1e3
    finally:
        common.environ_of = real


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=15)
    ap.add_argument("--scans", type=int, default=50)
    args = ap.parse_args(argv)
    for kind in ("plain", "fork"):
        env = {**os.environ, **PAD} if kind == "fork" else MINE
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, kind], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(args.procs)]
        try:
            for p in procs:
                assert p.stdout.readline() == "ok\n"
            size = len(Path(f"/proc/{procs[0].pid}/environ").read_bytes())
            up_to = cpu_per_scan(args.procs, args.scans, common.environ_of)
            whole = cpu_per_scan(args.procs, args.scans, read_whole)
            print(f"{args.procs} {kind} processes ({size:,} bytes of environ each): {up_to:.2f} ms CPU a scan read "
                  f"up to the NULs, {whole:.2f} ms read whole ({whole / up_to:.2f}x)", flush=True)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

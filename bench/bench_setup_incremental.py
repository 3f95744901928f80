"""`clusterctl setup` after a one-line edit of the requirements: what an added package costs.

    sudo .venv/bin/python bench/bench_setup_incremental.py [--nodes 4] [--add colorama==0.4.6]
                                                          [--repeat 3] [--code DIR] [--no-old-way]

One test cluster whose nodes reach no index, trainer/requirements.txt (torch 2.13.0 and the
trainer's packages) resolved with this machine's pip configuration, a fresh CLUSTERCTL_HOME.
In one run, each step a `clusterctl setup --json` on every node:
  first       from nothing: resolve, ship every wheel, build every venv
  unchanged   the same file again (every node skipped)
  add one     the file plus the --add line (and a comment that makes each edit a new one)
  remove it   the file without that line again; these three --repeat times
  old way     the --add line again, after emptying the nodes' wheel caches and uv's cache, with
              --force --refresh: everything resolved, shipped, unpacked and imported once more,
              which is what any edit of the file cost before setup was incremental
Prints each step's wall time, the bytes that left this machine (setup's own count and the
bridge's tx_bytes), the wheels shipped to the nodes, and add one / unchanged for each round and
its median (target < 3; the machine is shared and its load moves, so each add is measured right
after an unchanged run). --code DIR runs the clusterctl in DIR instead (e.g. `git archive` of an
older commit) to measure it the same way.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.cluster import TestCluster  # noqa: E402

VENV = "~/venvs/train"


def tx_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--add", default="colorama==0.4.6", help="the requirement line to add")
    ap.add_argument("--code", type=Path, default=REPO, help="the clusterctl checkout to run")
    ap.add_argument("--repeat", type=int, default=3, help="times to measure unchanged, add one and remove it")
    ap.add_argument("--no-old-way", action="store_true", help="skip the last step (it takes minutes)")
    args = ap.parse_args(argv)
    base = (REPO / "trainer" / "requirements.txt").read_text()
    with TestCluster(n=args.nodes, gpus=0, name_prefix="ccbi") as cl, tempfile.TemporaryDirectory() as td:
        work = Path(td)
        os.chmod(work, 0o755)
        req = work / "requirements.txt"
        raw = cl.inventory(setup={"requirements": str(req), "venv": VENV})
        del raw["python"]
        inv = work / "nodes.yaml"
        inv.write_text(yaml.safe_dump(raw, sort_keys=False))
        env = dict(os.environ, CLUSTERCTL_HOME=str(work / "home"), PYTHONPATH=str(args.code))

        def setup(name: str, text: str, *flags: str) -> dict:
            req.write_text(text)
            b0, t0 = tx_bytes(cl.bridge), time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "setup", "-i", str(inv), "--json",
                                *flags], capture_output=True, text=True, env=env, cwd=args.code, timeout=1800)
            took, out = time.perf_counter() - t0, tx_bytes(cl.bridge) - b0
            doc = json.loads(p.stdout or "{}")
            if p.returncode != 0:
                raise SystemExit(f"{name}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
            shipped = sorted({w for n in doc["nodes"] for w in n.get("wheels", [])})
            actions = sorted({n["action"] for n in doc["nodes"]})
            print(f"  {name:<10} {took:7.1f}s  {doc['bytes_sent'] / 1e6:8.2f} MB sent (bridge {out / 1e6:8.2f} MB)  "
                  f"{'/'.join(actions):<9} resolve {doc['resolved']:<18} wheels shipped: "
                  f"{len(shipped) if len(shipped) > 3 else ', '.join(shipped) or '-'}", flush=True)
            if name != "unchanged":
                print(f"{'':14}{doc['nodes'][0]['name']}: {doc['nodes'][0]['detail']}", flush=True)
            return {"seconds": took, "doc": doc}

        print(f"{args.nodes} nodes, no index reachable from them, {os.cpu_count()} CPUs for everything; "
              f"clusterctl from {args.code}")
        setup("first", base)
        # each add measured right after an unchanged run, so that both see the same load on this
        # shared machine: the ratio is taken per round, then its median
        unchanged, added, removed = [], [], []
        for i in range(args.repeat):
            unchanged.append(setup("unchanged", base)["seconds"])
            added.append(setup("add one", f"{base}# edit {i}\n{args.add}\n")["seconds"])
            removed.append(setup("remove it", base)["seconds"])
        u, a, r = (statistics.median(x) for x in (unchanged, added, removed))
        ratios = [x / y for x, y in zip(added, unchanged)]
        old = None
        if not args.no_old_way:
            for nd in cl.nodes:
                nd.run("rm -rf ~/.cache/clusterctl ~/.cache/uv", timeout=300)
            old = setup("old way", base + args.add + "\n", "--force", "--refresh")
        print(f"  medians: unchanged {u:.1f}s, add one {a:.1f}s, remove it {r:.1f}s; add one / unchanged per round: "
              f"{', '.join(f'{x:.2f}x' for x in ratios)}, median {statistics.median(ratios):.2f}x (target < 3)"
              + (f"; old way / add one: {old['seconds'] / a:.1f}x" if old else ""))
        rms = [nd.popen("rm -rf ~/venvs ~/.cache") for nd in cl.nodes]
        for p in rms:
            p.wait(300)
    return 0


if __name__ == "__main__":
    sys.exit(main())

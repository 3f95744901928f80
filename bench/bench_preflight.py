"""Full preflight vs `pdsh -R ssh -f 64 hostname` vs a bare fan-out over our transport.

    sudo .venv/bin/python bench/bench_preflight.py [8 64 256] [--repeat 3]

For each size: one test cluster, then (same run, alternating, best of --repeat):
  pdsh   pdsh -R ssh -f 64 -w <nodes> hostname  (OpenSSH per node, through an ssh wrapper
         carrying the cluster's key/known_hosts/user)
  bare   Cluster(inv) connect + run("hostname")  (our transport, one handshake per node)
  pre    Cluster(inv) connect + run_preflight(all checks)
Prints wall seconds, the ratios, the control process's CPU per node (getrusage of this
process: user+sys, threads included; pdsh's is its children's), and the node side's CPU per
node (the whole machine's busy CPU minus the control process's: sshd, the probe, the tools it
runs). Every "node" here shares this machine's cores, so node-side CPU adds to the wall time;
on real nodes each one spends it on its own cores, in parallel. No assertions on seconds.
Target (issue 3): pre <= 0.5 x pdsh and <= 1.5 x bare at 64 nodes.

--without CHECK[,CHECK]: a fourth row in the same alternation, the preflight without those checks
(what they cost here: gpu_health runs the test cluster's fake nvidia-smi twice more and its fake
dmesg, each a Python start on the node, where a real node runs the C tools).
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.inventory import parse_inventory  # noqa: E402
from orchestrator.checks.preflight import CHECKS, run_preflight  # noqa: E402
from orchestrator.transport import Cluster  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402


def cpu_self():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_children():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu_machine():
    """Busy CPU seconds of the whole machine: the control process, sshd and every node's probe."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def timed(fn, cpu=cpu_self):
    c0, m0, t0 = cpu(), cpu_machine(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, cpu() - c0, cpu_machine() - m0, out


def pdsh_wrapper(cluster, d: Path) -> Path:
    w = d / "ssh"
    w.write_text("#!/bin/sh\nexec /usr/bin/ssh -i {k} -o UserKnownHostsFile={kh} -o StrictHostKeyChecking=yes "
                 "-o BatchMode=yes -o IdentitiesOnly=yes -o ConnectTimeout=10 -F /dev/null -l {u} \"$@\"\n"
                 .format(k=cluster.identity_file, kh=cluster.known_hosts, u=cluster.user))
    w.chmod(0o755)
    return w


def bench(n, repeat, without=()):
    with TestCluster(n=n, gpus=8, name_prefix="ccbp") as cluster, tempfile.TemporaryDirectory() as td:
        for nd in cluster.nodes:
            nd.run("mkdir -p ~/gpt_train && echo 'print(1)' > ~/gpt_train/train.py")
        inv = parse_inventory(yaml.safe_dump(cluster.inventory(checks={"disk_min_gb": 0.1})), "<bench>")
        pdsh_wrapper(cluster, Path(td))  # the `ssh` first on pdsh's PATH
        hosts = ",".join(nd.host for nd in cluster.nodes)
        env = dict(os.environ, PDSH_SSH_ARGS="", PDSH_RCMD_TYPE="ssh", PATH=f"{td}:{os.environ['PATH']}")

        def pdsh():
            r = subprocess.run(["pdsh", "-R", "ssh", "-f", "64", "-w", hosts, "hostname"], env=env,
                               capture_output=True, text=True)
            got = sum(1 for ln in r.stdout.splitlines() if ln.strip())
            assert got == n, f"pdsh: {got}/{n} answered: {r.stderr[-500:]}"

        def bare():
            with Cluster(inv) as c:
                res = c.run("hostname")
                assert res.all_ok and c.handshakes == n

        def pre(checks=None):
            with Cluster(inv) as c:
                rep = run_preflight(c, inv, checks)
                assert c.handshakes == n
            # the test cluster's nodes have fake NVIDIA GPUs and this machine's CPU torch: python_env
            # rightly fails on that, and only that is expected
            bad = [(x.node.name, r.check, r.detail) for x in rep.nodes for r in x.results.values()
                   if r.status == "fail" and not (r.check == "python_env" and "CPU-only build" in r.detail)]
            assert not bad, bad[:5]

        rows = [("pdsh", pdsh, cpu_children), ("bare", bare, cpu_self), ("pre", pre, cpu_self)]
        if without:
            rows.append(("less", lambda: pre([c for c in CHECKS if c not in without]), cpu_self))
        best = {}
        for _ in range(repeat):
            for name, fn, cpu in rows:
                wall, c, m, _ = timed(fn, cpu)
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, c, m)
        (pw, pc, pm), (bw, bc, bm), (fw, fc, fm) = best["pdsh"], best["bare"], best["pre"]
        print(f"{n:4d} nodes  pdsh {pw:6.2f}s  bare {bw:6.2f}s  preflight {fw:6.2f}s  "
              f"pre/pdsh {fw / pw:4.2f}  pre/bare {fw / bw:4.2f}  "
              f"control CPU/node: preflight {fc / n * 1000:5.1f} ms, bare {bc / n * 1000:5.1f} ms, "
              f"pdsh(ssh children) {pc / n * 1000:5.1f} ms  "
              f"node-side CPU/node (machine minus control): preflight {(fm - fc) / n * 1000:5.1f} ms, "
              f"bare {(bm - bc) / n * 1000:5.1f} ms, pdsh {(pm - pc) / n * 1000:5.1f} ms", flush=True)
        if without:
            lw, lc, lm = best["less"]
            print(f"{n:4d} nodes  preflight without {','.join(without)} {lw:6.2f}s  ÷pdsh {lw / pw:4.2f}  "
                  f"control CPU/node {lc / n * 1000:5.1f} ms  node-side CPU/node {(lm - lc) / n * 1000:5.1f} ms",
                  flush=True)
        return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", type=int, nargs="*", default=[8, 64, 256])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--without", default="", help="a comma list of checks: also time the preflight without them")
    args = ap.parse_args(argv)
    without = tuple(c for c in args.without.split(",") if c)
    unknown = [c for c in without if c not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}; the checks: {', '.join(CHECKS)}")
    print(f"control: {os.cpu_count()} CPUs; best of {args.repeat}; fan-out 64 everywhere")
    for n in args.sizes:
        bench(n, args.repeat, without)


if __name__ == "__main__":
    main()

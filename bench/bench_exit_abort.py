"""A rank's own exit code against gloo's exit race: how often `sys.exit(3)` comes back as SIGABRT.

    .venv/bin/python bench/bench_exit_abort.py [--runs 20] [--old REV]

Each run is a 2-rank torchrun (gloo on CPU, this machine's loopback) whose rank 1 calls
sys.exit(3) right after a collective while rank 0 waits in the next one. gloo's worker thread
frees the finished collective's tensors after wait() returned, taking the GIL; when the rank
reaches Python's finalization first, that thread ends inside a noexcept destructor, std::terminate,
and torchrun reports rank 1's exit code as -6 instead of 3. Three ways, interleaved run by run:

  bare    no clusterctl hook (the user's torchrun by hand)
  old     the rank hook as it was at --old (default: the commit before the exit settle)
  new     the rank hook in this tree (orchestrator/remote/hook/sitecustomize.py), whose atexit
          waits while another thread of the rank is runnable (at most SETTLE_S)

It prints, per way, how many runs ended with rank 1's exit code 3, with -6, and otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOOK = REPO / "orchestrator" / "remote" / "hook"
OLD_REV = "80f5bfa"  # the last commit whose hook had no exit settle

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, x = dist.get_rank(), torch.ones(10)
    for step in range(6):
        if step == 3 and rank == 1:
            sys.exit(3)
        dist.all_reduce(x)
""")


def one(script: Path, hook: Path | None, port: int, scratch: Path) -> str:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    if hook is not None:
        fifos = Path(tempfile.mkdtemp(dir=scratch))
        env.update(PYTHONPATH=str(hook), CLUSTERCTL_HOOK_DIR=str(fifos))
    torchrun = Path(sys.executable).with_name("torchrun")
    p = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                        "--master-port", str(port), str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    m = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: 1", p.stderr)
    return m.group(1) if m else f"rc {p.returncode}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--old", default=OLD_REV)
    ap.add_argument("--port", type=int, default=31000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        scratch = Path(d)
        script = scratch / "exit3.py"
        script.write_text(SCRIPT)
        old = scratch / "oldhook"
        old.mkdir()
        (old / "sitecustomize.py").write_text(subprocess.run(
            ["git", "-C", str(REPO), "show", f"{a.old}:orchestrator/remote/hook/sitecustomize.py"],
            capture_output=True, text=True, check=True).stdout)
        ways = {"bare": None, "old": old, "new": HOOK}
        seen = {w: {} for w in ways}
        port = a.port
        for i in range(a.runs):
            for w, hook in ways.items():
                port += 1
                code = one(script, hook, port, scratch)
                seen[w][code] = seen[w].get(code, 0) + 1
            print(f"run {i + 1}/{a.runs}: " + "  ".join(f"{w} {dict(sorted(c.items()))}" for w, c in seen.items()),
                  file=sys.stderr, flush=True)
    print(f"rank 1's sys.exit(3) in {a.runs} runs per way (torchrun's exit code for rank 1):")
    for w, c in seen.items():
        other = {k: v for k, v in c.items() if k not in ("3", "-6")}
        print(f"  {w:5s} exit 3: {c.get('3', 0):3d}   SIGABRT (-6): {c.get('-6', 0):3d}   other: {other or 0}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

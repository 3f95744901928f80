"""What a `clusterctl` command costs before it does anything: this tree against an older one.

    .venv/bin/python bench/bench_cli_start.py [--before d872d73] [--repeat 10]

Each command (`--help`, `plan --help`, `status --help`, `tail --help`, `runs` on an empty home, and
`exec -- true` on the embedded default's two local nodes) runs `--repeat` times from each tree,
alternated command by command (this machine's speed drifts by more than the difference), with
the same interpreter and a fresh CLUSTERCTL_HOME. The older tree is `git archive`d into a
temporary directory; both trees are byte-compiled first. Printed per command: the median wall time and CPU (user + sys of the child)
from each tree, their ratios now/before, and how many modules of the package each loads and
whether paramiko is among them (one run each, `-X importtime` off).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = (["--help"], ["plan", "--help"], ["status", "--help"], ["tail", "--help"], ["runs"], ["exec", "--", "true"])
LOADED = ("import runpy, sys; sys.argv = ['clusterctl', *sys.argv[1:]]\n"
          "try:\n    runpy.run_module('orchestrator.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
          "import orchestrator\n"
          "print('LOADED', len([m for m in sys.modules if m.startswith('orchestrator')]), 'paramiko' in sys.modules,"
          " orchestrator.__file__, file=sys.stderr)")


def archive(rev: str, into: Path) -> Path:
    """The tree at `rev`, unpacked under `into`."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into


def once(tree: Path, args: list[str], home: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one command run from `tree`."""
    env = dict(os.environ, CLUSTERCTL_HOME=str(home), PYTHONPATH=str(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=tree, env=env, capture_output=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} from {tree}: exit {r.returncode}\n{r.stderr.decode()[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def loaded(tree: Path, args: list[str], home: Path) -> str:
    env = dict(os.environ, CLUSTERCTL_HOME=str(home), PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", LOADED, *args], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("LOADED ")), "LOADED ? ? ?").split()
    if not line[3].startswith(str(tree)):  # the venv's editable install must not stand in for the tree
        raise SystemExit(f"{tree}: the package was imported from {line[3]}")
    return f"{line[1]} modules{', paramiko' if line[2] == 'True' else ''}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="d872d73", help="the older tree (a git revision)")
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cli_start_") as td:
        old = Path(td) / "before"
        old.mkdir()
        trees = {"now": REPO, "before": archive(a.before, old)}
        for tree in trees.values():  # both read bytecode (this machine's environment sets PYTHONDONTWRITEBYTECODE)
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "orchestrator")], check=True)
        home = Path(td) / "home"
        print(f"clusterctl's start: this tree against {a.before}, {a.repeat} runs each, alternated; "
              f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
        for args in COMMANDS:
            got: dict[str, list[tuple[float, float]]] = {"now": [], "before": []}
            for _ in range(a.repeat):
                for side in ("before", "now"):
                    got[side].append(once(trees[side], args, home))
            med = {s: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for s, v in got.items()}
            print(f"  {' '.join(args):16s} before {med['before'][0] * 1e3:5.0f} ms wall {med['before'][1] * 1e3:5.0f} ms "
                  f"CPU ({loaded(trees['before'], args, home)}); now {med['now'][0] * 1e3:5.0f} ms wall "
                  f"{med['now'][1] * 1e3:5.0f} ms CPU ({loaded(trees['now'], args, home)}); now/before: wall "
                  f"{med['now'][0] / med['before'][0]:.2f}x, CPU {med['now'][1] / med['before'][1]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A node program's start: as text on every call (before) against the node code kept on the node (now).

    .venv/bin/python bench/bench_node_code.py [--repeat 40] [--before 6da0340]

Before (the tree at --before): remote/common.py's text, then the program's, sent on every call
and run as `python -S -c TEXT nodeinfo-args` (nodeinfo in the preflight probe and sync) or
`python - ARGS` with the text on stdin (the node agent). Now: `python -S -c BOOT CODE nodeinfo
ARGS` and `python -c BOOT CODE node_agent ARGS`, the code already on the node (probe.local_code),
its bytecode cached there by an earlier start. A zip of the same files run through zipimport
(the zipapp form) is timed beside them: zipimport compiles each module twice per start and
caches no bytecode.
Both run here, alternately, --repeat times each; printed: the median wall time and CPU time
(user + sys of the child) per start, their ratio now/before, and the bytes each call sends to
a node besides its arguments (now: none once the code is there; the code itself, a tar, once per
node and version). No assertions on seconds.
"""

import argparse
import resource
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator import probe  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def old_text(rev: str, name: str) -> bytes:
    def show(path):
        return subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True,
                              check=True).stdout
    return show("orchestrator/remote/common.py") + f"\n# ---- orchestrator/remote/{name}.py\n".encode() + \
        show(f"orchestrator/remote/{name}.py")


# the boot without its check for the unpacked code's mark (a path inside a zip is no file)
ZIP_BOOT = ('import sys\np=sys.argv[1]\nsys.path.insert(0,p);n=sys.argv[2];sys.argv[:3]=[n]\n'
            f'sys.exit(__import__("{probe.PACKAGE}."+n,fromlist=["main"]).main(sys.argv[1:]))')


def zipapp(code: Path) -> Path:
    """The same package as a zip (stored), for zipimport."""
    path = code.parent / f"{code.name}.zip"
    if not path.exists():
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            for f in sorted((code / probe.PACKAGE).glob("*.py")):
                z.write(f, f"{probe.PACKAGE}/{f.name}")
            z.writestr(f"{probe.PACKAGE}/{probe.COMPLETE}", b"")
    return path


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def once(argv, stdin: bytes | None, home: str) -> tuple[float, float]:
    c0, t0 = child_cpu(), time.perf_counter()
    r = subprocess.run(argv, input=stdin, capture_output=True, timeout=60,
                       env={"HOME": home, "PATH": "/usr/bin:/bin"})
    wall, cpu = time.perf_counter() - t0, child_cpu() - c0
    if r.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed: {r.stderr.decode()[-500:]}")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--before", default="6da0340", help="the tree whose programs travelled as text")
    a = ap.parse_args()
    py, home = sys.executable, "/tmp"
    code = probe.local_code()
    zipped = str(zipapp(code))
    subprocess.run(probe.local_argv("node_agent", "live"), capture_output=True)  # the bytecode cached
    subprocess.run(probe.local_argv("nodeinfo", "info", "-", flags=("-S",)), capture_output=True,
                   env={"HOME": home})
    texts = {name: old_text(a.before, name) for name in ("nodeinfo", "node_agent")}
    cases = {
        "nodeinfo info (-S, the preflight probe's)": {
            "before": lambda: ([py, "-S", "-c", texts["nodeinfo"].decode(), "info", "-"], None),
            "now": lambda: (probe.local_argv("nodeinfo", "info", "-", flags=("-S",)), None),
            "zipapp": lambda: ([py, "-S", "-c", ZIP_BOOT, zipped, "nodeinfo", "info", "-"], None)},
        "node_agent live (an agent verb)": {
            "before": lambda: ([py, "-", "live"], texts["node_agent"]),
            "now": lambda: (probe.local_argv("node_agent", "live"), None),
            "zipapp": lambda: ([py, "-c", ZIP_BOOT, zipped, "node_agent", "live"], None)},
    }
    sent = {"nodeinfo info (-S, the preflight probe's)": len(texts["nodeinfo"]),
            "node_agent live (an agent verb)": len(texts["node_agent"])}
    h, data = probe.node_code()
    print(f"python {sys.version.split()[0]}, {a.repeat} starts each, alternating; the node code: {h}, a tar of "
          f"{len(data)} bytes sent once per node and version")
    for what, sides in cases.items():
        got = {side: [] for side in sides}
        for _ in range(a.repeat):
            for side, build in sides.items():
                argv, stdin = build()
                got[side].append(once(argv, stdin, home))
        med = {side: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for side, v in got.items()}
        print(f"{what}:")
        for side in sides:
            print(f"  {side:6s} wall {med[side][0] * 1000:6.1f} ms  cpu {med[side][1] * 1000:6.1f} ms  "
                  f"sent per call {sent[what] if side == 'before' else 0:6d} bytes")
        for side in ("now", "zipapp"):
            print(f"  {side}/before: wall {med[side][0] / med['before'][0]:.2f}x, "
                  f"cpu {med[side][1] / med['before'][1]:.2f}x")


if __name__ == "__main__":
    main()

"""How soon a cut node is declared lost at the default settings, against the silence rule it
replaces, and whether a loaded control machine makes a healthy node look lost.

    sudo .venv/bin/python bench/bench_lost.py [--trials 5] [--soak-minutes 20] [--burners 4]

Cut (3 test nodes, a gloo DDP job, `--lost-timeout` at its default 30 s): once node2 logs steps,
its link is cut (`ip link set down` in its namespace) and the run's record gives the moment the
supervisor declared the attempt failed (attempts[0].failed_at). Each trial runs both ways in
turn: the evidence rule (the default) and `--no-lost-evidence` (the old way: 30 s of silence).
Printed: each trial, the medians, and the ratio. Target: the evidence rule declares <= 5 s after
the cut.

Soak: the same job for --soak-minutes with --burners busy-looping processes on this machine
(they load the control side and, since the test nodes are namespaces of this machine, the
nodes too). A node declared lost in a healthy run is a false loss. Target: none.

With --loaded-cuts N, N more cut trials run under the burners (the evidence rule only): a
loaded control machine must still see a cut, whichever rule ends up deciding.

The nodes share this machine's cores; no assertions, this prints figures.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.harness import cli, record, wait_for  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402

DDP = str(REPO / "tests" / "scripts" / "ddp_tiny.py")


def has(path: Path, needle: bytes) -> bool:
    try:
        return needle in path.read_bytes()
    except OSError:
        return False


def start(home: Path, inv: str, steps: int, *flags: str) -> Path:
    r = cli(home, "train", "-i", inv, "--skip-preflight", "--detach", *flags, "--", DDP, "--steps", str(steps),
            "--sleep", "0.1")
    if r.returncode != 0:
        raise SystemExit(f"bench: train did not start:\n{r.stderr}")
    return home / "runs" / r.stdout.strip()


def ended(run_dir: Path) -> dict | None:
    rec = record(run_dir)
    return rec if rec.get("state") in ("failed", "finished", "stopped") else None


def cut_trial(cluster, home: Path, inv: str, flags: tuple[str, ...]) -> float:
    """Seconds from the cut to the supervisor's declaration."""
    victim = cluster.nodes[1]
    run_dir = start(home, inv, 100000, *flags)
    wait_for(lambda: has(run_dir / "nodes" / "node2.log", b"step 3 "), 180, "steps on node2")
    t_cut = time.time()
    victim.link_down()
    try:
        rec = wait_for(lambda: (lambda r: r if r.get("attempts") and r["attempts"][0].get("failed_at") else None)(
            record(run_dir)), 120, "the loss to be declared")
        wait_for(lambda: ended(run_dir), 120, "the run to end")
    finally:
        victim.link_up()
    wait_for(lambda: not cluster.processes(victim), 120, "node2 clean once its link is back")
    states = {n["name"]: n["state"] for n in rec.get("nodes", [])}
    if states.get("node2") not in ("lost", None) and "lost" not in (rec["attempts"][0].get("verdict") or ""):
        raise SystemExit(f"bench: node2 was not declared lost: {rec.get('summary')}")
    return rec["attempts"][0]["failed_at"] - t_cut


def burn(stop):
    while not stop.is_set():
        for _ in range(100000):
            pass


def soak(cluster, home: Path, inv: str, minutes: float) -> tuple[int, int, int]:
    """Runs of the healthy job back to back for `minutes`: (runs, nodes declared lost, failed runs)."""
    runs = lost = failed = 0
    deadline = time.time() + minutes * 60
    while time.time() < deadline:
        steps = max(50, int(min(600, (deadline - time.time()) / 0.12)))
        run_dir = start(home, inv, steps)
        rec = wait_for(lambda: ended(run_dir), steps * 2 + 300, "the soak run to end")
        story = (run_dir / "supervisor.log").read_text()
        runs += 1
        lost += story.count(" lost: ")
        failed += rec.get("state") != "finished"
        print(f"  soak run {runs}: {steps} steps, {rec.get('state')}, "
              f"{len(rec.get('attempts', []))} attempt(s), {story.count(' lost: ')} lost", flush=True)
    return runs, lost, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5, help="cut trials each way")
    ap.add_argument("--soak-minutes", type=float, default=20.0, help="0 skips the soak")
    ap.add_argument("--burners", type=int, default=2 * (os.cpu_count() or 2),
                    help="busy-looping processes during the soak (default: twice the cores)")
    ap.add_argument("--loaded-cuts", type=int, default=0, help="cut trials under the burners after the soak")
    args = ap.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    with TestCluster(n=3, gpus=0, name_prefix="ccbl") as cluster, tempfile.TemporaryDirectory() as td:
        for n in cluster.nodes:
            n.run("mkdir -p ~/gpt_train")
        # the same node is cut trial after trial: its fault record must not quarantine it
        inv = str(cluster.write_inventory(Path(td) / "nodes.yaml", train={"quarantine_after": 0}))
        home = Path(td) / "home"
        got: dict[str, list[float]] = {"evidence": [], "silence": []}
        print(f"cut: 3 test nodes, node2's link cut, --lost-timeout 30 (default), {args.trials} trials each way",
              flush=True)
        for i in range(args.trials):
            for mode in (("evidence", "silence") if i % 2 == 0 else ("silence", "evidence")):
                s = cut_trial(cluster, home, inv, () if mode == "evidence" else ("--no-lost-evidence",))
                got[mode].append(s)
                print(f"  trial {i + 1} {mode:<8}: declared lost {s:5.1f} s after the cut", flush=True)
        ev, si = statistics.median(got["evidence"]), statistics.median(got["silence"])
        print(f"  median: evidence {ev:.1f} s (max {max(got['evidence']):.1f} s), silence {si:.1f} s: "
              f"{si / ev:.1f}x sooner (target <= 5 s: {'met' if max(got['evidence']) <= 5 else 'MISSED'})",
              flush=True)
        if args.soak_minutes > 0:
            stop = ctx.Event()
            burners = [ctx.Process(target=burn, args=(stop,), daemon=True) for _ in range(args.burners)]
            for b in burners:
                b.start()
            try:
                print(f"soak: {args.soak_minutes:g} min of healthy runs with {args.burners} busy-looping processes "
                      f"on this {os.cpu_count()}-core machine (control side and nodes alike)", flush=True)
                runs, lost, failed = soak(cluster, home, inv, args.soak_minutes)
                print(f"  {runs} runs, {lost} node(s) declared lost, {failed} run(s) not finished "
                      f"(target: no false loss: {'met' if lost == 0 and failed == 0 else 'MISSED'})", flush=True)
                loaded = [cut_trial(cluster, home, inv, ()) for _ in range(args.loaded_cuts)]
                if loaded:
                    print(f"  cuts under load: " + ", ".join(f"{s:.1f} s" for s in loaded), flush=True)
            finally:
                stop.set()
                for b in burners:
                    b.join(5)
                    if b.is_alive():
                        b.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

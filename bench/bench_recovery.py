"""Recovery time after a lost node, and what copying checkpoints off the nodes costs a step.

    sudo .venv/bin/python bench/bench_recovery.py [--victim 2] [--overhead-steps 60] [--repeat 2]
    sudo .venv/bin/python bench/bench_recovery.py --warm-compare 3 --steps 1500
    sudo .venv/bin/python bench/bench_recovery.py --warm-compare 2 --script --steps 2000

Recovery (5 test nodes, node5 `spare: true`, preset nano, a checkpoint every 10 steps,
`--max-restarts 1`, every other setting at its default (the lost-node rule on evidence, the fast
preflight on): once a checkpoint has reached the
control machine, one node's link is cut for good. The run must finish (exit 0) on the spare.
Every line of every node's log is timestamped as it arrives in the run directory, and
run.json's attempts[] give the supervisor's own boundaries. Printed, in order:

  detection   link cut → the supervisor records the node lost (on evidence; --lost-timeout 30 s the backstop)
  teardown    → attempt 1 ended (the other nodes stopped, their logs drained)
  relaunch    → attempt 2 began
  prepare     the spare claimed and brought to the run's code, node to node (runs/spares.py)
  restore     checkpoint streamed from the control machine to the new master
  preflight   the fast preflight on the new node set
  launch      torchrun started on every node over SSH
  rendezvous  torchrun's rendezvous and the workers' process group, up to the new master's
              `process group` phase end (the trainer's startup line gives its phases)
  startup     the master's imports, data and model, and checkpoint load
  first step  the trainer's startup line → its first step line
Target: everything after detection <= 20 s. With --warm-compare N, the same cut N times each with
the warm interpreters (runs/warmpool.py; the cut once every node, the spare too, has one) and with
`--no-warm`, alternating, each at least --settle s into the run: after detection, rendezvous and
startup, each way, with the ratio. --script runs, instead of the trainer, a script that is no
part of clusterctl (tests/scripts/nanogpt_like.py: nanoGPT's habits, `--checkpoint-dir out
--resume-args --init_from=resume`, a save every 10 iterations): only after detection → its first
`iter N: loss` line of attempt 2 is printed (the phases come from the trainer's startup line).

Copy overhead (2 test nodes, preset tiny, a checkpoint every 20 steps): the same run with
`train.copy_checkpoints` true and false, alternating, --repeat times each. Printed: the mean
step time the trainer reports (its own `step N ms`, steps after the first) and the wall time per
step from the master's step lines as they arrived, both ways, and the overhead in percent.
Target: copying costs <= 5 % of step time. Every node here shares this machine's cores, so the
copy's CPU (tar, ssh, sha256) competes with the training processes; on real nodes it runs on
cores the trainer does not use. No assertions: this prints figures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.harness import STEP, LogClock, end_supervisor, run_dir_of, start, wait_for  # noqa: E402
from bench.harness import text_of as _text  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402

ITER = re.compile(r"^iter (\d+): loss ")  # nanogpt_like.py's step line (rank 0)
NANOGPT = str(REPO / "tests" / "scripts" / "nanogpt_like.py")
STARTUP = re.compile(r"^startup ([\d.]+) s: (.*)$")


def write_inventory(cluster, path: Path, train: dict, spare: bool) -> str:
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    nodes = cluster.inventory()["nodes"]
    if spare:
        nodes[-1]["spare"] = True
    return str(cluster.write_inventory(path, nodes=nodes, checks={"disk_min_gb": 0.1}, output_dir="out",
                                       env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, train=train))


# ---------------------------------------------------------------- recovery
def recovery(victim: int, steps: int, warm: bool | None = None, settle: float = 0.0, script: bool = False) -> dict:
    """One cut. `warm`: None, the default; True, the cut waits for every node's warm interpreter;
    False, --no-warm. `settle`: the cut comes no sooner than this many seconds into the run.
    `script`: nanogpt_like.py instead of the trainer (only detection and after detection)."""
    with TestCluster(n=5, gpus=0, name_prefix="ccbr") as cluster, tempfile.TemporaryDirectory() as td:
        home = Path(td) / "home"
        inv = write_inventory(cluster, Path(td) / "nodes.yaml", spare=True, train={"max_restarts": 1} if script else {
            "module": "trainer", "max_restarts": 1,
            "args": ["--preset", "nano", "--max-steps", str(steps), "--batch-size", "2", "--block-size", "32",
                     "--log-every", "1", "--ckpt-every", "10", "--eval-steps", "1", "--sample-tokens", "0",
                     "--output-dir", "out"]})
        t_start = time.time()
        job = ["--checkpoint-dir", "out", "--resume-args", "--init_from=resume", "--", NANOGPT,
               f"--max_iters={steps}", "--eval_interval=10", "--iter_s=0.05"] if script else []
        proc = start(home, "train", "-i", inv, *(["--no-warm"] if warm is False else []), *job)
        try:
            run_dir = run_dir_of(home)
            clock = LogClock(run_dir / "nodes")
            wait_for(lambda: list((run_dir / "checkpoints").glob("snap-*.json" if script else "ckpt_*.pt")), 300,
                     "a checkpoint on the control machine")
            if warm:
                wait_for(lambda: all(n.warm_serving() for n in cluster.nodes), 300, "a warm interpreter on every node")
            time.sleep(max(0.0, t_start + settle - time.time()))
            t_fail = time.time()
            cluster.nodes[victim - 1].link_down()
            out, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        clock.stop()
        rec = json.loads((run_dir / "run.json").read_text())
        end_supervisor(rec)
        if proc.returncode != 0 or len(rec.get("attempts", [])) != 2:
            pre = (run_dir / "preflight.txt").read_text() if (run_dir / "preflight.txt").exists() else ""
            sup = (run_dir / "supervisor.log").read_text()[-3000:]
            raise SystemExit(f"bench: the run did not recover (exit {proc.returncode}):\n{err[-3000:]}\n"
                             f"last preflight:\n{pre}\nsupervisor.log:\n{sup}")
        if script:
            a1, a2 = rec["attempts"]
            master = [(t, _text(s)) for t, s in clock.lines[a2["nodes"][0]] if t >= a2["started"]]
            t_step = next(t for t, s in master if ITER.match(s))
            return {"detection": a1["failed_at"] - t_fail, "after detection": t_step - a1["failed_at"],
                    "nodes": a2["nodes"], "checkpoint": a2.get("checkpoint")}
        return phases(t_fail, rec["attempts"], clock.lines)


def phases(t_fail: float, attempts: list[dict], lines: dict[str, list]) -> dict:
    a1, a2 = attempts
    master = a2["nodes"][0]
    after = [(t, _text(s)) for t, s in lines[master] if t >= a2["started"]]
    t_up, up = next((t, m) for t, s in after if (m := STARTUP.match(s)))
    t_step = next(t for t, s in after if t > t_up and STEP.match(s))
    parts = dict(re.findall(r"([a-z ]+?) ([\d.]+) s(?:,|$)", up.group(2).strip()))
    parts = {k.strip(): float(v) for k, v in parts.items()}
    worker_start = t_up - float(up.group(1))
    out = {
        "detection": a1["failed_at"] - t_fail,
        "teardown": a1["ended"] - a1["failed_at"],
        "relaunch": a2["started"] - a1["ended"],
        "prepare": a2.get("prepare_s", 0.0),
        "restore": a2.get("restore_s", 0.0),
        "preflight": a2["preflight_s"],
        "launch": a2["launch_s"],
        "rendezvous": worker_start - a2["launched"] + parts["process group"],
        "startup": parts["imports"] + parts["data and model"] + parts["checkpoint"],
        "first step": t_step - t_up,
    }
    out["after detection"] = t_step - a1["failed_at"]
    out["unaccounted"] = out["after detection"] - sum(v for k, v in out.items()
                                                      if k not in ("detection", "after detection"))
    out["startup parts"] = ", ".join(f"{k} {v:.2f} s" for k, v in parts.items() if k != "process group")
    out["checkpoint"] = a2.get("checkpoint")
    out["nodes"] = a2["nodes"]
    return out


# ---------------------------------------------------------------- copy overhead
def one_run(cluster, td: Path, label: str, copy: bool, steps: int) -> dict:
    home = td / f"home-{label}"
    inv = write_inventory(cluster, td / f"{label}.yaml", spare=False, train={
        "module": "trainer", "copy_checkpoints": copy,
        "args": ["--preset", "tiny", "--max-steps", str(steps), "--batch-size", "2", "--block-size", "128",
                 "--log-every", "1", "--ckpt-every", "20", "--eval-steps", "1",
                 "--sample-tokens", "0", "--output-dir", "out"]})
    proc = start(home, "train", "-i", inv, "--skip-preflight")
    run_dir = run_dir_of(home)
    clock = LogClock(run_dir / "nodes")
    try:
        _, err = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    clock.stop()
    if proc.returncode != 0:
        raise SystemExit(f"bench: the {label} run failed (exit {proc.returncode}):\n{err[-3000:]}")
    master = cluster.nodes[0].name
    got = [(t, STEP.match(_text(s))) for t, s in clock.lines[master]]
    got = [(t, int(m.group(1)), int(m.group(2))) for t, m in got if m]
    later = [g for g in got if g[1] >= 2]
    copied = sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt_*.pt"))
    return {"step_ms": statistics.mean(ms for _, _, ms in later),
            "wall_ms": (later[-1][0] - later[0][0]) / (later[-1][1] - later[0][1]) * 1e3,
            "copied": copied}


def overhead(steps: int, repeat: int) -> dict:
    res = {True: [], False: []}
    with TestCluster(n=2, gpus=0, name_prefix="ccbo") as cluster, tempfile.TemporaryDirectory() as td:
        for i in range(repeat):
            for copy in (False, True) if i % 2 == 0 else (True, False):
                r = one_run(cluster, Path(td), f"{'on' if copy else 'off'}{i}", copy, steps)
                if copy and not r["copied"]:
                    raise SystemExit("bench: copy on, but no checkpoint reached the control machine")
                if not copy and r["copied"]:
                    raise SystemExit("bench: copy off, but checkpoints reached the control machine")
                res[copy].append(r)
                print(f"  run {i + 1} copy {'on ' if copy else 'off'}: step {r['step_ms']:.0f} ms (trainer), "
                      f"{r['wall_ms']:.0f} ms (wall){', copied ' + ', '.join(r['copied']) if copy else ''}",
                      flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("step_ms", "wall_ms")} for k, v in res.items()}
    return {"on": med[True], "off": med[False],
            "overhead_step_pct": (med[True]["step_ms"] / med[False]["step_ms"] - 1) * 100,
            "overhead_wall_pct": (med[True]["wall_ms"] / med[False]["wall_ms"] - 1) * 100}


def warm_compare(victim: int, steps: int, n: int, settle: float, script: bool = False) -> int:
    """Recovery with and without the warm interpreters (runs/warmpool.py), alternating."""
    got: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(n):
        for warm in (True, False) if i % 2 == 0 else (False, True):
            r = recovery(victim, steps, warm, settle, script)
            got[warm].append(r)
            print(f"  {'warm' if warm else 'cold'} {i + 1}: detection {r['detection']:.2f} s, after detection "
                  f"{r['after detection']:.2f} s" + ("" if script else f"; launch {r['launch']:.2f}, rendezvous "
                  f"{r['rendezvous']:.2f}, startup {r['startup']:.2f} s ({r['startup parts']})"), flush=True)
    for k in ("after detection",) if script else ("after detection", "rendezvous", "startup"):
        w, c = (statistics.median(r[k] for r in got[x]) for x in (True, False))
        print(f"{k}, median of {n}: warm {w:.2f} s, cold (--no-warm) {c:.2f} s: {c / w:.2f}x")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--victim", type=int, default=2, help="the node whose link is cut (1 = the master)")
    ap.add_argument("--steps", type=int, default=120, help="steps of the recovery run")
    ap.add_argument("--overhead-steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=2, help="runs each way for the copy overhead")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--warm-compare", type=int, default=0, metavar="N",
                    help="N cuts each with the warm interpreters (the cut once every node has one) and with "
                         "--no-warm, alternating, each at least --settle s into the run; then nothing else")
    ap.add_argument("--settle", type=float, default=40.0)
    ap.add_argument("--script", action="store_true",
                    help="with --warm-compare: tests/scripts/nanogpt_like.py (any script) instead of the trainer")
    args = ap.parse_args(argv)
    if args.warm_compare:
        return warm_compare(args.victim, args.steps, args.warm_compare, args.settle, args.script)
    if not args.skip_recovery:
        r = recovery(args.victim, args.steps)
        print(f"recovery: node{args.victim} cut for good; attempt 2 on {', '.join(r['nodes'])} "
              f"from {r['checkpoint']}")
        for k in ("detection", "teardown", "relaunch", "prepare", "restore", "preflight", "launch", "rendezvous",
                  "startup",
                  "first step", "unaccounted"):
            print(f"  {k:<12} {r[k]:6.2f} s" + (f"  ({r['startup parts']})" if k == "startup" else ""))
        print(f"  after detection: {r['after detection']:.2f} s (target <= 20 s: "
              f"{'met' if r['after detection'] <= 20 else 'MISSED'}); "
              f"failure to first step: {r['after detection'] + r['detection']:.2f} s", flush=True)
    if not args.skip_overhead:
        print(f"checkpoint copy overhead: preset tiny, 2 nodes, {args.overhead_steps} steps, a checkpoint every "
              f"20 steps, {args.repeat} runs each way", flush=True)
        o = overhead(args.overhead_steps, args.repeat)
        print(f"  copy off: step {o['off']['step_ms']:.0f} ms (trainer), {o['off']['wall_ms']:.0f} ms (wall)")
        print(f"  copy on:  step {o['on']['step_ms']:.0f} ms (trainer), {o['on']['wall_ms']:.0f} ms (wall)")
        worst = max(o["overhead_step_pct"], o["overhead_wall_pct"])
        print(f"  overhead: {o['overhead_step_pct']:+.1f} % (trainer step), {o['overhead_wall_pct']:+.1f} % (wall "
              f"per step) (target <= 5 %: {'met' if worst <= 5 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

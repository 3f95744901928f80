"""Goodput under faults: a run hit by a link cut, a kill -9, a hang and a straggler vs the same run unhurt.

    sudo .venv/bin/python bench/bench_goodput.py [--minutes 20] [--seed 1] [--repeat 1] [--steps N] [--spares 2] [--json FILE]

One invocation runs the same training twice (alternating, --repeat times each), each on a fresh
test cluster of 5 + --spares nodes (the issue: 2), the spares `spare: true`, so 5 train: the shipped trainer (preset nano,
batch 2, block 32, a progress line every step, a checkpoint every --ckpt-every steps), both with
`train --max-restarts 4 --min-nodes 3 --on-hang restart --on-straggler replace --hang-timeout 30
--lost-timeout 5` and the fast preflight.

  fault-free  nothing is done to it.
  faulted     four faults, in an order drawn from --seed, each at a random offset (drawn from the
              seed too) after the previous recovery, that is once the newest attempt's master has
              logged a step; the node hit is drawn from that attempt's nodes:
                link cut   the node's veth set down for good (`ip link set down`)
                kill -9    SIGKILL to the node's trainer process
                hang       SIGSTOP to the node's trainer process
                straggler  the node's trainer process held to 15 % of a core (a CFS quota: cgroup v2
                           cpu.max, else v1 cpu.cfs_quota_us, as tests/test_straggler_cluster.py,
                           with a 10 ms period: see `quota`)
              The trainer process is found as the tests find it: by the attempt's run key in its
              environment (CLUSTERCTL_RUN_KEY) with RANK set (torchrun has none).

Both runs train the same number of steps (--steps, else calibrated: a first short run on 5 nodes
measures the step rate, and the step count is what the fault-free run does in --minutes). Same
steps rather than the same wall budget: the final model is then the same model both ways, and
goodput = steps in the final model / wall time from launching `train` to its exit needs no
stopping rule; the ratio faulted / fault-free is the fault-free run's wall time over the faulted
one's. Target (issue 33, over 20 minutes): >= 0.97 (issue 21 asked for 0.8).

Printed, per run: wall time, final step, useful steps/s, the attempts (run.json) with their
verdicts; per fault: what was injected, when (from the launch), into which attempt at which step;
the verdict clusterctl recorded for that attempt; detection (injection -> the supervisor's
failed_at, else the moment it told the hang or straggler on stderr, else the attempt's end);
recovery (detection -> the next attempt's first step line on the control machine); the steps
redone (the last step the attempt reached - the checkpoint resumed from: a straggler, slowed,
still steps until it is stopped); back (injection -> the next attempt at that step); and lost:
back less the steps made between injection and the attempt's end at the fault-free run's steady
rate, an estimate of the fault's share of the wall-time difference (printed next to it). Every node shares this
machine's cores: a node left out gives its CPU to the others, so a run on fewer nodes may step
faster than on 5 (on real nodes it would not): the pair's line then says so, and also gives the
ratio from the lost time, fault-free wall / (fault-free wall + the faults' lost time), which that
does not flatter. With --spares 3 every node left out has a spare to take its place, the faulted
run ends on 5 nodes like the fault-free one, and the measured ratio needs no such caveat, but
another: the two runs come minutes apart, and this shared machine's speed moves between them by
more than the faults cost (the 20-minute pair of 2026-12-01: the faulted run's last attempt
stepped 16 % slower than the fault-free run, with no fault left running); the pair's drift line
gives both runs' step rates over their last TAIL_S seconds, and the measured ratio with the faulted
run's last span timed at the fault-free run's rate. The first attempt's rate is lower than either
on this machine: the spares' warm interpreters import torch in its first minute (the attempt's
nodes' before its first step, since 2026-12-02: its ranks fork from them). The
fault-free run is also the false-alarm check: its line says whom it named (a hang, a straggler, a
restart), which should be nobody. No assertions: this prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import (REPO, STEP, LogClock, cli, end_supervisor, record, run_dir_of, text_of,  # noqa: E402
                           training_process, wait_for)
from tests.cluster import TestCluster  # noqa: E402

NODES, SPARES = 5, 2
FLAGS = ["--max-restarts", "4", "--min-nodes", "3", "--on-hang", "restart", "--on-straggler", "replace",
         "--hang-timeout", "30", "--lost-timeout", "5"]
FAULTS = ("link cut", "kill -9", "hang", "straggler")
QUOTA = 0.15  # of one core, for the straggler
TARGET = 0.97  # issue 33 (over 20 minutes); issue 21 asked for 0.8
TAIL_S = 120.0  # each run's last seconds whose step rates tell the machine's drift between the runs
START_STEP = re.compile(r"\| start step (\d+)")


# ---------------------------------------------------------------- cluster and run
def inventory(cluster, path: Path, steps: int, ckpt_every: int, spares: int) -> str:
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    nodes = cluster.inventory()["nodes"]
    for nd in nodes[len(nodes) - spares:] if spares else ():
        nd["spare"] = True
    train = {"module": "trainer",
             "args": ["--preset", "nano", "--max-steps", str(steps), "--batch-size", "2", "--block-size", "32",
                      "--log-every", "1", "--ckpt-every", str(ckpt_every), "--eval-steps", "1",
                      "--sample-tokens", "0", "--output-dir", "out"]}
    return str(cluster.write_inventory(path, nodes=nodes, checks={"disk_min_gb": 0.1}, output_dir="out",
                                       env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, train=train))


class Train:
    """`clusterctl train` in the foreground: stdout to a file, stderr lines kept with their arrival
    time, the moment it exited."""

    def __init__(self, home: Path, out: Path, *args):
        env = dict(os.environ, CLUSTERCTL_HOME=str(home))
        self.t0 = time.time()
        self.out = open(out, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", *args], stdout=self.out,
                                     stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)
        self.err: list[tuple[float, str]] = []
        self.ended: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.err.append((time.time(), line.rstrip("\n")))
        self.proc.wait()
        self.ended = time.time()

    def running(self) -> bool:
        return self.ended is None

    def wait(self, timeout: float) -> bool:
        self._reader.join(timeout)
        return self.ended is not None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self._reader.join(10)
        self.out.close()

    def told(self, word: str, after: float) -> float | None:
        return next((t for t, ln in list(self.err) if t >= after and word in ln), None)


def steps_of(clock: LogClock, node: str, since: float = 0.0, until: float = float("inf")) -> list[tuple[float, int]]:
    """(arrival, step) of the trainer's step lines in `node`'s log that arrived in [since, until)."""
    out = []
    for t, s in list(clock.lines.get(node, [])):
        if since <= t < until and (m := STEP.match(text_of(s))):
            out.append((t, int(m.group(1))))
    return out


def stop_run(home: Path, run_dir: Path, train: Train) -> None:
    """Stop a run that ran past the bench's deadline (every node stopped), then the foreground."""
    rid = record(run_dir).get("id")
    if rid:
        cli(home, "stop", rid, timeout=180)
    if not train.wait(60):
        train.proc.kill()


# ---------------------------------------------------------------- faults
PERIOD_US = 10000  # the straggler's CFS period (tests/test_straggler_cluster.py Quota's default: 100 ms)


def quota(share: float):
    """A CPU quota on a process (tests/test_straggler_cluster.py Quota), but with a 10 ms CFS
    period instead of the default 100 ms: nano's step computes for ~13 ms here, so with 100 ms the
    rank gets its 15 ms in one go and is then parked for 85 ms, mostly where it waits in the
    all-reduce anyway (a bursty pause, not a slow CPU: in a trial it halved the whole run for 133 s
    and the straggler watch, which times compute, named nobody). 1.5 ms every 10 ms stretches every
    compute window, as a slow or throttled node does."""
    from tests.cluster.quota import Quota

    def missing(why: str):
        raise SystemExit(f"bench: {why} for the straggler")

    return Quota(share, PERIOD_US, missing)


def newest_stepping(run_dir: Path, clock: LogClock, after: int, train: Train, deadline: float) -> dict | None:
    """The newest attempt (numbered above `after`) once its master has logged a step; None if the
    run ended or the deadline passed first."""
    while train.running() and time.time() < deadline:
        atts = record(run_dir).get("attempts") or []
        if len(atts) > after:
            a = atts[-1]
            if a.get("ended") is None and steps_of(clock, a["nodes"][0], a["started"]):
                return a
        time.sleep(0.2)
    return None


def inject_all(cluster, run_dir: Path, clock: LogClock, train: Train, rng: random.Random, order: list[str],
               span: tuple[float, float], deadline: float, quota_box: list) -> list[dict]:
    by_name = {nd.name: nd for nd in cluster.nodes}
    done, after = [], 0
    for kind in order:
        a = newest_stepping(run_dir, clock, after, train, deadline)
        if a is None:
            done.append({"kind": kind, "injected": None,
                         "why": "the run ended or ran past the deadline before the previous fault's recovery"})
            continue
        offset = rng.uniform(*span)
        node = rng.choice(a["nodes"])
        first = steps_of(clock, a["nodes"][0], a["started"])[0][0]
        while train.running() and time.time() < first + offset:
            time.sleep(0.1)
        if not train.running():
            done.append({"kind": kind, "injected": None, "why": "the run ended before its moment"})
            continue
        f = {"kind": kind, "attempt": a["attempt"], "node": node, "offset": offset}
        if kind == "link cut":
            f["injected"] = time.time()
            by_name[node].link_down()
        else:
            p = wait_for(lambda: training_process(cluster, by_name[node], a["key"]) or (not train.running() and "gone"),
                         60, f"the trainer process on {node}")
            if p == "gone":
                done.append({"kind": kind, "injected": None, "why": "the run ended before its moment"})
                continue
            f.update(pid=p.pid, rank=int(p.environ().get("RANK", -1)))
            f["injected"] = time.time()
            if kind == "kill -9":
                os.kill(p.pid, signal.SIGKILL)
            elif kind == "hang":
                os.kill(p.pid, signal.SIGSTOP)
            else:
                quota_box.append(quota(QUOTA))
                quota_box[-1].add(p.pid)
        print(f"    +{f['injected'] - train.t0:6.1f} s  {kind} on {node}" +
              (f" (rank {f['rank']}, pid {f['pid']})" if "pid" in f else "") +
              f", attempt {a['attempt']}, {offset:.1f} s after its first step", flush=True)
        done.append(f)
        after = a["attempt"]
    return done


def fault_figures(f: dict, atts: list[dict], clock: LogClock, train: Train) -> dict:
    """Detection, recovery, steps redone and the time to be back where the fault struck, for one
    injected fault."""
    k, t = f["attempt"], f["injected"]
    a = atts[k - 1]
    nxt = atts[k] if len(atts) > k else None
    master = a["nodes"][0]
    before = steps_of(clock, master, a["started"], t)
    f["step_at_fault"] = before[-1][1] if before else 0
    f["verdict"], f["detail"] = a.get("verdict"), a.get("detail") or a.get("hang") or a.get("straggler")
    word = {"hang": "hang:", "straggler": "straggler:"}.get(f["kind"])
    told = train.told(word, t) if word else None
    detected = a.get("failed_at") or told or a.get("ended")
    f["detected_by"] = "failed_at" if a.get("failed_at") else "told" if told else "attempt end" if detected else None
    f["detection_s"] = detected - t if detected else None
    # a straggler, slowed, still steps until the attempt is stopped (and may save a checkpoint on
    # the SIGTERM): the step to get back to is the last one the attempt reached
    reached = steps_of(clock, master, a["started"], (a.get("ended") or float("inf")) + 1.0)
    f["step_reached"] = max(f["step_at_fault"], reached[-1][1] if reached else 0)
    if nxt is None:
        return f
    f["next_nodes"] = nxt["nodes"]
    after = steps_of(clock, nxt["nodes"][0], nxt["started"])
    m = re.search(r"(\d+)", nxt.get("checkpoint") or "")
    f["resumed_from"] = int(m.group(1)) if m else 0
    f["redone"] = f["step_reached"] - f["resumed_from"]
    if after:
        f["recovery_s"] = after[0][0] - detected if detected else None
        back = next((tt for tt, s in after if s >= f["step_reached"]), None)
        f["back_s"] = back - t if back else None
    return f


def steady_rate(r: dict, clock: LogClock, which: int = 0, tail_s: float | None = None) -> tuple[float, float] | None:
    """(steps per second, over how many seconds) of one attempt's master (the first: `which` 0; the
    last: -1), its first 10 s of steps left out; with `tail_s`, its last `tail_s` seconds only."""
    a = r["attempts"][which] if r["attempts"] else None
    got = steps_of(clock, a["nodes"][0], a["started"], a.get("failed_at") or float("inf")) if a else []
    got = [g for g in got if g[0] >= got[0][0] + 10] if got else []
    if got and tail_s is not None:
        got = [g for g in got if g[0] >= got[-1][0] - tail_s]
    if len(got) < 2 or got[-1][0] <= got[0][0]:
        return None
    return (got[-1][1] - got[0][1]) / (got[-1][0] - got[0][0]), got[-1][0] - got[0][0]


def one_run(label: str, faulted: bool, steps: int, ckpt_every: int, rng: random.Random | None,
            span: tuple[float, float], expect_s: float, spares: int = SPARES) -> dict:
    with TestCluster(n=NODES + spares, gpus=0, name_prefix="ccgp") as cluster, \
            tempfile.TemporaryDirectory(prefix="ccgp-") as d:
        td = Path(d)
        home = td / "home"
        inv = inventory(cluster, td / "nodes.yaml", steps, ckpt_every, spares)
        order = rng.sample(FAULTS, len(FAULTS)) if faulted else []
        if faulted:
            print(f"  {label}: faults in the order {', '.join(order)}", flush=True)
        train = Train(home, td / "stdout.txt", "-i", inv, *FLAGS)
        deadline = train.t0 + 3 * expect_s + 600
        quotas: list = []  # tests/test_straggler_cluster.py Quota
        faults: list[dict] = []
        try:
            run_dir = run_dir_of(home)
            clock = LogClock(run_dir / "nodes")
            if faulted:
                faults = inject_all(cluster, run_dir, clock, train, rng, order, span, deadline, quotas)
            if not train.wait(max(1.0, deadline - time.time())):
                print(f"  {label}: still running at the bench's deadline ({deadline - train.t0:.0f} s): stopped",
                      flush=True)
                stop_run(home, run_dir, train)
        finally:
            train.kill()
            for q in quotas:
                q.close()
        clock.stop()
        rec = record(run_dir)
        end_supervisor(rec)
        atts = rec.get("attempts") or []
        wall = (train.ended or time.time()) - train.t0
        last = max((s for a in atts for _, s in steps_of(clock, a["nodes"][0], a["started"])), default=0)
        if rec.get("state") == "finished" and train.proc.returncode == 0:
            final = steps
        else:  # the final model is the newest checkpoint that came home
            got = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("ckpt_*.pt")
                   if (m := re.search(r"ckpt_(\d+)", p.name))]
            final = max(got, default=0)
        tail = "\n".join(ln for _, ln in train.err[-15:])
        r = {"label": label, "faulted": faulted, "t0": train.t0, "exit": train.proc.returncode,
             "state": rec.get("state"), "wall_s": wall, "final_step": final, "last_step_seen": last,
             "goodput": final / wall,
             "attempts": [{k: a.get(k) for k in ("attempt", "nodes", "verdict", "detail", "checkpoint", "started",
                                                 "failed_at", "ended", "hang", "straggler")} for a in atts],
             "faults": [fault_figures(f, atts, clock, train) if f.get("injected") else f for f in faults],
             "order": order, "stderr_tail": tail}
        first, last = steady_rate(r, clock), steady_rate(r, clock, -1, TAIL_S)
        r["step_rate"] = first[0] if first else None
        r["last_rate"], r["last_span_s"] = last if last else (None, None)  # both runs' ends: the drift
        return r


# ---------------------------------------------------------------- calibration
def calibrate(ckpt_every: int, measure_s: float = 30.0, settle_s: float = 40.0,
              spares: int = SPARES) -> tuple[float, float]:
    """(steps per second, launch -> first step in seconds) of the run's settings on the runs' own
    cluster (5 nodes and the spares, whose warm interpreters and sshd share these cores), the
    steps counted from `settle_s` after the first: the spares' warm interpreters start at the first
    step and import torch for the next 10-20 s here, on the cores the ranks step on (counted
    from 10 s, the calibration undershot the runs' rate by about a fifth)."""
    with TestCluster(n=NODES + spares, gpus=0, name_prefix="ccgc") as cluster, \
            tempfile.TemporaryDirectory(prefix="ccgc-") as d:
        td = Path(d)
        home = td / "home"
        inv = inventory(cluster, td / "nodes.yaml", 10 ** 6, ckpt_every, spares)
        train = Train(home, td / "stdout.txt", "-i", inv, *FLAGS)
        master = cluster.nodes[0].name
        try:
            run_dir = run_dir_of(home)
            clock = LogClock(run_dir / "nodes")
            t_first = wait_for(lambda: steps_of(clock, master) or (not train.running() and "x"), 300,
                               "the calibration's first step")
            if t_first == "x":
                raise SystemExit("bench: the calibration run ended:\n" + "\n".join(ln for _, ln in train.err[-20:]))
            t_first = t_first[0][0]
            time.sleep(settle_s + measure_s)
            got = steps_of(clock, master, t_first + settle_s)
            stop_run(home, run_dir, train)
        finally:
            train.kill()
        clock.stop()
        end_supervisor(record(run_dir))
    if len(got) < 2:
        raise SystemExit("bench: the calibration run logged too few steps")
    return (got[-1][1] - got[0][1]) / (got[-1][0] - got[0][0]), t_first - train.t0


# ---------------------------------------------------------------- printing
def show_run(i: int, r: dict, base_rate: float | None) -> float:
    """Print one run; -> the seconds its faults cost (0 for the fault-free run)."""
    print(f"run {i} {'faulted' if r['faulted'] else 'fault-free'}: exit {r['exit']} ({r['state']}) in "
          f"{r['wall_s']:.1f} s, final step {r['final_step']} (last step line seen {r['last_step_seen']}), "
          f"{r['goodput']:.3f} useful steps/s" +
          (f"; steady {r['step_rate']:.2f} steps/s on its first attempt" if r.get("step_rate") else ""), flush=True)
    for a in r["attempts"]:
        print(f"    attempt {a['attempt']} on {','.join(a['nodes'])}" +
              (f" from {a['checkpoint']}" if a.get("checkpoint") else "") +
              f": {a.get('verdict')}" + (f" ({a['detail'][:140]})" if a.get("detail") else ""))

    def s(v):
        return "n/a" if v is None else f"{v:.1f} s"
    total = 0.0
    for f in r["faults"]:
        if not f.get("injected"):
            print(f"    {f['kind']}: not injected ({f['why']})")
            continue
        lost = None
        if f.get("back_s") is not None and base_rate:
            lost = f["back_s"] - (f["step_reached"] - f["step_at_fault"]) / base_rate
            f["lost_s"] = lost
            total += lost
        print(f"    {f['kind']} on {f['node']}" + (f" rank {f['rank']}" if "rank" in f else "") +
              f" at +{f['injected'] - r['t0']:.1f} s (attempt {f['attempt']}, step {f['step_at_fault']}): "
              f"verdict {f['verdict']!r}; detected in {s(f.get('detection_s'))} ({f.get('detected_by')}), the "
              f"attempt stopped at step {f['step_reached']}; next attempt's first step {s(f.get('recovery_s'))} "
              f"after detection, from step {f.get('resumed_from')} ({f.get('redone', 'n/a')} steps redone), back at "
              f"step {f['step_reached']} {s(f.get('back_s'))} after the fault: {s(lost)} lost")
    if r["exit"] != 0 or r["state"] != "finished":
        print("    the foreground's last lines:\n      " + r["stderr_tail"].replace("\n", "\n      "))
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="length of the fault-free run (the issue: 20)")
    ap.add_argument("--seed", type=int, default=1, help="draws the faults' order, moments and nodes")
    ap.add_argument("--repeat", type=int, default=1, help="pairs of runs, alternating which goes first")
    ap.add_argument("--steps", type=int, default=None, help="steps of both runs (default: calibrated to --minutes)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--spares", type=int, default=SPARES,
                    help="spare nodes (the issue: 2; three of the four faults leave a node out, so with 2 the "
                         "faulted run ends on 4 nodes, which step faster on this shared machine: 3 keeps it on 5 "
                         "and the measured ratio comparable)")
    ap.add_argument("--json", metavar="FILE", help="also write every figure there")
    args = ap.parse_args(argv)
    print(f"goodput under faults: {NODES} test nodes + {args.spares} spares, trainer nano (batch 2, block 32), a "
          f"checkpoint every {args.ckpt_every} steps; length "
          + (f"--steps {args.steps} per run" if args.steps else f"{args.minutes:g} min per fault-free run")
          + f"{'' if args.minutes == 20 and not args.steps else ' (the issue asks for 20 min)'}; seed {args.seed}, "
          f"{args.repeat} pair(s)")
    print(f"  both runs: train {' '.join(FLAGS)}", flush=True)
    expect = args.minutes * 60
    cal = None
    if args.steps:
        steps = args.steps
    else:
        rate, startup = calibrate(args.ckpt_every, spares=args.spares)
        steps = max(2 * args.ckpt_every, int(rate * (expect - startup)))
        cal = {"steps_per_s": rate, "startup_s": startup}
        print(f"calibration: {rate:.2f} steps/s on {NODES} nodes, {startup:.1f} s launch -> first step: "
              f"{steps} steps for ~{args.minutes:g} min", flush=True)
    # each fault comes 10 s .. an eighth of the expected length after the previous recovery's first step
    span = (10.0, max(20.0, expect / 8))
    print(f"  {steps} steps per run; each fault {span[0]:.0f}-{span[1]:.0f} s after the newest attempt's first "
          "step", flush=True)
    pairs = []
    for i in range(args.repeat):
        got = {}
        for faulted in ((False, True) if i % 2 == 0 else (True, False)):
            rng = random.Random(args.seed + i) if faulted else None
            r = one_run(f"run {i + 1} {'faulted' if faulted else 'fault-free'}", faulted, steps, args.ckpt_every,
                        rng, span, expect, args.spares)
            got[faulted] = r
        pairs.append(got)
    return report(args, steps, cal, pairs)


def drift(i: int, got: dict) -> None:
    """The machine's speed between the two runs: the faulted run's last attempt (on 5 nodes again
    with --spares 3) against the fault-free run, both at steady state. These test nodes share one
    machine's cores with whatever else it runs, and its speed moves by more than the faults cost
    over the minutes between the two runs: the measured ratio carries that; the line says how much,
    and what the ratio is with the last attempt timed at the fault-free run's rate."""
    base, last, span = got[False].get("last_rate"), got[True].get("last_rate"), got[True].get("last_span_s")
    if not base or not last or not span:
        return
    wall = got[True]["wall_s"] - span + span * last / base  # the faulted run's last span at the other's rate
    fixed = got[False]["wall_s"] / wall
    on = [len(got[f]["attempts"][-1]["nodes"]) if got[f]["attempts"] else NODES for f in (True, False)]
    cause = "this machine's drift" if on[0] == on[1] else "the faulted run's fewer nodes and this machine's drift"
    print(f"  pair {i}: steady step rate over the runs' last {span:.0f} s and {got[False]['last_span_s']:.0f} s "
          f"(on {on[0]} and {on[1]} nodes), faulted {last:.2f} steps/s against fault-free {base:.2f} "
          f"({last / base:.3f}x): {cause} between the runs; with that span timed at the fault-free rate, the "
          f"measured ratio would be {fixed:.3f}", flush=True)
    got[True]["drift"], got[True]["ratio_at_base_rate"] = last / base, fixed


def report(args, steps, cal, pairs) -> int:
    ratios, estimates, shrank = [], [], False
    for i, got in enumerate(pairs, 1):
        base = got[False].get("step_rate")
        show_run(i, got[False], None)
        named = [f"attempt {a['attempt']}: {a.get('hang') or a.get('straggler') or a.get('verdict')}"
                 for a in got[False]["attempts"] if a.get("hang") or a.get("straggler") or a.get("verdict") not in
                 (None, "finished", "running")]
        print(f"  pair {i}: the fault-free run ({got[False]['wall_s'] / 60:.1f} min) named "
              + ("nobody: no hang, no straggler, no restart" if not named else "; ".join(named) + " (a FALSE ALARM)"),
              flush=True)
        lost = show_run(i, got[True], base)
        ratio = got[True]["goodput"] / got[False]["goodput"]
        ratios.append(ratio)
        print(f"  pair {i}: goodput faulted / fault-free = {got[True]['goodput']:.3f} / {got[False]['goodput']:.3f} "
              f"= {ratio:.3f}; wall {got[True]['wall_s'] - got[False]['wall_s']:+.1f} s; the faults' lost time summed "
              f"{lost:.1f} s (an estimate: the step rate varies with this machine's load and the number of nodes)",
              flush=True)
        free = got[False]["wall_s"]
        fewer = len(got[True]["attempts"][-1]["nodes"]) if got[True]["attempts"] else NODES
        estimates.append(free / (free + lost))
        shrank = shrank or fewer < NODES
        drift(i, got)
        print(f"  pair {i}: from the lost time instead: {free:.1f} / ({free:.1f} + {lost:.1f}) = "
              f"{free / (free + lost):.3f}" + (
                  f"; the faulted run ended on {fewer} nodes, and on this machine, where every node shares the "
                  "same cores, fewer ranks step faster (not so on real nodes): the measured ratio is flattered by "
                  "that" if fewer < NODES else ""), flush=True)
    ratio = statistics.median(ratios)
    # a faulted run that ended on fewer nodes stepped faster here than it would on real nodes: its
    # measured ratio is flattered, so the verdict is judged on the lost-time estimate, and says so
    judged = statistics.median(estimates) if shrank else ratio
    how = (f"from the faults' lost time (the measured {ratio:.3f} is flattered: the faulted run ended on fewer "
           "nodes, which step faster on this shared machine)" if shrank else "measured")
    print(f"goodput ratio {judged:.3f} {how} ({'median of ' + str(len(ratios)) + ' pairs, ' if len(ratios) > 1 else ''}"
          f"fault-free runs of {statistics.median(g[False]['wall_s'] for g in pairs) / 60:.1f} min, {steps} steps, "
          f"seed {args.seed}): target >= {TARGET}: "
          f"{'PASS' if judged >= TARGET else 'MISSED'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"minutes": args.minutes, "seed": args.seed, "steps": steps,
                                               "ckpt_every": args.ckpt_every, "flags": FLAGS, "calibration": cal,
                                               "pairs": [[g[False], g[True]] for g in pairs], "ratios": ratios,
                                               "ratio": ratio, "estimates": estimates, "judged": judged,
                                               "target": TARGET}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

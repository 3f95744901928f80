"""The control plane's costs as curves over N test nodes x 8 ranks, with the light torchrun stand-in.

    sudo .venv/bin/python bench/bench_scale.py [8 32 64 256] [--repeat 3] [--tick 1] [--window 10] [--ranks-per-node 8]

For each N, one test cluster of N nodes and a spare (network namespaces with sshd, 8 fake GPUs each), whose
inventory's `python:` runs tests/cluster/fakes/torchrun.py for `-m torch.distributed.run` (a
static rendezvous, 8 `sleep` ranks per node carrying torchrun's environment, each writing its
own first line `[default<L>]:rank R up`, then one distinct line per rank every --tick seconds
written on its behalf; see that file for what it keeps of torchrun and what it does not).
Everything else is the product: `clusterctl train --skip-preflight --max-restarts 1 --no-warm` in the
foreground, its detached supervisor, the node agent, the log streams, the fail-fast teardown.

  first line   train command -> every rank's `rank R up` printed by the foreground `train`
  sup CPU      the supervisor's CPU (user+sys, all its threads, psutil on run.json's
               supervisor_pid) over --window s of steady state (every rank up, --tick lines
               flowing), in % of one core; the foreground `train`'s beside it
  RSS/threads/fds  the supervisor's, at the end of that window
  node scan ms one /proc scan for a run's marker (remote/common.py marked_pids, what every node's
               stop, waiter and stream repeat while a run ends there), run as the nodes' user on the
               first node. Each test node has a PID namespace of its own, so its /proc shows its own
               processes as a real machine's does; with --shared-proc (the harness before
               2026-12-01) every node's /proc shows every node's processes, so each of N nodes'
               scans reads N nodes' processes: quadratic on the test cluster alone
  status       `clusterctl status RUN` -> its first byte of output, and -> its exit; `runs` and
  runs, watch  `watch RUN --once` the same (the live view's first paint, off a terminal)
  straggler round CPU ms  the straggler judge's round over every rank's newest steps, in this process
               (StragglerWatch.check, one rank 3x slower: "straggler named" 1 when it is named, and
               alone); the progress reaching the supervisor is in its CPU above
  logs klines/s  every node's stand-in writes --burst-lines lines at once, shared out among its
               ranks (SIGUSR1: distinct lines; SIGUSR2: the same lines from every rank), timed from
               the signals to the last rank's closing line printed by the foreground `train`
               (folding on, the default; --no-fold for the other column). The bench reads
               the foreground's output on the same cores
  hang verdict s  one rank (of the middle node) stopped with SIGSTOP, which holds every rank of every
               node inside the stand-in's collective -> the hang watch's verdict file (train runs with
               --on-hang observe --hang-timeout 30); "hang named right" 1 when it names that rank alone.
               The verdict's snapshots ask every rank's hook: the stand-in answers for its ranks
  cut: ...     the last ranked node's link cut (ip link down): lost declared (attempt 1's recorded
               failure, this machine's clock) and every rank's first line of the attempt the spare
               joins, from the cut; the link then comes back and its part of attempt 1 is stopped
  teardown     SIGKILL of the last rank (on the spare, after the cut) -> no process carrying the run's
               CLUSTERCTL_RUN_KEY left on any node (this machine sees every node's processes: one
               scan, then what it found watched by pid every 5 ms, then a scan again; until
               2026-12-01 a whole scan every 5 ms, which took most of a core from the nodes);
               foreground `train` exit beside it
  ... sup CPU s  the supervisor's own CPU seconds for the launch (its start -> every rank's first
               line) and for the teardown: these do not stretch when the nodes crowd the cores,
               so they show the control side's growth where the wall-clock figures cannot

Each figure is printed with its growth factor against the smallest N. The nodes, their sshd and
agents, and the control process all share this machine's cores (2 on the machine this was
written on): node-side CPU lengthens every wall-clock figure here, which it would not on real
nodes. No assertions on seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench_failfast import run_pids, wait_for  # noqa: E402
from orchestrator.remote.agent_base import started_at  # noqa: E402  (a pid's start: tells it from a reuse)
from orchestrator.remote.common import env_values  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402
from tests.cluster.fakes import install_torchrun_standin  # noqa: E402

RANKS_PER_NODE = 8  # --ranks-per-node: the 8 GPUs a node; more puts more ranks on fewer nodes
# --real: what each rank runs under the real torchrun (no torch import: the launch chain is the subject)
REAL_SCRIPT = """import os, time
rank, tick, step = os.environ["RANK"], float(os.environ.get("CLUSTERCTL_STANDIN_TICK", "5")), 0
print(f"rank {rank} up", flush=True)
while True:
    time.sleep(tick if tick > 0 else 3600)
    step += 1
    print(f"rank {rank} step {step}", flush=True)
"""
UP = re.compile(rb"rank (\d+) up")
BURST_DONE = re.compile(rb"rank (\d+) burst (distinct|same) done")


class Foreground:
    """`clusterctl train` in the foreground; its output read as it comes, each rank's first line timed."""

    def __init__(self, inv: Path, home: Path, world: int, fold: bool = True):
        self.env = dict(os.environ, CLUSTERCTL_HOME=str(home), PYTHONPATH=str(REPO))
        self.world, self.seen, self.tail = world, {}, []
        self.ups: list[tuple[float, int]] = []  # every `rank R up` printed, of every attempt
        self.all_up = threading.Event()
        self.burst_done = {k: {} for k in ("distinct", "same")}  # kind -> rank -> when its `done` line was printed
        self.bursts_over = {k: threading.Event() for k in self.burst_done}
        self.t0 = time.monotonic()
        # --no-warm: the stand-in's ranks import no torch, and a warm interpreter on every node
        # (torch imported, ~290 MB each) would not fit 256 nodes on this machine
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv),
                                      "--skip-preflight", "--max-restarts", "1", "--no-warm", "--on-hang", "observe",
                                      "--hang-timeout", "30", *(() if fold else ("--no-fold",))],
                                     cwd=REPO, env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            now = time.monotonic()
            self.tail = (self.tail + [line])[-40:]
            if b" burst " in line:  # the bench's reading costs the shared cores too: one look per line
                for m in BURST_DONE.finditer(line):
                    got = self.burst_done[m.group(2).decode()]
                    got.setdefault(int(m.group(1)), now)
                    if len(got) >= self.world:
                        self.bursts_over[m.group(2).decode()].set()
                continue
            if b" up" in line:
                for m in UP.finditer(line):
                    self.seen.setdefault(int(m.group(1)), now)
                    self.ups.append((now, int(m.group(1))))
                if len(self.seen) >= self.world:
                    self.all_up.set()

    def wait_all_up(self, timeout: float) -> float | None:
        """Seconds from the command to the last rank's first line printed; None when not every rank's
        was printed within `timeout` (the foreground fell behind) while the run goes on."""
        deadline = time.monotonic() + timeout
        while not self.all_up.wait(0.2):
            if self.proc.poll() is not None:
                raise SystemExit(f"bench: train ended ({len(self.seen)}/{self.world} ranks seen):\n"
                                 + b"".join(self.tail).decode(errors="replace"))
            if time.monotonic() > deadline:
                return None
        return max(self.seen.values()) - self.t0


class ControlCopy:
    """Each rank's first line as it lands in the controller's copy of the node logs
    (runs/RUN/nodes/NODE.log), read as it grows: the stream without the foreground's printing."""

    def __init__(self, home: Path, t0: float, world: int):
        self.home, self.t0, self.world, self.seen, self.offsets = home, t0, world, {}, {}
        self.done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while not self.done.is_set() and len(self.seen) < self.world:
            for log in (self.home / "runs").glob("*/nodes/*.log") if (self.home / "runs").exists() else ():
                with open(log, "rb") as f:
                    f.seek(self.offsets.get(log, 0))
                    data = f.read()
                cut = data.rfind(b"\n") + 1
                self.offsets[log] = self.offsets.get(log, 0) + cut
                now = time.monotonic()
                for m in UP.finditer(data[:cut]):
                    self.seen.setdefault(int(m.group(1)), now)
            time.sleep(0.2)

    def all_up(self) -> float | None:
        self.done.set()
        return max(self.seen.values()) - self.t0 if len(self.seen) >= self.world else None


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def thread_cpu(pid: int) -> dict[int, float]:
    """Each thread's CPU seconds (user+sys) from /proc/PID/task/TID/stat."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_names(pid: int) -> dict[int, str]:
    """tid -> the Python thread's name, with the node's name taken out (`ping-node7` -> `ping-*`),
    from one `py-spy dump` (its threads are listed by their native id)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")  # the venv's (requirements-test)
    out = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=120).stdout
    names, tid, frames = {}, None, []
    for line in out.splitlines() + ["Thread 0 (end): \"\""]:
        m = re.match(r'Thread (\d+) \((?:idle|active|gil)[^)]*\): "(.*)"', line) or re.match(r'Thread (\d+) \(end\)', line)
        if m:
            if tid is not None and tid in names and names[tid].startswith("Thread-") and frames:
                names[tid] = frames[-1]  # an unnamed thread: its outermost frame below the bootstrap
            tid, frames = int(m.group(1)), []
            if m.lastindex == 2:
                names[tid] = re.sub(r"node\d+", "*", m.group(2)) or "?"
            continue
        fn = line.strip().split(" (")[0]
        if fn and not fn.startswith("Thread.") and not fn.startswith("Thread._"):
            frames.append(fn)
    return names


def steady(sup: psutil.Process, fg: psutil.Process, window: float, profile: Path | None = None) -> dict:
    threads0 = thread_cpu(sup.pid) if profile is not None else {}
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)
    c0, f0, t0 = cpu_s(sup), cpu_s(fg), time.monotonic()
    spy = None
    if profile is not None:  # where the GIL's holder is, sampled through the window: the Python work itself
        spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        spy = subprocess.Popen([spy_bin, "record", "--pid", str(sup.pid), "--gil", "--nonblocking", "--rate", "100",
                                "--duration", str(int(window)), "--format", "raw",
                                "--output", str(profile.with_suffix(".gil.txt"))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(window)
    dt = time.monotonic() - t0
    out = {"sup CPU %": 100 * (cpu_s(sup) - c0) / dt, "train CPU %": 100 * (cpu_s(fg) - f0) / dt,
           "sup RSS MiB": sup.memory_info().rss / 2**20, "sup threads": sup.num_threads(),
           "sup fds": sup.num_fds()}
    if profile is not None:  # the window's CPU by thread kind (after it: py-spy's dump costs the machine, not the window)
        threads1, names = thread_cpu(sup.pid), thread_names(sup.pid)
        kinds: dict[str, list] = {}
        for tid, c in threads1.items():
            k = kinds.setdefault(names.get(tid, "?"), [0.0, 0])
            k[0] += c - threads0.get(tid, 0.0)
            k[1] += 1
        try:
            spy.wait(120)
        except subprocess.TimeoutExpired:
            spy.kill()
        with open(profile, "w") as f:
            for name, (c, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
                f.write(f"{100 * c / dt:7.2f} %  {n:4d} threads  {name}\n")
    return out


SCAN = """
import statistics, time
took = []
for _ in range(5):
    t0 = time.perf_counter()
    found = marked_pids(RUN_KEY, lambda key: True)
    took.append(time.perf_counter() - t0)
print(1000 * statistics.median(took), len(found))
"""


def node_scan(cluster) -> dict:
    """The node side's /proc scan for run markers, timed as the nodes' user (see SCAN): on the first
    node, where each node has its own PID namespace (the default), else on this machine."""
    common = (REPO / "orchestrator" / "remote" / "common.py").read_text()
    if cluster.own_pids:
        out = cluster.nodes[0].run([cluster.python, "-"], input=common + SCAN, timeout=120)
    else:
        out = subprocess.run([sys.executable, "-"], input=common + SCAN, capture_output=True, text=True, timeout=120,
                             user=cluster.pw.pw_uid, group=cluster.pw.pw_gid, cwd="/")
    ms, marked = out.stdout.split()
    return {"node scan ms": float(ms), "marked procs": int(marked)}


def paint(name: str, argv: list[str], env: dict) -> dict:
    """`clusterctl ARGV` -> its first byte of output, and -> its exit."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *argv], cwd=REPO, env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.read(1)
    first = time.monotonic() - t0
    p.stdout.read()
    p.wait(120)
    return {f"{name} first s": first, f"{name} done s": time.monotonic() - t0}


def status_paint(run_id: str, env: dict) -> dict:
    """`status RUN`, `runs` and `watch RUN --once` of the running run, each first byte and exit."""
    return {**paint("status", ["status", run_id], env), **paint("runs", ["runs"], env),
            **paint("watch", ["watch", run_id, "--once"], env)}


def straggler_round(world: int, per_node: int, rounds: int = 5) -> dict:
    """The straggler judge's round over `world` ranks (runs/judge/straggler.py StragglerWatch.check,
    what the supervisor's watch thread does every PERIOD_S s with the streams' documents): each
    rank reports a window of new steps per round, rank world // 2 computing 3x the others; the
    median round's CPU milliseconds here, and whether that rank was named (the check's own answer)."""
    from orchestrator.runs.judge.straggler import DEFAULT_WINDOW, StragglerWatch

    named: list = []
    w = StragglerWatch(snap=list, node_of={r: f"node{r // per_node + 1}" for r in range(world)},
                       tell=lambda text: None, on_straggler=lambda new, cur: named.extend(new), say=lambda text: None,
                       streamed=True)
    took = []
    for k in range(rounds):
        docs = [{"rank": r, "answer": {"steps": [[k * DEFAULT_WINDOW + i, 0.3 if r == world // 2 else 0.1]
                                                 for i in range(DEFAULT_WINDOW)]}} for r in range(world)]
        t0 = time.process_time()  # CPU: the nodes crowding the cores stretch wall-clock time, not this
        w.check(docs)
        took.append(time.process_time() - t0)
    return {"straggler round CPU ms": 1000 * statistics.median(took),
            "straggler named": int([s.rank for s in named] == [world // 2])}


def log_bursts(fg: Foreground, run_id: str, per_rank: int) -> dict:
    """Every node's stand-in signalled to write `per_rank` lines from each of its ranks at once
    (SIGUSR1: distinct lines; SIGUSR2: the same lines from every rank, which folding prints once):
    lines/s from the signals to the last rank's `done` line printed by the foreground train."""
    standins = [pid for pid in run_pids(run_id, True) if "torchrun_standin" in " ".join(psutil.Process(pid).cmdline())]
    out = {}
    for kind, sig in (("distinct", signal.SIGUSR1), ("same", signal.SIGUSR2)):
        t0 = time.monotonic()
        for pid in standins:
            os.kill(pid, sig)
        if not fg.bursts_over[kind].wait(300):
            out[f"logs {kind} klines/s"] = None  # the foreground fell behind by minutes: no figure
            continue
        out[f"logs {kind} klines/s"] = per_rank * fg.world / (max(fg.burst_done[kind].values()) - t0) / 1000
    return out


def record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def cut_and_restart(fg: Foreground, cluster, run_dir: Path, timeout: float) -> dict:
    """The last ranked node's link cut (the spare is the cluster's last node): -> lost declared
    (attempt 1's recorded failure, on this machine's clock) and every rank's first line of the
    attempt the spare joins. The link comes back after; the cut node's part of attempt 1 is then
    stopped by its pending stop, waited for before the run goes on."""
    victim = cluster.nodes[-2]
    wall0, t0 = time.time(), time.monotonic()
    victim.link_down()
    try:
        rec = wait_for(lambda: (r := record(run_dir)) and len(r.get("attempts") or ()) >= 2 and r, timeout,
                       "attempt 2 to begin after the cut")
        failed_at = rec["attempts"][0].get("failed_at")
        firsts: dict[int, float] = {}

        def all_up() -> bool:
            for t, r in list(fg.ups):
                if t > t0:
                    firsts.setdefault(r, t)
            return len(firsts) >= fg.world
        wait_for(all_up, timeout, "every rank's first line in the attempt after the cut", interval=0.2)
        out = {"cut: lost declared s": failed_at - wall0 if failed_at else None,
               "cut: restart first line s": max(firsts.values()) - t0,
               "cut: verdict": rec["attempts"][0].get("verdict")}
    finally:
        victim.link_up()
    run_id = run_dir.name
    wait_for(lambda: not run_pids(run_id), 180, f"{victim.name}'s part of attempt 1 stopped once its link was back",
             interval=0.2)
    return out


def hang_verdict(run_dir: Path, rank: int, timeout: float) -> dict:
    """One rank stopped (SIGSTOP): every rank of every node then waits inside the stand-in's
    collective (tests/cluster/fakes/torchrun.py Collectives) -> the hang watch's verdict file
    (runs/RUN/hangs/N/verdict.json; the run goes on under --on-hang observe), and whether it names
    that rank and no other. The rank is let go after, and its next step line waited for."""
    pid = rank_pid(run_dir.name, rank)
    log = next((path for path in sorted((run_dir / "nodes").glob("*.log"))  # the rank's node's log: read
                if f":rank {rank} step " in path.read_text(errors="replace")), None)  # until found, not all
    before = log.stat().st_size if log else 0
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        found = wait_for(lambda: next(iter(run_dir.glob("hangs/*/verdict.json")), None), timeout,
                         "the hang watch's verdict on the stopped rank", interval=0.2)
        took = time.monotonic() - t0
        doc = json.loads(found.read_text())
    finally:
        os.kill(pid, signal.SIGCONT)
    if log is not None:
        wait_for(lambda: f":rank {rank} step " in log.read_bytes()[before:].decode(errors="replace"), timeout,
                 f"rank {rank}'s next step once it runs again", interval=0.2)
    named = [c.get("rank") for c in doc.get("culprits") or ()]
    return {"hang verdict s": took, "hang named right": int(named == [rank])}


def rank_pid(run_id: str, rank: int) -> int:
    for pid in run_pids(run_id, True):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if str(rank) in env_values(env, "RANK"):  # the script (torchrun has no RANK)
            return pid
    raise SystemExit(f"bench: no process of {run_id} carries RANK={rank}")


def gone_everywhere(run_id: str, until: float) -> bool:
    """No process of the run left on any node (this machine sees every node's): one scan of /proc, then
    the processes it found watched by pid until they are gone, then a scan again for any started
    meanwhile (as the node agent's wait_gone does). Scanning every few ms instead held most of a core
    of the two the nodes share at 64 nodes x 8 (a scan reads every process's environment: ~50 ms)."""
    while time.monotonic() < until:
        found = {pid: at for pid in run_pids(run_id, True) if (at := started_at(pid)) is not None}  # None: gone
        if not found:
            return True
        while found and time.monotonic() < until:
            time.sleep(0.005)
            found = {pid: at for pid, at in found.items() if started_at(pid) == at}
    return False


def left_of(run_id: str) -> list[str]:
    """What of the run is still running: node, pid, state and command line of up to 12 processes."""
    out = []
    for pid, node in list(run_pids(run_id, True).items())[:12]:
        try:
            p = psutil.Process(pid)
            out.append(f"{node} {pid} {p.status()} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            continue
    return out


def teardown(fg: Foreground, run_id: str, rank: int, sup: psutil.Process) -> dict:
    pid = rank_pid(run_id, rank)
    c0, t0 = cpu_s(sup), time.monotonic()
    os.kill(pid, signal.SIGKILL)
    if not gone_everywhere(run_id, time.monotonic() + 180):
        raise SystemExit("bench: timed out after 180s waiting for every node clean after the kill; left: "
                         + "; ".join(left_of(run_id)))
    clean = time.monotonic() - t0
    try:
        down_cpu = cpu_s(sup) - c0
    except psutil.NoSuchProcess:  # it ended with the run, between the last process and now
        down_cpu = None
    try:
        fg.proc.wait(180)
    except subprocess.TimeoutExpired:
        fg.proc.kill()
        raise SystemExit("bench: the foreground train did not end within 180 s of every node being clean")
    said = b"".join(fg.tail).decode(errors="replace")
    blamed = next((ln for ln in said.splitlines() if "failed first" in ln), "-")
    return {"teardown s": clean, "teardown sup CPU s": down_cpu, "train exit s": time.monotonic() - t0, "train exit code": fg.proc.returncode,
            "verdict": blamed.strip()[:200]}


def trial(cluster, inv: Path, home: Path, args) -> dict:
    """One run on the cluster: launch, steady state, status, kill a rank, every node clean."""
    world = (cluster.n - 1) * args.ranks_per_node  # the last node is the spare
    for old in (home / "runs").glob("*") if (home / "runs").exists() else ():
        shutil.rmtree(old)  # the previous trial's run: the watchers read only this one's
    fg = Foreground(inv, home, world, fold=not args.no_fold)
    copy = ControlCopy(home, fg.t0, world)
    sup = None
    try:
        first = fg.wait_all_up(args.launch_timeout)
        if first is None:  # the control copy may still have every rank: give it the same time
            wait_for(lambda: len(copy.seen) >= world, 60,
                     f"every rank's first line in the control copy (printed: {len(fg.seen)} of {world} ranks; "
                     f"in the control copy so far: {len(copy.seen)}; the foreground's last lines: "
                     f"{b''.join(fg.tail[-8:]).decode(errors='replace')!r})")
        out = {"first line, control copy s": copy.all_up(), "first line s": first,
               "ranks printed": len(fg.seen)}
        run_dir = next((home / "runs").glob("*/run.json")).parent
        sup = psutil.Process(json.loads((run_dir / "run.json").read_text())["supervisor_pid"])
        out["launch sup CPU s"] = cpu_s(sup)  # from its start: connect, claim, start, first lines
        time.sleep(args.settle)
        profile = (Path(args.profile) / f"sup-{cluster.n}-{time.strftime('%H%M%S')}.txt") if args.profile else None
        out.update(steady(sup, psutil.Process(fg.proc.pid), args.window, profile))
        out.update(node_scan(cluster))
        out.update(status_paint(run_dir.name, fg.env))
        out.update(straggler_round(world, args.ranks_per_node))
        if args.burst_lines and not args.real:
            out.update(log_bursts(fg, run_dir.name, burst_per_rank(args, cluster.n - 1)))
        if not args.real:  # the real chain's ranks (REAL_SCRIPT) enter no collective: no hang to name
            out.update(hang_verdict(run_dir, world // 2 + args.ranks_per_node - 3, args.launch_timeout))
        out.update(cut_and_restart(fg, cluster, run_dir, args.launch_timeout))
        out.update(teardown(fg, run_dir.name, world - 1, sup))
    finally:
        copy.done.set()
        if fg.proc.poll() is None:
            fg.proc.kill()
        keep_evidence(home, n=cluster.n - 1)
    return out


def keep_evidence(home: Path, n: int) -> None:
    """The run's record and the supervisor's log, kept under /tmp/bench-scale-evidence/N/ (the
    run's directory goes with the bench's temporary home); then the supervisor, if it outlived
    its foreground, is ended (its pid from run.json, checked to be this run's supervisor)."""
    for run_dir in (home / "runs").glob("*") if (home / "runs").exists() else ():
        dest = Path("/tmp/bench-scale-evidence") / str(n) / run_dir.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("run.json", "supervisor.log", "story.jsonl"):
            if (run_dir / name).exists():
                shutil.copy(run_dir / name, dest / name)
        try:
            pid = json.loads((run_dir / "run.json").read_text()).get("supervisor_pid")
            proc = psutil.Process(pid) if pid else None
            if proc is not None and run_dir.name in " ".join(proc.cmdline()):
                proc.kill()
                proc.wait(10)
        except (OSError, ValueError, psutil.Error):
            pass


def median(trials: list[dict]) -> dict:
    out = {}
    for k, v in trials[0].items():
        vals = [t[k] for t in trials if t[k] is not None]
        numeric = bool(vals) and all(isinstance(x, (int, float)) for x in vals) and k != "train exit code"
        out[k] = (statistics.median(vals) if vals else None) if numeric else v
    return out


def burst_per_rank(args, n: int) -> int:
    return max(1, args.burst_lines // (n * args.ranks_per_node))


def make_workdirs(cluster) -> None:
    """The inventory's workdir on every node, made through the node's home on this machine."""
    for nd in cluster.nodes:
        (nd.home / "gpt_train").mkdir()
        os.chown(nd.home / "gpt_train", cluster.pw.pw_uid, cluster.pw.pw_gid)


def standin_inventory(cluster, path: Path, nodes: list[dict], env: dict) -> Path:
    """The inventory at `path` whose `python:` runs the torchrun stand-in (see the module's doc)."""
    python = install_torchrun_standin(cluster.base_dir / "standin", cluster.python)
    return cluster.write_inventory(path, nodes=nodes, python=str(python), env=env)


def one_size(n: int, args) -> dict:
    t_up = time.monotonic()
    with TestCluster(n=n + 1, gpus=args.ranks_per_node, name_prefix="ccsc", own_pids=not args.shared_proc) as cluster, \
            tempfile.TemporaryDirectory(prefix="bench-scale-", ignore_cleanup_errors=True) as td:
        up = time.monotonic() - t_up
        make_workdirs(cluster)
        env = {"CLUSTERCTL_STANDIN_TICK": str(args.tick), "OMP_NUM_THREADS": "1",
               "CLUSTERCTL_STANDIN_BURST": str(burst_per_rank(args, n))}
        nodes = cluster.inventory()["nodes"]
        nodes[-1]["spare"] = True  # takes the cut node's place (cut_and_restart)
        if args.real:  # the real chain: torchrun and a script per rank that prints what the stand-in does
            script = cluster.base_dir / "ranks.py"
            script.write_text(REAL_SCRIPT)
            script.chmod(0o644)
            inv = cluster.write_inventory(Path(td) / "nodes.yaml", nodes=nodes, env=env, train={"script": str(script)})
        else:
            inv = standin_inventory(cluster, Path(td) / "nodes.yaml", nodes, env)
        repeat = args.repeat if n <= args.repeat_upto else 1
        trials = []
        for _ in range(repeat):
            try:
                trials.append(trial(cluster, inv, Path(td) / "home", args))
                print(json.dumps({"nodes": n, "trial": len(trials), **{k: round(v, 4) if isinstance(v, float) else v
                                                                        for k, v in trials[-1].items() if k != "verdict"}}),
                      flush=True)
            except SystemExit as e:  # this size failed: say why, keep the others
                print(f"bench: {n} nodes: {str(e)[:1500]}", flush=True)
                trials.append({"failed": str(e).splitlines()[0][:200]})
                break
        trials = [t for t in trials if "failed" not in t] or trials
    return {"cluster up s": up, "trials": repeat, **median(trials)}


def table(results: dict[int, dict], per: int = RANKS_PER_NODE) -> str:
    sizes = sorted(results)
    base = sizes[0]
    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    head = f"{'':28}" + "".join(f"{f'{n} x {per}':>20}" for n in sizes)
    rows = [head]
    for k in (k for k in keys if k not in ("verdict", "failed")):
        cells = []
        for n in sizes:
            v, b = results[n].get(k), results[base].get(k)
            if k in ("verdict", "failed"):
                continue
            if v is None:
                cells.append(f"{'-':>20}")
            elif n == base or not b or k in ("train exit code", "trials", "ranks printed") \
                    or not isinstance(v, (int, float)) or not isinstance(b, (int, float)):
                cells.append(f"{v:>20.4g}" if isinstance(v, float) else f"{str(v)[:20]:>20}")
            else:
                cells.append(f"{f'{v:.4g} ({v / b:.2f}x)':>20}")
        rows.append(f"{k:28}" + "".join(cells))
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", type=int, nargs="*", default=[8, 32, 64])
    ap.add_argument("--tick", type=float, default=5.0, help="seconds between each rank's lines at steady state")
    ap.add_argument("--window", type=float, default=10.0, help="steady-state sampling window, seconds")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after every rank is up before sampling")
    ap.add_argument("--launch-timeout", type=float, default=600.0)
    ap.add_argument("--real", action="store_true",
                    help="the real torchrun (and a small script per rank) instead of the stand-in")
    ap.add_argument("--profile", metavar="DIR", help="the supervisor's steady-window CPU by thread kind "
                    "(/proc per thread, names from py-spy dump) written to DIR/sup-N-HHMMSS.txt, and "
                    "py-spy's samples of the GIL's holder (raw) to DIR/sup-N-HHMMSS.gil.txt")
    ap.add_argument("--burst-lines", type=int, default=200_000,
                    help="lines of each log burst, shared out among the ranks (0: no bursts)")
    ap.add_argument("--no-fold", action="store_true", help="the foreground train with --no-fold")
    ap.add_argument("--repeat", type=int, default=3, help="runs per size (medians printed)")
    ap.add_argument("--ranks-per-node", type=int, default=RANKS_PER_NODE,
                    help="ranks (fake GPUs) per node: 64 nodes x 32 puts 2,048 ranks where 256 nodes do not fit")
    ap.add_argument("--repeat-upto", type=int, default=64, help="larger sizes run once")
    ap.add_argument("--shared-proc", action="store_true",
                    help="the test nodes share this machine's PID namespace, so each node's /proc shows every "
                         "node's processes (the harness before 2026-12-01); by default each node has its own, as "
                         "a real machine has")
    args = ap.parse_args(argv)
    what = "real torchrun" if args.real else "torchrun stand-in"
    print(f"bench_scale: N nodes x {args.ranks_per_node} ranks ({what}), tick {args.tick}s, window "
          f"{args.window}s, folding {'off' if args.no_fold else 'on'}, log bursts of {args.burst_lines} lines. The nodes share this machine's {psutil.cpu_count()} cores with the control "
          "process: node-side CPU lengthens every wall-clock figure.", flush=True)
    results = {}
    for n in args.sizes:
        results[n] = one_size(n, args)
        print(json.dumps({"nodes": n, **{k: round(v, 4) if isinstance(v, float) else v
                                         for k, v in results[n].items()}}), flush=True)
    growth = "; growth factors against " + f"{min(results)} nodes" if len(results) > 1 else ""
    print(f"\nper size (N nodes x {args.ranks_per_node} ranks{growth}):")
    print(table(results, args.ranks_per_node))
    for n, r in results.items():
        if "failed" in r:
            print(f"{n} nodes: FAILED: {r['failed']}")


if __name__ == "__main__":
    main()

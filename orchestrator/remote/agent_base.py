"""The node agent's shared ground (node_agent.py and its modules): where a run's directory is
(~/.clusterctl/node-runs/KEY), reading its files, finding its processes by the run key, and the
small waits and threads every part of the agent uses.
"""
import json
import os
import sys
import time

from .common import NODE_RUNS, RUN_KEY, marked_pids, safe_name

BASE = NODE_RUNS  # common.py
HOOK = "hook"  # RUNDIR/hook: the ranks' snapshot FIFOs (PID.fifo) and answers (PID.N.json)


def rundir(run_id):
    if not safe_name(run_id):
        sys.exit("bad run id")
    return os.path.join(BASE, run_id)


def read(path, default=None):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def proc_info(d):
    """RUNDIR/proc.json as the waiter wrote it (torchrun's pid and group, the waiter's pid, "wake"),
    {} before it is written."""
    return json.loads(read(os.path.join(d, "proc.json"), "{}") or "{}")


def run_pids(run_id, match=None):
    """This user's processes whose environment carries CLUSTERCTL_RUN_KEY=key (or, with
    `match`, a run key for which match(key) is true)."""
    return marked_pids(RUN_KEY, match or (lambda key: key == run_id))


def listening(pids, hook, root=lambda pid: ""):
    """Those of `pids` whose hook listens in `hook` (its PID.fifo: sitecustomize.py's snapshot
    door), the rank's own interpreter: a rank forked from the run's warm interpreter has the
    process torchrun started beside it, standing in, with the same RANK. `root(pid)`: the prefix
    the directory is seen through (a reader outside the node's mount namespace: /proc/PID/root)."""
    return [p for p in pids if hook and os.path.exists(os.path.join(root(p) + hook, f"{p}.fifo"))]


def own_interpreter(pids, hook, ppid):
    """Of one rank's processes (its data-loader workers carry its RANK too), the rank's own: the
    topmost one that listens, else the topmost. `ppid(pid)`: its parent's pid."""
    pick = listening(pids, hook) or list(pids)
    tops = [p for p in pick if ppid(p) not in pick]
    return min(tops or pick)


def started_at(pid):
    """The start time of process `pid` (clock ticks since boot), or None when it is gone or a zombie:
    with the pid, what tells a process from a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def wait_gone(find, until, found=None):
    """Wait until find() (a /proc scan for a run's processes) finds none, or the time `until`
    passes; whether none is left. The processes one scan found (`found`: those of a scan just
    made) are watched by pid and start time (a read of /proc/PID/stat each) until they are gone;
    only then is the scan repeated, for any they started meanwhile: a scan reads every process
    of the node, and while a run ends there the stop and the waiter each wait like this."""
    step = 0.01
    while True:
        left = {pid: started_at(pid) for pid in (find() if found is None else found)}
        found = None
        left = {pid: at for pid, at in left.items() if at is not None}
        if not left:
            return True
        while left and time.time() < until:
            time.sleep(min(step, max(0.0, until - time.time())))
            step = min(step * 2, 0.1)
            left = {pid: at for pid, at in left.items() if started_at(pid) == at}
        if left:
            return False


def pgid_of(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def save_seconds(d):
    try:
        return float(read(os.path.join(d, "save_seconds"), "") or 0)
    except ValueError:
        return 0.0


def wait_until(done, until):
    """Poll done() until it is true or the time `until` passes, every 10 ms at first, then
    less often (each poll may scan /proc); done()'s last value."""
    step = 0.01
    while not (ok := done()) and time.time() < until:
        time.sleep(min(step, max(0.0, until - time.time())))
        step = min(step * 2, 0.1)
    return ok


def threading_start(fn, *args):
    import threading

    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t

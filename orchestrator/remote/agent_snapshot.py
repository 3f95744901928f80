"""The node agent's `snapshot`: each rank's /proc state (rank_procs) and what its hook answers to a
request (its Python stacks and Flight Recorder, or its newest steps' progress), with py-spy reading
from outside a rank whose hook does not answer.
"""
import glob
import json
import os
import sys
import time

from .agent_base import HOOK, own_interpreter, proc_info, read, rundir, run_pids, wait_until
from .common import proc_environ


def proc_stat(pid):
    """(state, ppid, cpu seconds) of a process from /proc/PID/stat; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_io(pid):
    """Bytes the process read from and wrote to storage (/proc/PID/io; None where unreadable)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            got = dict(line.split(": ") for line in f.read().splitlines() if ": " in line)
        return int(got["read_bytes"]) + int(got["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def rank_procs(run_id, torchrun_pid, hook=None):
    """{pid: {"rank", "local_rank", "state", "ppid", "cpu_s", "wchan", "tree_cpu_s", "io", "at"}} for each
    rank of the run on this node: of the processes with that RANK that are not torchrun (a rank's
    data-loader workers carry its RANK too), its own interpreter (agent_base.own_interpreter);
    tree_cpu_s and io (disk bytes) are those of all of them together, read at `at` (the hang
    watch's sign that a rank works: runs/judge/hangrule.py)."""
    found = {}
    for pid in run_pids(run_id):
        if pid == torchrun_pid:
            continue
        env = proc_environ(pid, ("RANK", "LOCAL_RANK"))
        st = proc_stat(pid)
        if "RANK" not in env or st is None:
            continue
        found[pid] = {"pid": pid, "rank": int(env["RANK"]) if env["RANK"].isdigit() else env["RANK"],
                      "local_rank": env.get("LOCAL_RANK"), "state": st[0], "ppid": st[1], "cpu_s": st[2],
                      "wchan": (read(f"/proc/{pid}/wchan", "") or "").strip()}
    out = {}
    for rank in dict.fromkeys(p["rank"] for p in found.values()):
        group = [pid for pid, p in found.items() if p["rank"] == rank]
        pid = own_interpreter(group, hook, lambda p: found[p]["ppid"])
        ios = [disk_io(p) for p in group]
        out[pid] = dict(found[pid], at=time.time(), tree_cpu_s=round(sum(found[p]["cpu_s"] for p in group), 3),
                        io=sum(i for i in ios if i is not None) if any(i is not None for i in ios) else None)
    return out


def open_fifo(path, until, pid=None):
    """(fd, "") of a rank's request FIFO opened for writing, else (None, the rank's error). While
    the hook answers another request (the straggler watch's, the hang watch's) nobody reads it
    (ENXIO): it reads again within moments, so that is waited for, until `until` (time.time()),
    and for process `pid` stopped, STOPPED_WAIT_S at most (its hook reads again only once it runs)."""
    t0 = time.time()
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK), ""
        except OSError as e:
            if e.errno != 6 or time.time() > until:
                return None, "no hook answers in it" + ("" if e.errno in (2, 6) else f" ({e.strerror})")
        if pid is not None and time.time() - t0 >= STOPPED_WAIT_S and (proc_stat(pid) or "X")[0] in "TtXZ":
            return None, STOPPED
        time.sleep(0.05)


def snapshot(run_id, request, wait, what="stacks"):
    """Prints `snapshot_doc`."""
    print(json.dumps(snapshot_doc(run_id, request, wait, what)))


def snapshot_doc(run_id, request, wait, what="stacks"):
    """Every rank of the run on this node: its /proc state, and what its hook answers to request
    N within `wait` s (its threads' Python stacks, its Flight Recorder; with what=progress, its
    newest steps only). A dead process is not asked, nor a stopped (T) one for its stacks (a hang's
    culprit: py-spy reads it from outside); a stopped one is asked for its progress, which it
    answers once it runs again within `wait` (a rank throttled by stops is a straggler, not a
    hang), no longer than STOPPED_WAIT_S once only stopped ones have not answered. {"ranks": [...],
    "time"}."""
    d = rundir(run_id)
    hook = os.path.join(d, HOOK)
    info = proc_info(d)
    ranks = rank_procs(run_id, info.get("pid"), hook)
    asked = {}
    # how long a busy hook (answering another asker's request) is waited for: half the wait, at least
    # 3 s; a rank spinning in Python lends its hook the GIL in 5 ms slices, so an answer can take seconds
    busy_until = time.time() + max(3.0, float(wait) / 2)
    for pid, p in ranks.items():
        if p["state"] in "ZX" or (p["state"] in "Tt" and what != "progress"):
            p["error"] = "not asked: the process is stopped" if p["state"] in "Tt" else "not asked: it ended"
            continue
        drop_stale_answers(hook, pid)
        if os.path.exists(os.path.join(hook, f"{pid}.exiting")):  # its script ended (the hook's atexit)
            p["exiting"], p["error"] = True, "not asked: it is exiting (its script ended)"
            continue
        fd, why = open_fifo(os.path.join(hook, f"{pid}.fifo"), busy_until, pid)
        if fd is None:
            p["error"] = why
            continue
        tag = ("p" if what == "progress" else "") + str(int(request))
        try:
            os.write(fd, tag.encode() + b"\n")  # a line: another asker's may arrive in the same read
        finally:
            os.close(fd)
        asked[pid] = os.path.join(hook, f"{pid}.{tag}.json")
    asked_at = time.time()
    wait_until(lambda: answered(asked, what, asked_at), asked_at + float(wait))
    for pid, path in asked.items():
        try:
            with open(path) as f:
                ranks[pid]["answer"] = json.load(f)
            os.unlink(path)
        except (OSError, ValueError):
            st = proc_stat(pid)
            ranks[pid]["error"] = STOPPED if st is not None and st[0] in "Tt" else f"no answer within {float(wait):g}s"
        st = proc_stat(pid)  # after the wait: a process stopped meanwhile says so
        if st is not None:  # the tree's CPU grows by what the rank spent meanwhile: never less than the rank's
            grew = max(0.0, st[2] - ranks[pid]["cpu_s"])
            ranks[pid]["state"], ranks[pid]["cpu_s"] = st[0], st[2]
            ranks[pid]["tree_cpu_s"] = round(ranks[pid].get("tree_cpu_s", 0.0) + grew, 3)
    silent = [pid for pid, p in ranks.items() if "answer" not in p and p["state"] not in "ZX"]
    if what != "progress" and silent:  # ranks whose hook did not answer (stopped, holding the GIL): py-spy
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, len(silent))) as pool:  # at once: each may take PY_SPY_S
            for pid, (found, why) in zip(silent, pool.map(py_spy_stacks, silent)):
                ranks[pid]["pyspy"] = found if found is not None else why
    return {"ranks": sorted(ranks.values(), key=lambda p: str(p["rank"])), "time": time.time()}


def answered(asked, what, asked_at):
    """Whether every rank asked answered, or, for progress, only ranks stopped for good (or gone)
    are left, STOPPED_WAIT_S after asking: they never answer, one throttled by stops (the drill's
    runs every 0.2 s) has by then, and the hang watch learns of the stop without the whole wait."""
    missing = [pid for pid, a in asked.items() if not os.path.exists(a)]
    return not missing or (what == "progress" and time.time() - asked_at >= STOPPED_WAIT_S and
                           all((proc_stat(pid) or "X")[0] in "TtXZ" for pid in missing))


PY_SPY_S = 10.0  # one py-spy dump's limit
STOPPED_WAIT_S = 1.5  # a progress request waits no longer than this for ranks that are stopped
STOPPED = "not answered: the process is stopped"  # a rank asked, or about to be, that stays stopped
STALE_ANSWER_S = 120.0  # a hook's answer file nobody read for this long: its asker gave up on it


def drop_stale_answers(hook, pid):
    """Answers the rank wrote after their asker stopped waiting (a rank stopped past the wait
    answers when it runs again): removed once old, so the hook directory does not fill up."""
    cut = time.time() - STALE_ANSWER_S
    for path in glob.glob(os.path.join(hook, f"{pid}.*.json")):
        try:
            if os.stat(path).st_mtime < cut:
                os.unlink(path)
        except OSError:
            pass


def py_spy_stacks(pid):
    """The process's Python stacks read from outside by py-spy (`dump --nonblocking`: the process
    is not paused, so a stopped one stays stopped), in the hook's shape (outermost frame first,
    the main thread first) -> (stacks, None), or (None, why not): py-spy not installed (next to
    this python or on PATH), or ptrace not allowed (Ubuntu's kernel.yama.ptrace_scope=1 forbids
    it on a process that is not this one's descendant, unless root)."""
    import shutil
    import subprocess

    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    exe = exe if os.access(exe, os.X_OK) else shutil.which("py-spy")
    if exe is None:
        return None, "py-spy is not installed"
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid), "--json", "--nonblocking"], capture_output=True,
                           timeout=PY_SPY_S, stdin=subprocess.DEVNULL)
        doc = json.loads(r.stdout) if r.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return None, "py-spy: %s" % (type(e).__name__,)
    if not isinstance(doc, list):
        err = r.stderr.decode(errors="replace").strip().splitlines()
        return None, "py-spy: " + (err[-1][:200] if err else "exit %d" % r.returncode)
    import sysconfig

    libs = tuple({os.path.realpath(v) + os.sep for k, v in sysconfig.get_paths().items()
                  if k in ("stdlib", "platstdlib", "purelib", "platlib")})  # as the hook marks library frames
    threads = []
    for t in doc:
        frames = [{"file": f.get("filename"), "line": f.get("line"), "func": f.get("name"), "code": "",
                   "lib": os.path.realpath(f.get("filename") or "").startswith(libs)}
                  for f in reversed(t.get("frames") or [])]
        threads.append({"thread": t.get("thread_name") or str(t.get("thread_id")),
                        "main": t.get("thread_name") == "MainThread", "frames": frames})
    threads.sort(key=lambda t: not t["main"])
    return threads, None

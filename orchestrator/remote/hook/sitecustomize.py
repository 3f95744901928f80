"""clusterctl's hook in each rank of a run: answers a snapshot request with the rank's Python
stacks and its Flight Recorder, without the script's help and without ptrace.

The node agent writes this file into the run directory (RUNDIR/py/) and puts that directory in
front of the job's PYTHONPATH, so every Python process of the run imports it at start-up, before
the script. Where the node keeps the run's warm interpreter (CLUSTERCTL_WARM), a rank, and torchrun
itself, are forked from it, this process standing in (_warm; warm_client.py). In a rank (RANK is
set) it then hands stdout and stderr to the node's waiter, which writes them into the run's log as
whole lines tagged `[default<LOCAL_RANK>]:` and notes when a rank failed (_lines; agent_lines.py
RankLines). Then it makes a FIFO, CLUSTERCTL_HOOK_DIR/PID.fifo, and a daemon thread that waits in
open() on it: no CPU is spent until the node agent's `snapshot` writes a request number N there.
The thread then writes PID.N.json (whole, by rename): every thread's Python stack
(sys._current_frames, which works while the main thread waits inside a collective) and, when
torch.distributed is initialised, the Flight Recorder's dump (torch._C._distributed_c10d
._dump_fr_trace: pg_status per process group, the last entries with collective_seq_id and
profiling_name). A rank that cannot run Python (stopped, in D state) does not answer; the agent
reports its /proc state instead.

A request pN (the nodes' log streams ask every few seconds: the straggler and hang watches,
runs/judge/straggler.py, runs/judge/hangwatch.py) is answered with the rank's progress only,
PID.pN.json: the compute time of its newest steps, as the script reported them through
`clusterctl_step(step, compute_s)` (the shipped trainer does: trainer/progress.py), about 1 ms of
the rank's CPU, and per process group the newest collective entered and the newest completed (the
Flight Recorder's pg_status, a few microseconds): a rank inside a collective is one whose entered
is past its completed. A script that reports nothing gets, instead, when each of its newest
collectives was entered on this rank (the Flight Recorder's [pg_id, collective_seq_id,
time_created_ns], without stack traces: about 3 ms for 300 entries); no stacks either way.

At exit, after the script's own atexit handlers, a rank with torch.distributed initialised waits
while another of its threads is still runnable (about 20 ms, at most SETTLE_S): gloo's worker
freeing a collective's tensors after the script moved on would otherwise meet Python's
finalization and abort the rank, its exit code lost (_settle).

Stdlib only, nothing imported at the top but os and sys, nothing done outside a rank but _warm. The
Debian/Ubuntu sitecustomize this file shadows (or any other on the path) is run after it.
"""
import os
import sys

HOOK_ENV = "CLUSTERCTL_HOOK_DIR"
FR_ENTRIES = 64  # the newest Flight Recorder entries sent per rank
FRAMES = 40  # innermost frames sent per thread
STEPS_KEPT = 512  # the newest steps a rank keeps for a progress answer
SETTLE_S = 0.5  # the most a rank's exit waits for its other threads to stop running (_settle)
_steps = []  # [(step, compute_s, at)], newest last: what clusterctl_step was told, and when (the
# rank's monotonic clock, ms: the straggler watch measures how long a rank has been slow by it)
LINES_ENV = "CLUSTERCTL_LINES"  # the waiter's socket that takes the rank's output pipes (_lines)
LINES_PID_ENV = "CLUSTERCTL_LINES_PID"  # set once a rank handed its output over: its children inherit it
LINES_WAIT_S = 10.0  # how long the hand-over may take before the rank writes untagged
_said = []  # [(the rank's pid, its connection to the waiter)]


def clusterctl_step(step, compute_s):
    """A script tells clusterctl one step's compute time on this rank's own clock (the time it
    computed, its waits in collectives left out): the straggler watch compares ranks by it."""
    import time

    _steps.append((int(step), float(compute_s), round(time.monotonic(), 3)))
    if len(_steps) > 2 * STEPS_KEPT:
        del _steps[:STEPS_KEPT]


def _lib_dirs():
    import sysconfig

    out = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            out.add(os.path.realpath(p) + os.sep)
    return tuple(out)


def _stacks():
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    libs = _lib_dirs()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames = []
        for fs in traceback.extract_stack(frame)[-FRAMES:]:
            path = os.path.realpath(fs.filename) if fs.filename and not fs.filename.startswith("<") else fs.filename
            frames.append({"file": fs.filename, "line": fs.lineno, "func": fs.name, "code": (fs.line or "")[:160],
                           "lib": bool(path) and path.startswith(libs)})
        out.append({"thread": names.get(ident, str(ident)), "main": ident == main, "frames": frames})
    out.sort(key=lambda t: not t["main"])
    return out


def _flight_recorder():
    """The Flight Recorder's newest entries and every group's status and config, without the
    entries' stack traces: torch's first dump with them imports torch._inductor into the rank
    (about 800 modules, 1.2-2.6 s of its CPU, measured on torch 2.13), and where a rank is now is
    in its own stacks (_stacks)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    import pickle

    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace")
    doc = pickle.loads(dump(includeStackTraces=False))
    entries = []
    for e in (doc.get("entries") or [])[-FR_ENTRIES:]:
        entries.append({"pg_id": e.get("pg_id"), "process_group": list(e.get("process_group") or ()),
                        "collective_seq_id": e.get("collective_seq_id"), "p2p_seq_id": e.get("p2p_seq_id"),
                        "profiling_name": e.get("profiling_name"), "state": e.get("state"),
                        "input_sizes": e.get("input_sizes"), "time_created_ns": e.get("time_created_ns"),
                        "is_p2p": e.get("is_p2p")})
    status = {str(k): {kk: int(vv) for kk, vv in v.items()} for k, v in (doc.get("pg_status") or {}).items()}
    config = {str(k): {"name": v.get("name"), "desc": v.get("desc"), "ranks": str(v.get("ranks"))}
              for k, v in (doc.get("pg_config") or {}).items()}
    return {"pg_status": status, "pg_config": config, "entries": entries}


def _pg_status():
    """{pg_id: [last collective entered, last completed]}: the Flight Recorder's pg_status alone,
    without its entries (about 6 us; the entries cost about 60 ms at 2000). Empty before the
    rank's first collective, None without torch.distributed."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    import pickle

    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace")
    status = pickle.loads(dump(includeCollectives=False, includeStackTraces=False)).get("pg_status") or {}
    return {str(k): [int(v.get("last_enqueued_collective", -1)), int(v.get("last_completed_collective", -1))]
            for k, v in status.items()}


def _answer(d, request):
    import json
    import time

    doc = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "local_rank": os.environ.get("LOCAL_RANK"),
           "request": request, "time": time.time(), "step": _steps[-1][0] if _steps else None}
    try:
        doc["stacks"] = _stacks()
    except Exception as e:  # noqa: BLE001 - the answer says what could not be read
        doc["stacks_error"] = f"{type(e).__name__}: {e}"
    try:
        doc["fr"] = _flight_recorder()
    except Exception as e:  # noqa: BLE001
        doc["fr_error"] = f"{type(e).__name__}: {e}"
    path = os.path.join(d, f"{os.getpid()}.{request}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def _entered():
    """[[pg_id, collective_seq_id, time_created_ns]] of the newest collectives (no p2p)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    import pickle

    from torch._C import _distributed_c10d as c10d

    doc = pickle.loads(c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=False))
    out = [[str(e.get("pg_id")), e["collective_seq_id"], e["time_created_ns"]] for e in doc.get("entries") or ()
           if not e.get("is_p2p") and e.get("collective_seq_id") and e.get("time_created_ns")]
    return out[-STEPS_KEPT:]


def _progress(d, request):
    import json
    import time

    doc = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "request": request, "time": time.time(),
           "steps": _steps[-STEPS_KEPT:]}
    try:
        doc["pgs"] = _pg_status()
    except Exception as e:  # noqa: BLE001 - the answer says what could not be read
        doc["pgs_error"] = f"{type(e).__name__}: {e}"
    if not _steps:
        try:
            doc["entered"] = _entered()
        except Exception as e:  # noqa: BLE001 - the answer says what could not be read
            doc["entered_error"] = f"{type(e).__name__}: {e}"
    path = os.path.join(d, f"{os.getpid()}.{request}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def _serve(d, fifo):
    while True:
        try:
            with open(fifo, "rb") as f:  # blocks (GIL released) until the node agent writes
                requests = f.read().decode(errors="replace").split()  # one a line: two askers at once
        except OSError:
            return
        for request in requests:
            if request.isdigit() or (request[:1] == "p" and request[1:].isdigit()):
                try:
                    (_progress if request[0] == "p" else _answer)(d, request)
                except Exception:  # noqa: BLE001 - never disturb the job; the agent sees no answer
                    pass


def _runnable(me):
    """How many of this process's threads other than `me` (a native thread id) are runnable."""
    n = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # no /proc: nothing to wait for that we could see
        return 0
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                n += f.read().rsplit(b")", 1)[1].split()[:1] == [b"R"]
        except OSError:  # the thread ended
            continue
    return n


def _settle():
    """At exit, after the script's own atexit handlers and before Python's finalization: while
    another thread of the rank is runnable, hand it the GIL (sleep), at most SETTLE_S.

    gloo's worker thread frees a finished collective's work after the collective's wait() has
    returned, and that drops the last reference to the tensors' Python objects, which takes the
    GIL. A rank that exits right after a collective (`sys.exit(3)` mid-run) could reach
    finalization first: the worker's GIL take then ends the thread inside a noexcept destructor,
    std::terminate, SIGABRT, and the script's exit code 3 is reported as signal 6 (torch 2.13,
    gloo; about 1 exit in 3 on this 2-core machine, bench/bench_exit_abort.py)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    import threading
    import time

    me = str(threading.get_native_id())
    end = time.monotonic() + SETTLE_S
    quiet = 0
    while quiet < 2 and time.monotonic() < end:
        time.sleep(0.01)
        quiet = 0 if _runnable(me) else quiet + 1


def _leaving(fifo):
    """At exit (the script ended, its own atexit handlers ran): say so beside the request FIFO,
    then remove it. The hang watch takes a rank that is leaving for the run's end, not a hang."""
    try:
        with open(fifo[: -len(".fifo")] + ".exiting", "w"):
            pass
    except OSError:
        pass
    if os.path.exists(fifo):
        os.unlink(fifo)


def _install():
    d = os.environ.get(HOOK_ENV)
    if not d or "RANK" not in os.environ:
        return
    if os.environ.get("CLUSTERCTL_HOOK_PID") == str(os.getppid()):
        return  # a process the rank started (a data-loader worker): the rank answers for it
    fifo = os.path.join(d, f"{os.getpid()}.fifo")
    try:
        os.mkfifo(fifo, 0o600)
    except OSError:
        return
    os.environ["CLUSTERCTL_HOOK_PID"] = str(os.getpid())
    import atexit
    import threading

    atexit.register(_settle)  # registered first, run last
    atexit.register(_leaving, fifo)
    threading.Thread(target=_serve, args=(d, fifo), name="clusterctl-snapshot", daemon=True).start()


def _lines():
    """Hand this rank's output to the waiter (agent_lines.py RankLines), which writes it into the
    run's log as whole lines tagged `[default<LOCAL_RANK>]:`: two pipes, their read ends sent over
    CLUSTERCTL_LINES (SCM_RIGHTS) with LOCAL_RANK, their write ends put on fd 1 and 2, before the
    script writes anything. A process the rank starts inherits them (CLUSTERCTL_LINES_PID says it
    is done). The connection stays open to say how the script ends (_say): e for an uncaught
    exception, sN for sys.exit(N) with N non-zero, oN for os._exit(N), x for Python's
    finalization: the waiter's word when torchrun reaped the rank before it read its status. Where the waiter
    does not answer, the rank writes to the log untagged, as torchrun does."""
    path = os.environ.get(LINES_ENV)
    if not path or "RANK" not in os.environ or os.environ.get(LINES_PID_ENV):
        return
    _die_with_torchrun()
    import socket

    if len(path.encode()) >= 100:  # too long for sun_path: through a descriptor of its directory
        path = f"/proc/self/fd/{os.open(os.path.dirname(path), os.O_RDONLY)}/{os.path.basename(path)}"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pipes = []
    try:
        conn.settimeout(LINES_WAIT_S)
        conn.connect(path)
        pipes = [os.pipe(), os.pipe()]
        socket.send_fds(conn, [os.environ.get("LOCAL_RANK", "0").encode()], [r for r, _ in pipes])
        if conn.recv(1) != b"k":
            raise OSError("the waiter did not take the pipes")
    except OSError:
        conn.close()
        for fd in [fd for pair in pipes for fd in pair]:
            os.close(fd)
        return
    for fd, (r, w) in zip((1, 2), pipes):
        os.dup2(w, fd)
        os.close(w)
        os.close(r)
    os.environ[LINES_PID_ENV] = str(os.getpid())
    _said.append((os.getpid(), conn))
    import atexit

    atexit.register(_say, b"x")
    hook, leave, hard = sys.excepthook, sys.exit, os._exit

    def excepthook(*exc):
        _say(b"e")
        hook(*exc)

    def exit(code=None):
        if code not in (None, 0):
            _say(b"s%d" % code if isinstance(code, int) else b"s1")
        leave(code)

    def _exit(code):
        _say(b"o%d" % code)
        hard(code)

    sys.excepthook, sys.exit, os._exit = excepthook, exit, _exit


def _die_with_torchrun():
    """SIGKILL this rank when torchrun dies (PR_SET_PDEATHSIG), so a killed torchrun leaves no
    worker even where the node's waiter is gone too (it ends what is left by the run key)."""
    parent = os.getppid()
    try:  # PR_SET_PDEATHSIG, SIGKILL (the hook is stdlib only: it cannot take common.py's prctl)
        __import__("ctypes").CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
    except Exception:  # noqa: BLE001 - not Linux, or no libc: the waiter still ends it by run key
        return
    if os.getppid() != parent:  # torchrun died before the signal was armed
        os.kill(os.getpid(), 9)


def _say(what):
    """Tell the waiter how the script ends, a line (only from the rank itself, not a fork of it)."""
    for pid, conn in _said:
        if pid == os.getpid():
            try:
                conn.sendall(what + b"\n")
            except OSError:
                pass


def _warm():
    """The node's warm interpreter forks the rank, or torchrun itself, and this process stands in
    (remote/warm_client.py); torchrun's fork is noted where the waiter's stop looks (agent_stop.py)."""
    path = os.environ.get("CLUSTERCTL_WARM")  # warm.py's socket
    d = os.environ.get("CLUSTERCTL_NODE_DIR")  # the attempt's directory: where torchrun's fork is noted
    if not path or os.environ.get("CLUSTERCTL_HOOK_PID"):
        return
    import clusterctl_warm as w

    if "RANK" in os.environ:
        w.ask(path, _die_with_torchrun)
    elif d and w.is_torchrun(sys.orig_argv):
        w.ask(path, lambda: None, os.path.join(d, "torchrun.fork"))


def _chain():
    """Run the sitecustomize this one shadows (Debian's, a venv's), as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


for _step in (_warm, _lines, _install):  # _warm returns only where this process is to run itself
    try:
        _step()
    except Exception:  # noqa: BLE001 - the hook must never stop the job from starting
        pass
del _step
_chain()

"""The node agent's `start` and the waiter it forks: the detached parent of torchrun (a child
subreaper) that supervises it, carries out a stop request, ends whatever of the run is left once
torchrun ended, and records the node's exit code (recorded_exit). Everything the waiter uses is
imported here at its start: it lives as long as the run, and a version of the node code may be
pruned from the node meanwhile.
"""
import json
import os
import signal
import sys
import time

from .agent_base import BASE, HOOK, read, rundir, run_pids, started_at, threading_start, wait_gone
from .agent_lines import LINES_DRAIN_S, RankLines
from .agent_stop import KILLED_S, WAKE, end_run
from .common import PRIVATE_UMASK, RUN_KEY, own_dir, prctl, user_umask, write_atomic
from .warm import for_key

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
END_AGAIN_GRACE_S = 2.0  # once torchrun ended: what is left of the run gets this long after SIGTERM
# the Flight Recorder in every rank: its entries are what `snapshot` reads, and an NCCL collective
# timeout dumps them into RUNDIR/hook (TORCH_FR_BUFFER_SIZE is torch >= 2.5's name; the older
# TORCH_NCCL_TRACE_BUFFER_SIZE is left out: 2.13 warns on every rank that it is deprecated)
FLIGHT_RECORDER = (("TORCH_FR_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"))


def start(run_id, spec_hex="-"):
    # "-": the spec (JSON) is on stdin, so it (the inventory's env: tokens, keys) never shows on a
    # command line in `ps` on the node
    if spec_hex == "-":
        spec = json.loads(sys.stdin.buffer.read().decode() or "null")
        if not isinstance(spec, dict):
            sys.exit("no spec: expected the spec's JSON on stdin")
    else:
        spec = json.loads(bytes.fromhex(spec_hex).decode())
    d = rundir(run_id)
    own_dir(os.path.dirname(BASE))  # ~/.clusterctl: an older clusterctl's 0755 is tightened
    own_dir(BASE)
    os.mkdir(d)  # 0700 (0750 under share_with_group): private_files' umask
    umask = os.umask(PRIVATE_UMASK)  # spec.json holds the inventory's env: the user's eyes only, always
    try:
        write_atomic(os.path.join(d, "spec.json"), json.dumps(spec))
    finally:
        os.umask(umask)
    r, w = os.pipe()
    if os.fork() > 0:  # the caller: wait for the waiter to report torchrun's pid
        os.close(w)
        data = b""
        deadline = time.time() + 30
        while time.time() < deadline:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            data += chunk
        if not data:
            sys.exit("the run did not start: " + (read(os.path.join(d, "log"), "") or "")[-2000:])
        print(data.decode().strip(), flush=True)
        return
    os.close(r)
    os.setsid()  # leave the SSH session: a dropped connection must not kill the run
    if os.fork() > 0:
        os._exit(0)
    waiter(d, run_id, spec, w)


def hook_env(d, text, env):
    """RUNDIR/py/sitecustomize.py in front of the job's PYTHONPATH, its FIFOs and answers in
    RUNDIR/hook, and the Flight Recorder on (a value the user set is kept): every rank can be
    asked for its stacks and collectives (`snapshot`), and a collective timeout dumps there."""
    os.makedirs(os.path.join(d, "py"), exist_ok=True)
    os.makedirs(os.path.join(d, HOOK), exist_ok=True)
    write_atomic(os.path.join(d, "py", "sitecustomize.py"), text)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_client.py")) as f:
        write_atomic(os.path.join(d, "py", "clusterctl_warm.py"), f.read())  # the hook's `_warm` (warm.py)
    env["PYTHONPATH"] = os.path.join(d, "py") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CLUSTERCTL_HOOK_DIR"] = os.path.join(d, HOOK)
    for var, value in FLIGHT_RECORDER:
        env.setdefault(var, value)
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(d, HOOK, "fr_trace_"))


def default_signals():
    """An ignored signal stays ignored across exec: give the run back SIGTERM (its graceful stop),
    and the user's umask: what the job writes is the user's, not clusterctl's (private_files)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if user_umask() is not None:
        os.umask(user_umask())


def run_env(d, run_id, spec):
    """torchrun's environment: ours, the inventory's, and the run's marks (the run key every process
    of the run carries)."""
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    env[RUN_KEY] = run_id
    env["CLUSTERCTL_RUN_ID"] = run_id.split("@")[0]
    env["CLUSTERCTL_NODE_DIR"] = d  # where the job may leave save_seconds
    env["TORCHELASTIC_ERROR_FILE"] = os.path.join(d, "error.json")
    env.setdefault("PYTHONUNBUFFERED", "1")
    warm = for_key(run_id)
    if warm is not None:  # the ranks are forked from the run's warm interpreter (warm.py), else start cold
        env["CLUSTERCTL_WARM"] = warm
    return env


def waiter(d, run_id, spec, notify_fd):
    import subprocess

    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # release the SSH channel's pipes
        os.dup2(devnull, fd)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the waiter outlives torchrun to record its exit
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphaned workers become our children, not init's
    env = run_env(d, run_id, spec)
    cwd = os.path.expanduser(spec.get("cwd") or "~")
    for name, text in spec.get("files", {}).items():  # helpers the command runs
        write_atomic(os.path.join(d, os.path.basename(name)), text)
    log = open(os.path.join(d, "log"), "ab", buffering=0)
    lines = None
    if spec.get("hook"):  # the snapshot hook in every rank (remote/hook/sitecustomize.py)
        hook_env(d, spec["hook"], env)
        lines = RankLines.open(d, log.fileno(), env)
    argv = [os.path.expanduser(spec["argv"][0])] + [d + a[len("{rundir}"):] if a.startswith("{rundir}/")
                                                    else a for a in spec["argv"][1:]]
    try:
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_signals)
    except OSError as e:
        log.write(f"clusterctl: cannot start {spec['argv'][0]!r} in {cwd}: {e}\n".encode())
        write_atomic(os.path.join(d, "exit_code"), "127")
        os.write(notify_fd, json.dumps({"pid": None, "error": str(e)}).encode())
        os._exit(0)
    # SIGCHLD stays pending (not discarded) until supervise() takes it: torchrun's end is seen at
    # once instead of at the next poll; WAKE (agent_stop.py `wake`: a stop request was written)
    # the same way. Blocked only now, so torchrun does not inherit the mask; before proc.json
    # names us, so no WAKE can come unblocked (its default action would end the waiter)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, WAKE})
    if lines is not None:  # its thread inherits the mask: the signals stay supervise()'s
        lines.start()
    info = {"pid": p.pid, "pgid": p.pid, "waiter": os.getpid(), "started": time.time(),
            "wake": WAKE.name, "waiter_start": started_at(os.getpid())}
    write_atomic(os.path.join(d, "proc.json"), json.dumps(info))
    os.write(notify_fd, json.dumps(info).encode())
    os.close(notify_fd)
    nproc = nproc_of(argv)
    stop = {}
    rc = supervise(d, run_id, info, (lambda: lines.ended_well(nproc)) if lines is not None else None, stop)
    write_atomic(os.path.join(d, "ended"), repr(time.time()))
    # torchrun is gone, by any means: nothing of the run may outlive it on this node. Where a stop
    # request's end_run is under way, its end is waited for a moment (it kills, and watches its
    # finds by pid): once it found nothing left, a second pass would only read every process of
    # the node again
    if "thread" in stop:
        stop["thread"].join(KILLED_S)
    if stop.get("left") != 0:
        end_run(run_id, info, grace=END_AGAIN_GRACE_S)
    reap_until_gone(run_id, 5.0)
    if lines is not None:  # every rank's last lines are in the log before the exit code says it ended
        lines.finish(LINES_DRAIN_S)
    write_atomic(os.path.join(d, "exit_code"), str(recorded_exit(d, rc, lines, argv, log)))
    os._exit(0)


def supervise(d, run_id, info, ended_well=None, stop=None):
    """Wait for torchrun (reaping the orphans handed to us meanwhile) and carry out a stop
    request found in the run directory, looked for when WAKE comes and every 0.2 s (`ended_well`:
    whether every rank here ended with 0, so the stop need not wait for torchrun to leave; `stop`,
    a dict, gets the stop's "thread" and, once it ended, the processes it "left");
    torchrun's wait status as Popen reports it."""
    stop = {} if stop is None else stop

    def stop_run(grace, peer_failed):
        stop["left"] = end_run(run_id, info, grace, peer_failed, ended_well)

    stopping = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 1
        if pid == info["pid"]:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if pid:
            continue  # an orphaned worker, reaped
        if stopping is None:
            req = read(os.path.join(d, "stop"))
            if req is not None:
                req = json.loads(req)
                stopping = stop["thread"] = threading_start(stop_run, float(req.get("grace", 5)),
                                                            bool(req.get("peer_failed")))
        signal.sigtimedwait({signal.SIGCHLD, WAKE}, 0.2)  # a child ended, a stop request, or time to look for one


def recorded_exit(d, rc, lines, argv, log):
    """The node's exit code from torchrun's wait status (killed by signal N -> 128+N), except
    where a stop ended torchrun after every rank here had exited 0: torchrun was still leaving
    (its exit barrier waits for the other nodes' torchruns, and loses the store when node 0's
    leaves first), and the job ended well; its signal is not the job's verdict (said in the log)."""
    if rc in (-signal.SIGTERM, -signal.SIGKILL) and lines is not None and os.path.exists(os.path.join(d, "stop")) \
            and lines.ended_well(nproc_of(argv)):
        log.write(f"clusterctl: the stop ended torchrun (signal {-rc}) after every rank on this node had "
                  f"exited 0; exit code 0 recorded, the ranks' own\n".encode())
        return 0
    return 128 - rc if rc < 0 else rc


def nproc_of(argv):
    """The ranks a node's torchrun starts (its --nproc-per-node), or None when argv does not say."""
    for i, a in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            value = argv[i + 1] if a == flag and i + 1 < len(argv) else a[len(flag) + 1:] \
                if a.startswith(flag + "=") else None
            if value is not None:
                return int(value) if value.isdigit() else None
    return None


def reap_until_gone(run_id, seconds):
    """Reap our children until no process of the run is left (or `seconds` pass)."""
    def reap():
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass

    def find():
        reap()
        return [p for p in run_pids(run_id) if p != os.getpid()]

    wait_gone(find, time.time() + seconds)
    reap()

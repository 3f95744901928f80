"""The node agent's stop: `stop KEY GRACE [peer-failed]` and end_run, which ends a run's processes
(workers first, with the grace, then torchrun, then SIGKILL); the waiter (agent_waiter.py) calls
end_run too, once torchrun ended, and to carry out a stop request it finds in the run directory.
`ask` is the stop a node's log stream takes from the control machine (agent_stream.py): the request
written and the waiter woken to carry it out, no process started for it.
"""
import json
import os
import signal
import sys
import time

from .agent_base import (pgid_of, proc_info, read, rundir, run_pids, save_seconds, started_at, threading_start,
                         wait_gone, wait_until)
from .common import stop_grace, write_atomic

TORCHRUN_EXIT_S = 3.0  # on a stop, torchrun's time to exit on its own once its workers are gone:
# its monitor interval is 0.1 s, then its exit barrier (the other nodes, stopped at the same moment)
# and ~1 s of CPU tearing its interpreter down. Signalled sooner, it records a failure (1, 143)
# for a run whose ranks saved and ended well; later, a torchrun stuck in a barrier holds the stop.
KILLED_S = 1.0  # SIGKILLed processes are gone within moments; after this, what is left (or was
# started meanwhile) is SIGKILLed again
WAKE = signal.SIGUSR1  # wakes a waiter whose proc.json says "wake": it looks for a stop request at once


def writing_checkpoint(pids):
    """Whether one of `pids` has a file open for writing under a temporary name (a path part
    ending in .tmp or holding .tmp.): a checkpoint being written, to be renamed into place whole
    (trainer/checkpoint.py writes ckpt_N.pt.tmp.PID, and FSDP shards into ckpt_N.tmp/)."""
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                flags = int((read(f"/proc/{pid}/fdinfo/{fd}", "") or "").split("flags:")[1].split()[0], 8)
            except (OSError, IndexError, ValueError):
                continue  # closed meanwhile
            if path.startswith("/") and flags & 3 and any(part.endswith(".tmp") or ".tmp." in part
                                                           for part in path.split("/")):
                return True
    return False


def torchrun_pids(run_id, info):
    """torchrun's pids: the process the waiter started, and where a warm interpreter forked
    torchrun (warm.py), the fork that process stands in for (its pid in torchrun.fork)."""
    pids = {info.get("pid")}
    try:
        with open(os.path.join(rundir(run_id), "torchrun.fork")) as f:
            pids.add(int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return pids


def signal_once(pgid, pids, sig):
    """`sig` to the run's process group, while a process of the run is still in it (a pgid can be
    reused), and to each of `pids` the group's signal did not reach: once each, since a second
    SIGTERM can land in a handler's exit, where Python has put the default action back (the
    process then ends as killed, 143, not with its handler's code)."""
    groups = {p: pgid_of(p) for p in pids}
    grouped = bool(pgid) and pgid in groups.values()
    if grouped:
        try:
            os.killpg(pgid, sig)
        except OSError:
            grouped = False
    for pid in pids:
        if grouped and groups[pid] == pgid:
            continue
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def end_run(run_id, info, grace, peer_failed=False, ended_well=None):
    """SIGTERM the run's workers (the trainer checkpoints), then torchrun, SIGKILL what is left
    after `grace` s. Processes are found by the run key; the waiter `info["waiter"]` is spared.
    peer_failed: another node's part of the run died, so no collective (and no collective
    checkpoint) can complete: SIGKILL at once, unless a checkpoint is being written here (then
    it gets the grace to finish it, as on any stop). ended_well (the waiter's, agent_lines.py
    RankLines): whether every rank of this node was seen to end with 0; once true, that is the
    node's verdict and torchrun is not waited for (agent_waiter.py recorded_exit)."""
    waiter, torchrun = info.get("waiter"), torchrun_pids(run_id, info)

    def targets():
        return [p for p in run_pids(run_id) if p != waiter]

    def workers():
        return [p for p in targets() if p not in torchrun]

    def signal_all(sig, pids=None):
        pids = targets() if pids is None else pids
        signal_once(info.get("pgid"), pids, sig)
        return pids

    deadline = time.time() + float(grace)
    found = targets()  # one scan for the first steps (a scan reads every process of the node)
    if peer_failed and not writing_checkpoint(found):
        deadline = time.time()
    # the workers first, with the whole grace: they stop (the trainer checkpoints) and torchrun,
    # seeing them done, exits on its own with their verdict; torchrun is signalled itself only
    # when it has no workers (yet), or once the grace is over
    started = [p for p in found if p not in torchrun] if deadline > time.time() else []
    for pid in started:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    if started and wait_gone(workers, deadline):
        # workers done: torchrun exits on its own with their verdict, the code recorded. Where the
        # waiter saw every rank here end with 0, that verdict is recorded whatever ends torchrun:
        # its exit barrier (it waits there for every other node's torchrun) is not waited out
        well = ended_well or (lambda: False)
        wait_until(lambda: not targets() or workers() or well(), time.time() + TORCHRUN_EXIT_S)
        if well() and not workers():
            deadline = time.time()  # SIGKILL, below
    if deadline > time.time():  # the scan's finds where nothing was waited for since (each scan reads the node)
        gone = wait_gone(targets, deadline, signal_all(signal.SIGTERM, None if started else found))
    else:  # no grace left (or none given: a peer failed); with nothing waited for since the scan, what it found
        gone = wait_gone(targets, time.time() + KILLED_S, signal_all(signal.SIGKILL, None if started else found))
    if not gone:  # and anything started meanwhile
        gone = wait_gone(targets, time.time() + 5, signal_all(signal.SIGKILL))
    return 0 if gone else len(targets())


def request(d, grace, peer_failed):
    """Write the run's stop request (RUNDIR/stop, which the waiter carries out) unless one was
    written before; whether this one is the first."""
    if read(os.path.join(d, "stop")) is not None:
        return False
    write_atomic(os.path.join(d, "stop"), json.dumps({"grace": grace, "at": time.time(), "peer_failed": peer_failed}))
    return True


def wake(info):
    """Wake the run's waiter to carry out the stop request now; False where it cannot be woken (it
    is gone, or predates "wake" in proc.json: its SIGUSR1 would end it) and the caller stops the run."""
    waiter = info.get("waiter")
    if not waiter or info.get("wake") != WAKE.name or started_at(waiter) != info.get("waiter_start"):
        return False
    try:
        os.kill(waiter, WAKE)
        return True
    except OSError:
        return False


def ask(run_id, grace, peer_failed=False):
    """The stop a log stream is asked for (agent_stream.py): as `stop`, without a process of its
    own or a wait: the first request goes to the waiter, woken at once; a later one (a shorter
    grace: a second stop kills) or a waiter that cannot be woken, to end_run on a thread here."""
    d = rundir(run_id)
    if not os.path.isdir(d):
        return
    grace = stop_grace(grace, save_seconds(d))
    info = proc_info(d)
    if not (request(d, grace, peer_failed) and wake(info)):
        threading_start(end_run, run_id, info, grace, peer_failed)


def stop(run_id, grace, mode=""):
    if mode not in ("", "peer-failed"):
        sys.exit(f"unknown stop mode {mode!r}: expected peer-failed")
    d = rundir(run_id)
    if not os.path.isdir(d):
        print(json.dumps({"left": len(run_pids(run_id))}))
        return
    grace = stop_grace(grace, save_seconds(d))
    request(d, grace, mode == "peer-failed")  # first: the waiter finishes the stop if we are cut off
    info = proc_info(d)
    left = end_run(run_id, info, grace, mode == "peer-failed")
    # the waiter records the exit code once torchrun is reaped and the run is cleaned up
    wait_until(lambda: read(os.path.join(d, "exit_code")) is not None, time.time() + 8)
    if read(os.path.join(d, "exit_code")) is None and not run_pids(run_id):
        write_atomic(os.path.join(d, "exit_code"), "137")
    print(json.dumps({"left": left}))

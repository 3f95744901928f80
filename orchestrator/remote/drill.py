"""`clusterctl drill`'s hands on a node: shipped on stdin (`python3 - VERB ARGS`) with
remote/common.py in front (marked_pids, proc_environ, RUN_KEY come from there), stdlib only.

A run's processes are found by the marker they inherit (CLUSTERCTL_RUN_KEY=KEY), never by name;
the node agent's log stream of an attempt (`python3 - tail KEY ...`, started by the supervisor)
carries no marker, so it is found by its exact arguments: the agent's verb `tail` and the key.
This program itself runs with CLUSTERCTL_DRILL=RUN_ID in its environment, so `left` finds any
of the drill's own processes still running (a throttle whose connection was cut) by that marker.

  ranks KEY                     print {"ranks": {RANK: [pid, ...]}}: each rank's processes (its
                                data-loader workers carry its RANK too), torchrun's left out
  signal KEY SIG RANK [top]     send SIG (a number) to rank RANK's processes (with top: only the
                                topmost, the rank's own interpreter); print {"pids": [...]}
  freeze KEY | thaw KEY         SIGSTOP / SIGCONT every process of KEY on this node and the node
                                agent's stream of it; print {"pids": [...]}
  throttle KEY RANK SECONDS STOP_S RUN_S
                                for SECONDS, each time rank RANK is seen computing (running, not
                                asleep in a collective) stop it for STOP_S, then let it run for
                                RUN_S; it runs at the end whatever ends this (SIGTERM, SIGHUP);
                                print {"cycles": n}
  left RUN_ID                   print {"pids": [...]}: processes of any attempt of RUN_ID, of its
                                warm interpreter and of the drill of it (CLUSTERCTL_DRILL), still
                                on this node
"""
import json
import os
import signal
import sys
import time

from .agent_base import HOOK, own_interpreter, rundir
from .common import RUN_KEY, marked_pids, proc_environ, split_key

DRILL_MARK = "CLUSTERCTL_DRILL"


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rank_pids(key):
    """{rank: [pids]} of the run's processes on this node that carry a RANK (torchrun does not)."""
    out = {}
    for pid in marked_pids(RUN_KEY, lambda k: k == key):
        env = proc_environ(pid, ("RANK",))
        if "RANK" in env:
            out.setdefault(env["RANK"], []).append(pid)
    return out


def topmost(pids, key):
    """The rank's own interpreter (agent_base.own_interpreter)."""
    return own_interpreter(pids, os.path.join(rundir(key), HOOK), _ppid)


def stream_pids(key):
    """The node agent's `tail KEY ...` processes of this user: the attempt's log stream."""
    uid, out = os.getuid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if is_stream(argv, key):
            out.append(int(name))
    return out


def is_stream(argv, key):
    """argv is the agent's `tail KEY ...` as the node code starts it: `PYTHON [FLAGS] -c BOOT CODE
    node_agent tail KEY ...` (probe.py BOOT)."""
    at = argv.index("-c") if "-c" in argv else -1
    return at > 0 and argv[at + 3:at + 6] == ["node_agent", "tail", key]


def send(pids, sig):
    done = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            done.append(pid)
        except OSError:
            pass  # ended meanwhile
    return done


def cmd_ranks(key):
    print(json.dumps({"ranks": rank_pids(key)}))


def cmd_signal(key, sig, rank, which="all"):
    pids = rank_pids(key).get(rank, [])
    if pids and which == "top":
        pids = [topmost(pids, key)]
    print(json.dumps({"pids": send(pids, int(sig))}))


def _all_of(key):
    return sorted(set(marked_pids(RUN_KEY, lambda k: k == key)) | set(stream_pids(key)))


def cmd_freeze(key):
    print(json.dumps({"pids": send(_all_of(key), signal.SIGSTOP)}))


def cmd_thaw(key):
    print(json.dumps({"pids": send(_all_of(key), signal.SIGCONT)}))


class _End(Exception):
    pass


def _raise(*_):
    raise _End()


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return False


def cmd_throttle(key, rank, seconds, stop_s, run_s):
    """Each time the rank's interpreter is seen running (computing: a rank waiting in a collective
    sleeps), stop the rank for STOP_S, then let it run for at least RUN_S: its compute per step
    stretches while the time it waits for the others does not, which is what a straggler is."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _raise)
    until, cycles = time.time() + float(seconds), 0
    try:
        while time.time() < until:
            pids = rank_pids(key).get(rank, [])
            if not pids:
                break  # the rank is gone (the run ended or restarted)
            top = topmost(pids, key)
            seen = time.time() + 1.0
            while time.time() < min(seen, until) and not _running(top):
                time.sleep(0.002)
            if not _running(top):
                continue
            send(pids, signal.SIGSTOP)
            time.sleep(float(stop_s))
            send(pids, signal.SIGCONT)
            cycles += 1
            time.sleep(float(run_s))
    except _End:
        pass
    finally:
        send(rank_pids(key).get(rank, []), signal.SIGCONT)
    print(json.dumps({"cycles": cycles}))


def of_run(run_id):
    def match(k):
        return split_key(k)[0] == run_id  # its attempts' keys and its warm interpreter's
    return match


def cmd_left(run_id):
    pids = set(marked_pids(RUN_KEY, of_run(run_id)))
    pids |= set(marked_pids(DRILL_MARK, lambda v: v == run_id))
    print(json.dumps({"pids": sorted(pids)}))


def main(argv):
    {"ranks": cmd_ranks, "signal": cmd_signal, "freeze": cmd_freeze, "thaw": cmd_thaw,
     "throttle": cmd_throttle, "left": cmd_left}[argv[0]](*argv[1:])

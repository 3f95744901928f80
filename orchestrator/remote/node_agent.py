"""clusterctl's node agent: a program of the node code (probe.py `node_code`: `PYTHON -c BOOT CODE
node_agent CMD ARGS`), stdlib only. This module holds the verbs' dispatcher and the small verbs
(live, reach, tail's choice of output); the rest are modules of their own:
agent_base.py (the run directory, the run key's processes, small waits), agent_waiter.py (start
and the waiter), agent_lines.py (RankLines), agent_stop.py (stop, end_run), agent_tail.py (status,
the log's follower), agent_stream.py (the framed stream), agent_snapshot.py (snapshot, py-spy),
agent_claims.py (claim, release, claims). common.py holds the rules they share with the other
programs (write_atomic, marked_pids, stop_grace, safe_name), artifacts.py the stream's frames.

Everything a run leaves on a node lives in ~/.clusterctl/node-runs/KEY/, KEY = RUN_ID@NODE
(two `connection: local` nodes share one machine and one home):
  spec.json   what was started (argv, env, cwd)
  proc.json   pid/pgid of torchrun, the waiter's pid, start time
  log         torchrun's stdout+stderr, raw bytes (the controller copies it byte for byte)
  ended       when torchrun ended (node clock), written the moment the waiter reaped it
  exit_code   written atomically by the waiter once torchrun ended and nothing of the run is left
  error.json  torchrun's error file (TORCHELASTIC_ERROR_FILE), when it wrote one
  stop        a stop request {"grace", "at", "peer_failed"}: the waiter carries it out even when
              the `stop` that wrote it lost its connection half way
  save_seconds  how long the job's last checkpoint took (the trainer writes it; the stop grace
              covers it)
and ~/.clusterctl/claims/NODE, the node's claim {"run", "key", "who", "since", "renewed"}: one run at a
time, held by every attempt of it (RUN.aK@NODE) and stale once they ended (claim_stale).
All of it is the user's alone, 0700/0600 (0750/0640 under share_with_group; spec.json, which holds
the inventory's env, 0600 always): private_files. torchrun gets the user's own umask back.

The waiter (the parent of torchrun) is a child subreaper: a worker orphaned by a dead torchrun is
reparented to it, and once torchrun ended by any means, the waiter kills what is left of the run
(its process group, then every process carrying the run key). No controller is involved.

Every process of a run carries CLUSTERCTL_RUN_KEY=KEY (and CLUSTERCTL_RUN_ID=RUN_ID) in its
environment, so the run is found again by id (scanning /proc/*/environ of this user's
processes), never by name pattern.

  start KEY SPEC_JSON_HEX|-    detach torchrun (own session), print {"pid", "pgid"}; with -, the
                               spec's JSON is on stdin (off the command line)
  stop KEY GRACE [peer-failed] SIGTERM the run, SIGKILL after GRACE s; print {"left": n}. With
                               peer-failed (the run goes down because another node's part
                               died: no collective can complete, so nothing is left to save),
                               SIGKILL at once unless a process of the run is writing a
                               checkpoint (then as without it)
  status KEY                   print the run's state as JSON
  tail KEY OFFSET [status]     stream the log from OFFSET until the run ended and all is sent;
                               with status, then `status`'s JSON on stderr after STATUS_MARK
  tail KEY OFFSET stream CKPTDIR|- TBDIR OFFSETS_HEX [PROGRESS_S]
                               the same as framed records on stdout, with the node's new
                               checkpoints and TensorBoard bytes and, last, the status (Stream);
                               with PROGRESS_S > 0, also every rank's progress (`snapshot ...
                               progress`'s document) asked every PROGRESS_S s in this process,
                               for the straggler watch (absent or 0: none)
  live                         print the keys of runs still alive on this node
  claim NODE KEY WHO [live] [dirs]  take the node for run KEY, or renew KEY's own claim: print
                               {"ok": true, ...} or {"ok": false, the holder's record}; a stale
                               claim is replaced. With live, also "live": what `live` prints (a
                               launch's check for runs that hold no claim); with dirs and the
                               claim taken, also "dirs": the run's artifact directories, made
                               (artifacts.py `prepare`): one command where there were three
  release NODE KEY [dirs]      drop the node's claim if run KEY holds it; with dirs, also the
                               run's artifact directories where they are empty (a refused launch)
  claims                       print {NODE: claim + "stale"} for every claim on this machine
  snapshot KEY N WAIT [progress] each rank's /proc state and what its hook (remote/hook/
                               sitecustomize.py, in RUNDIR/py on the job's PYTHONPATH) answers
                               to request N within WAIT s: its Python stacks and Flight Recorder
                               (with `progress`: only the compute time of its newest steps;
                               the straggler watch has these from `tail ... stream PROGRESS_S`
                               instead, and asks this way only of a node with no stream)
  reach S HOST:PORT...         whether each HOST:PORT takes a TCP connection within S s
"""
import json
import os
import sys

# every module a verb uses, imported with this one: the boot writes the package's bytecode on the
# node only while it imports the program (even where PYTHONDONTWRITEBYTECODE is set), so a module
# imported later, inside a verb, would be compiled again on every start; and a long-lived verb
# (start's waiter) must hold all it needs before it runs, since its version may be pruned meanwhile
from .agent_base import BASE, read, rundir, run_pids
from .agent_claims import claim as take, claims, release as drop
from .agent_snapshot import snapshot
from .agent_stop import stop
from .agent_tail import Plain, follow, status
from .agent_waiter import start
from .common import private_files, run_dirs, safe_name


def tail(run_id, offset, report="", *watch):
    """The log from `offset` until the run ended and every byte is out; with report=status,
    then `status`'s JSON as the last stderr line, after STATUS_MARK (saves asking again); with
    report=stream, framed records instead (agent_stream.py Stream)."""
    if report not in ("", "status", "stream") or len(watch) not in ((3, 4) if report == "stream" else (0,)):
        sys.exit(f"unknown tail report {report!r}: expected status, or stream CKPTDIR|- TBDIR OFFSETS_HEX "
                 "[PROGRESS_S]")
    rundir(run_id)  # a bad run id is refused before anything else
    if report == "stream":
        # at the start, and only here: artifacts.py's tarfile would cost every other verb milliseconds
        from .agent_stream import Stream

        sink = Stream(run_id, *watch)
    else:
        sink = Plain(report)
    follow(run_id, int(offset), sink)


def live_keys():
    out = []
    for run_id in sorted(os.listdir(BASE)) if os.path.isdir(BASE) else []:
        d = os.path.join(BASE, run_id)
        if read(os.path.join(d, "exit_code")) is None and run_pids(run_id):
            out.append(run_id)
    return out


def live():
    print(json.dumps(live_keys()))


def claim(node, key, who, *more):
    if any(m not in ("live", "dirs") for m in more):
        sys.exit(f"unknown claim option {' '.join(more)!r}: expected live, dirs")
    if "dirs" in more and not safe_name(key.rpartition("@")[0]):
        sys.exit("bad run id")  # before the claim is taken: a refusal leaves nothing held

    def extra(ok):
        out = {"live": live_keys()} if "live" in more else {}
        if "dirs" in more and ok:  # the run's, not the attempt's: KEY is RUN_ID@NODE
            out["dirs"] = run_dirs(key.rpartition("@")[0])
        return out

    take(node, key, who, extra if more else None)


def release(node, key, *more):
    if any(m != "dirs" for m in more):
        sys.exit(f"unknown release option {' '.join(more)!r}: expected dirs")
    drop(node, key, dirs=bool(more))


def reach(timeout, *targets):
    """Whether this node can open a TCP connection to each HOST:PORT within `timeout` s (refused
    counts: the host answered). Prints {target: "ok" | why}."""
    import socket
    import threading

    out = {}

    def one(target):
        host, _, port = target.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=float(timeout)).close()
            out[target] = "ok"
        except ConnectionRefusedError:
            out[target] = "ok"
        except (OSError, ValueError) as e:
            out[target] = str(e) or type(e).__name__

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(float(timeout) + 2)
    print(json.dumps({t: out.get(t, "no answer") for t in targets}))


def main(argv):
    private_files()
    cmd, args = argv[0], argv[1:]
    {"start": start, "stop": stop, "status": status, "tail": tail, "live": live,
     "claim": claim, "release": release,
     "claims": claims, "snapshot": snapshot, "reach": reach}[cmd](*args)

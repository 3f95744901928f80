"""The run supervisor: one detached process per run on the control machine.

`clusterctl train` starts it in its own session, so it outlives the terminal, a closed laptop lid
or a killed `clusterctl`. It runs the run loop (orchestrator/runs/controller.py): it owns the run's
connections, takes the nodes' claims, launches each attempt, copies every node's log byte for byte
into the run directory (runs/logs/streams.py), applies the failure policy (runs/policy.py) and restarts
from checkpoints onto spares (runs/restart.py).

It can be replaced: `tail`, `status` and `stop` start one with --adopt when the recorded one is
gone. The replacement loads the record (runs/record.py) and re-enters the loop at the recorded
attempt: it resumes the log copies at their sizes, carries out pending stops, applies the failure
policy to what happened while nobody watched, and goes on restarting and copying checkpoints.

SIGTERM/SIGINT to the supervisor is a graceful stop request (runs/RUN/stop.json may give the
grace); a second one kills. A node that cannot be reached to stop it keeps a pending stop for the
attempt that ran there (runs/stopping.py), retried with backoff until it answers (up to
LOST_PATIENCE). Once the run has ended, with only pending stops left (a supervisor adopted for them
too), SIGTERM ends the supervisor within the grace: the stops stay pending in the record for the
next one.
Run: python -m orchestrator.runs.supervisor RUN_ID [--adopt]
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

from orchestrator.observe import delivery, trackers
from orchestrator.runs.controller import Controller
from orchestrator.runs.notify import notify_end
from orchestrator.runs.space import LogStream
from orchestrator.runs.stopping import say
from orchestrator.runs.store import SUPERVISOR_MARK, Run, run_umask
from orchestrator.transport import quiet_paramiko


def spawn(run: Run, adopt: bool = False) -> subprocess.Popen:
    """Start the run's supervisor, detached (own session), its output in supervisor.log."""
    umask = run_umask(run.spec)  # the log is the run's: the user's alone, or the group's too
    try:
        log = open(run.dir / "supervisor.log", "ab")
    finally:
        os.umask(umask)
    env = dict(os.environ, **{SUPERVISOR_MARK: run.id})
    argv = [sys.executable, "-m", "orchestrator.runs.supervisor", run.id] + (["--adopt"] if adopt else [])
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    finally:
        log.close()


def raise_open_files() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit: the supervisor holds about
    12 descriptors per node (the SSH socket, paramiko's pipes for each channel, the log copies),
    past the usual soft limit of 1,024 at about 80 nodes. (soft before, soft now); the hard
    limit is the system's to set, and a soft one already at it is left alone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # a hard limit of infinity the kernel caps lower (nr_open)
            pass
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_paramiko(bool(os.environ.get("CLUSTERCTL_DEBUG")))
    sys.stdout = sys.stderr = LogStream(1)  # supervisor.log: a full disk drops lines, never the supervisor
    run = Run(argv[0])
    run_umask(run.spec)  # first: all it writes (records, logs, checkpoint copies) is the user's, or the group's too
    before, now = raise_open_files()
    if now != before:
        say(f"open files: soft limit raised from {before} to {now} (about 12 per node are held)")
    lock = run.lock_supervisor()
    if lock is None:  # another supervisor runs the run
        return 0
    if "--adopt" in argv and (rec := run.record).state.terminal and not rec.pending_stops:
        return 0  # nothing left to do: it ended between the check and this start
    events = None
    try:
        ctl = Controller(run, adopt="--adopt" in argv)
        events = delivery.start(run, ctl.book.rec, say)  # --webhook, --notify-on (observe/delivery.py)
        if events is not None:
            ctl.book.sink = events.sink
        return ctl.main()
    finally:
        trackers.end(run, say)  # the run's MLflow runs end as it did (observe/trackers.py)
        if events is not None:
            events.close()
        if events is None or not events.notifies:  # train --notify / train.notify: when the run has ended
            notify_end(run, say, stdin=delivery.end_event(run))


if __name__ == "__main__":
    sys.exit(main())

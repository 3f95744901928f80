"""The node agent's `status` and the log's follower behind `tail`: status_doc (the run's state as
JSON), follow (the log from an offset until the run ended and every byte is out) and Plain (its raw
output, the status after STATUS_MARK). The framed stream's sink is agent_stream.py's Stream.
"""
import json
import os
import sys
import time

from .agent_base import proc_info, read, rundir, run_pids, save_seconds
from .common import first_rank_failure

STATUS_MARK = "clusterctl-status "  # `tail KEY OFFSET status`: its last stderr line, before the JSON


def status(run_id):
    print(json.dumps(status_doc(run_id)))


def status_doc(run_id):
    d = rundir(run_id)
    info = proc_info(d)
    code = read(os.path.join(d, "exit_code"))
    err = read(os.path.join(d, "error.json"))
    try:  # when torchrun ended, node clock
        ended = float(read(os.path.join(d, "ended"), "") or os.path.getmtime(os.path.join(d, "exit_code")))
    except (OSError, ValueError):
        ended = None
    size, last = 0, ""
    try:
        with open(os.path.join(d, "log"), "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
            last = lines[-1] if lines else ""
    except OSError:
        pass
    return {"exists": os.path.isdir(d), "pid": info.get("pid"), "started": info.get("started"),
            "exit_code": None if code is None else int(code), "alive": len(run_pids(run_id)),
            "log_size": size, "last_line": last, "error_file": err, "ended": ended,
            "rank_failed": first_rank_failure(d),
            "save_seconds": save_seconds(d), "stop_requested": read(os.path.join(d, "stop")) is not None}


def vanished(d, run_id):
    """The waiter was killed before it could record an exit code, and nothing of the run is left."""
    info = proc_info(d)
    if not info.get("waiter"):
        return False
    try:
        os.kill(info["waiter"], 0)
        return False
    except OSError:
        return not run_pids(run_id)


def follow(run_id, pos, sink):
    """Hand `sink` the log from `pos` on as it grows, until the run ended and every byte is out;
    then the run's status (sink.end)."""
    d = rundir(run_id)
    path = os.path.join(d, "log")
    deadline = time.time() + 30
    while not os.path.exists(path):  # the run may be a moment from starting
        if time.time() > deadline:
            sys.exit("no log for run " + run_id)
        time.sleep(0.05)
    idle_since = time.time()
    with open(path, "rb") as f:
        f.seek(pos)
        while True:
            chunk = f.read(1 << 20)
            if chunk:
                pos = sink.log(pos, chunk)
                idle_since = time.time()
                continue
            ended = os.path.exists(os.path.join(d, "exit_code"))
            if not ended and time.time() - idle_since > 2:  # quiet: is anyone left to write?
                idle_since = time.time()
                ended = vanished(d, run_id)
            if ended:
                chunk = f.read()  # whatever landed between the last read and the exit
                if not chunk:
                    sink.end(status_doc(run_id))
                    return
                pos = sink.log(pos, chunk)
                continue
            sink.tick()
            time.sleep(0.02)


class Plain:
    """`tail`'s raw output: the log bytes as they are; with report=status, the end after STATUS_MARK."""

    def __init__(self, report):
        self.report, self.out = report, sys.stdout.buffer

    def log(self, pos, chunk):
        self.out.write(chunk)
        self.out.flush()
        return pos + len(chunk)

    def tick(self):
        pass

    def end(self, doc):
        if self.report:
            sys.stderr.write(STATUS_MARK + json.dumps(doc) + "\n")

"""Whole-line, rank-tagged output for one torchrun worker (stdlib only; the node agent writes it
into the run directory and torchrun runs it in place of the training script).

    python rank_lines.py SCRIPT ARGS...      |      python rank_lines.py -m MODULE ARGS...

runs `python -u SCRIPT ARGS` (what torchrun itself would have run) with stdout and stderr on
pipes, and writes each complete line as `[default<LOCAL_RANK>]:line` to its own stdout/stderr
(the run's log, opened O_APPEND): every write is whole lines only, one write() per batch, so
lines from different ranks and streams never tear or merge. torchrun's own `--tee` cannot
promise that: it re-reads worker files with readline() and prints a partial line at EOF
(a flush mid-line, a tqdm bar) as if it were whole.

Signals torchrun or clusterctl send (TERM, INT, HUP, USR1, USR2) are passed on to the script;
the wrapper dies with torchrun and the script with the wrapper (PR_SET_PDEATHSIG, SIGKILL), so a
killed torchrun leaves no worker behind; the wrapper exits as the script did. A script that ends
with a non-zero exit code has its end time written beside this file (note_failure): the root
cause of a failed run is the node whose rank failed first.
"""
import os
import signal
import subprocess
import sys
import threading
import time

MAX_LINE = 1 << 16  # a "line" longer than this without a newline is cut, never held forever
FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def set_pdeathsig():
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort; the node agent still finds it by run key
        pass


def die_with_parent():
    set_pdeathsig()
    for s in FORWARD:
        signal.signal(s, signal.SIG_DFL)


def write_all(fd, data):
    while data:
        n = os.write(fd, data)
        data = data[n:]


def pump(src, dst, prefix):
    """Copy src to dst as whole prefixed lines."""
    pending = b""
    while True:
        chunk = os.read(src, 1 << 16)
        if not chunk:
            break
        pending += chunk
        cut = pending.rfind(b"\n") + 1
        if not cut and len(pending) < MAX_LINE:
            continue
        if not cut:
            cut = len(pending)
        lines = pending[:cut].split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        write_all(dst, b"".join(prefix + ln + b"\n" for ln in lines))
        pending = pending[cut:]
    if pending:  # the script ended without a final newline
        write_all(dst, prefix + pending + b"\n")


def note_failure(rc):
    """When this rank's script ended with rc != 0, by this node's clock, noted beside this file
    (the node's run directory; common.py's note_rank_failure): taken at once, before the output
    is drained, so the rank that failed of its own is ahead of the peers that only lost it, whose
    errors come after its sockets closed (the node agent's status reports the earliest)."""
    at = time.time()
    try:
        note_rank_failure(os.path.dirname(os.path.abspath(__file__)), os.environ.get("LOCAL_RANK", "0"), rc, at)
    except OSError:  # best effort: the node's end time still orders the failure
        pass


def main(argv):
    parent = os.getppid()
    set_pdeathsig()
    if os.getppid() != parent:  # torchrun died before the death signal was armed
        return 128 + signal.SIGKILL
    prefix = b"[default" + os.environ.get("LOCAL_RANK", "0").encode() + b"]:"
    child = subprocess.Popen([sys.executable, "-u", *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, preexec_fn=die_with_parent)

    def forward(signum, frame):
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for s in FORWARD:
        signal.signal(s, forward)
    readers = [threading.Thread(target=pump, args=(p.fileno(), fd, prefix))
               for p, fd in ((child.stdout, 1), (child.stderr, 2))]
    for t in readers:
        t.start()
    rc = child.wait()
    if rc != 0:
        note_failure(rc)
    for t in readers:
        t.join()
    if rc < 0:  # die of the same signal, so torchrun reports what really happened
        if -rc in FORWARD:
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

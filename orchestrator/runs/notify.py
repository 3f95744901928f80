"""Telling someone a run ended: `train --notify CMD` (or `notify:` in the inventory's train section).

The supervisor runs CMD once, on the control machine, when the run has ended (so it fires for
detached runs too), with /bin/sh -c and these variables in its environment:

    CLUSTERCTL_RUN_ID     the run id
    CLUSTERCTL_STATUS     finished, failed or stopped
    CLUSTERCTL_EXIT_CODE  the run's exit code (0 ok, else the first failed node's)
    CLUSTERCTL_FAILURE    the first failure in one line ("" when none)

for example `notify-send "$CLUSTERCTL_RUN_ID $CLUSTERCTL_STATUS"` or a curl to a webhook. The
command is the user's own (from their flag or inventory), run as a shell line on their own
machine; run data reaches it only through the environment, never inside the command text. It
has NOTIFY_TIMEOUT seconds; its output and any failure go to the supervisor's log, and never
change how the run is recorded.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Callable

from orchestrator.home import user_umask, users_env
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.store import SUPERVISOR_MARK, Run, read_json, write_json

NOTIFY_TIMEOUT = 60.0
_FILE = "notify.json"


def save_notify(run: Run, command: str | None) -> None:
    """Record the --notify command in the run directory (before the supervisor starts)."""
    if command:
        write_json(run.dir / _FILE, {"command": command})


def notify_command(run: Run) -> str | None:
    """--notify, else the inventory's train.notify, else None."""
    doc = read_json(run.dir / _FILE) or {}
    if doc.get("command"):
        return doc["command"]
    try:
        return getattr(run.spec.load_inventory().train, "notify", None)
    except Exception:  # noqa: BLE001 - an inventory that no longer loads has nothing to say here
        return None


def failure_text(rec: RunRecord) -> str:
    ff = rec.first_failure
    if ff is not None:
        return f"{ff.node}: {ff.reason}" + ("" if ff.exit_code is None else f" (exit code {ff.exit_code})")
    return rec.error or ("" if rec.exit_code == 0 else rec.summary or "")


def notify_env(rec: RunRecord) -> dict[str, str]:
    code = rec.exit_code
    return {"CLUSTERCTL_RUN_ID": rec.id, "CLUSTERCTL_STATUS": str(rec.state),
            "CLUSTERCTL_EXIT_CODE": "" if code is None else str(code),
            "CLUSTERCTL_FAILURE": " ".join(failure_text(rec).split())[:1000]}


def _cwd(run: Run) -> str:
    """Where `train` was started (so `--notify ./notify.sh` works), else the run directory."""
    try:
        cwd = run.spec.cwd
    except Exception:  # noqa: BLE001
        cwd = None
    return cwd if cwd and os.path.isdir(cwd) else str(run.dir)


def run_command(run: Run, command: str, env: dict[str, str], stdin: bytes | None, say: Callable[[str], None],
                timeout: float = NOTIFY_TIMEOUT) -> int | None:
    """Run the user's notify command (/bin/sh -c, from where `train` was started) with `env` added
    to the user's environment and `stdin`; its output goes to `say`. -> its exit code (None: it did
    not finish in `timeout`, and was killed)."""
    full = {k: v for k, v in users_env().items() if k != SUPERVISOR_MARK}  # the command is not the supervisor
    full.update(env)
    proc = subprocess.Popen(["/bin/sh", "-c", command], env=full,
                            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=_cwd(run), umask=user_umask())
    try:
        out, _ = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the command and its children
        proc.communicate()
        say(f"notify: the command ran past {timeout:g}s and was killed")
        return None
    text = out.decode(errors="replace").strip()
    if text:
        say(f"notify output: {text[-2000:]}")
    if proc.returncode != 0:
        say(f"notify: the command exited {proc.returncode}")
    return proc.returncode


def notify_end(run: Run, say: Callable[[str], None] = print, timeout: float = NOTIFY_TIMEOUT,
               stdin: bytes | None = None) -> int | None:
    """Run the notify command for an ended run (`stdin`: the end's event, observe/events.py);
    returns its exit code (None: none, or it did not finish). Never raises."""
    try:
        command = notify_command(run)
        if not command:
            return None
        rec = run.record
        say(f"notify: {command} (run {rec.state}, exit code {rec.exit_code})")
        return run_command(run, command, notify_env(rec), stdin, say, timeout)
    except Exception as e:  # noqa: BLE001 - a notification never changes how the run ended
        say(f"notify: failed: {type(e).__name__}: {e}")
        return None

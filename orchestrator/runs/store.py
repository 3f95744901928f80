"""Run records on the control machine: ~/.clusterctl/runs/RUN_ID/ ($CLUSTERCTL_HOME overrides).

  spec.json        what `train` asked for (inventory, args, options)
  run.json         the supervisor's record: state, nodes, ranks, pids, exit codes, summary
  preflight.txt    the preflight table as the supervisor rendered it
  supervisor.log   the supervisor's own output
  supervisor.lock  held (flock) by the one supervisor of the run; a replacement takes it over
  stop.json        a stop request {"grace", "at", "by"}: written by `stop` (or Ctrl-C), read by
                   whichever supervisor runs the run; the run then ends "stopped", whatever fails
  nodes/NODE.log   byte-for-byte copies of each node's log (same offsets as on the node)

Every write of a record is atomic (temp file + rename), so a crash of the controller at any
moment leaves the last good record, and the node logs survive as they are.

A run directory and what is written in it are the user's alone (0700, 0600), or with the
inventory's share_with_group also the group's to read (0750, 0640): the writing process's umask
(`run_umask`). spec.json, which holds the inventory and its env (tokens), is 0600 either way.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from datetime import datetime
from pathlib import Path

import psutil

from orchestrator.errors import ClusterctlError, UsageError
from orchestrator.home import own_runs_dir, runs_dir, set_umask
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.spec import RunSpec

SUPERVISOR_MARK = "CLUSTERCTL_SUPERVISOR"  # in the supervisor's environment: its run id


def new_run_id(name: str | None) -> str:
    base = name or "run"
    if not all(c.isalnum() or c in "-_." for c in base) or base.startswith("."):
        raise UsageError(f"--name {name!r}: use letters, digits, '-', '_' and '.' only")
    return f"{base}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def write_json(path: Path, doc: dict, mode: int = 0o666) -> None:
    """`doc` replaces the file at `path` whole. `mode` before the umask (0o600: the user's alone
    whatever the umask lets the group read)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
            json.dump(doc, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves the last good record and no torn temporary file
        raise


def run_umask(spec: RunSpec) -> int:
    """Make this process's umask the run's (home.py `set_umask`): its recorded inventory's
    share_with_group decides; one that no longer reads leaves the run private. Returns the umask
    it replaced."""
    try:
        share = spec.load_inventory().share_with_group
    except ClusterctlError:
        share = False
    return set_umask(share)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ids() -> list[str]:
    """Recorded run ids, oldest first by creation time (not by the record's last write)."""
    d = runs_dir()
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        doc = None if p.name.startswith(".") else read_json(p / "run.json")
        if doc is not None:
            found.append((RunRecord.from_json(doc, p.name).created, p.name))
    return [i for _, i in sorted(found)]


class Run:
    """A run directory on the control machine."""

    def __init__(self, run_id: str):
        self.id = run_id
        self.dir = runs_dir() / run_id

    @classmethod
    def create(cls, run_id: str, spec: RunSpec) -> "Run":
        """The run's directory, its spec and first record, made under the run's umask (run_umask;
        this process's own is given back)."""
        r = cls(run_id)
        umask = run_umask(spec)
        try:
            own_runs_dir()
            # built under a hidden name and renamed, so a run directory is never seen half made
            tmp = r.dir.with_name(f".{run_id}.tmp")
            (tmp / "nodes").mkdir(parents=True)
            write_json(tmp / "spec.json", spec.to_json(), mode=0o600)
            write_json(tmp / "run.json", RunRecord(run_id, created=time.time()).to_json())
            os.rename(tmp, r.dir)
        finally:
            os.umask(umask)
        return r

    @classmethod
    def find(cls, run_id: str | None) -> "Run":
        """A run by id or unique prefix; the latest run when None."""
        d = runs_dir()
        ids = _ids()
        if not ids:
            raise UsageError(f"no runs recorded under {d} yet; start one with `clusterctl train`")
        if run_id is None:
            return cls(ids[-1])
        if run_id in ids:
            return cls(run_id)
        matches = [i for i in ids if i.startswith(run_id)]
        if len(matches) == 1:
            return cls(matches[0])
        if matches:
            raise UsageError(f"run id {run_id!r} is ambiguous: {', '.join(matches[:5])}")
        raise UsageError(f"no run {run_id!r} under {d}; `clusterctl runs` lists them")

    @staticmethod
    def all() -> list["Run"]:
        return [Run(i) for i in _ids()]

    @property
    def spec(self) -> RunSpec:
        """What `train` asked for; keys a record lacks take RunSpec's defaults."""
        return RunSpec.from_json(read_json(self.dir / "spec.json"))

    @property
    def record(self) -> RunRecord:
        """The run's record as it is on disk now (each read reads the file); state `unknown` when
        there is none or it does not parse. The one way to read a record: `Book` writes it."""
        return RunRecord.from_json(read_json(self.dir / "run.json"), self.id)

    def clean_temporaries(self) -> list[str]:
        """Remove the temporary files (NAME.tmpPID) a writer that died mid-write left in the run
        directory; a live writer's are left alone. -> the names removed."""
        gone = []
        for p in [*self.dir.glob("*.tmp[0-9]*"), *self.dir.glob("*/*.tmp[0-9]*")]:
            pid = p.name.rsplit(".tmp", 1)[1]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                p.unlink(missing_ok=True)
                gone.append(p.name)
        return gone

    def node_log(self, node: str) -> Path:
        return self.dir / "nodes" / f"{node}.log"

    def request_stop(self, grace: float | None, by: str) -> dict:
        """Record a stop request (the first one's time is kept; a later grace replaces it)."""
        old = self.stop_request or {}
        doc = {"grace": grace if grace is not None else old.get("grace"), "at": old.get("at", time.time()),
               "by": by, "requests": old.get("requests", 0) + 1}
        write_json(self.dir / "stop.json", doc)
        return doc

    @property
    def stop_request(self) -> dict | None:
        return read_json(self.dir / "stop.json")

    def lock_supervisor(self):
        """Take the run's supervisor lock (held until this process exits); None when another
        live supervisor holds it."""
        import fcntl

        f = open(self.dir / "supervisor.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return None
        return f

    def supervisor_alive(self) -> bool:
        """The recorded supervisor still runs: the pid exists, carries this run's mark in its
        environment, and (when recorded) was created when the supervisor was, so a reused pid
        is never taken for it."""
        rec = self.record
        pid = rec.supervisor_pid
        if not pid:
            return False
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE or p.environ().get(SUPERVISOR_MARK) != self.id:
                return False
            born = rec.supervisor_created
            return born is None or abs(p.create_time() - born) < 1.0
        except psutil.Error:
            return False

    @property
    def terminal(self) -> bool:
        return self.record.state.terminal


def exit_meaning(code: int | None) -> str:
    """What an exit code usually means for a torchrun node."""
    import signal as _signal

    if code is None:
        return "no exit code (node lost)"
    if code == 0:
        return "success"
    if code == 137:
        return "killed (SIGKILL): often the out-of-memory killer"
    if code > 128:
        try:
            return f"killed by {_signal.Signals(code - 128).name}"
        except ValueError:
            return f"killed by signal {code - 128}"
    if code == 127:
        return "could not start (command or directory not found on the node; see the log below)"
    return "the training script failed"


EXIT_ABORT_MARK = "terminate called without an active exception"


def exit_hint(code: int | None, log_text: str) -> str | None:
    """A known failure worth one line of advice, from a worker's exit code and its log."""
    if code == 128 + 6 and EXIT_ABORT_MARK in log_text:
        return ("hint: a rank aborted (SIGABRT) in C++ teardown. If it happened after the last step, the "
                "usual cause is a process group still held at interpreter exit: delete the DDP/FSDP "
                "model, then call torch.distributed.destroy_process_group() before the script returns "
                "(trainer/train.py does this; see docs/runs/restarts.md).")
    return None

"""The inventory's sections besides the nodes: train, checks, sync and setup."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from orchestrator.inventory.fields import _check_env, _check_path, _Model, excerpt


def check_checkpoint_dir(v: str | None) -> str | None:
    """train.checkpoint_dir / --checkpoint-dir: a path on one line, not the workdir itself nor above it."""
    v = _check_path(v)
    if v is not None and not v.startswith(("/", "~")):
        parts = [p for p in v.split("/") if p not in ("", ".")]
        if not parts or ".." in parts:
            raise ValueError(f"{excerpt(v)} must name a directory inside the workdir (or an absolute path): "
                             f"restoring a checkpoint replaces what that directory holds")
    if v is not None and v.rstrip("/") in ("/", "~"):
        raise ValueError(f"{excerpt(v)} would be a whole filesystem or home: name the job's checkpoint directory")
    return v


class TrainSection(_Model):
    """What `clusterctl train` runs when no script is given on the command line."""

    module: str | None = "trainer"
    script: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    nproc_per_node: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = "auto"
    output_dir: str | None = None
    notify: str | None = None  # a shell command run on this machine when a run ends (runs/notify.py)
    # a run's events (observe/events.py): the ones `notify` runs for (comma list, default the end),
    # a URL every event is POSTed to, signed with webhook_secret (HMAC-SHA256), and how often a live
    # run sends a heartbeat (seconds; 0: never)
    notify_on: str | None = None
    webhook: str | None = None
    webhook_secret: str | None = None
    heartbeat: float | None = Field(default=None, ge=0, le=86400)
    max_restarts: int = Field(default=0, ge=0, le=100)  # relaunches after an infrastructure failure
    # a worker's exit codes that are retried too (the script's own: a preemption, a known flaky step),
    # like SkyPilot's recover_on_exit_codes; which failures are retried: runs/policy.py RETRY_RULES
    restart_on_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(default_factory=list)
    # a silent node is lost within seconds on evidence (its SSH port does not answer a TCP handshake
    # while the other nodes answer: transport/liveness.py); false: only after --lost-timeout of silence
    lost_evidence: bool = True
    # with restarts, a warm interpreter (torch imported) on every node of the run, spares included:
    # every attempt's ranks are forked from it instead of importing torch again (runs/warmpool.py)
    warm: bool = True
    queue: bool = False  # train waits for nodes held by another run instead of refusing (runs/queue.py)
    # each complete checkpoint is copied to the control machine while the run trains (runs/ckpt/given_home.py);
    # false keeps checkpoints on the nodes only (a shared filesystem, or checkpoints too big for the link)
    copy_checkpoints: bool = True
    # each node's complete checkpoints are also copied node to node to the next node in rank order
    # (runs/ckpt/given_replicas.py), so a checkpoint outlives the node that wrote it without crossing this machine
    checkpoint_replica: bool = False
    # the hang watch's backstop: no rank made progress (no step, no collective) for this many
    # seconds: a hang, named and acted on (runs/judge/hangwatch.py); 0 turns the watch off
    hang_timeout: float = Field(default=300.0, ge=0, le=86400)
    # a rank busy in its own code this long while the others wait for it in a collective is a hang
    hang_busy_limit: float = Field(default=600.0, gt=0, le=86400)
    on_hang: Literal["fail", "restart", "observe"] = "fail"  # restart: without the culprit's node
    # a rank whose median compute per step over the last straggler_window steps is this many times
    # the median of every rank's is a straggler (runs/judge/straggler.py); 0 turns the watch off
    straggler_factor: float = Field(default=1.3, ge=0, le=100)
    straggler_window: int = Field(default=50, ge=3, le=100000)
    on_straggler: Literal["warn", "replace"] = "warn"  # replace: restart without its node, onto a spare
    # a node with this many faults attributed to it (lost, killed, hung, straggled, failed health:
    # runs/nodefaults.py) within quarantine_window seconds is quarantined on its own; 0: never
    quarantine_after: int = Field(default=3, ge=0, le=1000)
    quarantine_window: float = Field(default=86400.0, gt=0, le=365 * 86400)
    # appended to the job's arguments when a launch starts from a restored checkpoint (a restart,
    # or --resume-from), e.g. nanoGPT's ["--init_from=resume"]: the script resumes unedited
    resume_args: list[str] = Field(default_factory=list)
    # the job's own checkpoint directory, relative to the workdir unless absolute: whatever the job
    # writes there (any names) is copied off the nodes once complete and put back on every node of
    # a restart (runs/ckpt/jobdir_home.py); CLUSTERCTL_CHECKPOINT_DIR names it to the job
    checkpoint_dir: str | None = None
    # at most one snapshot of checkpoint_dir per this many seconds (each look at the nodes takes the
    # newest complete version of every entry, however often the job rewrites it)
    checkpoint_interval: float = Field(default=3.0, ge=0.5, le=86400)

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v):
        return _check_env(v) if isinstance(v, dict) else v

    @field_validator("checkpoint_dir")
    @classmethod
    def _checkpoint_dir(cls, v):
        return check_checkpoint_dir(v)

    @field_validator("args", "resume_args", mode="before")
    @classmethod
    def _args(cls, v):
        if isinstance(v, str):
            raise ValueError("must be a list of strings, e.g. ['--preset', 'tiny'] or ['--init_from=resume']")
        if isinstance(v, list):
            for a in v:
                if isinstance(a, bool) or not isinstance(a, (str, int, float)):
                    raise ValueError("each argument must be text or a number; quote booleans and nulls")
            return [str(a) for a in v]
        return v

    @field_validator("module")
    @classmethod
    def _module(cls, v):
        if v is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_.]*\Z", v):
            raise ValueError(f"{excerpt(v)} is not a Python module name")
        return v


class ChecksSection(_Model):
    """Preflight thresholds."""

    clock_skew_warn: float = Field(default=1.0, ge=0)
    clock_skew_fail: float = Field(default=5.0, ge=0)
    disk_min_gb: float = Field(default=10.0, ge=0)
    require_gpu_idle: bool = True
    gpu_diag: bool = False  # gpu_health also runs `dcgmi diag -r 1` (about a minute) where dcgmi exists


class SyncSection(_Model):
    """What `clusterctl sync` pushes and ships besides what git would. src: the directory pushed
    (on this machine, relative to the inventory's directory; default: the git checkout `sync` runs
    in). include, exclude: paths relative to it. include: directories or globs shipped even when
    .gitignore excludes them (a data directory); exclude: globs never shipped (matched against the path, each parent directory and, without a
    '/', the base name)."""

    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    src: str | None = None

    @field_validator("src")
    @classmethod
    def _src(cls, v):
        if v is not None and (not v or "\x00" in v):
            raise ValueError("must be a directory on this machine (relative to the inventory's directory)")
        return v

    @field_validator("include", "exclude")
    @classmethod
    def _relative(cls, v):
        for p in v:
            if not p or "\x00" in p or p.startswith(("/", "~")) or ".." in p.split("/"):
                raise ValueError(f"{p!r} must be a non-empty path or glob inside the pushed directory")
        return v


class SetupSection(_Model):
    """What `clusterctl setup` builds on every node: the venv at `venv` from `requirements` (a
    requirements or lock file on this machine, relative to the inventory's directory), created by
    `interpreter` (default `python<python_version>`, else `python3`). With this section every
    node's `python:` is `<venv>/bin/python`."""

    requirements: str
    venv: str
    python_version: str | None = None  # "3.11": the nodes must run it (and it names the interpreter)
    interpreter: str | None = None  # the node's interpreter that creates the venv
    # clusterctl's node side in the venv too: `launch --from-env`, which the SLURM/k8s renders run
    clusterctl: bool = False

    @field_validator("python_version", mode="before")
    @classmethod
    def _version(cls, v):
        if isinstance(v, float):
            raise ValueError("write the version quoted, e.g. python_version: \"3.11\" (YAML reads an "
                             f"unquoted 3.10 as the number 3.1; this one was {v})")
        if isinstance(v, str) and not re.match(r"^3\.[0-9]{1,2}\Z", v):
            raise ValueError(f"{excerpt(v)} is not a Python version like \"3.11\"")
        return v

    @field_validator("requirements", "venv", "interpreter")
    @classmethod
    def _paths(cls, v):
        return _check_path(v)

    @field_validator("venv")
    @classmethod
    def _venv(cls, v):
        if v.rstrip("/") in ("", "~") or v.endswith("/"):
            raise ValueError(f"{excerpt(v)}: name the venv directory itself, e.g. ~/venvs/train")
        return v

    @property
    def python(self) -> str:
        """The interpreter the nodes run once the venv exists."""
        return self.venv + "/bin/python"

    @property
    def base(self) -> str:
        """The interpreter that creates the venv (and runs clusterctl's node-side scripts)."""
        return self.interpreter or (f"python{self.python_version}" if self.python_version else "python3")

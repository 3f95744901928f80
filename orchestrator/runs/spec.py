"""The typed state of a run: what `train` asked for (RunSpec), each node's state, the run's end.

Every default lives here once. The JSON records (spec.json, run.json) are read back through
these types: a record written by an older clusterctl lacks keys, and they take the defaults.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.inventory import Inventory, load_inventory, parse_inventory
from orchestrator.inventory.sections import TrainSection
from orchestrator.runs.judge.hang import SNAPSHOT_WAIT_S
from orchestrator.runs.judge.straggler import PERIOD_S
from orchestrator.runs.scaling import STREAM_STALL_S
from orchestrator.transport import DEFAULT_FANOUT, DEFAULT_LOST_TIMEOUT
from orchestrator.transport.liveness import PROBE_S, SUSPECT_S
from orchestrator.torchrun import RDZV_TIMEOUT_S


class RunState(str, enum.Enum):
    """A run as a whole (run.json "state"); str-valued so the JSON stays readable."""

    STARTING = "starting"  # the record exists, the supervisor is starting
    QUEUED = "queued"  # train --queue: waiting for its nodes' claims to clear (runs/queue.py)
    CONNECTING = "connecting"
    PREFLIGHT = "preflight"
    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"  # an attempt failed; the next one is being prepared (runs/controller.py)
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    UNKNOWN = "unknown"  # no readable record

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.FAILED, RunState.STOPPED)


class NodeState(str, enum.Enum):
    """One node of a run (run.json nodes[].state, and what `status` shows)."""

    PENDING = "pending"  # not started (yet)
    RUNNING = "running"  # torchrun started and not known to have ended
    FINISHED = "finished"  # torchrun exited 0
    FAILED = "failed"  # torchrun exited non-zero
    LOST = "lost"  # the connection went silent while the run ran
    UNREACHABLE = "unreachable"  # `status` could not ask the node
    GONE = "gone"  # the node no longer knows the run's process, and recorded no exit code

    def __str__(self) -> str:
        return self.value


def fields_of(cls, doc: dict) -> dict:
    """The keys of `doc` that are fields of `cls` (an older or newer record may have others)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in doc.items() if k in names}


_TRAIN = TrainSection.model_fields  # the inventory's train: defaults, stated once there


@dataclass(frozen=True)
class RunSpec:
    """What `train` asked for, every setting resolved (flags over the inventory's train: section),
    as recorded in spec.json. The inventory itself is recorded too (`inventory_text`): the run
    never reads the user's YAML again, so editing it mid-run changes nothing of the run."""

    inventory: str | None = None  # absolute path (for messages), or None for the embedded demo
    inventory_text: str | None = None  # the inventory as it was when the run started
    nodes: tuple[str, ...] = ()  # --nodes; empty: every node
    args: tuple[str, ...] = ()  # the user's SCRIPT ARGS; empty: the inventory's train section
    skip_preflight: bool = False
    force: bool = False
    nproc_per_node: int | str = "auto"
    grace: float = 5.0  # seconds between SIGTERM and SIGKILL when the run is stopped
    lost_timeout: float = DEFAULT_LOST_TIMEOUT
    lost_evidence: bool = _TRAIN["lost_evidence"].default  # --[no-]lost-evidence, else train.lost_evidence
    warm: bool = _TRAIN["warm"].default  # --[no-]warm, else train.warm: restarts fork ranks from warm interpreters
    fanout: int = DEFAULT_FANOUT
    accept_new_host_keys: bool = False
    connect_timeout: float | None = None
    cwd: str | None = None
    max_restarts: int = _TRAIN["max_restarts"].default  # --max-restarts, else train.max_restarts
    restart_on_exit_codes: tuple[int, ...] = ()  # --restart-on-exit-codes, else train.restart_on_exit_codes
    min_nodes: int | None = None  # --min-nodes: a restart may shrink to this many nodes; None: no shrinking
    queue: bool = _TRAIN["queue"].default  # --queue, else train.queue: wait for busy nodes instead of refusing
    queue_timeout: float | None = None  # --queue-timeout: how long to wait queued; None: until stopped
    resume_from: str | None = None  # --resume-from: the run whose newest copied checkpoint starts this one
    resume_set_aside: bool = False  # --resume-from RUN:set-aside: what RUN found in its checkpoint dir instead
    copy_checkpoints: bool = _TRAIN["copy_checkpoints"].default  # train.copy_checkpoints
    checkpoint_replica: bool = _TRAIN["checkpoint_replica"].default  # train.checkpoint_replica
    hang_timeout: float = _TRAIN["hang_timeout"].default  # --hang-timeout, else train.hang_timeout (0: off)
    on_hang: str = _TRAIN["on_hang"].default  # --on-hang, else train.on_hang: fail | restart | observe
    hang_busy_limit: float = _TRAIN["hang_busy_limit"].default  # --hang-busy-limit, else train.hang_busy_limit
    straggler_factor: float = _TRAIN["straggler_factor"].default  # --straggler-factor, else train.straggler_factor (0: off)
    straggler_window: int = _TRAIN["straggler_window"].default  # --straggler-window, else train.straggler_window (steps)
    on_straggler: str = _TRAIN["on_straggler"].default  # --on-straggler, else train.on_straggler: warn | replace
    resume_args: tuple[str, ...] = ()  # --resume-args, else train.resume_args: added when a checkpoint was restored
    checkpoint_dir: str | None = None  # --checkpoint-dir, else train.checkpoint_dir: the job's own (runs/ckpt/jobdir_home.py)
    checkpoint_interval: float = _TRAIN["checkpoint_interval"].default  # --checkpoint-interval, else train.checkpoint_interval
    allow_unhealthy: bool = False  # --allow-unhealthy: quarantined nodes are used, and none is quarantined
    # the settings that grow with the cluster (runs/scaling.py), as train resolved them
    suspect_s: float = SUSPECT_S  # an unanswered ping makes its node a suspect after this long
    probe_s: float = PROBE_S  # the suspect's TCP handshake must come within this
    snapshot_wait: float = SNAPSHOT_WAIT_S  # each node's wait for its ranks' hooks in a hang snapshot
    rendezvous_timeout: int = RDZV_TIMEOUT_S  # --rendezvous-timeout: torchrun's static rendezvous (--rdzv-conf)
    stream_stall: float = STREAM_STALL_S  # a log stream silent this long while its node answers is restarted
    progress_s: float = PERIOD_S  # every rank's progress asked for this often (a record without it: the old 10 s)
    scaling: dict | None = None  # {nodes, ranks, values, source}: what the rule derived and what was given

    @classmethod
    def from_json(cls, doc: dict | None) -> "RunSpec":
        kw = fields_of(cls, doc or {})
        for k in ("nodes", "args", "resume_args", "restart_on_exit_codes"):
            if k in kw:
                kw[k] = tuple(kw[k] or ())
        return cls(**{k: v for k, v in kw.items() if v is not None})  # null: the default

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "nodes": list(self.nodes), "args": list(self.args),
                "resume_args": list(self.resume_args), "restart_on_exit_codes": list(self.restart_on_exit_codes)}

    def cluster_options(self) -> dict:
        """The run's settings for a transport Cluster of its nodes."""
        return {"fanout": self.fanout, "accept_new_host_keys": self.accept_new_host_keys,
                "connect_timeout": self.connect_timeout, "lost_timeout": self.lost_timeout,
                "lost_evidence": self.lost_evidence, "suspect_s": self.suspect_s, "probe_s": self.probe_s}

    def load_inventory(self, nodes: list[str] | None = None) -> Inventory:
        """The run's inventory as recorded when it started (an older record: the file), narrowed
        to its nodes (or to `nodes`)."""
        if self.inventory_text is not None:
            inv = parse_inventory(self.inventory_text, source=self.inventory or "<recorded inventory>")
        else:
            inv = load_inventory(self.inventory)
        if self.checkpoint_dir is not None and inv.train.checkpoint_dir != self.checkpoint_dir:
            # --checkpoint-dir: the run's outputs (transfer/files.run_outputs) include it like the inventory's
            inv = dataclasses.replace(inv, train=inv.train.model_copy(update={"checkpoint_dir": self.checkpoint_dir}))
        return inv.select(nodes or list(self.nodes) or None)


DEFAULTS = RunSpec()


@dataclass
class NodeStatus:
    """One node of a run, as the supervisor knows it (run.json nodes[])."""

    name: str
    rank: int
    host: str
    state: NodeState = NodeState.PENDING
    nproc: int | None = None
    first_rank: int | None = None
    last_rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    ended: float | None = None  # when the supervisor saw the end (control clock)
    node_ended: float | None = None  # when torchrun ended, by the node's own clock
    rank_failed: float | None = None  # when one of its ranks first exited non-zero (node clock)
    error: str | None = None
    error_file: str | None = None  # torchrun's error file (JSON text), when it wrote one
    stopped_after_loss: bool = False

    @classmethod
    def from_json(cls, doc: dict) -> "NodeStatus":
        kw = fields_of(cls, doc)
        kw.setdefault("rank", 0)
        kw.setdefault("host", "")
        st = kw.get("state")
        kw["state"] = NodeState(st) if st in NodeState._value2member_map_ else NodeState.PENDING
        return cls(**kw)

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None and not (k == "stopped_after_loss" and not v)}

    @property
    def failed_at(self) -> float | None:
        """When the node failed, by its own clock: its first rank's non-zero exit, else torchrun's
        end. A rank that failed of its own ends before the peers that only lost it."""
        return self.rank_failed if self.rank_failed is not None else self.node_ended

    @property
    def ranks(self) -> str:
        """`0-7`, `3` for a node of one rank, `-` before ranks are assigned."""
        if self.first_rank is None:
            return "-"
        return str(self.first_rank) if self.last_rank in (None, self.first_rank) else f"{self.first_rank}-{self.last_rank}"

    @property
    def ranks_text(self) -> str:
        """`ranks 0-7`, `rank 3`, `no ranks yet`."""
        r = self.ranks
        return "no ranks yet" if r == "-" else f"rank{'s' if '-' in r else ''} {r}"


@dataclass(frozen=True)
class FirstFailure:
    """The root cause of a failed run: the first node to fail, and why."""

    node: str
    exit_code: int | None  # None: the node was lost
    reason: str
    at: float = field(default_factory=time.time)  # when the supervisor saw it (control clock)
    ended: float | None = None  # when the node failed (node clock: NodeStatus.failed_at), when known

    @classmethod
    def from_json(cls, doc: dict | None) -> "FirstFailure | None":
        """None for a record without one (or one too damaged to name its node)."""
        kw = fields_of(cls, doc) if isinstance(doc, dict) else {}
        if not kw.get("node"):
            return None
        kw.setdefault("exit_code", None)
        kw.setdefault("reason", "")
        return cls(**kw)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunResult:
    """How a run ended: the state and exit code recorded, and the one-paragraph summary."""

    state: RunState
    exit_code: int
    summary: str
    first_failure: FirstFailure | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"state": self.state, "exit_code": self.exit_code, "summary": self.summary}
        if self.first_failure is not None:
            doc["first_failure"] = self.first_failure.to_json()
        return doc

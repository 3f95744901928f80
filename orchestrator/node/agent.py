"""The node agent's client (orchestrator/remote/node_agent.py).

One function per verb returns a Call (wire.py): the node's command line (form.py: `PYTHON -c BOOT
CODE node_agent VERB ARGS`), its time limit and the reader that turns what came back into the
verb's small frozen reply. A node that could not be asked, or whose answer could not be read,
still gets a reply: its `error` says why.

On a node a run's processes carry the key RUN_ID[.aK]@NODE (the attempt's key, then the node); a
node's claim is held under RUN_ID@NODE."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence, TypeVar

from orchestrator.inventory import Node
from orchestrator.node import artifacts, form
from orchestrator.node.form import Exec
from orchestrator.node.wire import BadReply, Call, call, run  # noqa: F401 - the agent's callers take them from here
from orchestrator.node.wire import reply as _wire_reply
from orchestrator.transport import NodeResult

TIMEOUT = 60.0  # one agent command (claim, release, claims, live, start)
STATUS_MARK = "clusterctl-status "  # the agent's STATUS_MARK: `tail KEY OFFSET status`'s last stderr line
KEY_RE = re.compile(r"^(?P<run>[^@]+?)(?:\.a(?P<attempt>\d+))?@(?P<node>[^@]+)$")
T = TypeVar("T")
PROGRAM = "node_agent"


def _exec(node: Node, verb: str, *args: object, stdin: bytes | None = None) -> Exec:
    return form.command(node, PROGRAM, verb, *args, stdin=stdin)


def _call(node: Node, verb: str, *args: object, read: Callable[[NodeResult], T], timeout: float = TIMEOUT) -> Call[T]:
    return call(_exec(node, verb, *args), timeout, read)


def node_key(key: str, node: Node) -> str:
    """A run's (or attempt's) key on one node: KEY@NODE."""
    return f"{key}@{node.name}"


def _reply(r: NodeResult, want: type, build: Callable[[object], T], failed: Callable[[str], T]) -> T:
    return _wire_reply(r, want, build, failed, program="node agent")


# ------------------------------------------------------------------ run keys


@dataclass(frozen=True)
class RunKey:
    """A run's key on a node, RUN_ID[.aK]@NODE: the run, its attempt and the node."""

    key: str
    run: str
    attempt: int
    node: str

    @property
    def attempt_key(self) -> str:
        """RUN_ID[.aK]: what `status` and `stop` take."""
        return self.key.rpartition("@")[0]

    @classmethod
    def parse(cls, key: str) -> RunKey | None:
        """None for what is not a run key. A run id ends in 4 hex digits (store.new_run_id), so a
        trailing .aK is always the attempt."""
        m = KEY_RE.match(key)
        return cls(key, m["run"], int(m["attempt"] or 1), m["node"]) if m else None


# ------------------------------------------------------------------ status


@dataclass(frozen=True)
class AgentStatus:
    """A node's own view of one run: `status`, or the end of its `tail`."""

    exists: bool = False  # the run directory is on the node
    pid: int | None = None  # torchrun's
    started: float | None = None
    exit_code: int | None = None  # recorded once torchrun ended and nothing of the run is left
    alive: int = 0  # processes of the run
    log_size: int = 0
    last_line: str = ""
    error_file: str | None = None  # torchrun's error file, as text
    ended: float | None = None  # when torchrun ended, node clock
    save_seconds: float = 0.0  # how long the job's last checkpoint took
    stop_requested: bool = False
    error: str | None = None  # the node could not be asked, or its answer not read
    rank_failed: float | None = None  # when a rank first exited non-zero, node clock (remote/agent_lines.py RankLines)

    @classmethod
    def from_doc(cls, doc: dict) -> AgentStatus:
        code = doc.get("exit_code")
        return cls(bool(doc.get("exists")), doc.get("pid"), doc.get("started"), None if code is None else int(code),
                   int(doc.get("alive") or 0), int(doc.get("log_size") or 0), str(doc.get("last_line") or ""),
                   doc.get("error_file"), doc.get("ended"), float(doc.get("save_seconds") or 0),
                   bool(doc.get("stop_requested")), rank_failed=doc.get("rank_failed"))

    @classmethod
    def from_json(cls, text: str | bytes) -> AgentStatus:
        """BadReply when `text` is not a status."""
        try:
            doc = json.loads(text)
            if isinstance(doc, dict):
                return cls.from_doc(doc)
        except (TypeError, ValueError):
            pass
        raise BadReply(f"not a status: {text[-200:]!r}")

    def as_json(self) -> dict:
        """As the agent printed it, or {"error": why} (`status --json`'s nodes_now)."""
        return {"error": self.error} if self.error else {k: v for k, v in asdict(self).items() if k != "error"}


def read_status(r: NodeResult) -> AgentStatus:
    return _reply(r, dict, AgentStatus.from_doc, lambda why: AgentStatus(error=why))


def status(node: Node, key: str, timeout: float = 30) -> Call[AgentStatus]:
    """`status RUN_KEY`: the node's view of attempt `key` there."""
    return _call(node, "status", node_key(key, node), read=read_status, timeout=timeout)


def end_status(line: str) -> AgentStatus | None:
    """The status a `tail ... status` closes with (its last stderr line); None for any other line,
    BadReply for a status line that cannot be read."""
    return AgentStatus.from_json(line[len(STATUS_MARK):]) if line.startswith(STATUS_MARK) else None


# ------------------------------------------------------------------ stop


@dataclass(frozen=True)
class StopResult:
    """A node's `stop`: whether it ran (one that ran out of time ran: the node carries it out),
    how many processes of the run it left, and why there is no count."""

    reached: bool
    left: int | None = None
    error: str | None = None


def read_stop(r: NodeResult) -> StopResult:
    return _reply(r, dict, lambda d: StopResult(True, int(d["left"])), lambda why: StopResult(r.reachable, None, why))


def stop(node: Node, key: str, grace: float, peer_failed: bool = False) -> Call[StopResult]:
    """`stop RUN_KEY GRACE [peer-failed]`: SIGTERM attempt `key`, SIGKILL after `grace` (the agent
    stretches it over a checkpoint save). peer_failed: another node of the run failed, so no
    collective save can complete: the agent kills at once unless a checkpoint is being written."""
    mode = ["peer-failed"] if peer_failed else []
    return _call(node, "stop", node_key(key, node), grace, *mode, read=read_stop, timeout=grace + 30)


# ------------------------------------------------------------------ claims


@dataclass(frozen=True)
class Claim:
    """A node's claim: the run holding it (key RUN_ID@NODE), who started that run, since when;
    stale once its run has nothing left on the node."""

    run: str = ""
    key: str = ""
    who: str = ""
    since: float = 0.0
    stale: bool = False

    @classmethod
    def from_doc(cls, doc: dict) -> Claim:
        return cls(str(doc.get("run") or ""), str(doc.get("key") or ""), str(doc.get("who") or ""),
                   float(doc.get("since") or 0), bool(doc.get("stale")))


@dataclass(frozen=True)
class Claimed:
    """`claim`'s answer: ok and the claim now the run's, or not and the holder's claim; with `live`, also the
    runs alive on the node then, and with `dirs` (the claim taken) the run's artifact directories, made."""

    ok: bool
    claim: Claim = Claim()
    error: str | None = None
    live: Live | None = None
    dirs: artifacts.Dirs | None = None


def read_claimed(r: NodeResult, node: str | None = None) -> Claimed:
    """`node`: the claim was asked with `live` (the node's keys are kept: two local nodes share a machine)."""
    def build(d: dict) -> Claimed:
        live = None if node is None else _live_of(node, d.get("live"))
        dirs = artifacts.Dirs(dict(d["dirs"])) if isinstance(d.get("dirs"), dict) else None
        return Claimed(d.get("ok") is True, Claim.from_doc(d), live=live, dirs=dirs)

    return _reply(r, dict, build, lambda why: Claimed(False, error=why))


def claim(node: Node, run_id: str, who: str, live: bool = False, dirs: bool = False) -> Call[Claimed]:
    """`claim NODE RUN_ID@NODE WHO [live] [dirs]`: take the node for the run (atomic on the node);
    with `live`, the answer also says which runs are alive on the node; with `dirs`, once the claim
    is taken, the run's artifact directories are made and named (artifacts.prepare's answer)."""
    more = [*(["live"] if live else []), *(["dirs"] if dirs else [])]
    return _call(node, "claim", node.name, node_key(run_id, node), who, *more,
                 read=(lambda r: read_claimed(r, node.name)) if live else read_claimed)


@dataclass(frozen=True)
class Claims:
    """`claims`: every claim on the node's machine (two local nodes share one), by node name."""

    held: Mapping[str, Claim] = field(default_factory=dict)
    error: str | None = None


def read_claims(r: NodeResult) -> Claims:
    return _reply(r, dict, lambda d: Claims({name: Claim.from_doc(c) for name, c in d.items()}),
                  lambda why: Claims(error=why))


def claims(node: Node) -> Call[Claims]:
    return _call(node, "claims", read=read_claims)


@dataclass(frozen=True)
class Released:
    """`release`: whether the run's claim was dropped (False: another run holds the node, or none)."""

    released: bool
    error: str | None = None


def read_released(r: NodeResult) -> Released:
    return _reply(r, dict, lambda d: Released(d["released"] is True), lambda why: Released(False, why))


def release(node: Node, run_id: str, timeout: float = TIMEOUT, dirs: bool = False) -> Call[Released]:
    """`release NODE RUN_ID@NODE [dirs]`: drop the run's claim on the node (another run's stays); with
    dirs, the run's artifact directories too where they are empty (a refused launch's)."""
    return _call(node, "release", node.name, node_key(run_id, node), *(["dirs"] if dirs else []), read=read_released,
                 timeout=timeout)


# ------------------------------------------------------------------ live runs, start, listening


@dataclass(frozen=True)
class Live:
    """`live`: the runs with a process alive on the node, by key (found by the key in their environment)."""

    keys: tuple[RunKey, ...] = ()
    error: str | None = None


def _live_of(node: str, keys: object) -> Live:
    """The node's keys only: two `connection: local` nodes share one machine. BadReply when
    `keys` is not a list."""
    if not isinstance(keys, list):
        raise BadReply(f"not a list of run keys: {str(keys)[-200:]!r}")
    mine = [k for k in keys if isinstance(k, str) and k.endswith("@" + node)]
    return Live(tuple(RunKey.parse(k) or RunKey(k, k.rpartition("@")[0], 1, node) for k in mine))


def read_live(node: str, r: NodeResult) -> Live:
    return _reply(r, list, lambda keys: _live_of(node, keys), lambda why: Live(error=why))


def live(node: Node) -> Call[Live]:
    return _call(node, "live", read=lambda r: read_live(node.name, r))


@dataclass(frozen=True)
class StartSpec:
    """What `start` runs: argv ({rundir}/ names the run directory), its cwd, its environment and
    the helper files written into the run directory first."""

    argv: Sequence[str]
    cwd: str
    env: Mapping[str, str]
    files: Mapping[str, str] = field(default_factory=dict)
    hook: str = ""  # remote/hook/sitecustomize.py's text: every rank answers `snapshot` ("" none)

    def encoded(self) -> bytes:
        doc = {"argv": list(self.argv), "cwd": self.cwd, "files": dict(self.files), "env": dict(self.env)}
        if self.hook:
            doc["hook"] = self.hook
        return json.dumps(doc).encode()


@dataclass(frozen=True)
class Started:
    """`start`: torchrun's pid; `not_started` is the node's word when it could not be run (its log
    says so and its exit code, 127, is recorded); `error`: the agent did not answer."""

    pid: int | None = None
    not_started: str | None = None
    error: str | None = None


def read_started(r: NodeResult) -> Started:
    return _reply(r, dict, lambda d: Started(d.get("pid"), d.get("error")), lambda why: Started(error=why))


def start(node: Node, key: str, spec: StartSpec) -> Call[Started]:
    """`start RUN_KEY -`: the spec's JSON on stdin, never on a command line (the inventory's env
    holds tokens, and `ps` on the node shows argv)."""
    return call(_exec(node, "start", node_key(key, node), "-", stdin=spec.encoded()), TIMEOUT, read_started)


# ------------------------------------------------------------------ the log stream


@dataclass(frozen=True)
class StreamFrom:
    """What a node's `tail ... stream` carries besides the log: its checkpoint directory (None: not
    watched), its TensorBoard directory and, per file, the bytes the control copy already has;
    with progress_s > 0, every rank's progress asked every progress_s s (the straggler watch's)."""

    checkpoints: str | None
    tensorboard: str
    have: Mapping[str, int] = field(default_factory=dict)
    progress_s: float = 0.0


def tail(node: Node, key: str, offset: int, stream: StreamFrom | None = None) -> Exec:
    """`tail RUN_KEY OFFSET status`: the log from `offset` as raw bytes, closed by the status on
    stderr (end_status); with `stream`, `tail RUN_KEY OFFSET stream CKPTDIR|- TBDIR OFFSETS_HEX
    [PROGRESS_S]`: framed records (log bytes, checkpoints, TensorBoard bytes, the ranks' progress,
    the status last: AgentStatus.from_json). PROGRESS_S is left out when no progress is asked for:
    the line is then the one it always was."""
    if stream is None:
        return _exec(node, "tail", node_key(key, node), offset, "status")
    have = json.dumps(dict(stream.have)).encode().hex()
    progress = [f"{stream.progress_s:g}"] if stream.progress_s > 0 else []
    return _exec(node, "tail", node_key(key, node), offset, "stream", stream.checkpoints or "-", stream.tensorboard,
                 have, *progress)


# ------------------------------------------------------------------ snapshots and links (runs/judge/hang.py)


@dataclass(frozen=True)
class Snapshot:
    """`snapshot`: each rank of the run on the node, as the agent's JSON has it (runs/judge/hang.py
    RankSnap.from_agent reads one)."""

    ranks: tuple[Mapping, ...] = ()
    time: float | None = None
    error: str | None = None


def read_snapshot(r: NodeResult) -> Snapshot:
    return _reply(r, dict, snapshot_of, lambda why: Snapshot(error=why))


def snapshot_of(doc: Mapping) -> Snapshot:
    """A snapshot's document (the verb's reply, or a FRAME_SNAPSHOT record from the node's stream)."""
    if doc.get("error") or not isinstance(doc.get("ranks"), list):
        return Snapshot(error=f"the node agent's snapshot failed: {doc.get('error') or 'no ranks in it'}")
    return Snapshot(tuple(doc["ranks"]), doc.get("time"))


def snapshot(node: Node, key: str, request: int, wait: float, progress: bool = False) -> Call[Snapshot]:
    """`snapshot RUN_KEY N WAIT [progress]`: every rank's /proc state and its hook's answer to
    request N (progress: the compute time of its newest steps, not its stacks)."""
    return _call(node, "snapshot", node_key(key, node), request, wait, *(["progress"] if progress else []),
                 read=read_snapshot, timeout=wait + 30)


@dataclass(frozen=True)
class Reach:
    """`reach`: target -> "ok" or why no TCP connection opened."""

    result: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None


def read_reach(r: NodeResult) -> Reach:
    return _reply(r, dict, lambda d: Reach({str(k): str(v) for k, v in d.items()}), lambda why: Reach(error=why))


def reach(node: Node, targets: Sequence[str], seconds: float = 3.0) -> Call[Reach]:
    """`reach S HOST:PORT...`: whether this node opens a TCP connection to each target."""
    return _call(node, "reach", seconds, *targets, read=read_reach, timeout=seconds + 30)


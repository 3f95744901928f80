"""Restarts: a run whose failure is the infrastructure's is launched again, from its last checkpoint.

  After an attempt fails, `classify` decides whose failure it was. A lost node, a worker killed
  by a signal (the OOM killer's SIGKILL included) or a collective error after a peer died is the
  infrastructure's: the run is launched again as attempt k+1 (at most --max-restarts times), with
  the newest complete checkpoint restored onto the nodes (the control machine's copy, or what the
  surviving nodes hold when that is newer: an own checkpoint or a replica, runs/ckpt/given_replicas.py), on
  the healthy nodes plus spares (`spare: true` nodes take a lost node's place in rank order); with
  no spare left, --min-nodes lets the run go on with fewer nodes. The script's own failure (a Python exception that is not a
  communication error) is not retried: it would fail the same way again.

Each attempt is started under its own key RUN_ID.aK on the nodes (attempt 1 keeps RUN_ID), so
its processes are found by id like any run's; its logs append to the same nodes/NODE.log.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.errors import LaunchError
from orchestrator.inventory import Inventory
from orchestrator.node import artifacts, wire
from orchestrator.runs.ckpt.given_home import (
    CheckpointStore,
    RestoreError,
    restore,
    step_of,
)
from orchestrator.runs.ckpt import jobdir_setaside
from orchestrator.runs.ckpt.jobdir_home import DirStore, RestoreDirError, restore_dir
from orchestrator.runs.ckpt.jobdir_replicas import NodeRestoreDirError, NodeSnaps
from orchestrator.runs.ckpt.jobdir_replicas import restore_from_nodes as restore_dir_from_nodes
from orchestrator.runs.logs.follow import worker_failure
from orchestrator.runs.policy import exit_code_retried
from orchestrator.runs.ckpt.given_replicas import NodeRestoreError, restore_from_nodes
from orchestrator.runs.spec import NodeState, RunResult
from orchestrator.runs.store import Run

if TYPE_CHECKING:
    from orchestrator.runs.ckpt.jobdir_home import DirCopier
    from orchestrator.runs.ckpt.jobdir_replicas import DirReplicas
    from orchestrator.transport import Cluster

# a worker's error that says a peer or the network went away, not that the script is wrong
COMM_ERROR = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|DistNetworkError|DistBackendError|"
    r"RendezvousConnectionError|NCCL (?:error|communicator was aborted)|remote process exited|"
    r"ProcessGroupGloo.*(?:Read|Write|Timed out)|Gloo connectFullMesh failed|Socket Timeout|"
    r"Timed out waiting|watchdog caught collective operation timeout|TCPStore|ECONNREFUSED|"
    r"Connection refused", re.I)
EXCEPTION_LINE = re.compile(r"^(?:\[[A-Za-z_]*\d+\]:)*\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$", re.M)


@dataclass(frozen=True)
class Outcome:
    """One node at the end of an attempt, as `classify` reads it."""

    name: str
    state: str  # a NodeState value: finished, failed, lost, ...
    exit_code: int | None
    log: str = ""  # the tail of the node's log for this attempt


@dataclass(frozen=True)
class Verdict:
    retry: bool  # the infrastructure's failure: worth another attempt
    cause: str  # finished | stopped | node lost | killed by signal | peer failure | script error
    detail: str
    bad_nodes: tuple[str, ...] = ()  # not to be used again this run
    culprits: tuple[str, ...] = ()  # the nodes the fault is attributed to (runs/nodefaults.py)


# torchrun's own exceptions, raised because a worker failed: never the root cause when a worker's is there
LAUNCHER_EXCEPTION = re.compile(r"^torch\.distributed\.elastic\.|^(?:ChildFailedError|SignalException)\b")


def _last_exception(log: str) -> str | None:
    """The last exception a worker raised (torchrun's ChildFailedError wrapping it is passed over)."""
    found = [e.strip() for e in EXCEPTION_LINE.findall(log)]
    own = [e for e in found if not LAUNCHER_EXCEPTION.match(e)]
    return (own or found)[-1] if found else None


def classify(outcomes: list[Outcome], first: str | None, stopped: bool = False, exit_codes: tuple[int, ...] = ()
             ) -> Verdict:
    """Whose failure was it? `first` is the node the failure policy blamed (None: none failed);
    `exit_codes`: a worker's exit codes retried whatever else (--restart-on-exit-codes). Which
    class is retried: runs/policy.py RETRY_RULES."""
    if stopped:
        return Verdict(False, "stopped", "stopped on request")
    if first is None and all(o.state == NodeState.FINISHED.value for o in outcomes):
        return Verdict(False, "finished", "every node finished")
    lost = tuple(o.name for o in outcomes if o.state == NodeState.LOST.value)
    if lost:
        return Verdict(True, "node lost", f"{', '.join(lost)} lost", lost, lost)
    by_name = {o.name: o for o in outcomes}
    root = by_name.get(first) if first else next((o for o in outcomes if o.exit_code not in (0, None)), None)
    if root is None:
        return Verdict(False, "script error", "no node reported a failure")
    wf = worker_failure(root.log.encode())
    code = wf["exitcode"] if wf else root.exit_code
    if exit_code_retried(code, exit_codes):
        shown = 128 - code if code < 0 else code
        return Verdict(True, "exit code", f"{root.name}: a worker exited with {shown} (--restart-on-exit-codes)")
    if code is not None and (code < 0 or code > 128):
        sig = -code if code < 0 else code - 128
        what = "killed by SIGKILL (the OOM killer, or a kill -9)" if sig == 9 else f"killed by signal {sig}"
        return Verdict(True, "killed by signal", f"{root.name}: a worker was {what}", culprits=(root.name,))
    exc = _last_exception(root.log)
    if exc is not None and not COMM_ERROR.search(exc) and not (COMM_ERROR.search(root.log) and
                                                                 "RuntimeError" in exc.split(":")[0]):
        return Verdict(False, "script error", f"{root.name}: {exc}")
    if COMM_ERROR.search(root.log):
        return Verdict(True, "peer failure", f"{root.name}: a collective failed after a peer went away")
    return Verdict(False, "script error", f"{root.name}: exit code {root.exit_code}")


def next_nodes(current: list[str], spares: list[str], bad: tuple[str, ...], min_nodes: int
               ) -> tuple[list[str], list[str]] | None:
    """The next attempt's nodes in rank order: each bad node's place taken by the next spare;
    with no spare left it is dropped if at least `min_nodes` remain. None: not enough nodes.
    Returns (nodes, spares left)."""
    spares = [s for s in spares if s not in bad]
    out = []
    for name in current:
        if name not in bad:
            out.append(name)
        elif spares:
            out.append(spares.pop(0))
    if len(out) < len(current) and len(out) < min_nodes:
        return None
    return out, spares


def ordered(inv: Inventory, names: list[str]) -> Inventory:
    """The inventory with exactly `names`, in that order, node ranks renumbered from 0."""
    keep = tuple(dataclasses.replace(inv.node(n), rank=i) for i, n in enumerate(names))
    return dataclasses.replace(inv, nodes=keep, _by_name={})


def prepare_artifacts(cluster: "Cluster", run_id: str, names: list[str]) -> dict[str, dict]:
    """Each node's artifact directories for the run (created when missing): {node: {"checkpoints",
    "tensorboard", "replicas"}} as absolute paths on the node."""
    dirs = {}
    for name, got in wire.run(cluster, lambda n: artifacts.prepare(n, run_id), names).items():
        if got.error is not None:
            raise LaunchError(f"{name}: cannot create the run's checkpoint directory: {got.error}")
        dirs[name] = dict(got.dirs)
    return dirs


class Restorer:
    """Puts the newest complete checkpoint on the nodes that need it before a launch: from the
    nodes themselves (an own checkpoint or a replica, node to node) when one of them holds a newer
    one than this machine, else this run's newest here, else (attempt 1, or none copied yet)
    --resume-from's (`origin`; with `from_set_aside`, what the origin run found in its checkpoint
    directory and set aside, runs/ckpt/jobdir_setaside.py). With --checkpoint-dir, attempt 1 first sets aside
    what DIR holds: the run's checkpoints are its own. `tell`: a line of the run's story."""

    def __init__(self, cluster: "Cluster", inv: Inventory, store: CheckpointStore, origin: str | None, say,
                 dirsnap: "DirCopier | None" = None, checkpoint_dir: str | None = None,
                 dirreplica: "DirReplicas | None" = None, tell=None, from_set_aside: bool = False):
        self.cluster, self.inv, self.store, self.say = cluster, inv, store, say
        self.origin_id = origin
        self.origin = CheckpointStore(Run(origin).dir) if origin else None
        self.dirsnap, self.checkpoint_dir, self.dirreplica = dirsnap, checkpoint_dir, dirreplica
        self.tell, self.from_set_aside = tell or say, from_set_aside

    @classmethod
    def of(cls, cluster: "Cluster", inv: Inventory, copier, spec, say, tell) -> "Restorer":
        """The Restorer of a run (runs/spec.py RunSpec) whose artifacts `copier` carries."""
        return cls(cluster, inv, copier.store, spec.resume_from, say, copier.dirsnap, spec.checkpoint_dir,
                   copier.dirreplica, tell=tell, from_set_aside=spec.resume_set_aside)

    def before(self, k: int, dirs: dict[str, dict], nodes: list[str]) -> dict:
        """Attempt k's nodes made ready: -> the attempt record's fields. Attempt 1 with
        --checkpoint-dir sets aside what DIR holds (never this run's); then a relaunch, or
        --resume-from, restores."""
        if k == 1 and self.checkpoint_dir:
            self.set_aside_found(dirs, nodes)
        return self.restore(dirs, nodes, relaunch=k > 1) if k > 1 or self.origin is not None else {}

    def set_aside_found(self, dirs: dict[str, dict], nodes: list[str]) -> None:
        """What DIR holds on the first attempt's nodes, moved to set-aside/before-run/ there and
        recorded (runs/ckpt/jobdir_setaside.py); the story says what, where, and how to get it back."""
        run_dir = self.store.dir.parent
        replies = jobdir_setaside.set_aside(self.cluster, {n: dirs[n]["ckptdir"] for n in nodes},
                                     {n: jobdir_setaside.aside_dir(dirs[n], jobdir_setaside.BEFORE_RUN) for n in nodes})
        jobdir_setaside.Found(run_dir).write(self.checkpoint_dir, nodes, replies)
        held = [n for n in nodes if replies[n]["aside"]]
        for n in held:
            self.tell(f"{n}: {self.checkpoint_dir} held {jobdir_setaside.in_words(replies[n]['files'])} from before this "
                      f"run: set aside, not taken as this run's checkpoint (kept in {replies[n]['path']} there)")
        if held:
            self.tell(f"to start a run from what was set aside, on purpose: clusterctl train --resume-from "
                      f"{run_dir.name}:{jobdir_setaside.FORM}")

    def restore(self, dirs: dict[str, dict], nodes: list[str], relaunch: bool) -> dict:
        """The attempt record's fields for what was restored (empty: nothing to restore). Every
        copy here is verified before it is chosen; a damaged one is skipped and said. When copies
        were made and none is intact (and the nodes hold none newer), LaunchError: the run does
        not go back to step 0 without a word."""
        if self.checkpoint_dir:
            return self.restore_dir(dirs, nodes)
        t0 = time.monotonic()
        store = self.store if self.store.newest() or self.origin is None else self.origin
        here, skipped = store.newest_intact(self.say)
        if relaunch:  # what the surviving nodes hold may be newer
            try:
                found = restore_from_nodes(self.cluster, dirs, nodes, step_of(here) if here else -1, say=self.say)
            except NodeRestoreError as e:  # the older copy on this machine (if any) still serves
                self.say(f"{e}; restoring from this machine's copy instead")
                found = None
            if found is not None:
                return {"checkpoint": found[0], "restored": found[1], "restored_from": "nodes",
                        "restore_s": round(time.monotonic() - t0, 3), "skipped": skipped}
        if here is None and skipped:
            raise LaunchError(f"no intact checkpoint to restore: {', '.join(skipped)} in {store.dir} "
                              f"{'is' if len(skipped) == 1 else 'are'} damaged (the bytes no longer match "
                              f"their checksums) and the nodes hold none; not restarting from step 0. "
                              f"Nothing was changed on the nodes.")
        if here is None:
            self.say("restarting from scratch: no checkpoint was copied")
            return {}
        try:
            restored = restore(self.cluster, store, dirs, [self.inv.node(n) for n in nodes], here)
        except RestoreError as e:
            raise LaunchError(str(e)) from e
        out = {"checkpoint": here, "restored": restored, "restore_s": round(time.monotonic() - t0, 3),
               "skipped": skipped}
        if store is self.origin:
            out["resumed_from"] = self.origin_id
        return out


    def restore_dir(self, dirs: dict[str, dict], nodes: list[str]) -> dict:
        """--checkpoint-dir: the newest intact snapshot of the job's directory (this run's, else
        --resume-from's) into that directory on every node: one kept on the nodes
        (runs/ckpt/jobdir_replicas.py, node to node) when it is newer than this machine's newest intact copy
        (runs/ckpt/jobdir_home.py restore_dir), else that copy."""
        t0 = time.monotonic()
        own = run_dir = self.store.dir.parent
        aside = {n: jobdir_setaside.aside_dir(dirs[n], time.strftime("%Y%m%d-%H%M%S")) for n in nodes}
        paths = {n: dirs[n]["ckptdir"] for n in nodes}
        if self.origin is not None and not DirStore(own).names() and not NodeSnaps(own).names():
            if self.from_set_aside:  # nothing of this run's yet: what --resume-from RUN:set-aside names
                return self.put_back(paths, aside, nodes, t0)
            run_dir = self.origin.dir.parent  # nothing of this run's yet: --resume-from's
        store, on_nodes = DirStore(run_dir), NodeSnaps(run_dir)
        name, skipped = store.newest_intact(self.say)
        placed = None
        if on_nodes.names():
            try:
                placed = restore_dir_from_nodes(self.cluster, on_nodes, paths, aside, self.say,
                                            newer_than=store.doc(name)["taken"] if name else 0.0)
            except NodeRestoreDirError as e:
                if name is None:
                    raise LaunchError(f"{e}; no copy of the checkpoint directory is on this machine either") from e
                self.say(f"{e}; restoring from this machine's copy instead")
        if placed is not None:
            name, replies, older = placed
            store, skipped = on_nodes, skipped + older
        elif name is None:
            if skipped or on_nodes.names():
                raise LaunchError(f"no intact checkpoint to restore: {', '.join(skipped + on_nodes.names())} "
                                  "could not be put together from intact copies (see above); not restarting from "
                                  "scratch. Nothing was changed on the nodes.")
            return self.from_scratch(paths, aside, nodes)
        else:
            try:
                replies = restore_dir(self.cluster, store, name, paths, [self.inv.node(n) for n in nodes], aside)
            except RestoreDirError as e:
                raise LaunchError(str(e)) from e
        self.say(f"restored checkpoint {store.describe(name)} into {self.checkpoint_dir} on {', '.join(nodes)}")
        for n, r in sorted(replies.items()):
            if r["aside"]:
                self.say(f"{n}: {', '.join(r['aside'])} in {self.checkpoint_dir} set aside (not in the restored "
                         f"checkpoint; kept in {aside[n]})")
        for snaps in (self.dirsnap, self.dirreplica):
            if snaps is not None:
                snaps.restored(name, {n: r["files"] for n, r in replies.items()}, store)
        out = {"checkpoint": name, "restored": list(nodes), "restore_s": round(time.monotonic() - t0, 3),
               "skipped": skipped, "checkpoint_about": f"{store.about(name)} in {self.checkpoint_dir}",
               "set_aside": {n: r["aside"] for n, r in replies.items() if r["aside"]}}
        if store is on_nodes:
            out["restored_from"] = "nodes"
        if run_dir != own:
            out["resumed_from"] = self.origin_id
        return out

    def from_scratch(self, paths: dict[str, str], aside: dict[str, str], nodes: list[str]) -> dict:
        """A relaunch with no snapshot of this run: it starts from an empty DIR (what the failed
        attempt left there, a torn or never-copied save, is set aside) and without --resume-args."""
        replies = jobdir_setaside.set_aside(self.cluster, paths, aside)
        moved = {n: r["aside"] for n, r in replies.items() if r["aside"]}
        self.say(f"restarting from scratch: no checkpoint of {self.checkpoint_dir} was copied in this run")
        for n, names in sorted(moved.items()):
            self.tell(f"{n}: {', '.join(names)} in {self.checkpoint_dir}, left by the failed attempt and in no "
                      f"snapshot of this run, set aside (kept in {aside[n]} there)")
        return {"set_aside": moved} if moved else {}

    def put_back(self, paths: dict[str, str], aside: dict[str, str], nodes: list[str], t0: float) -> dict:
        """--resume-from RUN:set-aside: what RUN found in its DIR and set aside, into DIR on `nodes`."""
        found = jobdir_setaside.Found(self.origin.dir.parent)
        doc = found.doc()
        if doc is None:
            raise LaunchError(f"run {self.origin_id} set nothing aside ({found.path} is missing). Nothing was started.")
        replies = jobdir_setaside.put_back(self.cluster, doc, paths, aside, self.say)
        about = f"{found.about()}, set aside when run {self.origin_id} started"
        self.say(f"put back {about}, into {self.checkpoint_dir} on {', '.join(nodes)}")
        return {"checkpoint": jobdir_setaside.FORM, "restored": list(nodes), "restore_s": round(time.monotonic() - t0, 3),
                "checkpoint_about": about, "resumed_from": self.origin_id,
                "set_aside": {n: r["aside"] for n, r in replies.items() if r["aside"]}}


def outcomes(run: Run, runner) -> list[Outcome]:
    """Each node of an attempt (runs/attempt.py AttemptRunner) as `classify` reads it."""
    return [Outcome(st.name, st.state.value, st.exit_code, attempt_log(run, st.name, runner.record.log_start))
            for st in runner.statuses.values()]


def attempt_log(run: Run, node: str, log_start: dict[str, int]) -> str:
    """The node's log from where this attempt began (the copy appends across attempts)."""
    start = log_start.get(node, 0)
    try:
        with open(run.node_log(node), "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(start, size - (1 << 18)))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def summary(result: RunResult, attempts: list, verdict: Verdict, max_restarts: int) -> RunResult:
    """The run's result with its attempts told, when there was more than one or it failed."""
    if len(attempts) <= 1 and verdict.cause in ("finished", "stopped"):
        return result
    k = len(attempts)
    note = ""
    if verdict.retry and sum(1 for a in attempts if a.launched) > max_restarts:
        note = f" (no restart left: --max-restarts {max_restarts})"
    elif verdict.cause == "script error" and max_restarts:
        note = " (the script's own error: not retried)"
    if k <= 1:  # the summary already is the one attempt's story
        return dataclasses.replace(result, summary=result.summary + note) if note else result
    tried = "; ".join(f"attempt {a.attempt}: {a.verdict or '?'}" +
                      (f" ({a.detail})" if a.detail and a.verdict != "finished" else "") for a in attempts)
    text = f"{result.summary}\n{k} attempt{'s' if k > 1 else ''}: {tried}{note}"
    return dataclasses.replace(result, summary=text)

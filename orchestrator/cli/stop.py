"""`clusterctl stop`: stop a run on every node, by its id.

A live run gets a stop request (recorded in runs/RUN/stop.json, so a replacement supervisor
honours it too) and its supervisor a SIGTERM; `stop` then waits for the record to say the run
ended. A run that already ended is cleared on its nodes, and `stop` says what it cleared: an
attempt whose stop never reached a node (it was cut off, and came back after the supervisor gave
up) is stopped now, and the run's claim on a node that did not answer when it ended is dropped.
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import time

import click

from orchestrator.cli.jsonout import emit, run_doc
from orchestrator.cli.runs import _err, _summary, complete_run_ids, ensure_supervisor
from orchestrator.errors import ClusterctlError, UnreachableError
from orchestrator.node import agent
from orchestrator.runs.launch import stray_processes
from orchestrator.runs.policy import MAX_GRACE
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.stopping import LOG_DRAIN_S
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster


def _wait_ended(run: Run, timeout: float) -> RunRecord:
    """Wait until the run's record says it ended; returns the record."""
    deadline = time.time() + timeout
    while not run.terminal:
        if time.time() > deadline:
            raise ClusterctlError(f"run {run.id} did not stop within {timeout:g}s; "
                                  f"`clusterctl status {run.id}` shows where it stands")
        if not run.supervisor_alive():
            ensure_supervisor(run)
        time.sleep(0.2)
    return run.record


@click.command("stop")
@click.argument("run_id", shell_complete=complete_run_ids)
@click.option("--grace", type=click.FloatRange(0, 3600), default=None,
              help="Seconds between SIGTERM and SIGKILL (default: the run's own), stretched to twice "
                   f"the job's last checkpoint save, up to {MAX_GRACE:g}s.")
@click.option("--timeout", type=click.FloatRange(1), default=None,
              help=f"How long to wait for the run to end (default: the grace + {LOG_DRAIN_S + 60:g}s).")
@click.option("--json", "as_json", is_flag=True, help="Print the run as it ended (orchestrator/schemas/stop.json).")
def stop_command(run_id, grace, timeout, as_json):
    """Stop a run on every node: SIGTERM (the trainer checkpoints), then SIGKILL.

    Exits 3 naming every node where the stop could not be confirmed (unreachable); that stop
    stays pending and is carried out as soon as the node answers again."""
    run = Run.find(run_id)
    _stop(run, grace, timeout)
    if as_json:
        emit(run_doc(run.record))


def run_nodes(rec: RunRecord) -> list[str]:
    """Every node an ended run may have left something on: its attempts' nodes, the nodes it
    claimed, left out, or still has a stop pending on."""
    return sorted({n for a in rec.attempts for n in a.nodes} | {nd.name for nd in rec.nodes} | set(rec.claimed)
                  | set(rec.left_out) | set(rec.stop_pending))


def clear_ended(run: Run, grace: float | None) -> tuple[dict[str, list[str]], dict[str, str]]:
    """What is left of an ended run on its nodes, cleared now on each node that answers: its
    processes stopped (an attempt whose stop never reached the node), its claim dropped (a node
    that did not answer when the run ended). Returns ({node: [what was cleared]}, {node: why it
    was not asked})."""
    rec = run.record
    spec = run.spec
    cleared: dict[str, list[str]] = {}
    # every node of its inventory: a spare it claimed may be in no attempt of the record; one
    # that does not answer matters only where the run may have left something
    mine = set(run_nodes(rec))
    with Cluster(spec.load_inventory(), connect_timeout=spec.connect_timeout, fanout=spec.fanout,
                 accept_new_host_keys=spec.accept_new_host_keys) as cluster:
        asked = list(cluster.connections)
        strays, failed = stray_processes(cluster, run.id, asked)
        failed.update({k: v.error for k, v in cluster.unreachable.items() if k in mine})
        g = spec.grace if grace is None else grace
        for node, keys in strays.items():
            for key in keys:
                agent.run(cluster, lambda n: agent.stop(n, key.attempt_key, g), [node])
            cleared[node] = [f"processes of {', '.join(k.attempt_key for k in keys)} (stopped)"]
        released = agent.run(cluster, lambda n: agent.release(n, run.id), [n for n in asked if n not in failed])
        for node, r in released.items():
            if r.error is not None:
                failed[node] = r.error
            elif r.released:
                cleared.setdefault(node, []).append("its claim")
    if rec.claimed and not run.supervisor_alive():  # the record says what the run holds: no longer these
        Book(run).released([n for n in rec.claimed if n not in failed])
    return cleared, failed


def _stop_ended(run: Run, grace: float | None) -> None:
    """`stop` of a run that already ended: what is left of it on its nodes is cleared, and said."""
    rec = run.record
    cleared, failed = clear_ended(run, grace)
    if rec.pending_stops and not run.supervisor_alive():
        ensure_supervisor(run)  # it carries out the stops still pending as their nodes answer
    state = rec.state
    if cleared:
        where = "; ".join(f"{n}: {', '.join(what)}" for n, what in cleared.items())
        _err(f"clusterctl: run {run.id} had already {state}; cleared what was left of it: {where}")
    elif not failed:
        _err(f"clusterctl: run {run.id} already {state}; no process of it is left on its nodes, and no claim")
    if failed:
        pending = set(rec.stop_pending)
        later = ("a stop pending in its record clears it there once it answers again" if set(failed) <= pending
                 else f"run `clusterctl stop {run.id}` again once it answers")
        raise UnreachableError(failed, f"so processes or a claim of run {run.id} may be left there: {later}")


def _stop(run: Run, grace: float | None, timeout: float | None) -> None:
    rec = run.record
    if rec.state.terminal:
        _stop_ended(run, grace)
        return
    run.request_stop(grace, by=f"{getpass.getuser()}@{socket.gethostname()}")
    if run.supervisor_alive():
        os.kill(rec.supervisor_pid, signal.SIGTERM)
    else:
        ensure_supervisor(run)  # a replacement reads the request when it starts
    spec = run.spec
    wait = timeout or (max(spec.grace, grace or 0, MAX_GRACE) + LOG_DRAIN_S + spec.lost_timeout + 60)
    rec = _wait_ended(run, wait)
    pending = rec.stop_pending
    if pending:
        raise UnreachableError({n: "not reachable" for n in pending},
                               f"so run {run.id} could not be confirmed stopped there. The stop stays "
                               f"pending: it is carried out as soon as "
                               f"{'that node answers' if len(pending) == 1 else 'they answer'} again "
                               f"(`clusterctl status {run.id}` shows it)")
    _summary(rec)


__all__ = ["clear_ended", "stop_command"]

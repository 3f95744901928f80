"""`clusterctl stop`: stop a run on every node, by its id.

A live run gets a stop request (recorded in runs/RUN/stop.json, so a replacement supervisor
honours it too) and its supervisor a SIGTERM; `stop` then waits for the record to say the run
ended. A run that already ended is checked on its nodes all the same: an attempt whose stop never
reached a node (it was cut off, and came back after the supervisor gave up) is stopped now.
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
from orchestrator.runs import agent
from orchestrator.runs.launch import stray_processes
from orchestrator.runs.policy import MAX_GRACE
from orchestrator.runs.record import load as load_record
from orchestrator.runs.stopping import LOG_DRAIN_S
from orchestrator.runs.store import Run
from orchestrator.transport import Cluster


def _wait_ended(run: Run, timeout: float) -> dict:
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


def stop_strays(run: Run, grace: float | None) -> dict[str, list[str]]:
    """An ended run's processes still alive on a node (an attempt whose stop never reached it):
    stopped now. Returns {node: [the keys stopped]}; UnreachableError names nodes not asked."""
    rec = load_record(run)
    names = sorted({n for a in rec.attempts for n in a.nodes} | {nd.name for nd in rec.nodes})
    spec = run.spec
    if not names:
        return {}
    with Cluster(spec.load_inventory(names), connect_timeout=spec.connect_timeout, fanout=spec.fanout,
                 accept_new_host_keys=spec.accept_new_host_keys) as cluster:
        strays, failed = stray_processes(cluster, run.id, [n for n in names if n in cluster.connections])
        failed.update({k: v.error for k, v in cluster.unreachable.items()})
        g = spec.grace if grace is None else grace
        for node, keys in strays.items():
            for key in keys:
                agent.run(cluster, lambda n: agent.stop(n, key.attempt_key, g), [node])
    if failed:
        raise UnreachableError(failed, f"so processes of run {run.id} may still run there")
    return {node: [k.key for k in keys] for node, keys in strays.items()}


def _stop(run: Run, grace: float | None, timeout: float | None) -> None:
    rec = run.record
    if run.terminal and not rec.get("stop_pending"):
        strays = stop_strays(run, grace)
        if strays:
            where = "; ".join(f"{n}: {', '.join(k.split('@')[0] for k in ks)}" for n, ks in strays.items())
            _err(f"clusterctl: run {run.id} had already {rec.get('state')}, but processes of it were still "
                 f"running ({where}); stopped them")
        else:
            _err(f"clusterctl: run {run.id} already {rec.get('state')}; no process of it is left on its nodes")
        return
    run.request_stop(grace, by=f"{getpass.getuser()}@{socket.gethostname()}")
    if run.supervisor_alive():
        os.kill(rec["supervisor_pid"], signal.SIGTERM)
    else:
        ensure_supervisor(run)  # a replacement reads the request when it starts
    spec = run.spec
    wait = timeout or (max(spec.grace, grace or 0, MAX_GRACE) + LOG_DRAIN_S + spec.lost_timeout + 60)
    rec = _wait_ended(run, wait)
    pending = rec.get("stop_pending") or []
    if pending:
        raise UnreachableError({n: "not reachable" for n in pending},
                               f"so run {run.id} could not be confirmed stopped there. The stop stays "
                               f"pending: it is carried out as soon as "
                               f"{'that node answers' if len(pending) == 1 else 'they answer'} again "
                               f"(`clusterctl status {run.id}` shows it)")
    _summary(rec)


__all__ = ["stop_command", "stop_strays"]

"""`clusterctl drill`: a fault drill on the user's own cluster.

Starts the job as `clusterctl train` would (the inventory's train: section, or `-- SCRIPT ARGS`),
detached, with the settings a drill needs (a restart per fault, --on-hang restart, a short hang
backstop, a short straggler window), then injects each chosen fault once the run trains again
after the previous one (runs/drill.py), stops the run, checks that nothing of it or of the drill
is left on any node, and prints per fault what it cost (runs/drillreport.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import click

from orchestrator.cli.jsonout import emit
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, with_unreachable
from orchestrator.inventory import check_local_files
from orchestrator.runs.drillreport import FAULTS, RESTARTS, WHAT, Outcome, Planned, Report, line, parse_faults, plan

DRILL_HANG_TIMEOUT_S = 60.0  # the hang watch's backstop during a drill (a stopped rank is named within seconds anyway)
DEFAULT_FAULTS = ("kill", "hang", "lost")  # straggler: only when asked for (see the --faults help)
STRAGGLER_WINDOW = 10  # steps: a throttled rank is named within the drill's throttle (runs/drill.py THROTTLE_S)
STOP_WAIT_S = 300.0
START_WAIT_S = 900.0  # train --detach: preflight, sync, setup and the start on every node
LEFT_WAIT_S = 60.0


def _faults(ctx, param, value):
    try:
        return parse_faults(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _say(as_json: bool):
    return lambda text: click.echo(text, err=as_json)


def _train_argv(opts: ClusterOptions, name: str, restarts: int, hang_timeout: float, script: tuple[str, ...]):
    """`clusterctl train --detach` of the job with the drill's settings."""
    argv = [sys.executable, "-m", "orchestrator.cli", "train", "--detach", "--json", "-i", opts.inventory_path,
            "--name", name, "--max-restarts", str(restarts), "--on-hang", "restart",
            "--hang-timeout", f"{hang_timeout:g}", "--straggler-window", str(STRAGGLER_WINDOW),
            "--fanout", str(opts.fanout)]
    argv += [a for n in opts.nodes for a in ("--nodes", n)]
    argv += ["--accept-new-host-keys"] if opts.accept_new_host_keys else []
    argv += ["--connect-timeout", f"{opts.connect_timeout:g}"] if opts.connect_timeout is not None else []
    return argv + (["--", *script] if script else [])


def _start(argv: list[str]) -> tuple[str | None, int]:
    """Run `train --detach --json`: (the run id, 0), or (None, its exit code); its messages go to stderr."""
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=START_WAIT_S)
    except subprocess.TimeoutExpired:
        click.echo(f"clusterctl drill: `clusterctl train --detach` did not return within {START_WAIT_S:.0f} s "
                   "(its preflight or the start of the run on the nodes hangs); `clusterctl runs` shows whether "
                   "a run began, `clusterctl stop RUN` ends it.", err=True)
        return None, EXIT_FAILED
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {}
    if p.returncode == 0 and isinstance(doc, dict) and doc.get("run_id"):
        return doc["run_id"], 0
    why = (doc.get("error") or {}).get("message") if isinstance(doc, dict) else None
    click.echo(f"clusterctl drill: the run did not start (train exited {p.returncode})" + (f": {why}" if why else ""),
               err=True)
    return None, p.returncode or EXIT_FAILED


def _settings(restarts: int, hang_timeout: float) -> list[str]:
    out = [f"--max-restarts {restarts} (one per fault that restarts the run)",
           "--on-hang restart (a hang restarts the run without the culprit's node)",
           f"--hang-timeout {hang_timeout:g} (the hang watch's backstop, short for a drill; a stopped rank "
           "is named within seconds by the watch's rule)",
           f"--straggler-window {STRAGGLER_WINDOW} (steps a rank's compute is judged over)"]
    return out


def _run_faults(drill, planned: list[Planned], detect_wait: float, say) -> list[Outcome]:
    outcomes, after, since = [], 0, 0.0
    for i, p in enumerate(planned):
        if p.skip is not None:
            outcomes.append(Outcome(p.fault, skip=p.skip))
            continue
        a = drill.training(after, since)
        if a is None:
            rest = [Outcome(q.fault, skip=q.skip or "the run did not train (again) before it: "
                            f"`clusterctl status {drill.run.id}` says why") for q in planned[i:]]
            outcomes += rest
            break
        o = drill.inject(p.fault, a, detect_wait)
        outcomes.append(o)
        say(line(o))
        if not o.ok and p.fault in RESTARTS:  # no known attempt trains again: the rest would wait in vain
            outcomes += [Outcome(q.fault, skip=q.skip or f"not injected: the {p.fault} before it was not "
                                 "detected, named right and recovered from") for q in planned[i + 1:]]
            break
        after, since = (o.attempt if p.fault in RESTARTS else (o.attempt or 1) - 1), time.time()
    return outcomes


@click.command("drill", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@cluster_options
@click.option("--faults", default=",".join(DEFAULT_FAULTS), show_default=True, callback=_faults, metavar="LIST",
              help="The faults to inject, in order, comma-separated: " + "; ".join(f"{f}: {w}" for f, w in WHAT.items())
              + ". hang and lost each need a spare node. straggler slows a rank only while it computes on the CPU "
                "(a step that sleeps, or waits asleep on a GPU, is not stretched by it): not in the default.")
@click.option("--name", default="drill", show_default=True, help="The run's name (its id is NAME-DATE-TIME-XXXX).")
@click.option("--hang-timeout", type=click.FloatRange(5, 3600), default=DRILL_HANG_TIMEOUT_S, show_default=True,
              metavar="SECONDS", help="The hang watch's backstop while drilling.")
@click.option("--json", "as_json", is_flag=True,
              help="The report as one JSON document (orchestrator/schemas/drill.json); progress goes to stderr.")
@click.argument("script", nargs=-1, type=click.UNPROCESSED)
def drill_command(opts: ClusterOptions, faults, name, hang_timeout, as_json, script):
    """Run the job and inject faults into it, one after another: kill a worker rank, stop a rank
    (a hang), freeze one node's part of the run (a lost node), throttle a rank (a straggler).
    Per fault it prints how long detection took, whom the supervisor named, the relaunch, the
    steps redone, the time lost and the goodput at one such fault per hour and per day.

    Without SCRIPT it runs the inventory's `train:` section, as `clusterctl train` would.
    Exits 0 when every fault was detected, named right and recovered from and nothing of the run
    is left on any node; 1 otherwise; 3 when a node could not be checked."""
    if script and script[0].startswith("-") and script[0] != "-m":
        raise click.UsageError(f"no such option: {script[0]}. A script and its own arguments go after `--`: "
                               "clusterctl drill -i nodes.yaml -- train.py --lr 3e-4")
    if not opts.inventory_path:
        raise click.UsageError("a drill runs on your cluster: give its inventory, clusterctl drill -i nodes.yaml")
    inv = check_local_files(opts.load())  # a bad inventory ends here, with exit code 2
    spares = sum(1 for n in inv.nodes if n.spare)
    planned = plan(faults, len(inv.nodes) - spares, spares)
    restarts = sum(1 for p in planned if p.skip is None and p.fault in RESTARTS)
    say = _say(as_json)
    for p in planned:
        say(f"drill: {p.fault}: " + (f"skipped: {p.skip}" if p.skip else WHAT[p.fault]))
    if all(p.skip for p in planned):
        say("drill: no fault can be injected on this cluster; nothing was started")
        sys.exit(EXIT_FAILED)
    settings = _settings(restarts, hang_timeout)
    say("drill: the job runs with " + "; ".join(settings))
    run_id, code = _start(_train_argv(opts, name, restarts, hang_timeout, script))
    if run_id is None:
        sys.exit(code)
    _drive(run_id, planned, settings, hang_timeout, as_json, say)


def _drive(run_id: str, planned: list[Planned], settings: list[str], hang_timeout: float, as_json: bool, say):
    from orchestrator.runs.drill import Drill, leftovers, stop_run
    from orchestrator.runs.store import Run

    run = Run.find(run_id)
    drill = Drill(run, say)
    outcomes: list[Outcome] = []
    interrupted = False
    try:
        outcomes = _run_faults(drill, planned, hang_timeout + run.spec.lost_timeout + 180, say)
    except KeyboardInterrupt:
        interrupted = True
        say("drill: interrupted: stopping the run")
    finally:
        stop_run(run, STOP_WAIT_S)
        left, unchecked = leftovers(run, LEFT_WAIT_S)
    report = Report(run.id, outcomes, left, unchecked, settings)
    _print(report, as_json, say)
    code = EXIT_INTERRUPTED if interrupted else (EXIT_OK if report.ok else EXIT_FAILED)
    sys.exit(with_unreachable(unchecked, code))


def _print(report: Report, as_json: bool, say) -> None:
    if as_json:
        emit(report.to_json())
        return
    click.echo(f"drill report, run {report.run_id}:")
    for o in report.outcomes:
        click.echo("  " + line(o))
    for node, pids in sorted(report.left.items()):
        click.echo(f"  LEFT on {node}: processes {', '.join(map(str, pids))} of the run or its drill")
    for node, why in sorted(report.unchecked.items()):
        click.echo(f"  {node}: could not be checked for what the drill left: {why}")
    if not report.left and not report.unchecked:
        click.echo("  nothing of the run or of its drill is left on any node (checked on every node, spares included)")
    click.echo("  goodput at one fault per hour / per day is that simple estimate: 1 - time lost / 3600 s, "
               "1 - time lost / 86400 s")
    done = sum(1 for o in report.outcomes if o.ok)
    click.echo(f"drill: {done} of {len(report.outcomes)} fault{'s' if len(report.outcomes) != 1 else ''} detected, "
               f"named right and recovered from" + ("" if report.ok else ": FAILED"))


__all__ = ["drill_command"]

"""`clusterctl train`: record the run, start its detached supervisor, follow its logs.

The supervisor (orchestrator/runs/supervisor.py) owns the run from there; `train` only
prints what it records, so Ctrl-C here is a stop request to it (recorded in the run, so a
replacement supervisor honours it too), and a killed `train` loses nothing (`clusterctl
tail` re-attaches: orchestrator/cli/runs.py). `--detach` returns once the run holds its
nodes and is launching, or with the error that stopped it (another run holds a node: 1).
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import sys
import shlex
import time

import click

from orchestrator.cli.jsonout import emit, json_lines, run_doc
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.cli import trainscale
from orchestrator.cli.runs import follow
from orchestrator.errors import EXIT_INTERRUPTED
from orchestrator.inventory import check_local_files
from orchestrator.inventory.read import decode_inventory, read_inventory_bytes
from orchestrator.inventory.sections import check_checkpoint_dir
from orchestrator.runs.ckpt.jobdir_replicas import NodeSnaps
from orchestrator.runs.ckpt.given_home import CheckpointStore
from orchestrator.runs.ckpt.jobdir_home import DirStore
from orchestrator.runs.curves import carry_over
from orchestrator.runs.judge.hang import ON_HANG
from orchestrator.runs.judge.straggler import ON_STRAGGLER
from orchestrator.cli.events_options import event_options, save_events
from orchestrator.runs.ckpt.jobdir_setaside import FORM as SET_ASIDE
from orchestrator.runs.ckpt.jobdir_setaside import RECORD, Found
from orchestrator.runs.spec import DEFAULTS, RunSpec, RunState
from orchestrator.runs.store import Run, new_run_id
from orchestrator.runs.supervisor import spawn

DETACH_WAIT_S = 600  # --detach: how long connecting, claiming and preflight may take


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def _nproc(ctx, param, value):
    if value in (None, "auto"):
        return value
    try:
        n = int(value)
        if n < 1:
            raise ValueError
        return n
    except ValueError:
        raise click.BadParameter("use 'auto' or a positive number of processes per node") from None


def start_supervisor(run: Run) -> subprocess.Popen:
    return spawn(run)


def wait_launching(run: Run, sup: subprocess.Popen) -> int:
    """--detach: wait until the run holds its nodes and launches (0), or ended before (its code)."""
    deadline = time.time() + DETACH_WAIT_S
    while time.time() < deadline:
        state = run.record.state
        if state in (RunState.LAUNCHING, RunState.RUNNING):
            return 0
        if state is RunState.QUEUED:
            _err(f"clusterctl: run {run.id} is queued; `clusterctl queue` shows what it waits for")
            return 0
        if state.terminal or sup.poll() is not None:
            rec = run.record
            _err(f"clusterctl: run {run.id} {rec.state}: {rec.error or rec.summary or ''}")
            return int(rec.exit_code or 1)
        time.sleep(0.1)
    _err(f"clusterctl: run {run.id} still {run.record.state} after {DETACH_WAIT_S}s; it goes on "
         f"(`clusterctl tail {run.id}`)")
    return 0


def _check_script(script: tuple[str, ...]) -> None:
    if script and script[0].startswith("-") and script[0] != "-m":
        raise click.UsageError(f"no such option: {script[0]}. A script and its own arguments go after "
                               "`--`: clusterctl train -i nodes.yaml -- train.py --lr 3e-4")
    if script and script[0] == "-m" and len(script) == 1:
        raise click.UsageError("-m needs a module: clusterctl train -- -m package.module ARGS")


def _checkpointed_run(run: Run, checkpoint_dir: str | None) -> str:
    """--resume-from RUN: its id when it has a complete checkpoint on this machine (else exit 2):
    a snapshot of its checkpoint directory with --checkpoint-dir, else the trainer's ckpt_N.pt."""
    store = run.dir / "checkpoints"
    checkpoints = DirStore(run.dir) if checkpoint_dir else CheckpointStore(run.dir)
    if checkpoint_dir and checkpoints.newest() is None and NodeSnaps(run.dir).newest() is not None:
        return run.id  # kept on the nodes (train.checkpoint_replica): checked there, before the launch
    if not store.is_dir() or checkpoints.newest() is None:
        if not checkpoint_dir:
            raise click.UsageError(f"run {run.id} has no complete checkpoint (a run's checkpoints are copied there "
                                   "while it trains, from CLUSTERCTL_CHECKPOINT_DIR, or with --checkpoint-dir from "
                                   f"the job's own directory) in {store} to resume from")
        found = Found(run.dir).about()
        raise click.UsageError(
            f"run {run.id} has no snapshot of its checkpoint directory {checkpoint_dir} in {store} to resume "
            "from: it ended before a checkpoint it wrote there was complete on every node, or it wrote none. "
            + (f"What {checkpoint_dir} held when it started was set aside ({found}): `clusterctl train "
               f"--resume-from {run.id}:{SET_ASIDE}` starts a run from that. " if found else "")
            + "Nothing was started.")
    # a skipped copy is told with the attempt's start (cli/runs.py announce) and kept in its record
    intact, skipped = checkpoints.newest_intact(lambda line: None)
    if intact is None:
        raise click.UsageError(f"run {run.id} has no intact checkpoint in {store}: {', '.join(skipped)} "
                               f"{'is' if len(skipped) == 1 else 'are all'} damaged (the bytes no longer match "
                               "their checksums). Nothing was started and nothing changed on the nodes.")
    return run.id


def _set_aside_run(run: Run, checkpoint_dir: str | None) -> str:
    """--resume-from RUN:set-aside: RUN's id when it set aside what its checkpoint directory held (else exit 2)."""
    if not checkpoint_dir:
        raise click.UsageError(f"--resume-from {run.id}:{SET_ASIDE} puts files into the job's checkpoint "
                               f"directory: run {run.id} had none; give one with --checkpoint-dir DIR")
    if Found(run.dir).doc() is None:
        raise click.UsageError(f"run {run.id} set nothing aside: its checkpoint directory was empty on every node "
                               f"when it started, or it ran without --checkpoint-dir ({run.dir / RECORD} is "
                               "missing). Nothing was started.")
    return run.id


def _origin(flag: str | None) -> tuple[Run | None, bool]:
    """--resume-from RUN or RUN:set-aside -> (the run, whether its set-aside files are meant)."""
    if flag is None:
        return None, False
    run_id, colon, form = flag.rpartition(":") if ":" in flag else (flag, "", "")
    if colon and form != SET_ASIDE:
        raise click.UsageError(f"--resume-from {flag!r}: give a run (its id or a unique prefix), or RUN:{SET_ASIDE} "
                               "for what RUN found in its checkpoint directory and set aside")
    return Run.find(run_id), bool(colon)  # no such run: UsageError


def _as_recorded(origin: Run, script: tuple[str, ...], checkpoint_dir: str | None, resume_args: str | None,
                 inv_dir: str | None) -> tuple[tuple[str, ...], str | None, str | None, list[str]]:
    """--resume-from RUN resumes what RUN ran: its script and arguments, --checkpoint-dir and
    --resume-args, each unless given again (the inventory's train: section is what runs when RUN
    ran it). -> (script, checkpoint_dir, resume_args, what was taken, in words)."""
    spec, taken = origin.spec, []
    if not script and spec.args:
        script = tuple(spec.args)
        taken.append(f"the script and its arguments ({shlex.join(script)})")
    if checkpoint_dir is None:  # its own, or none (a trainer's run) whatever the inventory says now
        checkpoint_dir = spec.checkpoint_dir
        if checkpoint_dir or inv_dir:
            taken.append(f"--checkpoint-dir {checkpoint_dir}" if checkpoint_dir else "no --checkpoint-dir")
    if resume_args is None and spec.resume_args:
        resume_args = shlex.join(spec.resume_args)
        taken.append(f"--resume-args {shlex.quote(resume_args)}")
    return script, checkpoint_dir, resume_args, taken


def _checkpoint_dir(inv, flag: str | None) -> str | None:
    """--checkpoint-dir, else train.checkpoint_dir; exit 2 for a path that cannot be one."""
    try:
        found = check_checkpoint_dir(flag) if flag is not None else inv.train.checkpoint_dir
    except ValueError as e:
        raise click.UsageError(f"--checkpoint-dir: {e}") from None
    return found


def _checkpoints(inv, resume_from: str | None, resume_args: str | None, checkpoint_dir: str | None,
                 script: tuple[str, ...]) -> tuple[dict, tuple[str, ...]]:
    """RunSpec's checkpoint settings, flags over --resume-from's record over the inventory's:
    checkpoint_dir, resume_from (a run with a complete checkpoint, or what it set aside, checked),
    resume_set_aside and resume_args (split as a shell would); and the script to run."""
    origin, from_set_aside = _origin(resume_from)
    checked, taken = None, []
    if origin is not None:
        script, flag, resume_args, taken = _as_recorded(origin, script, checkpoint_dir, resume_args,
                                                        inv.train.checkpoint_dir)
        checkpoint_dir = _checkpoint_dir(inv, flag) if flag is not None else None
        checked = (_set_aside_run if from_set_aside else _checkpointed_run)(origin, checkpoint_dir)
    else:
        checkpoint_dir = _checkpoint_dir(inv, checkpoint_dir)
    if taken:
        _err(f"clusterctl: resuming run {origin.id} as it ran: {', '.join(taken)}, from its record "
             "(give one again to change it)")
    return {"checkpoint_dir": checkpoint_dir, "resume_from": checked, "resume_set_aside": from_set_aside,
            "resume_args": tuple(inv.train.resume_args if resume_args is None else
                                 _split_args(resume_args, "--resume-args"))}, script


def _split_args(text: str, flag: str) -> list[str]:
    """A flag's arguments, split as a shell would (quotes kept together); bad quoting exits 2."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise click.UsageError(f"{flag} {text!r}: {e} (quote it as a shell would)") from None


@click.command("train", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@cluster_options
@click.option("--name", help="A name for the run (its id is NAME-DATE-TIME-XXXX).")
@click.option("--detach", is_flag=True, help="Return once the run is launched; re-attach with `clusterctl tail`.")
@click.option("--skip-preflight", is_flag=True, help="Launch without the fast preflight.")
@click.option("--force", is_flag=True, help="Launch despite a failed preflight, a node busy with another run, "
                                            "or more processes than a node has GPUs.")
@click.option("--nproc-per-node", default=DEFAULTS.nproc_per_node, callback=_nproc, show_default=True,
              help="Processes per node: auto = train.nproc_per_node, else the inventory's gpus (gpus: 0 = "
                   "one), else the GPUs found, else 1. More than a node's GPUs exits 2 unless --force.")
@click.option("--grace", type=click.FloatRange(0, 3600), default=DEFAULTS.grace, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when the run is stopped.")
@trainscale.options
@click.option("--warm/--no-warm", default=None, help="With --max-restarts, a warm interpreter (torch imported) on each "
              "node: every attempt's ranks fork from it [default: the inventory's train.warm, else on].")
@click.option("--lost-evidence/--no-lost-evidence", default=None,
              help="Declare a silent node lost within seconds when its SSH port answers no TCP handshake "
                   "while the other nodes answer; --no-lost-evidence waits --lost-timeout of silence "
                   "[default: the inventory's train.lost_evidence, else on].")
@click.option("--notify", metavar="CMD", default=None,
              help="Shell command run on this machine when the run ends, with CLUSTERCTL_RUN_ID, "
                   "CLUSTERCTL_STATUS, CLUSTERCTL_EXIT_CODE and CLUSTERCTL_FAILURE set (default: the "
                   "inventory's train.notify).")
@event_options
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per log line, then one for the run (orchestrator/schemas/train.json).")
@click.option("--max-restarts", type=click.IntRange(0, 100), default=None,
              help="Relaunch after an infrastructure failure (node lost, killed, peer died) up to N times, "
                   "from the last checkpoint, with spare nodes taking lost ones' places [default: the "
                   "inventory's train.max_restarts, else 0].")
@click.option("--restart-on-exit-codes", metavar="CODES", default=None,
              help="A worker's exit codes (comma-separated, 1-255) that are retried too, on the same nodes, "
                   "counting against --max-restarts [default: the inventory's train.restart_on_exit_codes].")
@click.option("--min-nodes", type=click.IntRange(1), default=None,
              help="A restart may go on with fewer nodes, down to this many, when no spare is left "
                   "(the script must take a different world size).")
@click.option("--queue", is_flag=True,
              help="When another run holds a node, wait for it instead of refusing: the run is recorded "
                   "`queued` and starts when its nodes are free, queued runs of this machine first come, "
                   "first served (`clusterctl queue` lists them) [default: the inventory's train.queue].")
@click.option("--queue-timeout", type=click.FloatRange(1), default=None, metavar="SECONDS",
              help="Give up (exit 1, nothing started) after waiting queued this long [default: wait until "
                   "stopped].")
@click.option("--resume-from", metavar="RUN", default=None,
              help="Start from the newest checkpoint copied home from run RUN (id or unique prefix): it is "
                   "put on the nodes before launch. RUN's script and arguments, --checkpoint-dir and "
                   "--resume-args are used unless given again. RUN:set-aside starts from what RUN found in "
                   "its checkpoint directory when it started, and set aside.")
@click.option("--resume-args", metavar="'ARGS'", default=None,
              help="Arguments added to the job's own when it starts from a restored checkpoint (a restart, "
                   "or --resume-from), split as a shell would, e.g. --resume-args '--init_from=resume' for "
                   "nanoGPT [default: the inventory's train.resume_args].")
@click.option("--checkpoint-dir", metavar="DIR", default=None,
              help="The job's own checkpoint directory, relative to the workdir unless absolute (nanoGPT's "
                   "out, a Trainer's output_dir): whatever the job writes there, any names, is copied to this "
                   "machine once complete on every node and put back on every node before a restart. What it "
                   "holds when the run starts is set aside, never taken as the run's "
                   "[default: the inventory's train.checkpoint_dir].")
@click.option("--checkpoint-interval", type=click.FloatRange(0.5, 86400), default=None, metavar="SECONDS",
              help="With --checkpoint-dir: at most one snapshot of it per this many seconds, each of the newest "
                   "version of every checkpoint its writer has closed [default: the inventory's "
                   "train.checkpoint_interval, else 3].")
@click.option("--allow-unhealthy", is_flag=True,
              help="Use quarantined nodes for this run (`clusterctl health` lists them), and quarantine none "
                   "whose health check fails.")
@click.option("--hang-timeout", type=click.FloatRange(0, 86400), default=None, metavar="SECONDS",
              help="The hang watch's backstop: no rank made progress (a step, a collective) for this long: "
                   "snapshot every rank's stacks and collectives, name the rank holding the others up, and apply "
                   "--on-hang (ranks waiting for a stopped or idle rank are named within seconds, whatever "
                   "this is); 0 turns the watch off [default: the inventory's train.hang_timeout, else 300].")
@click.option("--hang-busy-limit", type=click.FloatRange(0, 86400, min_open=True), default=None, metavar="SECONDS",
              help="A rank busy in its own code this long while the others wait for it in a collective is a "
                   "hang [default: the inventory's train.hang_busy_limit, else 600].")
@click.option("--on-hang", type=click.Choice(ON_HANG), default=None,
              help="What a hang does: fail the run, restart it from its checkpoint without the culprit's node "
                   "(a spare takes its place; counts against --max-restarts), or observe (report and go on) "
                   "[default: the inventory's train.on_hang, else fail].")
@click.option("--on-straggler", type=click.Choice(ON_STRAGGLER), default=None,
              help="What a straggler (a rank computing --straggler-factor times the median, over the last "
                   "--straggler-window steps, as the trainer reports it) does: warn (name it), or replace (restart "
                   "from the checkpoint without its node, onto a spare, when a restart and a spare are left) "
                   "[default: the inventory's train.on_straggler, else warn].")
@click.option("--straggler-factor", type=click.FloatRange(0, 100), default=None, metavar="X",
              help="How many times the median compute per step makes a straggler; 0 turns the watch off "
                   "[default: the inventory's train.straggler_factor, else 1.3].")
@click.option("--straggler-window", type=click.IntRange(3, 100000), default=None, metavar="STEPS",
              help="The steps each rank's median compute is taken over [default: the inventory's "
                   "train.straggler_window, else 50].")
@click.option("--dry-run", is_flag=True, help="Print the rank map and the settings that grow with the cluster "
                                            "(derived from its node and rank counts, or given); start nothing.")
@click.option("--no-fold", is_flag=True, help="Print every line: identical lines of many ranks are not folded "
                                            "into one under their ranks (the logs on disk keep every line).")
@click.argument("script", nargs=-1, type=click.UNPROCESSED)
def train_command(opts: ClusterOptions, name, detach, skip_preflight, force, nproc_per_node, grace,
                  lost_timeout, rendezvous_timeout, lost_evidence, warm, notify, as_json, max_restarts, restart_on_exit_codes, min_nodes, queue, queue_timeout, resume_from,
                  resume_args, checkpoint_dir, checkpoint_interval, allow_unhealthy, hang_timeout, hang_busy_limit,
                  on_hang, on_straggler, straggler_factor, straggler_window, dry_run, no_fold, script, events):
    """Preflight, then torchrun on every node in rank order; stream every rank's log.

    Without SCRIPT it runs the inventory's `train:` section (the bundled trainer by
    default); otherwise `-- train.py ARGS` or `-- -m package.module ARGS`. When any
    node fails, every node is stopped and the first failure is explained."""
    _check_script(script)
    inv = check_local_files(opts.load())  # a bad inventory ends here, with exit code 2
    if queue and force:
        raise click.UsageError("--queue waits for busy nodes and --force shares them: use one of the two")
    queue = (queue or inv.train.queue) and not force  # --force shares the nodes: nothing to wait for
    path = os.path.abspath(opts.inventory_path) if opts.inventory_path else None
    checkpoints, script = _checkpoints(inv, resume_from, resume_args, checkpoint_dir, script)
    scaled = trainscale.resolve(click.get_current_context(), inv, nproc_per_node=nproc_per_node, fanout=opts.fanout,
                                lost_timeout=lost_timeout, hang_timeout=hang_timeout,
                                rendezvous_timeout=rendezvous_timeout)
    if dry_run:
        return trainscale.dry_run(inv, nproc_per_node, scaled, as_json)
    run = Run.create(new_run_id(name), RunSpec(
        inventory=path, inventory_text=decode_inventory(read_inventory_bytes(path), path) if path else None,
        nodes=tuple(opts.nodes), args=tuple(script), skip_preflight=skip_preflight, force=force,
        nproc_per_node=nproc_per_node, grace=grace, **scaled,
        allow_unhealthy=allow_unhealthy, accept_new_host_keys=opts.accept_new_host_keys, cwd=os.getcwd(),
        connect_timeout=opts.connect_timeout, min_nodes=min_nodes,
        max_restarts=inv.train.max_restarts if max_restarts is None else max_restarts,
        restart_on_exit_codes=_exit_codes(restart_on_exit_codes, inv.train.restart_on_exit_codes),
        queue=queue, queue_timeout=queue_timeout, **checkpoints,
        copy_checkpoints=inv.train.copy_checkpoints, checkpoint_replica=inv.train.checkpoint_replica,
        **_health(inv.train, lost_evidence=lost_evidence, warm=warm, hang_busy_limit=hang_busy_limit,
                  on_hang=on_hang, on_straggler=on_straggler, straggler_factor=straggler_factor,
                  straggler_window=straggler_window, checkpoint_interval=checkpoint_interval)))
    save_events(run, notify, events)
    _carry_curves(run)
    sup = start_supervisor(run)
    _err(_started(run, inv))
    if detach:
        emit({"ok": True, "run_id": run.id, "records": str(run.dir)}) if as_json else click.echo(run.id)
        _err(f"clusterctl: follow it with `clusterctl tail {run.id}`, see it with `clusterctl status {run.id}`, "
             f"stop it with `clusterctl stop {run.id}`")
        sys.exit(wait_launching(run, sup))
    presses: list[float] = []
    interrupt = _interrupter(run, sup, presses)
    code = follow(run, on_interrupt=interrupt, supervisor=sup, sink=json_lines if as_json else None, fold=not no_fold)
    if presses and code == 0:
        code = EXIT_INTERRUPTED
    if as_json:
        emit(run_doc(run.record), compact=True)
    sys.exit(code)


def _interrupter(run: Run, sup, presses: list[float]):
    """Ctrl-C in the foreground: a stop request to the supervisor, each press noted in `presses`."""
    def interrupt():
        presses.append(time.time())
        run.request_stop(None, by=f"{getpass.getuser()}@{socket.gethostname()}")
        pid = run.record.supervisor_pid if run.supervisor_alive() else sup.pid
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if len(presses) == 1:
            _err(f"clusterctl: stopping run {run.id} gracefully on every node (Ctrl-C again to kill)")
        else:
            _err(f"clusterctl: killing run {run.id} on every node now")
    return interrupt


def _started(run: Run, inv) -> str:
    spares = sum(1 for n in inv.nodes if n.spare)
    return (f"clusterctl: run {run.id} on {len(inv.nodes) - spares} nodes"
            f"{f' (+{spares} spare)' if spares else ''} (records in {run.dir})")


def _carry_curves(run: Run) -> None:
    """--resume-from RUN: RUN's curves go on in this run's (runs/curves.py); not for what RUN set
    aside, which is no part of its history."""
    if run.spec.resume_from and not run.spec.resume_set_aside:
        carry_over(Run.find(run.spec.resume_from).dir, run.dir)


def _exit_codes(flag: str | None, inventory: list[int]) -> tuple[int, ...]:
    """--restart-on-exit-codes '3,42' (else the inventory's list); a bad value is a usage error (exit 2)."""
    if flag is None:
        return tuple(inventory)
    try:
        codes = tuple(int(c) for c in flag.replace(" ", "").split(",") if c)
    except ValueError:
        codes = ()
    if not codes or any(not 1 <= c <= 255 for c in codes):
        raise click.BadParameter(f"{flag!r}: give exit codes from 1 to 255, comma-separated, e.g. 3,42",
                                 param_hint="--restart-on-exit-codes")
    return codes


def _health(train, **flags) -> dict:
    """The loss rule, the hang and straggler watches' settings and the checkpoint directory's
    interval: each flag given, else the inventory's train: value."""
    return {k: getattr(train, k) if v is None else v for k, v in flags.items()}


__all__ = ["train_command"]

from __future__ import annotations

import os
import re
import sys

import click

from orchestrator import shell
from orchestrator.errors import EXIT_FAILED, UsageError
from orchestrator.platforms.fromenv import (
    DEFAULT_PORT,
    checklist,
    detect_gpus,
    detect_platform,
    launch_env,
    local_checks,
    visible,
)
from orchestrator.runs.scaling import derive
from orchestrator.torchrun import RDZV_CONF_ENV, nproc_for, rdzv_conf, rdzv_timeout_given, target_argv, torchrun_argv


@click.command("launch", context_settings={"ignore_unknown_options": True})
@click.option("--from-env", "from_env", is_flag=True,
              help="Take nodes, node rank and master from the platform's environment (required).")
@click.option("-i", "--inventory", "inventory_path", type=click.Path(dir_okay=False), default=None,
              help="Inventory for env and train args (optional; default: the trainer's defaults).")
@click.option("--dry-run", is_flag=True, help="Print the checklist and the torchrun command; run nothing.")
@click.option("--nproc-per-node", type=click.IntRange(1, 1024), default=None,
              help="Processes on this node (default: the GPUs found, else 1).")
@click.option("--nnodes", type=click.IntRange(1, 100000), default=None, help="Override the node count.")
@click.option("--node-rank", type=click.IntRange(0, 100000), default=None, help="Override this node's rank.")
@click.option("--master-addr", default=None, help="Override the master address.")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None, help="Override the master port.")
@click.option("--iface", default=None, help="Pin NCCL/gloo to this interface.")
@click.option("--skip-checks", is_flag=True, help="Launch even if a node-local check fails.")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(from_env, inventory_path, dry_run, nproc_per_node, nnodes, node_rank, master_addr,
                   master_port, iface, skip_checks, script_args):
    """In a pod or batch step: read the platform's variables, check this node, exec torchrun.

    Reads SLURM_*, PET_* (Kubeflow), JOB_COMPLETION_INDEX (Indexed Job), SKYPILOT_* or
    WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT (nodes, not processes), in that order. SCRIPT
    ARGS after `--` are what torchrun runs (default: the inventory's train section, else
    `-m trainer`). `clusterctl render slurm|k8s` write jobs that call exactly this."""
    if not from_env:
        raise UsageError("launch runs inside a scheduler's job and needs --from-env; to start a run "
                         "over SSH use `clusterctl train`")
    inv = None
    if inventory_path:
        from orchestrator.inventory import load_inventory
        inv = load_inventory(inventory_path)
    plat = detect_platform(os.environ, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                           master_port=master_port,
                           default_port=inv.master_port if inv else DEFAULT_PORT)
    if iface is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,14}", iface):
        raise UsageError(f"--iface {iface!r} is not an interface name")
    local = detect_gpus()
    gpus = visible(local.gpus, os.environ)
    inv_node = inv.nodes[plat.node_rank] if inv is not None and len(inv.nodes) == plat.nnodes else None
    if nproc_per_node is not None:
        nproc = nproc_per_node
    elif inv_node is not None:
        nproc = nproc_for(inv_node, len(gpus) or None, inv.train.nproc_per_node)
    elif inv is not None and inv.train.nproc_per_node != "auto":
        nproc = int(inv.train.nproc_per_node)
    else:
        nproc = len(gpus) or 1
    env = launch_env(plat, os.environ, inv, iface)
    target = target_argv(inv, script_args) if inv is not None else (list(script_args) or ["-m", "trainer"])
    checks = local_checks(plat, nproc, local, env, inv)
    rendezvous_s = _rendezvous_timeout(env, plat.nnodes, plat.nnodes * nproc)
    argv = torchrun_argv(python=sys.executable, nnodes=plat.nnodes, nproc=nproc, node_rank=plat.node_rank,
                         master_addr=plat.master_addr, master_port=plat.master_port, run_id=plat.run_id,
                         target=target, rdzv=rdzv_conf(env, rendezvous_s))
    click.echo(checklist(plat, nproc, local, gpus, target, env, checks, rendezvous_s), err=True)
    failed = [c for c in checks if c.status == "fail"]
    if dry_run:
        for k, v in env.items():
            if os.environ.get(k) != v:
                click.echo(f"export {k}={shell.quote(v)}")
        click.echo(shell.join(argv))
        sys.exit(EXIT_FAILED if failed and not skip_checks else 0)
    if failed and not skip_checks:
        click.echo("clusterctl: error: a node check failed (above); fix it or pass --skip-checks", err=True)
        sys.exit(EXIT_FAILED)
    click.echo("exec " + shell.join(argv), err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)


def _rendezvous_timeout(env, nnodes: int, ranks: int) -> int:
    """torchrun's rendezvous timeout on this node: the one PET_RDZV_CONF gives (a render, the job's
    own environment), else `train`'s rule for the platform's node count (runs/scaling.py), so
    every node of the job derives the same value."""
    try:
        given = rdzv_timeout_given(env)
    except ValueError as e:
        raise UsageError(f"{RDZV_CONF_ENV}={env.get(RDZV_CONF_ENV)!r} in this node's environment is not what "
                         f"torchrun accepts: {e}. Nothing was started.") from None
    return given if given is not None else derive(nnodes, ranks).rendezvous_timeout

from __future__ import annotations

import click

from orchestrator.cli.jsonout import emit
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.platforms.render import _write, render_k8s, render_slurm

# ------------------------------------------------------------------ CLI

# Options are parsed up to `--` or the script's name, so a mistyped flag before them
# (`--partiton gpu`) is refused by click with exit 2 instead of joining the trainer's arguments.
_SCRIPT_ARGS = {"allow_interspersed_args": False}


@click.group("render")
def render_command():
    """Write the run `train` would start as a SLURM batch script or Kubernetes manifests."""


_gpus_opt = click.option("--gpus-per-node", "gpus", type=click.IntRange(0, 1024), default=None,
                         help="Processes (and GPUs) per node (default: the inventory's gpus/nproc_per_node).")
_out_opt = click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
_json_opt = click.option("--json", "as_json", is_flag=True,
                         help="Print {ok, target, text, output, nodes, ...} (orchestrator/schemas/render.json); "
                              "with -o the file is written as well.")


def _done(text: str, output: str | None, as_json: bool, target: str, inv, **meta) -> None:
    if not as_json:
        _write(text, output)
        return
    if output:
        _write(text, output)
    emit({"ok": True, "target": target, "output": output, "nodes": [n.name for n in inv.nodes],
          "master": inv.master.name, "master_port": inv.master_port, **meta, "text": text})


@render_command.command("slurm", context_settings=_SCRIPT_ARGS)
@cluster_options
@_gpus_opt
@_out_opt
@click.option("--job-name", default="clusterctl", show_default=True)
@click.option("--log", default="%x-%j.out", show_default=True, help="sbatch --output pattern.")
@click.option("--partition", default=None, help="sbatch --partition.")
@click.option("--time", "time_limit", default=None, help="sbatch --time (e.g. 24:00:00).")
@_json_opt
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def render_slurm_command(opts: ClusterOptions, gpus, output, job_name, log, partition, time_limit,
                         as_json, script_args):
    """An sbatch script: one task per node, each running `clusterctl launch --from-env`.

    SCRIPT ARGS (after `--`) replace the inventory's train section, as with `train`."""
    inv = opts.load()
    _done(render_slurm(inv, script_args, job_name=job_name, gpus=gpus, log=log, partition=partition,
                       time_limit=time_limit), output, as_json, "slurm", inv, job_name=job_name)


@render_command.command("k8s", context_settings=_SCRIPT_ARGS)
@cluster_options
@_gpus_opt
@_out_opt
@click.option("--image", required=True,
              help="Container image with clusterctl, torch and the trainer (with a setup: section: "
                   "the setup venv at its path, clusterctl in it).")
@click.option("--name", default="clusterctl", show_default=True, help="Job and Service name.")
@click.option("--namespace", default=None, help="metadata.namespace (default: kubectl's).")
@click.option("--gpu-resource", default="nvidia.com/gpu", show_default=True,
              help="Extended resource to request (amd.com/gpu on ROCm clusters).")
@click.option("--checkpoint-pvc", default=None, metavar="CLAIM",
              help="Mount this ReadWriteMany PersistentVolumeClaim at /checkpoints (a directory per "
                   "--name) as CLUSTERCTL_CHECKPOINT_DIR and let a failed Job restart every pod from "
                   "the newest checkpoint there (default: no retries).")
@click.option("--max-restarts", type=click.IntRange(0, 100), default=None,
              help="With --checkpoint-pvc: how many times the whole Job may restart  [default: 3]")
@_json_opt
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def render_k8s_command(opts: ClusterOptions, gpus, output, image, name, namespace, gpu_resource,
                       checkpoint_pvc, max_restarts, as_json, script_args):
    """An Indexed Job + headless Service: one pod per node, each running `clusterctl launch
    --from-env` with node rank JOB_COMPLETION_INDEX and node 0 as `<name>-0.<name>`."""
    inv = opts.load()
    _done(render_k8s(inv, script_args, image=image, name=name, namespace=namespace, gpus=gpus,
                     gpu_resource=gpu_resource, checkpoint_pvc=checkpoint_pvc, max_restarts=max_restarts),
          output, as_json, "k8s", inv, job_name=name)

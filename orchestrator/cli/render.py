from __future__ import annotations

import click

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


@render_command.command("slurm", context_settings=_SCRIPT_ARGS)
@cluster_options
@_gpus_opt
@_out_opt
@click.option("--job-name", default="clusterctl", show_default=True)
@click.option("--log", default="%x-%j.out", show_default=True, help="sbatch --output pattern.")
@click.option("--partition", default=None, help="sbatch --partition.")
@click.option("--time", "time_limit", default=None, help="sbatch --time (e.g. 24:00:00).")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def render_slurm_command(opts: ClusterOptions, gpus, output, job_name, log, partition, time_limit,
                         script_args):
    """An sbatch script: one task per node, each running `clusterctl launch --from-env`.

    SCRIPT ARGS (after `--`) replace the inventory's train section, as with `train`."""
    _write(render_slurm(opts.load(), script_args, job_name=job_name, gpus=gpus, log=log,
                        partition=partition, time_limit=time_limit), output)


@render_command.command("k8s", context_settings=_SCRIPT_ARGS)
@cluster_options
@_gpus_opt
@_out_opt
@click.option("--image", required=True, help="Container image with clusterctl, torch and the trainer.")
@click.option("--name", default="clusterctl", show_default=True, help="Job and Service name.")
@click.option("--namespace", default=None, help="metadata.namespace (default: kubectl's).")
@click.option("--gpu-resource", default="nvidia.com/gpu", show_default=True,
              help="Extended resource to request (amd.com/gpu on ROCm clusters).")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def render_k8s_command(opts: ClusterOptions, gpus, output, image, name, namespace, gpu_resource,
                       script_args):
    """An Indexed Job + headless Service: one pod per node, each running `clusterctl launch
    --from-env` with node rank JOB_COMPLETION_INDEX and node 0 as `<name>-0.<name>`."""
    _write(render_k8s(opts.load(), script_args, image=image, name=name, namespace=namespace, gpus=gpus,
                      gpu_resource=gpu_resource), output)

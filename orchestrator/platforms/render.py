"""`clusterctl render slurm|k8s`: the run `clusterctl train` would start, as an sbatch script or a
Kubernetes Indexed Job + headless Service.

Both call exactly `clusterctl launch --from-env` on every node, which reads the scheduler's
variables and execs torchrun through orchestrator.torchrun, so the flags, the environment
(scaled timeouts, inventory env, interface pins, train.env) and the trainer arguments are the
ones `train` uses. Nothing is left for the user to keep in step by hand. With a `setup:` section
they run it with the venv's python (`node_python`), which `setup.clusterctl: true` gives clusterctl.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click
import yaml

from orchestrator import shell
from orchestrator.errors import UsageError
from orchestrator.inventory import Inventory
from orchestrator.torchrun import node_env, nproc_for, target_argv

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.%/:,=+@-]+$")  # sbatch reads #SBATCH lines itself: no quoting
IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
CHECKPOINT_MOUNT = "/checkpoints"  # where --checkpoint-pvc is mounted: CLUSTERCTL_CHECKPOINT_DIR


# ------------------------------------------------------------------ what every node gets

def common_env(inv: Inventory) -> tuple[dict[str, str], list[str]]:
    """node_env() of every node, keeping what all nodes agree on. A scheduler decides which
    host is which rank, so a per-node setting cannot follow its node; those keys are returned
    as dropped (the caller warns)."""
    envs = [node_env(inv, n) for n in inv.nodes]
    first = envs[0]
    keep = {k: v for k, v in first.items() if all(e.get(k) == v for e in envs[1:])}
    dropped = sorted({k for e in envs for k in e} - set(keep))
    return keep, dropped


def gpus_per_node(inv: Inventory, override: int | None) -> tuple[int, bool]:
    """(processes per node, whether to request GPUs). SLURM's --gpus-per-node and a Job's pod
    template give every node the same, so the inventory must agree across nodes."""
    cpu_only = all(n.gpus == 0 for n in inv.nodes)  # `gpus: 0` everywhere: ask for no GPUs
    if override is not None:
        return override, override > 0 and not cpu_only
    counts = {n.name: nproc_for(n, None, inv.train.nproc_per_node) for n in inv.nodes}
    if len(set(counts.values())) > 1:
        desc = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise UsageError(f"nodes have different GPU counts ({desc}); a SLURM or Kubernetes render "
                         "gives every node the same, so pass --gpus-per-node")
    if all(n.gpus is None for n in inv.nodes) and inv.train.nproc_per_node == "auto":
        raise UsageError("the inventory does not say how many GPUs a node has: set `gpus:` on the "
                         "nodes or pass --gpus-per-node")
    return next(iter(counts.values())), not cpu_only


def node_python(inv: Inventory) -> str | None:
    """The interpreter that runs `launch --from-env` on every node: the setup venv's when the
    inventory has `setup:` (the nodes' only Python then, so clusterctl must be in it), else None
    (the inventory's python, or the image's `clusterctl`)."""
    if inv.setup is None:
        return None
    if not inv.setup.clusterctl:
        src = inv.source if inv.source and not inv.source.startswith("<") else "<inventory>"
        raise UsageError(f"{inv.source} has a setup: section, so the job would run "
                         f"`{inv.setup.python} -m orchestrator.cli launch --from-env` on every node, but "
                         "setup builds that venv without clusterctl in it: add `clusterctl: true` to "
                         f"setup:, run `clusterctl setup -i {src}` (it installs clusterctl's node side in "
                         "the venv) and render again")
    return inv.setup.python


def launch_argv(nproc: int) -> list[str]:
    """The arguments after `clusterctl`: the in-pod launcher with the trainer to run."""
    return ["launch", "--from-env", "--nproc-per-node", str(nproc), "--"]


def _warn_dropped(dropped: list[str]) -> None:
    if dropped:
        click.echo("clusterctl: warning: left out per-node settings a scheduler cannot place "
                   f"(they differ between nodes): {', '.join(dropped)}", err=True)


def _write(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text)
        click.echo(f"wrote {output}", err=True)
    else:
        sys.stdout.write(text)


# ------------------------------------------------------------------ SLURM

def render_slurm(inv: Inventory, user_args=(), *, job_name: str = "clusterctl",
                 gpus: int | None = None, log: str = "%x-%j.out", partition: str | None = None,
                 time_limit: str | None = None) -> str:
    for flag, value in (("--job-name", job_name), ("--log", log), ("--partition", partition),
                        ("--time", time_limit)):
        if value is not None and not SBATCH_VALUE.match(value):
            raise UsageError(f"{flag} {value!r}: #SBATCH lines are read by sbatch without a shell, "
                             "so use only letters, digits and _.%/:,=+@-")
    nproc, want_gpus = gpus_per_node(inv, gpus)
    venv_python = node_python(inv)
    env, dropped = common_env(inv)
    _warn_dropped(dropped)
    target = target_argv(inv, user_args)
    lines = [
        "#!/bin/bash",
        f"# Rendered by `clusterctl render slurm` from {Path(inv.source).name}: the run `clusterctl train`",
        "# would start, under SLURM. Submit with `sbatch FILE`; edit the inventory and render again",
        "# rather than this file.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={len(inv.nodes)}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if want_gpus:
        lines.append(f"#SBATCH --gpus-per-node={nproc}")
    lines.append(f"#SBATCH --output={log}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    lines += [
        "set -euo pipefail",
        "",
        "# Rank 0 and the rendezvous live on the allocation's first host.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        'export MASTER_ADDR="$head"',
        f"export MASTER_PORT={shell.quote(inv.master_port)}",
        "",
        "# The environment `clusterctl train` gives every node: timeouts scaled to the node count,",
        "# the inventory's env, interface pins and train.env.",
    ]
    lines += [f"export {k}={shell.quote(v)}" for k, v in env.items()]
    lines += [
        "",
        f"cd {shell.path(inv.workdir)}",
        "",
        "# One task per node. Each runs `launch --from-env`: it reads SLURM_NNODES, SLURM_NODEID and",
        "# SLURM_JOB_ID, checks the node, prints the checklist and execs torchrun. A node that fails",
        "# ends the whole step (--kill-on-bad-exit), as `train` tears every node down.",
    ]
    if venv_python:
        lines.append(f"# {venv_python}: the venv `clusterctl setup` builds on every node, clusterctl in it.")
    lines += [
        "srun --kill-on-bad-exit=1 " + shell.path(venv_python or inv.python) + " "
        + shell.join(["-m", "orchestrator.cli", *launch_argv(nproc), *target]),
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ Kubernetes

def _check_k8s_names(name: str, namespace: str | None, nnodes: int) -> None:
    # The pods' hostnames are <name>-<index>, which must stay a DNS label (63 characters).
    longest = f"{name}-{nnodes - 1}"
    if not DNS1035_LABEL.match(name) or len(longest) > 63:
        raise UsageError(f"--name {name!r}: the Job and its Service need a DNS label (lowercase "
                         "letters, digits and '-', starting with a letter), short enough that "
                         f"{longest!r} fits in 63 characters")
    if namespace is not None and (not DNS1123_LABEL.match(namespace) or len(namespace) > 63):
        raise UsageError(f"--namespace {namespace!r} is not a DNS-1123 label")


def _k8s_meta(name: str, namespace: str | None) -> dict:
    m: dict = {"name": name}
    if namespace:
        m["namespace"] = namespace
    m["labels"] = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "clusterctl"}
    return m


def _k8s_service(name: str, namespace: str | None, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _k8s_meta(name, namespace),
        "spec": {
            # headless: one DNS record per pod, <name>-<index>.<name>, which is how node 0 is found
            "clusterIP": "None",
            "selector": {"job-name": name},
            # records exist before the pods are Ready: rendezvous happens before any readiness
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": port, "targetPort": port}],
        },
    }


def _resume_args(target: list[str], checkpoint_pvc: str | None) -> list[str]:
    """The bundled trainer resumes from CLUSTERCTL_CHECKPOINT_DIR with `--resume auto`; say so in
    the args, so that a retried pod picks up the newest checkpoint on the claim. Another
    script gets its args unchanged: it must read CLUSTERCTL_CHECKPOINT_DIR itself."""
    if checkpoint_pvc is None or target[:2] != ["-m", "trainer"]:
        return target
    given = []
    for i, a in enumerate(target):
        if a == "--resume":
            given.append(target[i + 1] if i + 1 < len(target) else "")
        elif a.startswith("--resume="):
            given.append(a.split("=", 1)[1])
    if any(v != "auto" for v in given):
        raise UsageError(f"--resume {given[-1]!r} with --checkpoint-pvc: a retried pod would start "
                         "from it again instead of from the newest checkpoint on the claim; drop "
                         "--resume (the claim's checkpoints are resumed with --resume auto)")
    return target if given else [*target, "--resume", "auto"]


def _k8s_command(venv_python: str | None, nproc: int) -> list[str]:
    """The image's `clusterctl`, or with `setup:` the venv's python (a `~/` venv through sh, since
    a container's command is not run by a shell: "$HOME" is the pod's)."""
    if venv_python is None:
        return ["clusterctl", *launch_argv(nproc)]
    if not venv_python.startswith("~"):
        return [venv_python, "-m", "orchestrator.cli", *launch_argv(nproc)]
    run = f'exec {shell.path(venv_python)} -m orchestrator.cli "$@"'
    return ["/bin/sh", "-c", run, "clusterctl", *launch_argv(nproc)]


def _k8s_container(inv: Inventory, user_args, *, image: str, name: str, nproc: int, want_gpus: bool,
                   gpu_resource: str, checkpoint_pvc: str | None = None) -> dict:
    env, dropped = common_env(inv)
    _warn_dropped(dropped)
    port = inv.master_port
    pod_env = [
        {"name": "WORLD_SIZE", "value": str(len(inv.nodes))},  # the node count: launch --from-env reads it as nodes
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(port)},
        {"name": "CLUSTERCTL_RUN_ID", "value": name},
        *({"name": k, "value": v} for k, v in env.items()),
    ]
    container: dict = {
        "name": "trainer",
        "image": image,
        # node rank: JOB_COMPLETION_INDEX, which the Job controller sets in every Indexed pod
        "command": _k8s_command(node_python(inv), nproc),
        "args": _resume_args(target_argv(inv, user_args), checkpoint_pvc),
        "env": pod_env,
        "ports": [{"name": "rendezvous", "containerPort": port}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if checkpoint_pvc:
        pod_env.append({"name": "CLUSTERCTL_CHECKPOINT_DIR", "value": CHECKPOINT_MOUNT})
        # one directory per Job name on the claim: another run's checkpoints are never resumed
        container["volumeMounts"].append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT, "subPath": name})
    if inv.workdir.startswith("/"):
        container["workingDir"] = inv.workdir
    if want_gpus:
        container["resources"] = {"limits": {gpu_resource: nproc}}
    return container


def _k8s_restarts(nnodes: int, checkpoint_pvc: str | None, max_restarts: int) -> dict:
    """The Job's failure policy.

    Without a checkpoint claim, `backoffLimit: 0`: one failed pod fails the Job, as one failed
    node fails `train`. The checkpoints would be in the pod's own filesystem, so a retried Job
    would start again from step 0, redoing the work and reporting the result as one run.

    With a claim, the whole gang restarts from the newest checkpoint on it. A Job has no "restart
    every pod" action, and one pod restarting alone cannot rejoin: torchrun's static rendezvous
    happens once, at start, in a store that pod 0's torchrun serves. What does work:
    `restartPolicy: Never` (an in-place container restart would be that lone pod), so a lost pod
    makes its peers' collectives fail and every pod exits non-zero; the Job replaces each failed
    index, the replacements meet in a fresh rendezvous on the new pod 0 (same DNS name) and
    resume with `--resume auto`. `backoffLimitPerIndex` would retry indexes separately, which is
    the lone-pod case again, so the one Job-wide `backoffLimit` counts the failures: each gang
    restart costs every pod once, and up to once more for a replacement that started while the
    old pod 0 still served the old rendezvous (it fails when that pod goes), hence
    2 x nodes x restarts. A podFailurePolicy makes the Job wait for a failed pod to be gone
    before replacing it (podReplacementPolicy Failed), so one index never has two pods, and:
      - exit code 2 fails the Job: `clusterctl launch --from-env` refused its arguments or the
        platform's variables, and a retry would be the same mistake. Exit code 1 must stay
        retryable: it is what torchrun returns on every pod whose peer was lost, the very
        failure to resume from (a trainer's own usage error also arrives as torchrun's 1).
      - DisruptionTarget (drain, preemption, eviction) fails the Job: the trainer takes SIGTERM
        as a stop, all ranks agree, save a checkpoint and exit 0, so the other indexes succeed
        and a replacement would wait alone for peers that are done. Failing at once leaves
        that fresh checkpoint on the claim; `kubectl apply` the manifest again to resume it.
    """
    if not checkpoint_pvc:
        return {"backoffLimit": 0}
    return {
        "backoffLimit": 2 * nnodes * max_restarts,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}},
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
    }


def _k8s_job(name: str, namespace: str | None, nnodes: int, container: dict, *,
             checkpoint_pvc: str | None = None, max_restarts: int = 3) -> dict:
    # the 64 MiB default /dev/shm is too small for DataLoader workers and NCCL
    volumes: list[dict] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if checkpoint_pvc:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_pvc}})
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _k8s_meta(name, namespace),
        "spec": {
            "completionMode": "Indexed",
            "completions": nnodes,
            "parallelism": nnodes,
            **_k8s_restarts(nnodes, checkpoint_pvc, max_restarts),
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": name}},
                "spec": {
                    "subdomain": name,
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def render_k8s_objects(inv: Inventory, user_args=(), *, image: str, name: str = "clusterctl",
                       namespace: str | None = None, gpus: int | None = None,
                       gpu_resource: str = "nvidia.com/gpu", checkpoint_pvc: str | None = None,
                       max_restarts: int | None = None) -> list[dict]:
    """The headless Service that names node 0 and the Indexed Job with one pod per node."""
    if not IMAGE_RE.match(image):
        raise UsageError(f"--image {image!r} is not an image reference")
    if checkpoint_pvc is not None and (not DNS1123_SUBDOMAIN.match(checkpoint_pvc) or len(checkpoint_pvc) > 253):
        raise UsageError(f"--checkpoint-pvc {checkpoint_pvc!r} is not a PersistentVolumeClaim name "
                         "(lowercase letters, digits, '-' and '.')")
    if max_restarts is not None and checkpoint_pvc is None:
        raise UsageError("--max-restarts needs --checkpoint-pvc: without a claim the checkpoints die "
                         "with the pod, so a restarted Job would start again from step 0")
    nnodes = len(inv.nodes)
    _check_k8s_names(name, namespace, nnodes)
    nproc, want_gpus = gpus_per_node(inv, gpus)
    container = _k8s_container(inv, user_args, image=image, name=name, nproc=nproc, want_gpus=want_gpus,
                               gpu_resource=gpu_resource, checkpoint_pvc=checkpoint_pvc)
    job = _k8s_job(name, namespace, nnodes, container, checkpoint_pvc=checkpoint_pvc,
                   max_restarts=3 if max_restarts is None else max_restarts)
    return [_k8s_service(name, namespace, inv.master_port), job]


def render_k8s(inv: Inventory, user_args=(), **kw) -> str:
    objs = render_k8s_objects(inv, user_args, **kw)
    head = (f"# Rendered by `clusterctl render k8s` from {Path(inv.source).name}: the run `clusterctl "
            "train` would start,\n# as an Indexed Job (node rank = JOB_COMPLETION_INDEX) and the headless "
            "Service that names node 0.\n# Apply with `kubectl apply -f FILE`.\n")
    return head + yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False, width=100)

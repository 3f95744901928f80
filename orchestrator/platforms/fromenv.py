"""`clusterctl launch --from-env`: the in-pod launcher.

The platform (SLURM, a Kubeflow PyTorchJob, a Kubernetes Indexed Job, SkyPilot, or any
scheduler that sets WORLD_SIZE/RANK/MASTER_ADDR like PAI) already decided how many nodes there
are and which one this is. This reads that, finds the local GPUs, prints a checklist, runs the
preflight checks that make sense on one node (the same probe and parsers as `clusterctl
preflight`, run locally: orchestrator/checks/registry.py LOCAL_CHECKS), and execs torchrun with
the flags and environment `clusterctl train` would use (orchestrator.torchrun). `render
slurm|k8s` call exactly this.

Precedence (the first platform whose marker variable is set wins; flags beat everything):
  1. SLURM      SLURM_JOB_ID + SLURM_NNODES | SLURM_JOB_NUM_NODES, SLURM_NODEID,
                master = MASTER_ADDR or the first host of `scontrol show hostnames $SLURM_JOB_NODELIST`
  2. Kubeflow   PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT
  3. Indexed Job JOB_COMPLETION_INDEX (node rank), WORLD_SIZE (nodes), MASTER_ADDR
  4. SkyPilot   SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK, master = first of SKYPILOT_NODE_IPS
  5. generic    WORLD_SIZE (nodes, as such a platform sets it), RANK (node rank), MASTER_ADDR
Port: --master-port, PET_MASTER_PORT, MASTER_PORT, the inventory's master_port, 29500.
WORLD_SIZE and RANK count nodes here; set next to SLURM/SkyPilot/an Indexed Job they must agree
with the scheduler's numbers (Kubeflow's own WORLD_SIZE/RANK are left alone).
"""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Mapping

from orchestrator import shell
from orchestrator.checks import CheckResult, Ctx
from orchestrator.errors import UsageError
from orchestrator.gpus import GPU_PROBE, Gpu, gpu_facts
from orchestrator.gpus import visible  # noqa: F401 - part of this module's interface (CUDA_VISIBLE_DEVICES)
from orchestrator.torchrun import dist_timeout_s, iface_env, node_env, scaled_env

DEFAULT_PORT = 29500
TOOL_TIMEOUT_S = 15


@dataclass(frozen=True)
class Platform:
    source: str  # what set the numbers, for the checklist
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    run_id: str


def scontrol_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames LIST` (node[1-3] -> node1 node2 node3)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=TOOL_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise UsageError(f"could not expand SLURM_JOB_NODELIST={nodelist!r} with scontrol ({e}); "
                         "set MASTER_ADDR or pass --master-addr") from e
    return [h for h in out.split() if h]


def _int(env: Mapping[str, str], key: str, lo: int = 0) -> int | None:
    v = env.get(key)
    if v is None or v == "":
        return None
    if not re.fullmatch(r"\d+", v.strip()):
        raise UsageError(f"{key}={v!r} is not a whole number")
    n = int(v)
    if n < lo:
        raise UsageError(f"{key}={v!r} must be at least {lo}")
    return n


def _need(value, what: str, source: str):
    if value is None or value == "":
        raise UsageError(f"{source}: {what} is not set, so this node cannot tell its place in the job")
    return value


@dataclass
class _Read:
    """What one platform's variables say, before the overrides and the cross-checks."""

    source: str
    n: int | None
    rank: int | None
    addr: str | None
    port: int | None = None
    run_id: str | None = None
    check_generic: bool = True  # WORLD_SIZE/RANK, when set too, must agree (they count nodes here)


def _slurm(env, node_rank, master_addr, nnodes, hostnames) -> _Read:
    source = "SLURM"
    n = _int(env, "SLURM_NNODES", 1) or _int(env, "SLURM_JOB_NUM_NODES", 1)
    rank = _int(env, "SLURM_NODEID") if node_rank is None else node_rank
    _need(rank, "SLURM_NODEID (run it under srun, one task per node)", source)
    addr = master_addr or env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        _need(nodelist, "SLURM_JOB_NODELIST (or MASTER_ADDR)", source)
        hosts = hostnames(nodelist)
        addr = hosts[0] if hosts else None
    return _Read(source, n, rank, addr, run_id=env["SLURM_JOB_ID"])


def _kubeflow(env, node_rank, master_addr, nnodes, hostnames) -> _Read:
    if ":" in env["PET_NNODES"]:
        raise UsageError(f"PET_NNODES={env['PET_NNODES']!r} is an elastic range; clusterctl runs a "
                         "fixed number of nodes, so set minReplicas = maxReplicas")
    rank = _int(env, "PET_NODE_RANK") if node_rank is None else node_rank
    addr = master_addr or env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    # the operator's WORLD_SIZE/RANK may count processes: not cross-checked
    return _Read("Kubeflow PyTorchJob (PET_*)", _int(env, "PET_NNODES", 1), rank, addr,
                 port=_int(env, "PET_MASTER_PORT", 1), check_generic=False)


def _indexed_job(env, node_rank, master_addr, nnodes, hostnames) -> _Read:
    source = "Kubernetes Indexed Job"
    rank = _int(env, "JOB_COMPLETION_INDEX") if node_rank is None else node_rank
    n = _int(env, "WORLD_SIZE", 1)
    if nnodes is None:
        _need(n, "WORLD_SIZE (the number of nodes; or pass --nnodes)", source)
    return _Read(source, n, rank, master_addr or env.get("MASTER_ADDR"))


def _skypilot(env, node_rank, master_addr, nnodes, hostnames) -> _Read:
    n = _int(env, "SKYPILOT_NUM_NODES", 1)
    rank = _int(env, "SKYPILOT_NODE_RANK") if node_rank is None else node_rank
    ips = [ip for ip in (env.get("SKYPILOT_NODE_IPS") or "").split() if ip]
    if ips and len(ips) != n:
        raise UsageError(f"SkyPilot: SKYPILOT_NODE_IPS lists {len(ips)} hosts but SKYPILOT_NUM_NODES={n}")
    addr = master_addr or (ips[0] if ips else env.get("MASTER_ADDR"))
    return _Read("SkyPilot", n, rank, addr, run_id=env.get("SKYPILOT_TASK_ID"))


def _generic(env, node_rank, master_addr, nnodes, hostnames) -> _Read:
    n, rank = _int(env, "WORLD_SIZE", 1), _int(env, "RANK") if node_rank is None else node_rank
    addr = master_addr or env.get("MASTER_ADDR")
    if nnodes is None and n is None and rank is None and not addr:
        raise UsageError("no platform variables found: set WORLD_SIZE (nodes), RANK (this node) and "
                         "MASTER_ADDR, or run under SLURM, a Kubeflow PyTorchJob, a Kubernetes Indexed "
                         "Job or SkyPilot")
    return _Read("WORLD_SIZE/RANK/MASTER_ADDR", n, rank, addr, check_generic=False)


# In precedence order: (does this platform's marker appear?, its reader).
_PLATFORMS: tuple[tuple[Callable[[Mapping[str, str]], bool], Callable[..., _Read]], ...] = (
    (lambda env: bool(env.get("SLURM_JOB_ID") and (env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES"))),
     _slurm),
    (lambda env: bool(env.get("PET_NNODES")), _kubeflow),
    (lambda env: bool(env.get("JOB_COMPLETION_INDEX")), _indexed_job),
    (lambda env: bool(env.get("SKYPILOT_NUM_NODES")), _skypilot),
    (lambda env: True, _generic),
)


def _cross_check(r: _Read, env: Mapping[str, str], n: int, rank: int, nnodes, node_rank) -> None:
    generic_n, generic_rank = _int(env, "WORLD_SIZE", 1), _int(env, "RANK")
    if generic_n is not None and nnodes is None and generic_n != n:
        raise UsageError(f"{r.source} says {n} nodes but WORLD_SIZE={generic_n}; WORLD_SIZE counts "
                         "nodes here, so make them agree or unset WORLD_SIZE")
    if generic_rank is not None and node_rank is None and generic_rank != rank:
        raise UsageError(f"{r.source} says this is node {rank} but RANK={generic_rank}; make them agree "
                         "or unset RANK")


def detect_platform(env: Mapping[str, str], *, nnodes: int | None = None, node_rank: int | None = None,
                    master_addr: str | None = None, master_port: int | None = None,
                    default_port: int = DEFAULT_PORT,
                    hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> Platform:
    """Read the platform's variables (module docstring for the precedence). Missing or
    contradictory values raise UsageError with one sentence saying which."""
    reader = next(read for applies, read in _PLATFORMS if applies(env))
    r = reader(env, node_rank, master_addr, nnodes, hostnames)
    n = _need(nnodes if nnodes is not None else r.n, "the number of nodes (WORLD_SIZE, or --nnodes)", r.source)
    rank = _need(node_rank if node_rank is not None else r.rank, "this node's rank (RANK, or --node-rank)",
                 r.source)
    addr = _need(r.addr, "the master address (MASTER_ADDR, or --master-addr)", r.source)
    if r.check_generic:
        _cross_check(r, env, n, rank, nnodes, node_rank)
    if rank >= n:
        raise UsageError(f"{r.source}: node rank {rank} is not below the node count {n}")
    port = master_port or r.port or _int(env, "MASTER_PORT", 1) or default_port
    run_id = env.get("CLUSTERCTL_RUN_ID") or r.run_id or re.sub(r"[^A-Za-z0-9_.-]", "-", f"ctl-{addr}-{port}")
    return Platform(r.source, n, rank, addr, port, run_id)


# ------------------------------------------------------------------ local GPUs

@dataclass(frozen=True)
class LocalGpus:
    tool: str | None  # "nvidia-smi" | "rocm-smi" | None (no tool: a CPU node)
    gpus: tuple[Gpu, ...] = ()
    error: str | None = None  # the tool is there but failed (driver mismatch...)


def local_gpus(text: str) -> LocalGpus:
    """GPU_PROBE's output -> LocalGpus (every GPU the tool lists; visible() narrows them)."""
    f = gpu_facts(text)
    if f.tool is not None and f.gpus is None:
        return LocalGpus(f.tool, error=f.error)
    return LocalGpus(f.tool, tuple(f.gpus or ()))


def detect_gpus(env: Mapping[str, str] | None = None) -> LocalGpus:
    """Run the GPU probe (the one preflight and top run) on this machine."""
    try:
        p = subprocess.run(["/bin/sh", "-s"], input=("gpu_apps=always\n" + GPU_PROBE).encode(), capture_output=True,
                           timeout=TOOL_TIMEOUT_S, env=dict(env) if env is not None else None)
    except (OSError, subprocess.SubprocessError) as e:
        return LocalGpus(None, error=str(e))
    return local_gpus(p.stdout.decode(errors="replace"))


# ------------------------------------------------------------------ node-local checks

_IFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,14}")


def local_context(plat: Platform, nproc: int, local: LocalGpus, env: Mapping[str, str], inv=None) -> Ctx:
    """This node as preflight's parsers see it: `gpus` = the processes to launch (0 when there is
    no GPU: a CPU node), its iface from GLOO/NCCL_SOCKET_IFNAME when that names one interface,
    the master from the platform, the inventory's checks settings and output dir when given."""
    from orchestrator.inventory import parse_inventory

    base = inv if inv is not None else parse_inventory(
        f"master_port: {int(plat.master_port)}\nnodes: [{{name: master, host: localhost}}]\n", "<launch --from-env>")
    same = inv is not None and len(inv.nodes) == plat.nnodes
    template = base.nodes[plat.node_rank] if same else base.nodes[0]
    iface = next((v for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                  if (v := env.get(k)) and _IFACE.fullmatch(v)), None)
    me = dataclasses.replace(template, name=socket.gethostname() or "this-node", rank=plat.node_rank,
                             gpus=nproc if local.tool is not None and local.gpus else 0, iface=iface,
                             python=sys.executable, connection="local")
    master = dataclasses.replace(base.nodes[0], name="master", rank=0, host=plat.master_addr,
                                 address=plat.master_addr)
    nodes = (me,) if plat.node_rank == 0 else (master, me)
    view = dataclasses.replace(base, nodes=nodes, master_port=plat.master_port, _by_name={})
    vis = next((env[k] for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
                if env.get(k) is not None), None)
    return Ctx(node=me, inventory=view, is_master=plat.node_rank == 0,
               visible_gpus=None if vis is None else tuple(x.strip() for x in vis.split(",") if x.strip()))


def local_checks(plat: Platform, nproc: int, local: LocalGpus, env: Mapping[str, str], inv=None,
                 probe: Callable | None = None) -> list[CheckResult]:
    """preflight's node-local checks on this node: one probe run here (`probe(inventory, node,
    checks, env) -> text`, default checks.preflight.probe_locally), read by the same parsers.
    output_dir only with an inventory (it says where the run writes)."""
    from orchestrator.checks.preflight import node_results, probe_locally
    from orchestrator.checks.registry import LOCAL_CHECKS

    ctx = local_context(plat, nproc, local, env, inv)
    names = [c for c in LOCAL_CHECKS if c != "output_dir" or inv is not None]
    text = (probe or probe_locally)(ctx.inventory, ctx.node, names, env)
    return list(node_results(names, text, ctx).values())


# ------------------------------------------------------------------ the launch

def launch_env(plat: Platform, base: Mapping[str, str], inv=None, iface: str | None = None) -> dict[str, str]:
    """What torchrun runs under: the process env, the scaled timeouts unless already set (a
    render exported them), the inventory's node_env when one is given, the run id."""
    env = dict(base)
    scaled = scaled_env(plat.nnodes)
    if inv is not None:
        inv_node = inv.nodes[plat.node_rank] if len(inv.nodes) == plat.nnodes else None
        if inv_node is not None:
            extra = node_env(inv, inv_node)
        else:
            from orchestrator.platforms.render import common_env
            extra = common_env(inv)[0]
        for k, v in scaled_env(len(inv.nodes)).items():  # rescale to the platform's node count
            if extra.get(k) == v:
                extra[k] = scaled[k]
        env.update(extra)
    else:
        for k, v in scaled.items():
            env.setdefault(k, v)
    if iface:
        env.update(iface_env(iface))
    env["CLUSTERCTL_RUN_ID"] = plat.run_id
    return env


def checklist(plat: Platform, nproc: int, local: LocalGpus, gpus, target, env, checks,
              rendezvous_s: int | None = None) -> str:
    first = plat.node_rank * nproc
    ranks = f"rank {first}" if nproc == 1 else f"ranks {first}-{first + nproc - 1}"
    found = (f"{local.tool} sees {len(gpus)}" + (f": {gpus[0].name}" if gpus else "")) if local.tool \
        else "no GPU tool, CPU processes"
    t = env.get("CLUSTERCTL_DIST_TIMEOUT") or str(dist_timeout_s(plat.nnodes))
    buf = env.get("NCCL_BUFFSIZE")
    buf = f"{int(buf) // (1024 * 1024)} MiB" if buf and buf.isdigit() else (buf or "default")
    lines = [
        f"clusterctl launch --from-env ({plat.source})",
        f"  nodes          {plat.nnodes}",
        f"  this node      {plat.node_rank} ({socket.gethostname()}), {ranks}",
        f"  GPUs per node  {nproc} ({found})",
        f"  total GPUs     {plat.nnodes * nproc} (world size)",
        f"  master         {plat.master_addr}:{plat.master_port}, run id {plat.run_id}",
        f"  config         {shell.join(target)}",
        f"  timeouts       collective {t} s (NCCL_TIMEOUT {env.get('NCCL_TIMEOUT', '-')}), "
        f"NCCL_BUFFSIZE {buf}" + (f", rendezvous {rendezvous_s} s" if rendezvous_s is not None else ""),
    ]
    for c in checks:
        lines.append(f"  check {c.status.upper() if c.status == 'fail' else c.status:4}     {c.check}: {c.detail}")
        if c.remedy and c.status in ("warn", "fail"):
            lines.append(f"                   → {c.remedy}")
    return "\n".join(lines)

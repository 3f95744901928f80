"""`clusterctl inventory from-slurm`: an inventory of the SLURM allocation this runs in.

Inside `salloc` or an `sbatch` job, the nodes are SLURM_JOB_NODELIST expanded by `scontrol
show hostnames` (node 0, the master, is the first). GPUs per node come from, in order:
  1. SLURM_GPUS_PER_NODE (`--gpus-per-node=2` or `a100:2`): every node;
  2. SLURM_GPUS_ON_NODE when no job-wide SLURM_GPUS is set (`--gres=gpu:2` asks per node, so
     every node has the same): every node;
  3. the job's per-node GRES (`scontrol show job -d`, `Nodes=node1 ... GRES=gpu:2(IDX:0-1)`),
     which also covers `--gpus=3` spread unevenly over the nodes;
  4. otherwise left out, and preflight counts the GPUs itself.
The other settings (ssh, workdir, python, env, train, and per-node settings of nodes it names)
come from a template inventory when one is given, so `preflight`, `exec`, `top` and `train`
work on the allocated nodes with the site's usual settings.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import yaml

from orchestrator.errors import UsageError
from orchestrator.inventory import load_inventory, parse_inventory

TOOL_TIMEOUT_S = 15

# `Nodes=node[1-2] CPU_IDs=0 Mem=0 GRES=gpu:a100:2(IDX:0-1),nic:1` in `scontrol show job -d`
_NODES_GRES = re.compile(r"^\s*Nodes=(?P<nodes>\S+)\s.*?\bGRES=(?P<gres>\S*)", re.M)


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodelist: str
    hosts: tuple[str, ...]
    gpus: dict[str, int]  # host -> GPUs allocated there; hosts left out: unknown


def _scontrol(argv: list[str], what: str) -> str:
    try:
        p = subprocess.run(["scontrol", *argv], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except FileNotFoundError:
        raise UsageError(f"scontrol is not on PATH, so {what} cannot be read; run this on a node "
                         "of the SLURM cluster, inside the allocation") from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"`scontrol {' '.join(argv)}` did not answer within {TOOL_TIMEOUT_S}s "
                         f"(is slurmctld reachable?), so {what} cannot be read") from None
    if p.returncode != 0:
        raise UsageError(f"`scontrol {' '.join(argv)}` failed ({p.returncode}): "
                         f"{(p.stderr or p.stdout).strip()[-300:]}")
    return p.stdout


def expand_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames node[1-3]` -> ["node1", "node2", "node3"]."""
    return _scontrol(["show", "hostnames", nodelist], f"the node list {nodelist!r}").split()


def job_detail(job_id: str) -> str:
    return _scontrol(["show", "job", "-d", job_id], f"job {job_id}'s GPUs")


def requested_gpus(spec: str) -> int | None:
    """SLURM_GPUS_PER_NODE: "2", "a100:2", "a100:1,v100:1" (-> 2); None when unreadable."""
    total = 0
    for item in spec.split(","):
        m = re.fullmatch(r"(?:[^:]+:)?(\d+)", item.strip())
        if not m:
            return None
        total += int(m[1])
    return total


def gres_gpus(gres: str) -> int | None:
    """GPUs in a GRES list: "gpu:2(IDX:0-1)", "gpu:a100:1(IDX:0),nic:1" (-> 1); None if no GPU."""
    found = None
    for item in re.split(r",(?![^(]*\))", gres):  # not the commas of "(IDX:0,2)"
        m = re.fullmatch(r"gpu(?::[^:(]+)?:(\d+)(?:\(.*\))?", item.strip())
        if m:
            found = (found or 0) + int(m[1])
    return found


def parse_job_gres(text: str) -> list[tuple[str, int | None]]:
    """[(node list, GPUs on each of its nodes)] from `scontrol show job -d`."""
    return [(m["nodes"], gres_gpus(m["gres"])) for m in _NODES_GRES.finditer(text)]


def read_allocation(env: Mapping[str, str], hostnames: Callable[[str], list[str]] = expand_hostnames,
                    detail: Callable[[str], str] = job_detail) -> Allocation:
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        raise UsageError("not inside a SLURM allocation (SLURM_JOB_ID / SLURM_JOB_NODELIST are not "
                         "set): run it in `salloc`, an `sbatch` script or `srun --pty`")
    hosts = tuple(hostnames(nodelist))
    if not hosts:
        raise UsageError(f"SLURM_JOB_NODELIST={nodelist!r} names no hosts")
    per_node = env.get("SLURM_GPUS_PER_NODE")
    on_node = env.get("SLURM_GPUS_ON_NODE")
    n = requested_gpus(per_node) if per_node else None
    if n is None and on_node and not env.get("SLURM_GPUS") and re.fullmatch(r"\d+", on_node.strip()):
        n = int(on_node)
    if n is not None:
        return Allocation(job_id, nodelist, hosts, {h: n for h in hosts})
    gpus: dict[str, int] = {}
    for nodes, count in parse_job_gres(detail(job_id)):
        if count is not None:
            for h in (hostnames(nodes) if re.search(r"[\[,]", nodes) else [nodes]):
                gpus[h] = count
    return Allocation(job_id, nodelist, hosts, {h: gpus[h] for h in hosts if h in gpus})


def inventory_yaml(alloc: Allocation, template: str | None = None, *, user: str | None = None,
                   iface: str | None = None, master_port: int | None = None) -> str:
    """The inventory text: the template's settings (when given) with the allocation's nodes.
    A template node whose name is an allocated host keeps its per-node settings."""
    doc: dict = {}
    known: dict[str, dict] = {}
    if template:
        load_inventory(template)  # a broken template fails here, with its file:line
        doc = yaml.safe_load(Path(template).expanduser().read_text()) or {}
        known = {n["name"]: n for n in doc.get("nodes") or [] if isinstance(n, dict) and "name" in n}
    nodes = []
    for h in alloc.hosts:
        node = dict(known.get(h) or {"name": h, "host": h})
        if h in alloc.gpus:
            node["gpus"] = alloc.gpus[h]
        if iface:
            node["iface"] = iface
        nodes.append(node)
    if user:
        doc["ssh"] = {**(doc.get("ssh") or {}), "user": user}
    if master_port is not None:
        doc["master_port"] = master_port
    doc["nodes"] = nodes
    head = f"# SLURM job {alloc.job_id} ({alloc.nodelist}); nodes[0] is the master (rank 0)"
    if template:
        head += f"; other settings from {template}"
    out = head + "\n" + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)
    parse_inventory(out, source="<from-slurm>")  # what we write must load
    return out

"""The launch contract shared by `train`, the SLURM/k8s renders and `launch --from-env`.

One place decides the torchrun flags and the per-node environment, so a job
moves between SSH, SLURM and Kubernetes without being rewritten.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from orchestrator.inventory import Inventory, Node


def dist_timeout_s(nnodes: int) -> int:
    """Collective timeout scaled with the node count: 1 node 1 h, 2-7 nodes 2 h,
    8+ nodes 4 h. With fail-fast teardown this is a safety net,
    not the failure detector."""
    if nnodes <= 1:
        return 3600
    if nnodes < 8:
        return 7200
    return 14400


# torchrun's rendezvous timeout unless told: its LaunchConfig sets 900 s (torch/distributed/launcher/api.py;
# the static handler's own 600 s is never reached through torchrun)
RDZV_TIMEOUT_S = 900
RDZV_CONF_ENV = "PET_RDZV_CONF"  # torchrun's --rdzv-conf when the flag is not given (torch's argparse_util.env)


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """torchrun's rendezvous configuration `key=value,key=value` as torch reads it
    (rendezvous/utils.py): keys and values stripped, an empty text is none. ValueError for a part
    without a key or a value, which torchrun would refuse on every node."""
    out: dict[str, str] = {}
    for part in text.strip().split(",") if text.strip() else []:
        key, _, value = part.partition("=")
        if not key.strip() or not value.strip():
            raise ValueError(f"{part.strip()!r} is not key=value (torchrun's form: timeout=900,key=value)")
        out[key.strip()] = value.strip()
    return out


def rdzv_timeout_given(env: Mapping[str, str]) -> int | None:
    """The rendezvous timeout a node's environment sets through PET_RDZV_CONF, if it does;
    ValueError when that is not a whole number of seconds or the text is not torchrun's form."""
    value = parse_rdzv_conf(env.get(RDZV_CONF_ENV, "")).get("timeout")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"timeout={value} is not a whole number of seconds, at least 1")
    return int(value)


def rdzv_conf(env: Mapping[str, str], timeout: int) -> str:
    """torchrun's --rdzv-conf for a node: what its environment's PET_RDZV_CONF says (the flag
    replaces that variable whole, so its other keys are carried over), with `timeout`."""
    conf = {**parse_rdzv_conf(env.get(RDZV_CONF_ENV, "")), "timeout": str(int(timeout))}
    return ",".join(f"{k}={v}" for k, v in conf.items())


def nccl_buffsize(nnodes: int) -> int:
    """NCCL's socket buffer: 32 MB from 8 nodes up, 16 MB below."""
    return (32 if nnodes >= 8 else 16) * 1024 * 1024


def scaled_env(nnodes: int) -> dict[str, str]:
    t = dist_timeout_s(nnodes)
    return {
        # read by the trainer for init_process_group(timeout=...)
        "CLUSTERCTL_DIST_TIMEOUT": str(t),
        # the same timeout for NCCL; harmless where NCCL ignores it
        "NCCL_TIMEOUT": str(t),
        "NCCL_BUFFSIZE": str(nccl_buffsize(nnodes)),
        # surface NCCL errors as exceptions so a dead peer ends the process instead of hanging
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def iface_env(iface: str | None) -> dict[str, str]:
    """Pin NCCL and gloo to the node's interface. Without GLOO_SOCKET_IFNAME gloo binds
    to whatever the hostname resolves to (often 127.0.0.1) and cross-host rendezvous fails."""
    if not iface:
        return {}
    return {"NCCL_SOCKET_IFNAME": iface, "GLOO_SOCKET_IFNAME": iface}


def node_env(inv: Inventory, node: Node, *, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for one node: scaled timeouts < inventory env < node env < iface pins
    < train.env < extra (run id and such)."""
    env = scaled_env(len(inv.nodes))
    env.update(inv.env)
    env.update(node.env)
    env.update(iface_env(node.iface))
    env.update(inv.train.env)
    env.update(extra or {})
    return env


def nproc_for(node: Node, found_gpus: int | None = None, override: int | str | None = None) -> int:
    """Processes per node, the one rule `preflight`'s rank map, `train` and the renders share:
    an explicit number (--nproc-per-node, train.nproc_per_node) wins; else the inventory's
    `gpus:` (`gpus: 0` is a CPU node: one process); else the GPUs the probe found; else 1."""
    if override not in (None, "auto"):
        return int(override)
    if node.gpus is not None:
        return node.gpus or 1
    return found_gpus or 1


def nprocs_for(inv: Inventory, gpus_found: dict[str, int | None],
               override: int | str | None = None) -> dict[str, int]:
    """nproc_for every node; `override` (the --nproc-per-node flag) else the inventory's
    train.nproc_per_node."""
    chosen = override if override not in (None, "auto") else inv.train.nproc_per_node
    return {n.name: nproc_for(n, gpus_found.get(n.name), chosen) for n in inv.nodes}


def too_many_procs(inv: Inventory, nprocs: dict[str, int],
                   gpus_found: dict[str, int | None]) -> dict[str, tuple[int, int, str]]:
    """{node: (processes, GPUs, "found" | "in the inventory")} for every GPU node asked to run
    more processes than it has GPUs: the extra ranks would die with 'invalid device ordinal'.
    The GPUs are those the probe found, else (not probed) the inventory's `gpus:`. Fewer
    processes are fine, and a CPU node (`gpus: 0`, or no GPU found) runs any number."""
    out = {}
    for n in inv.nodes:
        if n.gpus == 0:
            continue
        found = gpus_found.get(n.name)
        gpus, where = (found, "found") if found is not None else (n.gpus, "in the inventory")
        if gpus and nprocs[n.name] > gpus:
            out[n.name] = (nprocs[n.name], gpus, where)
    return out


def target_argv(inv: Inventory, user_args: Sequence[str] = ()) -> list[str]:
    """What torchrun runs: the user's `SCRIPT ARGS` / `-m MODULE ARGS`, else the inventory's
    train section (the bundled trainer by default)."""
    if user_args:
        return list(user_args)
    t = inv.train
    if t.script:
        return [t.script, *t.args]
    return ["-m", t.module or "trainer", *t.args]


def torchrun_argv(*, python: str, nnodes: int, nproc: int, node_rank: int | str, master_addr: str,
                  master_port: int | str, run_id: str, target: Sequence[str],
                  extra: Sequence[str] = (), rdzv: str | None = None) -> list[str]:
    """`python -m torch.distributed.run` (the interpreter's own torchrun, whatever PATH says)
    with a static rendezvous: ranks are node_rank * nproc + local_rank, node_rank being the position among
    the nodes of the run (`Inventory.select` renumbers a subset from 0). `rdzv`: its --rdzv-conf
    (`rdzv_conf`: the rendezvous timeout); None leaves torchrun's own (PET_RDZV_CONF, else 900 s)."""
    return [python, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
            "--master-addr", master_addr, "--master-port", str(master_port), "--rdzv-id", run_id,
            *(["--rdzv-conf", rdzv] if rdzv is not None else []), *extra, *target]


def rank_map(inv: Inventory, nprocs: dict[str, int]) -> list[tuple[Node, int, int]]:
    """[(node, first_rank, last_rank)] in node-rank order."""
    out, start = [], 0
    for n in inv.nodes:
        k = nprocs[n.name]
        out.append((n, start, start + k - 1))
        start += k
    return out


def rank_map_text(inv: Inventory, nprocs: dict[str, int]) -> str:
    """The rank map: `rank 0-7 → node1 (10.0.0.1), ...` with the world size."""
    parts = []
    rows = rank_map(inv, nprocs)
    for node, a, b in rows:
        r = f"rank {a}" if a == b else f"rank {a}-{b}"
        parts.append(f"{r} → {node.name} ({node.address})")
    world = sum(nprocs[node.name] for node, _, _ in rows)  # nprocs may name nodes left out (spares)
    return f"world size {world} on {len(rows)} nodes: " + ", ".join(parts)

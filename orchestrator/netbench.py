"""`clusterctl netbench`: measure the real link between the master and every worker.

TCP throughput in both directions and round-trip latency (a stdlib probe,
remote/netprobe.py, shipped over each node's existing SSH connection), and
optionally a real `torch.distributed` all-reduce across all nodes with their
own backend.  The result feeds `clusterctl plan --link FILE`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

import click

from orchestrator.errors import EXIT_FAILED, ClusterctlError, CommandFailed, CommandTimeout
from orchestrator.inventory import Inventory, Node
from orchestrator.node import netprobe, wire
from orchestrator.torchrun import iface_env
from orchestrator.node.form import Exec
from orchestrator.transport import Cluster, Proc, first_line

class NetbenchError(ClusterctlError):
    exit_code = EXIT_FAILED


@dataclass(frozen=True)
class LinkMeasure:
    node: str  # the worker; the other end is the master
    up_bps: float  # worker -> master, bits per second
    down_bps: float  # master -> worker
    rtt_s: float  # median TCP round trip

    @property
    def bps(self) -> float:
        return min(self.up_bps, self.down_bps)


@dataclass(frozen=True)
class AllreduceMeasure:
    nbytes: int
    dtype: str
    backend: str
    nodes: int
    times: list[float]

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


@dataclass
class NetReport:
    master: str
    links: list[LinkMeasure] = field(default_factory=list)
    allreduce: AllreduceMeasure | None = None

    @property
    def bandwidth_bps(self) -> float:
        """The slowest direction of the slowest link: what a ring all-reduce runs at."""
        return min(x.bps for x in self.links)

    @property
    def latency_s(self) -> float:
        """One-way latency: half the median round trip."""
        return statistics.median(x.rtt_s for x in self.links) / 2

    def to_json(self) -> dict:
        doc = {"master": self.master, "bandwidth_bps": self.bandwidth_bps, "latency_s": self.latency_s,
               "links": [asdict(x) | {"bps": x.bps} for x in self.links], "allreduce": None}
        if self.allreduce:
            doc["allreduce"] = asdict(self.allreduce) | {"seconds": self.allreduce.seconds}
        return doc


def _first_line(proc: Proc, timeout: float) -> str:
    """The probe server's first stdout line (where it listens), or NetbenchError."""
    try:
        return first_line(proc, timeout)
    except CommandTimeout as e:
        raise NetbenchError(f"{proc.node}: the network probe did not start within {timeout:g}s: "
                            f"{e.result.stderr.strip()[-500:]}") from None
    except CommandFailed as e:
        raise NetbenchError(f"{proc.node}: the network probe exited: {e.result.stderr.strip()[-500:]}") from None


def _client(cluster: Cluster, node: Node, *args, timeout: float) -> dict:
    got = wire.run(cluster, lambda n: netprobe.client(n, *args, timeout=timeout), [node.name])[node.name]
    if got.error is not None:
        raise NetbenchError(f"{node.name}: {got.error}")
    return got.doc


def measure_links(cluster: Cluster, inv: Inventory, *, seconds: float = 2.0, max_bytes: int = 1 << 30,
                  rtt_count: int = 20, port: int = 0, timeout: float = 120) -> list[LinkMeasure]:
    """Throughput both ways and RTT between the master and each worker, one worker at a time
    (so workers don't share the master's link). Transfers are sized to last ~`seconds`."""
    master = inv.master
    conn = cluster.connections.get(master.name)
    if conn is None:
        raise NetbenchError(f"{master.name} (the master) is unreachable: {cluster.unreachable[master.name].error}")
    server = netprobe.serve(master, port, timeout).start(conn)
    listen_port = None
    try:
        first = _first_line(server, 30)
        listen_port = netprobe.listening_port(first)
        if listen_port is None:
            raise NetbenchError(f"{master.name}: the network probe did not say where it listens: {first[-300:]!r}")
        addr = master.address if not master.is_local else "127.0.0.1"
        out = []
        for node in inv.nodes[1:]:
            if node.name not in cluster.connections:
                continue
            rates = {}
            for direction in ("up", "down"):
                probe = _client(cluster, node, addr, listen_port, direction, 4 << 20, timeout=timeout)
                est = probe["bytes"] * 8 / max(probe["seconds"], 1e-6)
                n = int(min(max_bytes, max(4 << 20, est / 8 * seconds)))
                res = _client(cluster, node, addr, listen_port, direction, n, timeout=timeout)
                rates[direction] = res["bytes"] * 8 / res["seconds"]
            rtt = _client(cluster, node, addr, listen_port, "rtt", rtt_count, timeout=timeout)["rtts"]
            out.append(LinkMeasure(node.name, rates["up"], rates["down"], statistics.median(rtt)))
        return out
    finally:
        try:
            if listen_port is not None:
                wire.send(cluster, lambda n: netprobe.quit_server(n, listen_port), [master.name], timeout=10)
        except Exception:  # noqa: BLE001 - the server also exits on its own timeout
            pass
        server.kill()
        server.close()


def measure_allreduce(cluster: Cluster, inv: Inventory, *, nbytes: int, iters: int = 3,
                      dtype: str = "fp16", backend: str | None = None, port: int | None = None,
                      timeout: float = 600) -> AllreduceMeasure:
    """One process per node runs a real all-reduce of `nbytes` with the node's backend."""
    if backend is None:
        backend = "nccl" if all(n.gpus for n in inv.nodes) else "gloo"
    port = port or inv.master_port
    world = len(inv.nodes)

    def cmd(node: Node) -> Exec:
        env = {**node.env, **iface_env(node.iface), "OMP_NUM_THREADS": node.env.get("OMP_NUM_THREADS", "1")}
        return netprobe.command(node, "allreduce", node.rank, world, inv.master.address, port, nbytes, iters,
                                backend, dtype, env=env)

    res = wire.send(cluster, cmd, timeout=timeout)
    if not res.all_ok:
        bad = "; ".join(f"{k}: {v.describe()} {v.stderr.strip()[-300:]}" for k, v in res.failed.items())
        raise NetbenchError(f"all-reduce failed: {bad}")
    got = netprobe.read(res[inv.master.name])
    if got.error is not None:
        raise NetbenchError(f"all-reduce: {inv.master.name}: {got.error}")
    rank0 = got.doc
    return AllreduceMeasure(rank0["bytes"], dtype, backend, world, rank0["times"])


def parse_size(text: str) -> int:
    t = text.strip().upper().replace(" ", "")
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "B": 1}
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * units[u])
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size like 60.3MB, 512MiB or 1GB") from None

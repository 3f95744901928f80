"""`clusterctl top`: every GPU of every node in one live table (instead of `watch -n 1 rocm-smi`
on each node).

One SSH connection per node for the whole session (transport.Cluster) and one remote
invocation per node per refresh: the GPU probe preflight uses too (orchestrator.gpus.GPU_PROBE,
with every process listed), read by the same parser (orchestrator.gpus.gpu_facts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.gpus import GPU_PROBE, Gpu, GpuProcess, gpu_facts

PROBE = ("gpu_apps=always\n" + GPU_PROBE + 'echo "@@end"\n').encode()
PROBE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class NodeGpus:
    name: str
    host: str
    gpus: tuple[Gpu, ...] = ()
    tool: str | None = None  # "nvidia-smi" | "rocm-smi" | None (no GPU tool on the node)
    error: str | None = None
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)  # rocm-smi: GPU not known
    reachable: bool = True

    def to_json(self) -> dict:
        d = {"name": self.name, "host": self.host, "tool": self.tool,
             "gpus": [g.to_json() for g in self.gpus], "error": self.error}
        if self.processes:
            d["processes"] = [p.__dict__ for p in self.processes]
        return d


def parse_probe(text: str) -> tuple[str | None, list[Gpu], list[GpuProcess], str | None]:
    """The probe's output -> (tool, gpus, processes not placed on a GPU, error)."""
    if "\n@@end" not in "\n" + text:
        return None, [], [], "the GPU probe stopped before the end of its output"
    f = gpu_facts(text)
    if f.gpus is None and f.tool is not None:
        return f.tool, [], [], f"{f.tool} failed: {f.error}"
    return f.tool, list(f.gpus or ()), list(f.processes), None


def collect(cluster, nodes=None) -> list[NodeGpus]:
    """One refresh: the probe on every node at once over the open connections."""
    result = cluster.run("sh -s", stdin=PROBE, timeout=PROBE_TIMEOUT_S, nodes=nodes)
    out = []
    for node in cluster.nodes:
        if node.name not in result:
            continue
        r = result[node.name]
        if r.exit_code is None or r.error:
            out.append(NodeGpus(node.name, node.host, error=r.describe(), reachable=False))
            continue
        tool, gpus, procs, err = parse_probe(r.stdout)
        if err is None and r.exit_code != 0:
            err = f"the GPU probe exited {r.exit_code}: {r.stderr.strip()[-300:]}"
        out.append(NodeGpus(node.name, node.host, tuple(gpus), tool, err, tuple(procs)))
    return out


def _fmt(v, unit="", digits=0) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def _procs_text(procs) -> str:
    """`pid command [run]` per process, on one line (`; ` between): a GPU is one row."""
    parts = []
    for p in procs:
        what = (p.command or p.name or "?")
        run = f" [{p.run_id}]" if p.run_id else ""
        parts.append(f"{p.pid}{run} {what}")
    return "; ".join(parts) or "-"


def _short(name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `H100 80GB HBM3`: the vendor is the tool's column."""
    for vendor in ("NVIDIA ", "AMD "):
        name = name.removeprefix(vendor)
    return name


def table(views: list[NodeGpus], title: str):
    """One row per GPU at any width: the process column, then the name, are cut with `…` on a
    narrow screen; only a node's error or its `no GPUs` wraps (it is not a GPU's row)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    def cell(text: str, style: str = "") -> Text:
        return Text(text, style=style, no_wrap=True, overflow="ellipsis")

    t = Table(title=title, expand=False, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, just in (("node", "left"), ("gpu", "right"), ("name", "left"), ("util", "right"),
                      ("mem MiB", "right"), ("temp", "right"), ("power", "right")):
        t.add_column(col, justify=just, no_wrap=col != "name", min_width=4 if col == "name" else None)
    t.add_column(Text("process [run]"), min_width=8)
    for v in views:
        if v.error:
            t.add_row(v.name, "", "", "", "", "", "", Text(v.error, style="red"))
            continue
        if not v.gpus:
            t.add_row(v.name, "", "", "", "", "", "", Text("no GPUs (no nvidia-smi or rocm-smi)" if v.tool is None
                                                        else "no GPUs", style="dim"))
            continue
        for i, g in enumerate(v.gpus):
            mem = f"{_fmt(g.mem_used_mib)}/{_fmt(g.mem_total_mib)}"
            t.add_row(v.name if i == 0 else "", str(g.index), cell(_short(g.name)), _fmt(g.util, "%"), mem,
                      _fmt(g.temp_c, "C"), _fmt(g.power_w, "W", 0),
                      cell(_procs_text(g.processes if v.tool != "rocm-smi" or i else v.processes)))
    return t

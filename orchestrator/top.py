"""`clusterctl top`: every GPU of every node in one live table (replaces `watch -n 1 rocm-smi`
on each node, seed 000).

One SSH connection per node for the whole session (transport.Cluster) and one remote
invocation per node per refresh: remote/gputop.sh asks nvidia-smi or rocm-smi for the GPUs and
their compute processes, and reads each process's command line and CLUSTERCTL_RUN_ID from /proc
where the node allows it. Parsing is pure (parse_probe + orchestrator.gpus).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import resources


from orchestrator.gpus import (Gpu, GpuProcess, attach_processes, parse_nvidia_smi_apps_csv, parse_nvidia_smi_csv,
                   parse_rocm_smi_json, parse_rocm_smi_pids_json)

PROBE = resources.files("orchestrator").joinpath("remote/gputop.sh").read_bytes()
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


def _sections(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@@"):
            cur = out.setdefault(line[2:].strip(), [])
        elif cur is not None:
            cur.append(line)
    return out


def _proc_info(sections: dict[str, list[str]]) -> dict[int, tuple[str | None, str | None]]:
    info = {}
    for key, lines in sections.items():
        if not key.startswith("proc "):
            continue
        pid = int(key.split()[1])
        cmd = (lines[0].strip() if lines else "") or None
        run_id = next((ln.split("=", 1)[1] for ln in lines[1:] if ln.startswith("CLUSTERCTL_RUN_ID=")), None)
        info[pid] = (cmd, run_id or None)
    return info


def parse_probe(text: str) -> tuple[str | None, list[Gpu], list[GpuProcess], str | None]:
    """gputop.sh output -> (tool, gpus, unplaced processes, error)."""
    s = _sections(text)
    if "end" not in s:
        return None, [], [], "the GPU probe stopped before the end of its output"
    rc = next((k.split()[1] for k in s if k.startswith("rc ")), "0")
    info = _proc_info(s)

    def enrich(p: GpuProcess) -> GpuProcess:
        cmd, run_id = info.get(p.pid, (None, None))
        return replace(p, command=cmd, run_id=run_id)

    try:
        if "nvidia-gpus" in s:
            body = "\n".join(s["nvidia-gpus"])
            if rc != "0":
                return "nvidia-smi", [], [], f"nvidia-smi failed (exit {rc}): {body.strip()[-300:]}"
            apps = [(u, enrich(p)) for u, p in parse_nvidia_smi_apps_csv("\n".join(s.get("nvidia-apps", [])))]
            return "nvidia-smi", attach_processes(parse_nvidia_smi_csv(body), apps), [], None
        if "rocm-gpus" in s:
            body = "\n".join(s["rocm-gpus"])
            if rc != "0":
                return "rocm-smi", [], [], f"rocm-smi failed (exit {rc})"
            procs = [enrich(p) for p in parse_rocm_smi_pids_json("\n".join(s.get("rocm-pids", [])))]
            return "rocm-smi", parse_rocm_smi_json(body), procs, None
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        return None, [], [], f"could not parse the GPU tool's output: {e}"
    return None, [], [], None  # "@@none": no GPU tool, a CPU node


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
    parts = []
    for p in procs:
        what = (p.command or p.name or "?")
        what = what if len(what) <= 48 else what[:45] + "..."
        run = f" [{p.run_id}]" if p.run_id else ""
        parts.append(f"{p.pid} {what}{run}")
    return "\n".join(parts) or "-"


def table(views: list[NodeGpus], title: str):
    from rich.table import Table

    t = Table(title=title, expand=False)
    for col, just in (("node", "left"), ("gpu", "right"), ("name", "left"), ("util", "right"),
                      ("memory MiB", "right"), ("temp", "right"), ("power", "right"),
                      ("process [run]", "left")):
        t.add_column(col, justify=just)
    for v in views:
        if v.error:
            t.add_row(v.name, "", f"[red]{v.error}[/red]", "", "", "", "", "")
            continue
        if not v.gpus:
            t.add_row(v.name, "", "[dim]no GPUs (no nvidia-smi or rocm-smi)[/dim]" if v.tool is None
                      else "[dim]no GPUs[/dim]", "", "", "", "", _procs_text(v.processes))
            continue
        for i, g in enumerate(v.gpus):
            mem = f"{_fmt(g.mem_used_mib)}/{_fmt(g.mem_total_mib)}"
            t.add_row(v.name if i == 0 else "", str(g.index), g.name, _fmt(g.util, "%"), mem,
                      _fmt(g.temp_c, "C"), _fmt(g.power_w, "W", 0),
                      _procs_text(g.processes if v.tool != "rocm-smi" or i else v.processes))
    return t

"""gpu_count and gpu_idle: nvidia-smi / rocm-smi sections of the probe (parsers in ..gpus)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.gpus import (Gpu, GpuProcess, attach_processes, parse_nvidia_smi_apps_csv, parse_nvidia_smi_csv,
                    parse_rocm_smi_json, parse_rocm_smi_pids_json)
from orchestrator.checks import Ctx, CheckResult, fail, first_line, ok, sections, skip, warn


def gpus_from_probe(text: str) -> tuple[str | None, list[Gpu] | None, str | None]:
    """(tool, gpus, error): tool None when neither nvidia-smi nor rocm-smi exists;
    gpus None when the tool failed (error says why)."""
    for s in sections(text):
        if s.name == "nvidia-gpus":
            if s.rc not in (0, None):
                return "nvidia-smi", None, first_line(s.body) or f"exit code {s.rc}"
            try:
                return "nvidia-smi", parse_nvidia_smi_csv(s.body), None
            except (ValueError, KeyError) as e:
                return "nvidia-smi", None, f"unreadable output: {e}"
        if s.name == "rocm-gpus":
            if s.rc not in (0, None):
                return "rocm-smi", None, first_line(s.body) or f"exit code {s.rc}"
            try:
                return "rocm-smi", parse_rocm_smi_json(s.body), None
            except ValueError as e:
                return "rocm-smi", None, f"unreadable output: {e}"
    return None, None, None


# Memory in use with no process listed means a holder this shell cannot see (a process in
# another container or PID namespace). Desktop GPUs show a few hundred MiB for the display
# server, which is not a compute app either, so only more than that is worth a warning.
HIDDEN_HOLDER_MIB = 1024


@dataclass(frozen=True)
class Holder:
    """A process holding GPU memory."""

    pid: int
    name: str
    used_mib: int | None
    gpu: int | None  # index, where the tool says which GPU
    command: str | None  # full command line, where /proc let us read it


def gpu_processes(text: str) -> list[Holder]:
    cmdlines: dict[int, str | None] = {}
    found: list[tuple[GpuProcess, int | None]] = []
    for s in sections(text):
        if s.name == "proc" and s.arg.strip().isdigit():
            cmdlines[int(s.arg)] = s.body.strip() or None
        elif s.name == "nvidia-apps":
            try:
                apps = parse_nvidia_smi_apps_csv(s.body)
            except ValueError:
                apps = []
            gpus = gpus_from_probe(text)[1] or []
            index = {p.pid: g.index for g in attach_processes(gpus, apps) for p in g.processes}
            found += [(p, index.get(p.pid)) for _, p in apps]
        elif s.name == "rocm-pids":
            try:
                found += [(p, None) for p in parse_rocm_smi_pids_json(s.body)]
            except ValueError:
                pass
    return [Holder(p.pid, p.name, p.used_mib, gpu, cmdlines.get(p.pid)) for p, gpu in found]


def parse_gpu_count(text: str, ctx: Ctx) -> CheckResult:
    want = ctx.node.gpus
    tool, gpus, err = gpus_from_probe(text)
    if tool is None:
        if want == 0:
            return ok("gpu_count", "CPU node (gpus: 0), no GPU tool needed")
        return fail("gpu_count", "neither nvidia-smi nor rocm-smi found on PATH",
                    f"install the GPU driver tools on {ctx.node.name}, or set `gpus: 0` for a CPU node")
    if gpus is None:
        return fail("gpu_count", f"{tool} failed: {err}",
                    f"fix the driver on {ctx.node.name} (`{tool}` must work); a driver/library "
                    "mismatch usually needs a reboot or reinstall")
    n = len(gpus)
    model = gpus[0].name if gpus else ""
    what = f"{n} GPU{'s' if n != 1 else ''}" + (f" ({model})" if model else "") + f" via {tool}"
    if want is None:
        return ok("gpu_count", f"{what}; inventory does not say (nproc_per_node will be {n or 1})")
    if n == want:
        return ok("gpu_count", what)
    remedy = (f"set `gpus: {n}` for {ctx.node.name} in the inventory (torchrun --nproc-per-node {n or 1} "
              f"there); launching {want} processes on {n} GPUs fails with 'invalid device ordinal'")
    if n < want:
        return fail("gpu_count", f"{what}, inventory says {want}", remedy)
    return warn("gpu_count", f"{what}, inventory says {want} (only {want} will be used)", remedy)


def parse_gpu_idle(text: str, ctx: Ctx) -> CheckResult:
    tool, gpus, err = gpus_from_probe(text)
    if tool is None:
        return skip("gpu_idle", "no GPU tool on the node")
    if gpus is None:
        return skip("gpu_idle", f"{tool} failed (see gpu_count)")
    procs = gpu_processes(text)
    if not procs:
        hidden = [g for g in gpus if (g.mem_used_mib or 0) >= HIDDEN_HOLDER_MIB]
        if hidden:
            held = ", ".join(f"GPU {g.index} {g.mem_used_mib} MiB" for g in hidden[:4])
            return warn("gpu_idle", f"GPU memory in use ({held}{' ...' if len(hidden) > 4 else ''}) by no "
                        f"process {tool} lists here: another container, or a user whose processes "
                        "this account cannot see",
                        f"find the owner on {ctx.node.name} (`{tool}` as root or on the host); a job "
                        "already on these GPUs slows the run or makes it run out of memory")
        if not any(s.name in ("nvidia-apps", "rocm-pids") for s in sections(text)):
            return ok("gpu_idle", f"no GPU memory in use on {len(gpus)} GPU(s)")
        return ok("gpu_idle", f"no process holds GPU memory on {len(gpus)} GPU(s)")
    parts = []
    for p in procs[:4]:
        mem = f", {p.used_mib} MiB" if p.used_mib is not None else ""
        on = f" on GPU {p.gpu}" if p.gpu is not None else ""
        parts.append(f"pid {p.pid} ({p.command or p.name}{mem}{on})")
    more = f" and {len(procs) - 4} more" if len(procs) > 4 else ""
    detail = "GPU memory held by " + "; ".join(parts) + more
    pids = " ".join(str(p.pid) for p in procs)
    remedy = (f"a leftover run makes NCCL hang: stop it on {ctx.node.name} (`kill {pids}`, "
              "or `clusterctl stop` for a clusterctl run)")
    if ctx.inventory.checks.require_gpu_idle:
        return fail("gpu_idle", detail, remedy)
    return warn("gpu_idle", detail, remedy)

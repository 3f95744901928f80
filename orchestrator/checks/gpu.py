"""gpu_count and gpu_idle: GPU_PROBE's nvidia-smi / rocm-smi sections (parsers in ..gpus).

Processes per node follow one rule (orchestrator/torchrun.py nproc_for): `gpus: N` in the inventory
-> N processes; `gpus: 0` -> a CPU node, one process; `gpus` unset -> the GPUs found."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.checks import Check, Ctx, CheckResult, Probe, fail, ok, skip, warn
from orchestrator.gpus import GPU_PROBE, GpuFacts, gpu_facts

# Preflight lists the GPU processes only when gpu_idle is asked for and some GPU holds memory.
GPU = Probe("gpu", "gpu_apps=never\nif want gpu_idle; then gpu_apps=busy; fi\n" + GPU_PROBE)


def facts(text: str, ctx: Ctx | None = None) -> GpuFacts:
    env = None
    if ctx is not None and ctx.visible_gpus is not None:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(ctx.visible_gpus)}
    return gpu_facts(text, env)


def gpus_from_probe(text: str):
    """(tool, gpus, error): tool None when neither nvidia-smi nor rocm-smi exists; gpus None
    when the tool failed (error says why)."""
    f = gpu_facts(text)
    return f.tool, (list(f.gpus) if f.gpus is not None else None), f.error


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


def gpu_processes(text: str, ctx: Ctx | None = None) -> list[Holder]:
    return [Holder(p.pid, p.name, p.used_mib, gpu, p.command) for p, gpu in facts(text, ctx).holders()]


def parse_gpu_count(text: str, ctx: Ctx) -> CheckResult:
    want, name = ctx.node.gpus, ctx.node.name
    f = facts(text, ctx)
    if f.tool is None:
        if want == 0:
            return ok("gpu_count", "CPU node (gpus: 0): one process, no GPU tool needed")
        detail = "neither nvidia-smi nor rocm-smi found on PATH"
        remedy = f"install the GPU driver tools on {name}, or set `gpus: 0` for a CPU node"
        if want is None:
            return warn("gpu_count", f"{detail}: the node runs one CPU process", remedy)
        return fail("gpu_count", f"{detail}, inventory says {want}", remedy)
    if f.gpus is None:
        return fail("gpu_count", f"{f.tool} failed: {f.error}",
                    f"fix the driver on {name} (`{f.tool}` must work); a driver/library "
                    "mismatch usually needs a reboot or reinstall")
    n = len(f.gpus)
    model = f.gpus[0].name if f.gpus else ""
    what = f"{n} GPU{'s' if n != 1 else ''}" + (f" ({model})" if model else "") + f" via {f.tool}"
    if want is None:
        return ok("gpu_count", f"{what}; inventory does not say: {n or 1} process{'es' if n > 1 else ''}"
                  + ("" if n else " (CPU)"))
    if want == 0:
        if n == 0:
            return ok("gpu_count", f"{what}; CPU node (gpus: 0): one process")
        if ctx.node.cpu:  # said on purpose: nothing to warn about on every preflight
            return ok("gpu_count", f"{what}; CPU node by choice (cpu: true): one process, its GPUs left alone")
        return warn("gpu_count", f"{what}, but the inventory says gpus: 0: the node runs one CPU process",
                    f"drop `gpus: 0` for {name} (or set `gpus: {n}`) to train on its GPUs, or say `cpu: true` "
                    "for a CPU node on purpose")
    if n == want:
        return ok("gpu_count", what)
    if n < want:
        return fail("gpu_count", f"{what}, inventory says {want}",
                    f"set `gpus: {n}` for {name} in the inventory (torchrun --nproc-per-node {n or 1} "
                    f"there): {want} processes on {n} GPU{'s' if n != 1 else ''} fail with "
                    "'invalid device ordinal'")
    return warn("gpu_count", f"{what}, inventory says {want}: {n - want} GPU{'s' if n - want != 1 else ''} "
                f"stay idle", f"set `gpus: {n}` for {name} to use them all (fewer processes than GPUs is fine)")


def parse_gpu_idle(text: str, ctx: Ctx) -> CheckResult:
    f = facts(text, ctx)
    if f.tool is None:
        return skip("gpu_idle", "no GPU tool on the node")
    if f.gpus is None:
        return skip("gpu_idle", f"{f.tool} failed (see gpu_count)")
    procs = gpu_processes(text, ctx)
    if not procs:
        hidden = [g for g in f.gpus if (g.mem_used_mib or 0) >= HIDDEN_HOLDER_MIB]
        if hidden:
            held = ", ".join(f"GPU {g.index} {g.mem_used_mib} MiB" for g in hidden[:4])
            return warn("gpu_idle", f"GPU memory in use ({held}{' ...' if len(hidden) > 4 else ''}) by no "
                        f"process {f.tool} lists here: another container, or a user whose processes "
                        "this account cannot see",
                        f"find the owner on {ctx.node.name} (`{f.tool}` as root or on the host); a job "
                        "already on these GPUs slows the run or makes it run out of memory")
        if not f.listed:
            return ok("gpu_idle", f"no GPU memory in use on {len(f.gpus)} GPU(s)")
        return ok("gpu_idle", f"no process holds GPU memory on {len(f.gpus)} GPU(s)")
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


GPU_COUNT = Check(
    "gpu_count", "the GPUs nvidia-smi/rocm-smi report match the inventory's `gpus:`",
    "set `gpus:` for the node to what nvidia-smi/rocm-smi report, or fix the driver",
    probes=(GPU,), parse=parse_gpu_count, fast=True)
GPU_IDLE = Check(
    "gpu_idle", "no process already holds GPU memory",
    "stop the leftover process (`clusterctl stop` for a clusterctl run)",
    probes=(GPU,), parse=parse_gpu_idle)

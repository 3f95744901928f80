"""GPU facts from nvidia-smi, rocm-smi and amd-smi: the one probe snippet that asks for them (GPU_PROBE),
and pure parsers from the tools' text to `Gpu` records.

preflight (gpu_count, gpu_idle, python_env), `top` and `launch --from-env` all run GPU_PROBE
(over SSH, or locally) and read its output with gpu_facts(). Every parser takes the tool's
exact output and never raises on a missing reading: "[N/A]", "[Not Supported]", "N/A" and
empty fields become None.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from orchestrator.gpus.amd import (  # noqa: F401 - the GPU parsers' public names
    ROCM_GPU_ARGV,
    ROCM_PIDS_ARGV,
    parse_amd_smi_static_json,
    parse_rocm_smi_csv,
    parse_rocm_smi_json,
    parse_rocm_smi_pids_json,
)
from orchestrator.gpus.nvidia import (  # noqa: F401
    NVIDIA_APP_FIELDS,
    NVIDIA_APPS_ARGV,
    NVIDIA_GPU_ARGV,
    NVIDIA_GPU_FIELDS,
    attach_processes,
    count_nvidia_smi_list,
    parse_nvidia_smi_apps_csv,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_list,
)
from orchestrator.gpus.records import MIB, Gpu, GpuProcess, number  # noqa: F401
from orchestrator.probe import sections

# The GPU probe: sections @@nvidia-gpus / @@rocm-gpus (+ @@rc), @@nvidia-apps / @@rocm-pids,
# then @@proc PID per process on a GPU (its command line, and CLUSTERCTL_RUN_ID where /proc lets
# us read its environment), or @@no-gpu-tool. $gpu_apps says when to list the processes:
# always (top), busy (only when some GPU has memory in use: the list costs a second nvidia-smi,
# tens of ms to seconds on a real node, and a CUDA context alone takes hundreds of MiB, so no
# process hides under 16 MiB), or never.
GPU_PROBE = r"""pids=""
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "@@nvidia-gpus"
  gpus=$(@@NVIDIA_GPU_ARGV@@ 2>&1)
  rc=$?
  printf '%s\n' "$gpus"
  echo "@@rc $rc"
  if [ "$rc" = 0 ] && { [ "$gpu_apps" = always ] || { [ "$gpu_apps" = busy ] && printf '%s\n' "$gpus" |
      awk -F', *' '$@@MEM@@ !~ /^[0-9]+$/ || $@@MEM@@ + 0 > 16 { busy = 1 } END { exit !busy }'; }; }; then
    echo "@@nvidia-apps"
    apps=$(@@NVIDIA_APPS_ARGV@@ 2>/dev/null)
    printf '%s\n' "$apps"
    pids=$(printf '%s\n' "$apps" | cut -d, -f@@PID@@)
  fi
elif command -v rocm-smi >/dev/null 2>&1; then
  echo "@@rocm-gpus"
  @@ROCM_GPU_ARGV@@ 2>/dev/null
  echo "@@rc $?"
  if [ "$gpu_apps" != never ]; then
    echo "@@rocm-pids"
    apps=$(@@ROCM_PIDS_ARGV@@ 2>/dev/null)
    printf '%s\n' "$apps"
    pids=$(printf '%s\n' "$apps" | grep -o 'PID[0-9]*' | cut -c4-)
  fi
else
  echo "@@no-gpu-tool"
fi
for pid in $pids; do
  case $pid in *[!0-9]*|'') continue ;; esac
  echo "@@proc $pid"
  if [ -r "/proc/$pid/cmdline" ]; then tr '\000' ' ' < "/proc/$pid/cmdline" 2>/dev/null; fi
  echo
  if [ -r "/proc/$pid/environ" ]; then
    tr '\000' '\n' < "/proc/$pid/environ" 2>/dev/null | grep '^CLUSTERCTL_RUN_ID=' | head -n1
  fi
done
"""
for _token, _value in (("@@NVIDIA_GPU_ARGV@@", " ".join(NVIDIA_GPU_ARGV)),
                       ("@@NVIDIA_APPS_ARGV@@", " ".join(NVIDIA_APPS_ARGV)),
                       ("@@ROCM_GPU_ARGV@@", " ".join(ROCM_GPU_ARGV)),
                       ("@@ROCM_PIDS_ARGV@@", " ".join(ROCM_PIDS_ARGV)),
                       ("@@MEM@@", str(NVIDIA_GPU_FIELDS.index("memory.used") + 1)),
                       ("@@PID@@", str(NVIDIA_APP_FIELDS.index("pid") + 1))):
    GPU_PROBE = GPU_PROBE.replace(_token, _value)

# ---------------------------------------------------------------- GPU_PROBE's output

@dataclass(frozen=True)
class GpuFacts:
    """What GPU_PROBE found on a node."""

    tool: str | None  # "nvidia-smi" | "rocm-smi" | None (neither on PATH)
    gpus: tuple[Gpu, ...] | None  # None when the tool failed (error says why)
    error: str | None = None
    processes: tuple[GpuProcess, ...] = ()  # not placed on a GPU (rocm-smi does not say which)
    listed: bool = False  # the probe asked for the process list

    @property
    def vendor(self) -> str | None:
        return {"nvidia-smi": "nvidia", "rocm-smi": "amd"}.get(self.tool or "")

    def holders(self) -> list[tuple[GpuProcess, int | None]]:
        """Every process holding GPU memory, with its GPU's index where the tool says."""
        return [(p, g.index) for g in self.gpus or () for p in g.processes] + \
            [(p, None) for p in self.processes]


def visible(gpus, env: Mapping[str, str]):
    """Only the GPUs CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES leave
    (nvidia-smi and rocm-smi list every GPU whatever these say)."""
    for key in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        v = env.get(key)
        if v is not None:
            ids = {x.strip() for x in v.split(",") if x.strip()}
            return tuple(g for g in gpus if str(g.index) in ids or (g.uuid or "") in ids)
    return tuple(gpus)


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:300]


def gpu_facts(text: str, env: Mapping[str, str] | None = None) -> GpuFacts:
    """GPU_PROBE's output (alone, or inside the preflight probe's) -> GpuFacts. env: limit the
    GPUs to what *_VISIBLE_DEVICES in it leave (a launcher's view of its own node)."""
    secs = sections(text)
    procs: dict[int, tuple[str | None, str | None]] = {}
    for s in secs:
        if s.name == "proc" and s.arg.strip().isdigit():
            lines = s.body.splitlines()
            run_id = next((ln.split("=", 1)[1] for ln in lines[1:] if ln.startswith("CLUSTERCTL_RUN_ID=")), None)
            procs[int(s.arg)] = ((lines[0].strip() if lines else "") or None, run_id or None)

    def enrich(p: GpuProcess) -> GpuProcess:
        cmd, run_id = procs.get(p.pid, (None, None))
        return replace(p, command=cmd, run_id=run_id)

    by_name = {s.name: s for s in secs}
    try:
        if "nvidia-gpus" in by_name:
            s = by_name["nvidia-gpus"]
            if s.rc not in (0, None):
                return GpuFacts("nvidia-smi", None, _first_line(s.body) or f"exit code {s.rc}")
            gpus = parse_nvidia_smi_csv(s.body)
            apps = by_name.get("nvidia-apps")
            listed = [(u, enrich(p)) for u, p in parse_nvidia_smi_apps_csv(apps.body)] if apps else []
            placed = attach_processes(gpus, listed)
            uuids = {g.uuid for g in gpus}
            stray = tuple(p for u, p in listed if u not in uuids)
            if env is not None:
                placed = list(visible(placed, env))
            return GpuFacts("nvidia-smi", tuple(placed), None, stray, apps is not None)
        if "rocm-gpus" in by_name:
            s = by_name["rocm-gpus"]
            if s.rc not in (0, None):
                return GpuFacts("rocm-smi", None, _first_line(s.body) or f"exit code {s.rc}")
            gpus = parse_rocm_smi_json(s.body)
            pids = by_name.get("rocm-pids")
            listed = tuple(enrich(p) for p in parse_rocm_smi_pids_json(pids.body)) if pids else ()
            if env is not None:
                gpus = list(visible(gpus, env))
            return GpuFacts("rocm-smi", tuple(gpus), None, listed, pids is not None)
    except (ValueError, KeyError) as e:  # json.JSONDecodeError is a ValueError
        tool = "nvidia-smi" if "nvidia-gpus" in by_name else "rocm-smi"
        return GpuFacts(tool, None, f"unreadable output: {e}")
    return GpuFacts(None, None)

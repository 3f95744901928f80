"""GPU facts from nvidia-smi, rocm-smi and amd-smi: the one probe snippet that asks for them (GPU_PROBE),
and pure parsers from the tools' text to `Gpu` records.

preflight (gpu_count, gpu_idle, python_env), `top` and `launch --from-env` all run GPU_PROBE
(over SSH, or locally) and read its output with gpu_facts(). Every parser takes the tool's
exact output and never raises on a missing reading: "[N/A]", "[Not Supported]", "N/A" and
empty fields become None.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Mapping

# nvidia-smi: one line per GPU, no header, no units; the order is what the parser assumes
# when the header is absent.
NVIDIA_GPU_FIELDS = ("index", "uuid", "name", "utilization.gpu", "memory.used", "memory.total",
                     "temperature.gpu", "power.draw")
NVIDIA_APP_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")
NVIDIA_GPU_ARGV = ("nvidia-smi", "--query-gpu=" + ",".join(NVIDIA_GPU_FIELDS),
                   "--format=csv,noheader,nounits")
NVIDIA_APPS_ARGV = ("nvidia-smi", "--query-compute-apps=" + ",".join(NVIDIA_APP_FIELDS),
                    "--format=csv,noheader,nounits")
# rocm-smi: everything top shows, as JSON ({"card0": {...}, ...}); pids separately.
ROCM_GPU_ARGV = ("rocm-smi", "--showid", "--showproductname", "--showuse", "--showmeminfo", "vram",
                 "--showtemp", "--showpower", "--json")
ROCM_PIDS_ARGV = ("rocm-smi", "--showpids", "--json")

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

MIB = 1024 * 1024
_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]",
            "unknown", "[insufficient permissions]", "-", "none"}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: int | None = None
    command: str | None = None  # full command line, where the node let us read it
    run_id: str | None = None  # CLUSTERCTL_RUN_ID from the process environment


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    util: float | None = None  # percent
    mem_used_mib: int | None = None
    mem_total_mib: int | None = None
    temp_c: float | None = None
    power_w: float | None = None
    uuid: str | None = None
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)

    @property
    def busy(self) -> bool:
        return bool(self.processes)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("uuid")
        d["processes"] = [asdict(p) for p in self.processes]
        return d


def number(value: object) -> float | None:
    """'69.88 W' -> 69.88; '[N/A]' / '[Not Supported]' / '' -> None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    s = str(value).strip()
    if s.lower() in _MISSING:
        return None
    m = re.match(r"^[-+]?\d+(?:\.\d+)?", s)
    return float(m.group(0)) if m else None


def _int(value: object) -> int | None:
    v = number(value)
    return None if v is None else int(round(v))


def _text(value: object) -> str:
    s = str(value or "").strip()
    return "" if s.lower() in _MISSING else s


def _csv_rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return [[c.strip() for c in row] for row in csv.reader(lines, skipinitialspace=True)]


def _header_key(head: str) -> str:
    """'memory.used [MiB]' -> 'memory.used'; 'used_gpu_memory [MiB]' -> 'used_memory'."""
    key = head.split("[")[0].strip()
    return {"used_gpu_memory": "used_memory", "gpu_name": "name"}.get(key, key)


def _records(text: str, default_fields: tuple[str, ...], marker: str) -> list[dict[str, str]]:
    rows = _csv_rows(text)
    if not rows:
        return []
    fields: tuple[str, ...] = default_fields
    # format=csv without noheader: the first row names the fields (with " [unit]" where the
    # field has one); it is recognised by the marker or by any field the caller asked for.
    heads = {_header_key(h) for h in rows[0]}
    if marker in heads or heads & set(default_fields):
        fields = tuple(_header_key(h) for h in rows[0])
        rows = rows[1:]
    out = []
    for row in rows:
        if len(row) != len(fields):
            raise ValueError(f"nvidia-smi: expected {len(fields)} fields, got {len(row)}: {row}")
        out.append(dict(zip(fields, row)))
    return out


def parse_nvidia_smi_csv(text: str, fields: tuple[str, ...] = NVIDIA_GPU_FIELDS) -> list[Gpu]:
    """`nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits]`.

    With a header the columns may come in any order, carry units and include fields not
    read here; without one they must be `fields` in order. A query without `index` numbers
    the GPUs by row (nvidia-smi prints them in index order)."""
    gpus = []
    for row, rec in enumerate(_records(text, fields, "index")):
        gpus.append(Gpu(
            index=int(rec["index"]) if "index" in rec else row,
            name=_text(rec.get("name")),
            util=number(rec.get("utilization.gpu")),
            mem_used_mib=_int(rec.get("memory.used")),
            mem_total_mib=_int(rec.get("memory.total")),
            temp_c=number(rec.get("temperature.gpu")),
            power_w=number(rec.get("power.draw")),
            uuid=_text(rec.get("uuid")) or None,
        ))
    return sorted(gpus, key=lambda g: g.index)


def parse_nvidia_smi_apps_csv(text: str) -> list[tuple[str, GpuProcess]]:
    """`nvidia-smi --query-compute-apps=<NVIDIA_APP_FIELDS> --format=csv,...` -> [(gpu_uuid, proc)]."""
    out = []
    for rec in _records(text, NVIDIA_APP_FIELDS, "pid"):
        pid = _int(rec.get("pid"))
        if pid is None:
            continue
        out.append((_text(rec.get("gpu_uuid")),
                    GpuProcess(pid=pid, name=_text(rec.get("process_name") or rec.get("name")),
                               used_mib=_int(rec.get("used_memory")))))
    return out


def attach_processes(gpus: list[Gpu], apps: list[tuple[str, GpuProcess]]) -> list[Gpu]:
    """Put each compute app on the GPU whose uuid it names (nvidia-smi reports them apart)."""
    by_uuid: dict[str, list[GpuProcess]] = {}
    for uuid, proc in apps:
        by_uuid.setdefault(uuid, []).append(proc)
    return [replace(g, processes=g.processes + tuple(by_uuid.get(g.uuid or "", ()))) for g in gpus]


# ---------------------------------------------------------------- rocm-smi

def _first(card: dict[str, str], *keys: str) -> str | None:
    """The first of keys with a numeric reading."""
    return next((card[k] for k in keys if k in card and number(card[k]) is not None), None)


def _first_text(card: dict[str, str], *keys: str) -> str:
    return next((_text(card[k]) for k in keys if _text(card.get(k))), "")


def _pick(card: dict[str, str], prefix: str) -> str | None:
    """The first key starting with prefix that has a number (sensor names differ by model)."""
    for k, v in card.items():
        if k.startswith(prefix) and number(v) is not None:
            return v
    return None


def _rocm_gpu(key: str, card: dict[str, str]) -> Gpu:
    m = re.search(r"(\d+)$", key)
    index = int(m.group(1)) if m else 0
    used_b, total_b = number(card.get("VRAM Total Used Memory (B)")), number(card.get("VRAM Total Memory (B)"))
    name = _first_text(card, "Card Series", "Card series", "Card SKU", "Card model", "Card Model",
                        "Device Name", "GPU ID", "Device ID")
    return Gpu(
        index=index,
        name=name,
        util=number(_first(card, "GPU use (%)", "GPU Utilization (%)")),
        mem_used_mib=None if used_b is None else int(used_b // MIB),
        mem_total_mib=None if total_b is None else int(total_b // MIB),
        temp_c=number(_first(card, "Temperature (Sensor edge) (C)", "Temperature (Sensor junction) (C)")
                      or _pick(card, "Temperature (Sensor")),
        power_w=number(_first(card, "Average Graphics Package Power (W)",
                              "Current Socket Graphics Package Power (W)")
                       or _pick(card, "Current Socket") or _pick(card, "Average")),
        uuid=_text(card.get("Unique ID")) or None,
    )


def parse_rocm_smi_json(text: str) -> list[Gpu]:
    """`rocm-smi --showid --showproductname --showuse --showmeminfo vram --showtemp --showpower --json`:
    {"card0": {"GPU use (%)": "0", ...}, "system": {...}}. Key names differ between ROCm
    releases (edge/junction sensors, average/current socket power); the first one with a
    number wins."""
    data = json.loads(text) if text.strip() else {}
    gpus = [_rocm_gpu(k, v) for k, v in data.items() if k.startswith("card") and isinstance(v, dict)]
    return sorted(gpus, key=lambda g: g.index)


def parse_rocm_smi_csv(text: str) -> list[Gpu]:
    """The same query with --csv: a `device,<key>,...` header, one `cardN,...` row per GPU."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("device,")), None)
    if start is None:
        return []
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    gpus = [_rocm_gpu(row["device"], {k: v for k, v in row.items() if k and k != "device"})
            for row in reader if (row.get("device") or "").startswith("card")]
    return sorted(gpus, key=lambda g: g.index)


def parse_rocm_smi_pids_json(text: str) -> list[GpuProcess]:
    """`rocm-smi --showpids --json`: {"system": {"PID4242": "python3, 2, 1073741824, 0, 0"}}
    (name, GPUs used, VRAM bytes, SDMA, CU occupancy). rocm-smi does not say which GPU."""
    data = json.loads(text) if text.strip() else {}
    out = []
    for key, value in (data.get("system") or {}).items():
        m = re.match(r"^PID\s*(\d+)$", key)
        if not m:
            continue
        parts = [p.strip() for p in str(value).split(",")]
        vram = number(parts[2]) if len(parts) > 2 else None
        out.append(GpuProcess(pid=int(m.group(1)), name=parts[0] if parts else "",
                              used_mib=None if vram is None else int(vram // MIB)))
    return sorted(out, key=lambda p: p.pid)


_LIST_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: ([^)]+)\)\s*$")


def parse_nvidia_smi_list(text: str) -> list[Gpu]:
    """`nvidia-smi -L`: one `GPU <i>: <name> (UUID: GPU-...)` line per GPU. The indented
    `MIG ... Device N:` lines under a MIG-enabled GPU are its instances, not more GPUs."""
    gpus = []
    for ln in text.splitlines():
        m = _LIST_LINE.match(ln)
        if m:
            gpus.append(Gpu(index=int(m.group(1)), name=m.group(2), uuid=m.group(3)))
    return gpus


def count_nvidia_smi_list(text: str) -> int:
    """`nvidia-smi -L` -> number of GPUs (MIG instances are not counted)."""
    return len(parse_nvidia_smi_list(text))


# ---------------------------------------------------------------- amd-smi

_AMD_MIB = {"B": 1 / MIB, "KB": 1 / 1024, "MB": 1, "GB": 1024}  # amd-smi's "MB" is 2**20 bytes


def parse_amd_smi_static_json(text: str) -> list[Gpu]:
    """`amd-smi static --json`: name (asic.market_name) and VRAM size per GPU. ROCm 7
    wraps the list as {"gpu_data": [...]}; earlier releases print the bare list. Sizes
    come as {"value": 196592, "unit": "MB"}."""
    data = json.loads(text) if text.strip() else []
    entries = data.get("gpu_data", []) if isinstance(data, dict) else data
    gpus = []
    for pos, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        size = (entry.get("vram") or {}).get("size")
        total = None
        if isinstance(size, dict) and number(size.get("value")) is not None:
            total = int(number(size["value"]) * _AMD_MIB.get(str(size.get("unit", "MB")).upper(), 1))
        asic = entry.get("asic") or {}
        gpus.append(Gpu(index=int(entry.get("gpu", pos)),
                        name=_text(asic.get("market_name")) or _text((entry.get("board") or {}).get("product_name")),
                        mem_total_mib=total,
                        uuid=_text(asic.get("asic_serial")) or None))
    return sorted(gpus, key=lambda g: g.index)


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
    from orchestrator.checks import sections

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

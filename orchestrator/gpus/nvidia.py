"""nvidia-smi: what clusterctl asks it, and parsers of its CSV and `-L` answers."""

from __future__ import annotations

import csv
import re
from dataclasses import replace

from orchestrator.gpus.records import Gpu, GpuProcess, _int, _text, number

# nvidia-smi: one line per GPU, no header, no units; the order is what the parser assumes
# when the header is absent.
NVIDIA_GPU_FIELDS = ("index", "uuid", "name", "utilization.gpu", "memory.used", "memory.total",
                     "temperature.gpu", "power.draw")
NVIDIA_APP_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")
NVIDIA_GPU_ARGV = ("nvidia-smi", "--query-gpu=" + ",".join(NVIDIA_GPU_FIELDS),
                   "--format=csv,noheader,nounits")
NVIDIA_APPS_ARGV = ("nvidia-smi", "--query-compute-apps=" + ",".join(NVIDIA_APP_FIELDS),
                    "--format=csv,noheader,nounits")

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

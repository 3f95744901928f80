"""rocm-smi and amd-smi: what clusterctl asks them, and parsers of their JSON and CSV answers."""

from __future__ import annotations

import csv
import io
import json
import re

from orchestrator.gpus.records import MIB, Gpu, GpuProcess, _text, number

# rocm-smi: everything top shows, as JSON ({"card0": {...}, ...}); pids separately.
ROCM_GPU_ARGV = ("rocm-smi", "--showid", "--showproductname", "--showuse", "--showmeminfo", "vram",
                 "--showtemp", "--showpower", "--json")
ROCM_PIDS_ARGV = ("rocm-smi", "--showpids", "--json")


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

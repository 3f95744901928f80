"""GPU and GPU-process records, and the reading of a tool's value that may be missing."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

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

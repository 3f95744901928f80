"""Bandwidth and latency as people write them (`1gbit`, `25GbE`, `50us`) and back."""

from __future__ import annotations

import re

_SI = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_bandwidth(text: str) -> float:
    """A rate -> bits per second.  Bits: 1gbit, 100mbit, 25Gbps, 10Gb/s, 955Mbit/s, 1e9 (bare = bit/s).
    Bytes: 1.2GB/s, 125MB/s, 100MBps, 1GiB/s (capital B, or 'byte').  Note: tc reads 'gbps' as
    bytes; here 'bps' is bits, the networking convention."""

    raw = text.strip()
    mt = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?\s*"
                      r"(bits?|bit/s|bps|b/s|b|B|B/s|Bps|bytes?|bytes?/s)?", raw)
    if not mt or (mt.group(2) and not mt.group(3)):
        raise ValueError(f"{text!r} is not a bandwidth like 1gbit, 25Gbps, 100mbit or 1.2GB/s")
    value = float(mt.group(1))
    prefix = (mt.group(2) or "").lower()
    unit = mt.group(3) or "bit"
    byte = unit.startswith("B") or unit.startswith("byte")
    bps = value * _SI[prefix] * (8 if byte else 1)
    if bps <= 0:
        raise ValueError(f"{text!r}: bandwidth must be > 0")
    return bps


def parse_latency(text: str) -> float:

    mt = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)?", text.strip())
    if not mt:
        raise ValueError(f"{text!r} is not a latency like 50us, 0.2ms or 0.001s")
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[mt.group(2)]
    return float(mt.group(1)) * scale


def fmt_bps(bps: float) -> str:
    for div, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= div:
            v = bps / div
            return f"{v:.3g} {unit}"
    return f"{bps:.0f} bit/s"



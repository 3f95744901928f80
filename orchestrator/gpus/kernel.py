"""NVIDIA Xid events in the kernel log: the parser of `NVRM: Xid` lines and what each code means.

The driver logs every GPU error it sees as `NVRM: Xid (PCI:0000:19:00): 48, pid=..., name=...,
<message>`. The line's time is read where the log has one with a time zone: `dmesg --time-format
iso` (`2024-11-15T12:02:03,470068+00:00`, also behind --decode's `kern  :warn  : `) and
`journalctl -o short-iso` (`2025-01-02T15:20:12+0800 host kernel: ...`). `dmesg -T` and raw
`[seconds]` stamps carry no zone or no date: their time is None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-9A-Fa-f])?\): "
                  r"(\d+)(?:, pid=([^,]*), name=([^,]*))?,\s*(.*?)\s*$")
_ISO = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[,.](\d{1,6})\d*)?([+-]\d\d:?\d\d|Z)")


@dataclass(frozen=True)
class Xid:
    code: int
    pci: str  # "0000:19:00": domain:bus:device, as the driver names the GPU
    message: str
    time: float | None = None  # epoch seconds, where the log line says when with a time zone
    process: str | None = None  # the process the driver blames, when it names one


def log_time(prefix: str) -> float | None:
    """The epoch seconds of an ISO 8601 stamp with a zone in a log line's prefix, else None."""
    m = _ISO.search(prefix)
    if not m:
        return None
    stamp = m.group(1) + (f".{m.group(2)}" if m.group(2) else "") + ("+00:00" if m.group(3) == "Z" else m.group(3))
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def parse_xids(text: str) -> list[Xid]:
    """Every `NVRM: Xid` line of a kernel log, in log order; other lines are skipped."""
    out = []
    for line in text.splitlines():
        m = _XID.search(line)
        if not m:
            continue
        process = (m.group(4) or "").strip()
        out.append(Xid(code=int(m.group(2)), pci=pci_key(m.group(1)), message=m.group(5),
                       time=log_time(line[:m.start()]),
                       process=None if process in ("", "<unknown>") else process))
    return out


def pci_key(address: str) -> str:
    """'PCI:0000:19:00' / '00000000:19:00.0' (nvidia-smi's bus id) -> '0000:19:00', lower case."""
    parts = address.lower().removeprefix("pci:").split(":")
    if len(parts) < 3:
        return address.lower()
    return f"{parts[0][-4:].rjust(4, '0')}:{parts[1]}:{parts[2].split('.')[0]}"


# What a code means (NVIDIA's Xid catalog, in a few words). Codes in APPLICATION_XIDS are
# usually an application's fault (a bad address, a killed context): the GPU itself is fine.
XID_MEANING = {
    8: "GPU stopped processing (timeout)", 13: "graphics engine exception", 31: "GPU memory page fault",
    32: "corrupted push buffer stream", 38: "driver firmware error", 43: "GPU stopped processing",
    45: "preemptive cleanup after an earlier error", 48: "double-bit ECC error",
    56: "display engine error", 57: "video memory interface error", 61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt", 63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed", 68: "video decoder exception",
    69: "graphics engine class error", 74: "NVLink error", 79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error",
    109: "context switch timeout", 119: "GSP RPC timeout", 120: "GSP error", 121: "C2C link error",
    140: "unrecovered ECC error", 154: "GPU recovery action changed",
}
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 69, 109})

"""GPU health readings: what clusterctl asks nvidia-smi, amd-smi and dcgmi about a GPU's health,
and pure parsers from their text answers to records (the verdicts are checks/gpu_health.py's).

`nvidia-smi -q` and `amd-smi metric --ecc --ecc-blocks` print the same shape: `Key : value` lines
nested by indentation under one header per GPU; `tree` reads both. A field the driver does not
report ("N/A", "[Not Supported]", a section that is absent) is None, never a failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orchestrator.gpus.records import _int, _text

NVIDIA_HEALTH_ARGV = ("nvidia-smi", "-q")
NVLINK_ARGV = ("nvidia-smi", "nvlink", "--status")
AMD_HEALTH_ARGV = ("amd-smi", "metric", "--ecc", "--ecc-blocks")
DCGM_DIAG_ARGV = ("dcgmi", "diag", "-r", "1")

_LINE = re.compile(r"^( *)([^:]+?)\s*:(?:\s+(.*?))?\s*$")
KeyPath = tuple[str, ...]


def tree(lines: list[str]) -> list[tuple[KeyPath, str | None]]:
    """Indented `Key : value` lines -> [(path of keys, value)]; a key without a value opens a
    section whose deeper lines sit under it. A line without ` : ` ("ECC Errors") is a section too."""
    out: list[tuple[KeyPath, str | None]] = []
    stack: list[tuple[int, str]] = []
    for line in lines:
        if not line.strip():
            continue
        line = line.rstrip("\n").expandtabs(8)
        m = _LINE.match(line)
        indent = len(line) - len(line.lstrip(" "))
        key, value = (m.group(2).strip(), m.group(3)) if m else (line.strip(), None)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        out.append((tuple(k for _, k in stack) + (key,), value))
        if not value:
            stack.append((indent, key))
    return out


def _get(entries, *suffix: str) -> str | None:
    """The value of the first entry whose path ends with suffix, read as text (N/A -> None)."""
    n = len(suffix)
    return next((_text(v) or None for p, v in entries if p[-n:] == suffix and v is not None), None)


def _yes(value: str | None) -> bool | None:
    return None if value is None else value.strip().lower() in ("yes", "active", "enabled")


# ---------------------------------------------------------------- nvidia-smi -q

@dataclass(frozen=True)
class NvidiaHealth:
    """One GPU as `nvidia-smi -q` describes it (index: its position in the answer)."""

    index: int
    bus_id: str  # "00000000:19:00.0"
    name: str = ""
    persistence: bool | None = None
    utilization: float | None = None  # percent; None under MIG
    pcie_gen: int | None = None  # the GPU's current link generation
    pcie_gen_max: int | None = None  # the most this GPU and slot allow
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    ecc_volatile_uncorrectable: int | None = None  # since the driver loaded
    retired_pending: bool | None = None  # pages waiting to be retired (pre-Ampere)
    remap_pending: bool | None = None  # rows waiting for a GPU reset to be remapped
    remap_failed: bool | None = None
    remap_uncorrectable: int | None = None
    slowdowns: tuple[str, ...] = ()  # the active hardware clock-event reasons
    recovery: str | None = None  # what the driver asks for: "GPU Reset", "Node Reboot", ...


_GPU_HEADER = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_HW_SLOWDOWNS = ("HW Slowdown", "HW Thermal Slowdown", "HW Power Brake Slowdown")


def _blocks(text: str, header: re.Pattern) -> list[tuple[str | None, list[str]]]:
    """Split at the header lines: [(header's group 1, the lines under it)]. Lines before the
    first header form a block with None when they hold anything (a grep'd excerpt)."""
    blocks: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in text.splitlines():
        m = header.match(line)
        if m:
            blocks.append((m.group(1), []))
        else:
            blocks[-1][1].append(line)
    return blocks


def _volatile_uncorrectable(entries) -> int | None:
    """Volatile uncorrectable ECC errors: the `... Uncorrectable ...` counters (Ampere and later:
    DRAM/SRAM) or `Double Bit > Total` (earlier GPUs) under ECC Errors > Volatile."""
    counts = [_int(v) for p, v in entries if p[:2] == ("ECC Errors", "Volatile") and v is not None
              and ("Uncorrectable" in p[-1] or (p[-1] == "Total" and "Double Bit" in p))]
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def _recovery(entries) -> str | None:
    action = _get(entries, "GPU Recovery Action")
    if action and action.lower() != "none":
        return action
    if _yes(_get(entries, "GPU Reset Status", "Reset Required")):
        return "GPU Reset"
    if _yes(_get(entries, "GPU Reset Status", "Drain and Reset Recommended")):
        return "Drain and Reset"
    return None


def _nvidia_gpu(index: int, bus_id: str, entries) -> NvidiaHealth:
    link = ("PCI", "GPU Link Info")
    gen = _get(entries, *link, "PCIe Generation", "Device Current") or \
        _get(entries, *link, "PCIe Generation", "Current")
    reasons = {p[0] for p, _ in entries} & {"Clocks Event Reasons", "Clocks Throttle Reasons"}
    slow = tuple(p[-1] for p, v in entries if p[0] in reasons and p[-1] in _HW_SLOWDOWNS and _yes(_text(v)))
    return NvidiaHealth(
        index=index, bus_id=bus_id, name=_get(entries, "Product Name") or "",
        persistence=_yes(_get(entries, "Persistence Mode")),
        utilization=_int(_get(entries, "Utilization", "GPU") or _get(entries, "Utilization", "Gpu")),
        pcie_gen=_int(gen), pcie_gen_max=_int(_get(entries, *link, "PCIe Generation", "Max")),
        pcie_width=_int(_get(entries, *link, "Link Width", "Current")),
        pcie_width_max=_int(_get(entries, *link, "Link Width", "Max")),
        ecc_volatile_uncorrectable=_volatile_uncorrectable(entries),
        retired_pending=_yes(_get(entries, "Retired Pages", "Pending Page Blacklist")),
        remap_pending=_yes(_get(entries, "Remapped Rows", "Pending")),
        remap_failed=_yes(_get(entries, "Remapped Rows", "Remapping Failure Occurred")),
        remap_uncorrectable=_int(_get(entries, "Remapped Rows", "Uncorrectable Error")),
        slowdowns=slow, recovery=_recovery(entries))


def parse_nvidia_query(text: str) -> tuple[int | None, list[NvidiaHealth]]:
    """`nvidia-smi -q` (or `-q -d ...`, which prints fewer sections) -> (the GPUs it says are
    attached, one record per GPU block it printed). Fewer records than attached GPUs means the
    answer was cut short."""
    blocks = _blocks(text, _GPU_HEADER)
    attached = _int(_get(tree(blocks[0][1]), "Attached GPUs"))
    gpus = [_nvidia_gpu(i, bus or "", tree(lines)) for i, (bus, lines) in enumerate(blocks[1:])]
    return attached, gpus


# ---------------------------------------------------------------- nvidia-smi nvlink --status

@dataclass(frozen=True)
class NvLinks:
    """One GPU's NVLink links: index -> GB/s, None for `<inactive>`. `note`: what nvidia-smi said
    instead of links ("all links are inActive", "Device does not have or support Nvlink", MIG)."""

    index: int
    links: dict[int, float | None]
    note: str = ""

    @property
    def inactive(self) -> list[int]:
        return [k for k, v in self.links.items() if v is None]

    @property
    def all_inactive(self) -> bool:
        note = "all links are inactive" in self.note.lower()
        return note or (bool(self.links) and len(self.inactive) == len(self.links))


_NVLINK_GPU = re.compile(r"^GPU (\d+): ")
_NVLINK_LINK = re.compile(r"^\s*Link (\d+): (.*?)\s*$")


def parse_nvlink_status(text: str) -> list[NvLinks]:
    """`nvidia-smi nvlink --status`: a `GPU i: NAME (UUID: ...)` line per GPU, then `Link n: 25 GB/s`
    or `Link n: <inactive>` lines, or one line saying why there are none. Empty: no NVLink at all."""
    out: list[NvLinks] = []
    for line in text.splitlines():
        m = _NVLINK_GPU.match(line)
        if m:
            out.append(NvLinks(int(m.group(1)), {}))
            continue
        link = _NVLINK_LINK.match(line)
        if out and link:
            speed = re.match(r"^\d+(?:\.\d+)?", link.group(2))  # "26.562 GB/s"; "<inactive>"
            out[-1].links[int(link.group(1))] = float(speed.group(0)) if speed and float(speed.group(0)) else None
        elif out and line.strip():
            out[-1] = NvLinks(out[-1].index, out[-1].links, (out[-1].note + " " + line.strip()).strip())
    return out


# ---------------------------------------------------------------- amd-smi metric --ecc --ecc-blocks

@dataclass(frozen=True)
class AmdEcc:
    """One AMD GPU's RAS counters. uncorrectable / deferred: block -> count, with "TOTAL" for the
    whole GPU where amd-smi printed it. index None: an excerpt without its `GPU: n` line."""

    index: int | None
    uncorrectable: dict[str, int]
    deferred: dict[str, int]
    correctable: dict[str, int]


_AMD_GPU = re.compile(r"^GPU: (\d+)\s*$")


def parse_amd_ecc(text: str) -> list[AmdEcc]:
    """`amd-smi metric --ecc --ecc-blocks` (text): per `GPU: n`, an `ECC:` section with TOTAL_*_COUNT
    and an `ECC_BLOCKS:` section with a CORRECTABLE/UNCORRECTABLE/DEFERRED_COUNT per block (UMC,
    SDMA, GFX, ...). "N/A" counters are left out."""
    out = []
    for gpu, lines in _blocks(text, _AMD_GPU):
        counts: dict[str, dict[str, int]] = {"UNCORRECTABLE": {}, "DEFERRED": {}, "CORRECTABLE": {}}
        for path, value in tree(lines):
            n, leaf = _int(value), path[-1]
            if n is None or not leaf.endswith("_COUNT") or leaf.startswith("CACHE_"):
                continue
            kind = leaf[:-len("_COUNT")]
            block = "TOTAL" if kind.startswith("TOTAL_") else (path[-2] if len(path) > 1 else "?")
            counts.get(kind.removeprefix("TOTAL_"), {})[block] = n
        if gpu is not None or any(counts.values()):
            out.append(AmdEcc(None if gpu is None else int(gpu), counts["UNCORRECTABLE"], counts["DEFERRED"],
                              counts["CORRECTABLE"]))
    return out


# ---------------------------------------------------------------- dcgmi diag

@dataclass(frozen=True)
class DcgmTest:
    """One row of `dcgmi diag`'s table: status pass/fail/warn/skip, per GPU where it says
    (`Fail - GPU: 0`; None: all GPUs), and the Warning/Info lines under it, joined."""

    name: str
    status: str
    gpus: tuple[int, ...] | None = None
    warnings: tuple[str, ...] = ()


_DCGM_ROW = re.compile(r"^\| ?(.*?)\s*\| ?(.*?)\s*\|?\s*$")
_DCGM_RESULT = re.compile(r"^(Pass|Fail|Warn|Skip)\b(?:\s*-\s*(All|GPU:\s*([\d,\s]+)))?", re.I)
_DCGM_TEXT = slice(30, 75)  # the result column: dcgmi cuts long texts into 45-character pieces


def parse_dcgm_diag(text: str) -> tuple[list[DcgmTest], str | None]:
    """`dcgmi diag -r N` (the table) -> (its tests, the error it printed instead, if any). A long
    Warning/Info text is cut into rows with an empty first column; a test failing on some GPUs
    and passing on the others has a row per outcome."""
    tests: list[DcgmTest] = []
    notes: list[list[str]] = []
    for line in text.splitlines():
        m = _DCGM_ROW.match(line)
        if not m or line.startswith(("|-----", "+")):
            continue
        name, result = m.group(1), _DCGM_RESULT.match(m.group(2))
        if result and (name or (tests and not notes[-1])):
            gpus = None if result.group(3) is None else tuple(int(g) for g in re.findall(r"\d+", result.group(3)))
            tests.append(DcgmTest(name or tests[-1].name, result.group(1).lower(), gpus))
            notes.append([])
        elif name in ("Warning", "Info") and tests:
            notes[-1].append(line[_DCGM_TEXT])
        elif not name and tests and notes[-1]:
            notes[-1][-1] += line[_DCGM_TEXT]
    tests = [DcgmTest(t.name, t.status, t.gpus, tuple(" ".join(n.split()) for n in ns))
             for t, ns in zip(tests, notes)]
    error = next((ln.strip() for ln in text.splitlines() if ln.startswith("Error:")), None)
    return tests, error

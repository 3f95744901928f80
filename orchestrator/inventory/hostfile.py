"""DeepSpeed/MPI hostfiles (`worker-1 slots=4`) as inventories."""

from __future__ import annotations

import re
from typing import Any

import yaml

from orchestrator.errors import InventoryError
from orchestrator.inventory.hosts import check_host
from orchestrator.inventory.load import parse_inventory


_HOSTFILE_RE = re.compile(r"^\s*(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\d+))?\s*$")


def parse_hostfile(text: str, source: str = "<hostfile>") -> list[dict]:
    """A DeepSpeed/MPI hostfile (`worker-1 slots=4`, `#` comments) -> node dicts."""
    nodes = []
    for ln, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOSTFILE_RE.match(line)
        if not m:
            raise InventoryError(f"cannot parse hostfile line {raw.strip()!r}; expected 'HOST slots=N'",
                                 path=source, line=ln)
        host = m["host"]
        try:
            check_host(host)
        except ValueError as e:
            raise InventoryError(str(e), path=source, line=ln) from None
        name = host.split(".")[0] if not re.match(r"^[0-9.]+$", host) else host.replace(".", "-")
        node = {"name": name, "host": host}
        if m["slots"] is not None:
            node["gpus"] = int(m["slots"])
        if any(n["name"] == name for n in nodes):
            raise InventoryError(f"host {host!r} listed twice", path=source, line=ln)
        nodes.append(node)
    if not nodes:
        raise InventoryError("the hostfile lists no hosts", path=source)
    return nodes


def hostfile_to_yaml(text: str, source: str, *, user: str | None = None, master_port: int = 29500,
                     iface: str | None = None) -> str:
    nodes = parse_hostfile(text, source)
    if iface:
        for n in nodes:
            n["iface"] = iface
    doc: dict[str, Any] = {}
    if user:
        doc["ssh"] = {"user": user}
    doc["master_port"] = master_port
    doc["nodes"] = nodes
    out = f"# imported from {source}; nodes[0] is the master (rank 0)\n"
    out += yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)
    parse_inventory(out, source="<imported>")  # what we write must load
    return out

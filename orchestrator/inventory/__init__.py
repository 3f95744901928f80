"""The inventory: a YAML list of nodes, validated once into frozen models.

read.py reads the file (bounded YAML), ranges.py expands `gpu[01-32]`, load.py validates it into
models.py's `Inventory` and `Node` with file:line errors (hosts.py says what a host, an address
and a port may be); hostfile.py, ansible.py and sshconfig.py read the other formats a user may
already have. This file only names what the rest of clusterctl imports.
"""

from orchestrator.inventory.fields import excerpt
from orchestrator.inventory.hostfile import hostfile_to_yaml, parse_hostfile
from orchestrator.inventory.hosts import check_host
from orchestrator.inventory.load import check_local_files, load_inventory, parse_inventory
from orchestrator.inventory.models import (
    DEFAULT_INVENTORY,
    MAX_NODES,
    NAME_RE,
    Inventory,
    InventoryModel,
    Node,
    NodeModel,
    SSHSettings,
)
from orchestrator.inventory.sections import ChecksSection, SetupSection, SyncSection, TrainSection

__all__ = ["DEFAULT_INVENTORY", "MAX_NODES", "NAME_RE", "ChecksSection", "Inventory", "InventoryModel",
           "Node", "NodeModel", "SSHSettings", "SetupSection", "SyncSection", "TrainSection", "check_host",
           "check_local_files",
           "excerpt", "hostfile_to_yaml", "load_inventory", "parse_hostfile", "parse_inventory"]

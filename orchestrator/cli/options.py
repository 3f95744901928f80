"""Options every node-facing command shares, and opening the cluster from them."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import click

from orchestrator.inventory import Inventory, check_local_files, load_inventory
from orchestrator.transport import DEFAULT_FANOUT, Cluster


@dataclass(frozen=True)
class ClusterOptions:
    inventory_path: str | None
    fanout: int
    accept_new_host_keys: bool
    connect_timeout: float | None
    nodes: tuple[str, ...]

    def load(self) -> Inventory:
        inv = load_inventory(self.inventory_path)
        return inv.select(list(self.nodes)) if self.nodes else inv

    def cluster(self, inventory: Inventory | None = None) -> Cluster:
        return Cluster(check_local_files(inventory or self.load()), fanout=self.fanout,
                       accept_new_host_keys=self.accept_new_host_keys,
                       connect_timeout=self.connect_timeout)


def _split_nodes(ctx, param, value):
    """`--nodes gpu[03-05],gpu09 --nodes gpu12` -> the names, each range expanded (NodeSet syntax)."""
    from orchestrator.inventory.ranges import expand

    out: list[str] = []
    for v in value or ():
        try:
            out += [x for x in expand(v, what="--nodes") if x not in out]
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return tuple(out)


def complete_nodes(ctx, param, incomplete: str):
    """Shell completion for --nodes: the node names of the inventory given with -i (or
    $CLUSTERCTL_INVENTORY, else the default), folded to one range when they share a prefix."""
    from click.shell_completion import CompletionItem

    from orchestrator.inventory.ranges import fold

    try:
        names = [n.name for n in load_inventory(ctx.params.get("inventory_path") or os.environ.get("CLUSTERCTL_INVENTORY")).nodes]
    except Exception:  # noqa: BLE001 - completion never fails loudly; a bad inventory completes nothing
        return []
    head, _, last = incomplete.rpartition(",")
    prefix = head + "," if head else ""
    items = [CompletionItem(prefix + n) for n in names if n.startswith(last)]
    if not last and len(names) > 1:
        items.insert(0, CompletionItem(prefix + fold(names), help="every node"))
    return items


def cluster_options(f):
    """Adds -i/--inventory, --fanout, --accept-new-host-keys, --connect-timeout, --nodes
    and passes them to the command as one `opts: ClusterOptions` argument."""

    @click.option("-i", "--inventory", "inventory_path", type=click.Path(),
                  default=lambda: os.environ.get("CLUSTERCTL_INVENTORY"),
                  help="Inventory YAML (default: $CLUSTERCTL_INVENTORY, else the embedded "
                       "two-local-node demo).")
    @click.option("--fanout", type=click.IntRange(1, 4096), default=DEFAULT_FANOUT, show_default=True,
                  help="Most nodes contacted at once.")
    @click.option("--accept-new-host-keys", is_flag=True,
                  help="Trust and record host keys seen for the first time (ssh's "
                       "StrictHostKeyChecking=accept-new). Changed keys are always refused.")
    @click.option("--connect-timeout", type=click.FloatRange(0.1, 600), default=None,
                  help="Seconds to wait for each node's SSH handshake (default: inventory or 10).")
    @click.option("--nodes", "nodes", multiple=True, callback=_split_nodes, shell_complete=complete_nodes,
                  help="Only these nodes (names or ranges: gpu[03-05],gpu09), renumbered from rank 0 in "
                       "inventory order: the first of them is the master.")
    @functools.wraps(f)
    def wrapper(*args, inventory_path, fanout, accept_new_host_keys, connect_timeout, nodes, **kw):
        opts = ClusterOptions(inventory_path, fanout, accept_new_host_keys, connect_timeout, nodes)
        return f(*args, opts=opts, **kw)

    return wrapper
